"""The official OpenAI Python client against a running Tandem router.

Run by tests/cluster.rs with the venv that scripts/test makes. Every case is requested four ways
(streaming and not, with and without the `ignore_eos` extension) at temperature 0, and the text,
finish reason and usage are compared with what the golden file implies. Exits non-zero on any
mismatch, printing each one.
"""

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import openai


def run_case(client, model, case, stream, ignore_eos):
    extra = {"ignore_eos": True} if ignore_eos else {}
    common = dict(model=model, max_tokens=case["max_tokens"], temperature=0, extra_body=extra)
    text, finish, usage = "", None, None
    if case["kind"] == "chat":
        if stream:
            chunks = client.chat.completions.create(
                messages=case["messages"], stream=True,
                stream_options={"include_usage": True}, **common)
            role_seen = False
            for ch in chunks:
                if ch.usage is not None:
                    usage = ch.usage
                for c in ch.choices:
                    if c.delta.role == "assistant":
                        role_seen = True
                    text += c.delta.content or ""
                    if c.finish_reason:
                        finish = c.finish_reason
            if not role_seen:
                return ["stream never sent the assistant role"]
        else:
            r = client.chat.completions.create(messages=case["messages"], **common)
            text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
            if r.choices[0].message.role != "assistant":
                return [f"role {r.choices[0].message.role!r}"]
    else:
        if stream:
            chunks = client.completions.create(
                prompt=case["prompt"], stream=True,
                stream_options={"include_usage": True}, **common)
            for ch in chunks:
                if ch.usage is not None:
                    usage = ch.usage
                for c in ch.choices:
                    text += c.text
                    if c.finish_reason:
                        finish = c.finish_reason
        else:
            r = client.completions.create(prompt=case["prompt"], **common)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage

    errors = []
    if ignore_eos:
        want_text, want_finish, want_tokens = case["text_ignore_eos"], "length", case["max_tokens"]
    else:
        want_text, want_finish, want_tokens = case["text_eos"], case["finish_eos"], case["tokens_eos"]
    if text != want_text:
        errors.append(f"text {text!r} != {want_text!r}")
    if finish != want_finish:
        errors.append(f"finish_reason {finish!r} != {want_finish!r}")
    if usage is None:
        errors.append("no usage")
    else:
        if usage.completion_tokens != want_tokens:
            errors.append(f"completion_tokens {usage.completion_tokens} != {want_tokens}")
        if usage.prompt_tokens != case["prompt_tokens"]:
            errors.append(f"prompt_tokens {usage.prompt_tokens} != {case['prompt_tokens']}")
        if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
            errors.append("total_tokens is not the sum")
    return errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--ca-cert", help="trust this CA (an https base URL with a test certificate)")
    a = ap.parse_args()
    cases = json.load(open(a.cases))
    http_client = openai.DefaultHttpxClient(verify=a.ca_cert) if a.ca_cert else None
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=600,
                           http_client=http_client)

    models = [m.id for m in client.models.list().data]
    if a.model not in models:
        print(f"model {a.model!r} not in /v1/models {models}")
        return 1

    jobs = [(c, s, i) for c in cases for s in (False, True) for i in (True, False)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda j: (j, run_case(client, a.model, *j)), jobs))
    failed = 0
    for (case, stream, ignore_eos), errors in results:
        if errors:
            failed += 1
            print(f"FAIL {case['id']} stream={stream} ignore_eos={ignore_eos}: " + "; ".join(errors))
    print(f"{len(jobs) - failed}/{len(jobs)} OpenAI client checks passed")

    # Errors come back as the client's typed exceptions with OpenAI's body.
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        print("FAIL unknown model was accepted")
        failed += 1
    except openai.NotFoundError as e:
        if e.body.get("code") != "model_not_found":
            print(f"FAIL unknown model body {e.body}")
            failed += 1

    # With keys set on the router, a wrong key is the client's AuthenticationError.
    if a.api_key != "unused":
        wrong = openai.OpenAI(base_url=a.base_url, api_key=a.api_key + "-wrong", max_retries=0,
                              timeout=600, http_client=http_client)
        try:
            wrong.models.list()
            print("FAIL a wrong API key was accepted")
            failed += 1
        except openai.AuthenticationError as e:
            if e.body.get("code") != "invalid_api_key":
                print(f"FAIL wrong key body {e.body}")
                failed += 1
            else:
                print("a wrong API key is refused: AuthenticationError invalid_api_key")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
