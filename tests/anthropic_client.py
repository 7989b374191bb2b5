"""The official Anthropic Python client against a Tandem router's Messages API.

Checks, each printed as PASS or FAIL, then "N/M Anthropic client checks passed":
greedy text equal to the chat endpoint's for the same conversation (system prompt included),
streamed text equal to the whole message's, a stop sequence ending the text with its
stop_reason, max_tokens cutting it, a tool_use round trip (the call, then its tool_result
answered), count_tokens equal to the usage of the same request, and errors as the client's
typed exceptions (unknown model, a malformed block, a wrong key where keys are set).
"""

import argparse
import json
import sys

import urllib.request

import anthropic

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", required=True, help="the router's HTTP root (no /v1)")
ap.add_argument("--model", required=True)
ap.add_argument("--api-key", default="unused")
a = ap.parse_args()

client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=600)
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)


def chat_text(system, messages, max_tokens, **extra):
    """What the chat endpoint answers for the same conversation, greedily."""
    msgs = ([{"role": "system", "content": system}] if system else []) + messages
    body = {"model": a.model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, **extra}
    req = urllib.request.Request(f"{a.base_url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {a.api_key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]


# Greedy: this client has no temperature parameter (Anthropic's API dropped it), the server
# still takes the field, as earlier clients send it.
GREEDY = {"temperature": 0}
system = "You are a concise assistant."
convo = [{"role": "user", "content": "Name three colors of the rainbow."}]

# Greedy text: the Messages API answers what chat answers.
m = client.messages.create(model=a.model, max_tokens=48, system=system, messages=convo,
                           extra_body=GREEDY)
want = chat_text(system, convo, 48)
text = "".join(b.text for b in m.content if b.type == "text")
check("text equals chat's", text == want["message"]["content"], f"{text!r} vs {want!r}")
reason = {"stop": "end_turn", "length": "max_tokens"}[want["finish_reason"]]
check("stop_reason", m.stop_reason == reason, f"{m.stop_reason} vs {reason}")
check("usage", m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 48, str(m.usage))
check("ids and shape", m.id.startswith("msg_") and m.type == "message" and m.role == "assistant",
      str(m))

# Streamed: the same text, the typed events the client parses.
with client.messages.stream(model=a.model, max_tokens=48, system=system, messages=convo,
                            extra_body=GREEDY) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
check("streamed text equals the whole", streamed == text, f"{streamed!r} vs {text!r}")
check("streamed final message", final.stop_reason == m.stop_reason
      and final.usage.output_tokens == m.usage.output_tokens, str(final))

# A stop sequence taken from the text ends it there, and says which.
words = text.split()
if len(words) >= 3:
    stop = " " + words[2]
    sm = client.messages.create(model=a.model, max_tokens=48, system=system, messages=convo,
                                extra_body=GREEDY, stop_sequences=[stop, "never-there"])
    st = "".join(b.text for b in sm.content if b.type == "text")
    check("stop sequence", sm.stop_reason == "stop_sequence" and sm.stop_sequence == stop
          and text.startswith(st) and stop not in st, f"{sm.stop_reason} {sm.stop_sequence!r} {st!r}")
else:
    check("stop sequence", False, f"too short a text to pick a stop from: {text!r}")

# max_tokens cuts.
short = client.messages.create(model=a.model, max_tokens=3, messages=convo, extra_body=GREEDY)
check("max_tokens", short.stop_reason == "max_tokens" and short.usage.output_tokens == 3,
      str(short))

# A tool_use round trip: the call (forced with tool_choice any), then its result answered.
tools = [{
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
call = client.messages.create(model=a.model, max_tokens=64, messages=ask, tools=tools,
                              tool_choice={"type": "any"}, extra_body=GREEDY)
uses = [b for b in call.content if b.type == "tool_use"]
check("tool_use", call.stop_reason == "tool_use" and len(uses) >= 1
      and uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str)
      and uses[0].id.startswith("toolu_"), str(call))
if uses:
    follow = ask + [
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "Sunny, 21 C"}]},
    ]
    answer = client.messages.create(model=a.model, max_tokens=32, messages=follow, tools=tools,
                                    extra_body=GREEDY)
    atext = "".join(b.text for b in answer.content if b.type == "text")
    check("tool_result answered", answer.stop_reason in ("end_turn", "max_tokens") and atext != "",
          str(answer))
    with client.messages.stream(model=a.model, max_tokens=64, messages=ask, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as s:
        fin = s.get_final_message()
    suses = [b for b in fin.content if b.type == "tool_use"]
    check("streamed tool_use", fin.stop_reason == "tool_use" and len(suses) >= 1
          and suses[0].input == uses[0].input, str(fin))

# Structured output (output_config.format): JSON that follows the schema.
schema = {"type": "object", "properties": {"color": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["color", "count"], "additionalProperties": False}
so = client.messages.create(model=a.model, max_tokens=64, messages=convo, extra_body=GREEDY,
                            output_config={"format": {"type": "json_schema", "schema": schema}})
try:
    doc = json.loads("".join(b.text for b in so.content if b.type == "text"))
    check("output_config format", isinstance(doc.get("color"), str)
          and isinstance(doc.get("count"), int) and set(doc) == {"color", "count"}, str(doc))
except ValueError as e:
    check("output_config format", False, f"{e}: {so}")

# count_tokens: what the request's prompt holds.
n = client.messages.count_tokens(model=a.model, system=system, messages=convo)
check("count_tokens", n.input_tokens == m.usage.input_tokens,
      f"{n.input_tokens} vs {m.usage.input_tokens}")
nt = client.messages.count_tokens(model=a.model, messages=ask, tools=tools)
check("count_tokens with tools", nt.input_tokens == call.usage.input_tokens,
      f"{nt.input_tokens} vs {call.usage.input_tokens}")

# Errors: the client's typed exceptions, Anthropic's body.
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=convo)
    check("unknown model", False, "accepted")
except anthropic.NotFoundError as e:
    check("unknown model", e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error",
          str(e.body))
try:
    client.messages.create(model=a.model, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                  "media_type": "image/png",
                                                                  "data": "AAAA"}}]}])
    check("a malformed block", False, "accepted")
except anthropic.BadRequestError as e:
    msg = e.body["error"]["message"]
    check("a malformed block", e.body["error"]["type"] == "invalid_request_error"
          and "messages[0].content[0]" in msg, msg)
if a.api_key != "unused":
    wrong = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key + "-wrong", max_retries=0)
    try:
        wrong.messages.create(model=a.model, max_tokens=4, messages=convo)
        check("a wrong key", False, "accepted")
    except anthropic.AuthenticationError as e:
        check("a wrong key", e.body["error"]["type"] == "authentication_error", str(e.body))

print(f"{sum(checks)}/{len(checks)} Anthropic client checks passed")
sys.exit(0 if all(checks) else 1)
