"""The official OpenAI Python client, and the OpenAI Agents SDK, against a Tandem router's
Responses API.

Checks, each printed as PASS or FAIL, then "N/M Responses client checks passed": greedy text
equal to the chat endpoint's for the same conversation (instructions included), the streamed
events and text equal to the whole response's, max_output_tokens ending it as incomplete, a
function-call round trip (the call, then its output answered), streamed calls, a
previous_response_id chain of three turns equal to chat over the whole conversation (and finding
its prefix in the cache), structured output, retrieve, input_items, delete, store false,
background responses polled and cancelled, input_tokens counted, errors as the client's typed
exceptions; then an agent of the Agents SDK with a function tool on its default Responses model,
run whole and streamed.
"""

import argparse
import asyncio
import json
import sys
import time
import urllib.request

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", required=True, help="the router's HTTP root (no /v1)")
ap.add_argument("--model", required=True)
ap.add_argument("--api-key", default="unused")
a = ap.parse_args()

client = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key=a.api_key, max_retries=0, timeout=600)
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)


def chat(messages, max_tokens, **extra):
    """What the chat endpoint answers for the same conversation, greedily."""
    body = {"model": a.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            **extra}
    req = urllib.request.Request(f"{a.base_url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {a.api_key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def expect_error(name, kind, call, want=None):
    """`call` raises the client's `kind`; `want(body)` holds of the error body."""
    try:
        call()
        check(name, False, "accepted")
    except kind as e:
        # The client's body is the error object (the "error" field of OpenAI's answer).
        body = e.body if isinstance(e.body, dict) else {}
        body = body.get("error", body)
        check(name, want is None or want(body), str(body))
    except Exception as e:  # another exception is a failure, with its text
        check(name, False, f"{type(e).__name__}: {e}")


system = "You are a concise assistant."
question = "Name three colors of the rainbow."

# Greedy text: the Responses API answers what chat answers.
r = client.responses.create(model=a.model, instructions=system, input=question,
                            max_output_tokens=48, temperature=0)
want = chat([{"role": "system", "content": system}, {"role": "user", "content": question}], 48)
wtext = want["choices"][0]["message"]["content"]
check("text equals chat's", r.output_text == wtext, f"{r.output_text!r} vs {wtext!r}")
status = {"stop": "completed", "length": "incomplete"}[want["choices"][0]["finish_reason"]]
check("status", r.status == status, f"{r.status} vs {status}")
check("usage", r.usage.input_tokens == want["usage"]["prompt_tokens"]
      and r.usage.output_tokens == want["usage"]["completion_tokens"]
      and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, str(r.usage))
check("ids and shape", r.id.startswith("resp_") and r.object == "response"
      and r.output[0].type == "message" and r.output[0].role == "assistant"
      and r.output[0].id.startswith("msg_") and r.instructions == system and r.model == a.model,
      str(r))

# Streamed: the typed events, in order, with the same text.
kinds, deltas, seqs, final = [], [], [], None
with client.responses.stream(model=a.model, instructions=system, input=question,
                             max_output_tokens=48, temperature=0) as s:
    for ev in s:
        kinds.append(ev.type)
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    # The helper's final response is the completed event's (an incomplete one has none).
    if final is not None and final.status == "completed":
        final = s.get_final_response()
check("streamed text equals the whole", "".join(deltas) == r.output_text
      and final.output_text == r.output_text, f"{''.join(deltas)!r} vs {r.output_text!r}")
end = "response.completed" if status == "completed" else "response.incomplete"
check("streamed events", kinds[:4] == ["response.created", "response.in_progress",
                                       "response.output_item.added", "response.content_part.added"]
      and kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", end]
      and seqs == list(range(len(seqs))), str(kinds))
check("streamed final response", final.status == r.status
      and final.usage.output_tokens == r.usage.output_tokens, str(final))

# max_output_tokens: incomplete, with the reason.
short = client.responses.create(model=a.model, input=question, max_output_tokens=3, temperature=0)
check("max_output_tokens", short.status == "incomplete"
      and short.incomplete_details.reason == "max_output_tokens"
      and short.usage.output_tokens == 3, str(short))

# A function-call round trip: the call (forced with tool_choice required), then its output.
tools = [{
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
call = client.responses.create(model=a.model, input=ask, tools=tools, tool_choice="required",
                               max_output_tokens=64, temperature=0)
calls = [o for o in call.output if o.type == "function_call"]
check("function_call", len(calls) >= 1 and calls[0].name == "get_weather"
      and isinstance(json.loads(calls[0].arguments).get("city"), str)
      and calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_"), str(call))
if calls:
    follow = ask + [c.model_dump(exclude_none=True) for c in calls] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model=a.model, input=follow, tools=tools,
                                     max_output_tokens=32, temperature=0)
    want = chat(ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": c.call_id, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"}], 32,
        tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
               for t in tools])
    wmsg = want["choices"][0]["message"]
    got_calls = [o for o in answer.output if o.type == "function_call"]
    same = (answer.output_text == (wmsg.get("content") or "")
            and len(got_calls) == len(wmsg.get("tool_calls") or []))
    check("function_call_output answered as chat answers it", same,
          f"{answer.output} vs {wmsg}")
    streamed_args, items = [], []
    with client.responses.stream(model=a.model, input=ask, tools=tools,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=64, temperature=0) as s:
        for ev in s:
            if ev.type == "response.function_call_arguments.done":
                streamed_args.append(ev.arguments)
            if ev.type == "response.output_item.done":
                items.append(ev.item.type)
        fin = s.get_final_response()
    fcalls = [o for o in fin.output if o.type == "function_call"]
    check("streamed function_call", fin.status == "completed" and len(fcalls) >= 1
          and streamed_args[:1] == [calls[0].arguments] and fcalls[0].arguments == calls[0].arguments
          and "function_call" in items, f"{fin} {streamed_args}")

# previous_response_id: three turns, each sending only its new input; the third equals chat over
# the whole conversation, and the follow-ups find their prefix in the worker's cache.
turns = ["My name is Ada. Say hello to me.", "What is my name?", "Say it once more."]
r1 = client.responses.create(model=a.model, instructions=system, input=turns[0],
                             max_output_tokens=24, temperature=0)
r2 = client.responses.create(model=a.model, instructions=system, input=turns[1],
                             previous_response_id=r1.id, max_output_tokens=24, temperature=0)
r3 = client.responses.create(model=a.model, instructions=system, input=turns[2],
                             previous_response_id=r2.id, max_output_tokens=24, temperature=0)
convo = [{"role": "system", "content": system},
         {"role": "user", "content": turns[0]}, {"role": "assistant", "content": r1.output_text},
         {"role": "user", "content": turns[1]}, {"role": "assistant", "content": r2.output_text},
         {"role": "user", "content": turns[2]}]
want3 = chat(convo, 24)
check("previous_response_id chain equals chat", r3.output_text ==
      want3["choices"][0]["message"]["content"]
      and r3.usage.input_tokens == want3["usage"]["prompt_tokens"]
      and r3.previous_response_id == r2.id,
      f"{r3.output_text!r} vs {want3['choices'][0]['message']['content']!r}")
check("follow-ups reuse the prefix cache", r2.usage.input_tokens_details.cached_tokens > 0
      and r3.usage.input_tokens_details.cached_tokens > 0,
      f"{r2.usage} {r3.usage}")

# Structured output through text.format.
schema = {"type": "object", "properties": {"color": {"type": "string"},
                                           "count": {"type": "integer"}},
          "required": ["color", "count"], "additionalProperties": False}
so = client.responses.create(model=a.model, input=question, max_output_tokens=64, temperature=0,
                             text={"format": {"type": "json_schema", "name": "colors",
                                              "schema": schema, "strict": True}})
try:
    doc = json.loads(so.output_text)
    check("text.format json_schema", isinstance(doc.get("color"), str)
          and isinstance(doc.get("count"), int) and set(doc) == {"color", "count"}, str(doc))
except ValueError as e:
    check("text.format json_schema", False, f"{e}: {so}")

# Retrieve, input_items, delete.
got = client.responses.retrieve(r2.id)
check("retrieve", got.id == r2.id and got.output_text == r2.output_text
      and got.status == r2.status, str(got))
items = client.responses.input_items.list(r2.id, order="asc")
texts = [i.content[0].text for i in items.data if i.type == "message"]
check("input_items", texts == [turns[0], r1.output_text, turns[1]]
      and all(i.id for i in items.data), str(items.data))
d = client.responses.delete(r1.id)
expect_error("deleted is gone", openai.NotFoundError, lambda: client.responses.retrieve(r1.id))
expect_error("previous_response_id of a deleted response", openai.NotFoundError,
             lambda: client.responses.create(model=a.model, input="x", previous_response_id=r1.id),
             lambda b: b["code"] == "previous_response_not_found"
             and b["param"] == "previous_response_id")
unstored = client.responses.create(model=a.model, input=question, max_output_tokens=4,
                                   temperature=0, store=False)
expect_error("store false keeps nothing", openai.NotFoundError,
             lambda: client.responses.retrieve(unstored.id))

# Background: polled to its end; and cancelled while it runs (a long output, EOS ignored, is
# still running when the cancel follows the create).
bg = client.responses.create(model=a.model, input=question, max_output_tokens=8, temperature=0,
                             background=True)
check("background starts", bg.status in ("queued", "in_progress") and bg.background, str(bg))
while bg.status in ("queued", "in_progress"):
    time.sleep(0.2)
    bg = client.responses.retrieve(bg.id)
check("background completes", bg.status in ("completed", "incomplete")
      and bg.usage.output_tokens <= 8 and bg.output_text != "", str(bg))
long = client.responses.create(model=a.model, input="Tell me a long story.", temperature=0,
                               max_output_tokens=4000, background=True,
                               extra_body={"ignore_eos": True})
cancelled = client.responses.cancel(long.id)
again = client.responses.retrieve(long.id)
check("background cancelled", cancelled.status == "cancelled" and again.status == "cancelled",
      f"{cancelled.status} {again.status}")
expect_error("cancel of a response not in background", openai.BadRequestError,
             lambda: client.responses.cancel(r2.id))

# input_tokens: what the first request's prompt holds.
n = client.responses.input_tokens.count(model=a.model, instructions=system, input=question)
check("input_tokens", n.input_tokens == r.usage.input_tokens,
      f"{n.input_tokens} vs {r.usage.input_tokens}")
expect_error("input_tokens refuses what it does not serve", openai.BadRequestError,
             lambda: client.responses.input_tokens.count(model=a.model, input=question,
                                                         extra_body={"personality": "friendly"}),
             lambda b: b["param"] == "personality")

# Errors: the client's typed exceptions, OpenAI's body.
expect_error("unknown model", openai.NotFoundError,
             lambda: client.responses.create(model="no-such-model", input="hi"),
             lambda b: b["code"] == "model_not_found")
expect_error("a malformed item names it", openai.BadRequestError,
             lambda: client.responses.create(model=a.model, input=[
                 {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
             lambda b: "input[0].content[0]" in b["message"])
expect_error("a hosted tool is refused", openai.BadRequestError,
             lambda: client.responses.create(model=a.model, input="hi",
                                             tools=[{"type": "web_search"}]),
             lambda b: b["param"] == "tools")


# The Agents SDK: an agent with a function tool, on its default (Responses) model.
async def agents_checks():
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny, 21 C in {city}"

    aclient = openai.AsyncOpenAI(base_url=f"{a.base_url}/v1", api_key=a.api_key, max_retries=0,
                                 timeout=600)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=a.model, openai_client=aclient),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    kinds = [i.type for i in result.new_items]
    check("agent calls its tool and answers", len(asked) >= 1
          and "tool_call_item" in kinds and "tool_call_output_item" in kinds
          and isinstance(result.final_output, str) and result.final_output != "",
          f"{asked} {kinds} {result.final_output!r}")
    before = len(asked)
    streamed = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
    deltas = []
    async for ev in streamed.stream_events():
        if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
            deltas.append(ev.data.delta)
    check("agent streamed", len(asked) > before and isinstance(streamed.final_output, str)
          and streamed.final_output != "" and "".join(deltas) == streamed.final_output,
          f"{asked} {deltas} {streamed.final_output!r}")


asyncio.run(agents_checks())

passed = sum(checks)
print(f"{passed}/{len(checks)} Responses client checks passed")
sys.exit(0 if passed == len(checks) else 1)
