"""Structured outputs through the official OpenAI Python client against a running Tandem router.

Run by tests/cluster.rs (and tests/disagg.rs, where the first token comes from a prefill worker)
with the venv that scripts/test makes. Every answer given a JSON schema must parse and validate
against it (Python `jsonschema`), greedy and sampled, streamed and not; `json_object` must stream
a JSON object; vLLM's guided_choice / guided_regex must hold; logit_bias must ban a token; a schema
with a construct the grammar engine does not implement must be a 400 naming it. Prints one line
per failed check and "N/N structured output checks passed" at the end; exits non-zero on any
failure.
"""

import argparse
import json
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 32},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "list_enum": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "yellow"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
        },
        "required": ["colors", "mood"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 3, "maximum": 7},
            "flag": {"type": "boolean"},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 16}]},
        },
        "required": ["score", "count", "flag", "note"],
        "additionalProperties": False,
    },
    "defs_and_refs": {
        "type": "object",
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "label": {"type": "string", "maxLength": 12},
                },
                "required": ["id", "label"],
                "additionalProperties": False,
            }
        },
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 3},
        },
        "required": ["items"],
        "additionalProperties": False,
    },
}

PROMPTS = [
    "Describe a person as JSON.",
    "Give me some data about a place in JSON.",
    "Answer in JSON: what do you like?",
]


def fmt(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat(client, model, prompt, stream, **kw):
    """Returns (text, finish_reason, chunks with content)."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, 1
    text, finish, pieces = "", None, 0
    for ch in client.chat.completions.create(model=model, messages=messages, stream=True, **kw):
        for c in ch.choices:
            if c.delta.content:
                text += c.delta.content
                pieces += 1
            if c.finish_reason:
                finish = c.finish_reason
    return text, finish, pieces


def check_schema(client, model, name, schema, prompt, stream, temperature, seed):
    label = f"{name} stream={stream} t={temperature} seed={seed} prompt={prompt!r}"
    text, finish, _ = chat(client, model, prompt, stream, max_tokens=256,
                           temperature=temperature, seed=seed, response_format=fmt(name, schema))
    if finish != "stop":
        return [f"{label}: finish {finish!r}, text {text!r}"]
    try:
        value = json.loads(text)
    except ValueError as e:
        return [f"{label}: not JSON ({e}): {text!r}"]
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return [f"{label}: does not validate ({e.message}): {text!r}"]
    return []


def check_json_object(client, model):
    text, finish, pieces = chat(client, model, "Return a JSON object with a name and an age.", True, max_tokens=256,
                                temperature=0, response_format={"type": "json_object"})
    errors = []
    if pieces < 3:
        errors.append(f"json_object: streamed in {pieces} pieces")
    if finish != "stop":
        errors.append(f"json_object: finish {finish!r}: {text!r}")
    else:
        try:
            if not isinstance(json.loads(text), dict):
                errors.append(f"json_object: not an object: {text!r}")
        except ValueError as e:
            errors.append(f"json_object: not JSON ({e}): {text!r}")
    return errors


def check_guided(client, model):
    errors = []
    options = ["positive", "negative", "neutral"]
    for seed in range(3):
        r = client.completions.create(model=model, prompt="The review 'great food' is", max_tokens=16,
                                      temperature=1.0, seed=seed, extra_body={"guided_choice": options})
        if r.choices[0].text not in options:
            errors.append(f"guided_choice seed {seed}: {r.choices[0].text!r}")
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    for seed in range(3):
        r = client.completions.create(model=model, prompt="A street and number:", max_tokens=16,
                                      temperature=1.0, seed=seed, extra_body={"guided_regex": pattern})
        if not re.fullmatch(pattern, r.choices[0].text):
            errors.append(f"guided_regex seed {seed}: {r.choices[0].text!r}")
    return errors


def check_logit_bias(client, model):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    first = r.choices[0].logprobs.tokens[0]
    top = r.choices[0].logprobs.top_logprobs[0]
    second = [t for t in sorted(top, key=top.get, reverse=True) if t != first][0]
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(
        f"{root}/tokenize", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": first, "add_special_tokens": False}).encode())
    with urllib.request.urlopen(req) as resp:
        ids = json.load(resp)["tokens"]
    if len(ids) != 1:
        return [f"logit_bias: {first!r} is {len(ids)} tokens"]
    banned = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100})
    if banned.choices[0].text != second:
        return [f"logit_bias: banning {first!r} gave {banned.choices[0].text!r}, not {second!r}"]
    return []


def check_refusals(client, model):
    errors = []
    bad = [
        (fmt("unique", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
         "uniqueItems"),
        (fmt("typo", {"type": "strng"}), "strng"),
        ({"type": "yaml"}, "yaml"),
    ]
    for response_format, needle in bad:
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8, response_format=response_format)
            errors.append(f"{needle}: accepted")
        except openai.BadRequestError as e:
            if needle not in str(e) or "response_format" not in str(e):
                errors.append(f"{needle}: 400 without naming it: {e}")
    return errors


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def streamed_calls(chunks):
    """Accumulates streamed tool-call deltas as the OpenAI SDK's users do."""
    calls, content, finish = {}, "", None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                finish = c.finish_reason
    return [calls[i] for i in sorted(calls)], content, finish


def check_calls(label, calls, allowed):
    errors = []
    if not calls:
        return [f"{label}: no tool call"]
    for c in calls:
        if c["name"] not in allowed:
            errors.append(f"{label}: called {c['name']!r}")
            continue
        try:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMA_OF[c["name"]])
        except (ValueError, jsonschema.ValidationError) as e:
            errors.append(f"{label}: arguments {c['arguments']!r}: {e}")
        if not c["id"]:
            errors.append(f"{label}: a call without an id")
    return errors


def check_tools(client, model):
    """The round trip: a required call, its result sent back, a final answer."""
    errors = []
    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    for seed, temperature in [(None, 0.0), (3, 0.9), (5, 1.0)]:
        label = f"tools required t={temperature}"
        r = client.chat.completions.create(model=model, messages=question, tools=[WEATHER, CLOCK],
                                           tool_choice="required", max_tokens=200,
                                           temperature=temperature, seed=seed)
        choice = r.choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        errors += check_calls(label, calls, {"get_weather", "get_time"})
        if choice.finish_reason != "tool_calls":
            errors.append(f"{label}: finish {choice.finish_reason!r}")
    # Streamed, with a named function.
    chunks = client.chat.completions.create(
        model=model, messages=question, tools=[WEATHER, CLOCK], max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True)
    calls, content, finish = streamed_calls(chunks)
    errors += check_calls("tools named, streamed", calls, {"get_time"})
    if finish != "tool_calls" or content.strip():
        errors.append(f"tools named, streamed: finish {finish!r}, content {content!r}")
    # The result goes back; the model answers in text.
    r = client.chat.completions.create(model=model, messages=question, tools=[WEATHER],
                                       tool_choice="required", max_tokens=200, temperature=0)
    msg = r.choices[0].message
    if not msg.tool_calls:
        return errors + ["round trip: no call to answer"]
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
         "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "clear"})},
    ]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                           max_tokens=60, temperature=0)
    f = final.choices[0]
    if f.finish_reason not in ("stop", "length", "tool_calls"):
        errors.append(f"round trip: finish {f.finish_reason!r}")
    if f.finish_reason != "tool_calls" and not (f.message.content or "").strip():
        errors.append(f"round trip: an empty final answer: {f.message!r}")
    if f.message.tool_calls:
        errors += check_calls("round trip, auto", [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in f.message.tool_calls], {"get_weather"})
    # tool_choice none: plain text, never calls.
    n = client.chat.completions.create(model=model, messages=question, tools=[WEATHER],
                                       tool_choice="none", max_tokens=30, temperature=0)
    if n.choices[0].message.tool_calls or n.choices[0].finish_reason == "tool_calls":
        errors.append("tool_choice none: a call was made")
    return errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quick", action="store_true", help="one schema run per schema")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600)

    jobs = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompt = PROMPTS[i % len(PROMPTS)]
        runs = [(False, 0.0, None)] if args.quick else [
            (False, 0.0, None), (True, 0.0, None), (False, 0.8, 7), (True, 1.0, 11)]
        for stream, temperature, seed in runs:
            jobs.append(lambda n=name, s=schema, p=prompt, st=stream, t=temperature, sd=seed:
                        check_schema(client, args.model, n, s, p, st, t, sd))
    if not args.quick:
        jobs += [lambda: check_json_object(client, args.model),
                 lambda: check_guided(client, args.model),
                 lambda: check_logit_bias(client, args.model),
                 lambda: check_refusals(client, args.model),
                 lambda: check_tools(client, args.model)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda f: f(), jobs))
    failed = [e for r in results for e in r]
    for e in failed:
        print("FAIL", e)
    passed = len(jobs) - sum(1 for r in results if r)
    print(f"{passed}/{len(jobs)} structured output checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
