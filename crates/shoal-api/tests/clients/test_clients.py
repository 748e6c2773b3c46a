"""The official Python clients (openai, anthropic, ollama) against a running `shoal serve`.

Run by scripts/api-clients.sh, which starts three servers: OPEN (smollm2 and qwen05, no keys),
KEYED (smollm2; this script creates its keys) and THINKING (smollm2 with Qwen3's chat
template, replaying output written in a thinking model's format). Every test must pass; the
exit code is the number of failures.

    python3 test_clients.py --open http://127.0.0.1:PORT --keyed http://127.0.0.1:PORT2 \
        --thinking http://127.0.0.1:PORT3
"""

import argparse
import json
import sys
import time
import traceback

import anthropic
import httpx
import jsonschema
import ollama
import openai

PLAIN = "smollm2"  # small and fast: plain chat, streaming, stops, seeds, errors
TOOLS = "qwen05"  # knows the Hermes tool-call format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
RESULT = "It is 18 degrees Celsius and sunny in Paris."

TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def check_args(call, tool):
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


# ---------------------------------------------------------------- OpenAI


@test
def openai_chat(o, **_):
    r = o.chat.completions.create(
        model=PLAIN, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12
    )
    c = r.choices[0]
    assert isinstance(c.message.content, str) and c.message.content.strip(), r
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u


@test
def openai_roles_and_length(o, **_):
    r = o.chat.completions.create(
        model=PLAIN,
        messages=[
            {"role": "developer", "content": "You answer briefly."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": [{"type": "text", "text": "Now write a long story about a dragon."}]},
        ],
        max_completion_tokens=3,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length", r
    assert r.usage.completion_tokens == 3, r.usage


@test
def openai_stream_with_usage(o, **_):
    chunks = list(
        o.chat.completions.create(
            model=PLAIN,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length"), finishes
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens > 0, chunks[-1]
    # the streamed text equals the non-streamed greedy text
    full = o.chat.completions.create(
        model=PLAIN, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, temperature=0
    ).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in o.chat.completions.create(
            model=PLAIN,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert streamed == full, (streamed, full)


@test
def openai_stop(o, **_):
    msgs = [{"role": "user", "content": "List the days of the week."}]
    full = o.chat.completions.create(model=PLAIN, messages=msgs, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert len(text) > 20, text
    stop = text[12:16]
    cut = text.find(stop)
    r = o.chat.completions.create(model=PLAIN, messages=msgs, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:cut], (r.choices[0].message.content, text, stop)
    assert r.choices[0].finish_reason == "stop"


@test
def openai_seed(o, **_):
    def run(seed):
        return o.chat.completions.create(
            model=PLAIN,
            messages=[{"role": "user", "content": "Write a short poem about the sea."}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
        ).choices[0].message.content

    a, b = run(42), run(42)
    assert a == b, (a, b)
    assert any(run(s) != a for s in (1, 2, 3)), "different seeds all gave the same text"


@test
def openai_logprobs(o, **_):
    r = o.chat.completions.create(
        model=PLAIN,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    lp = r.choices[0].logprobs.content
    assert len(lp) == 5, lp
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3, t
        # greedy: the chosen token is the most likely one
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4, t


@test
def openai_completions(o, **_):
    r = o.completions.create(model=PLAIN, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert "Paris" in r.choices[0].text, r
    s = list(o.completions.create(model=PLAIN, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


@test
def openai_models(o, **_):
    ids = {m.id for m in o.models.list()}
    assert {PLAIN, TOOLS} <= ids, ids


@test
def openai_tool_round_trip(o, **_):
    r = o.chat.completions.create(model=TOOLS, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id, call
    args = check_args(call, WEATHER)
    assert "paris" in args["city"].lower(), args
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    # A 0.5B model given the tools again tends to call them again; without them it answers
    # from the tool result, which shows the call and the result reached it.
    final = o.chat.completions.create(model=TOOLS, messages=msgs, temperature=0, max_tokens=60)
    f = final.choices[0]
    assert f.finish_reason in ("stop", "length") and "18" in f.message.content, f
    again = o.chat.completions.create(model=TOOLS, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=60)
    assert again.choices[0].message.content or again.choices[0].message.tool_calls, again


@test
def openai_tool_round_trip_streaming(o, **_):
    chunks = list(
        o.chat.completions.create(model=TOOLS, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=100, stream=True)
    )
    calls = {}
    for ch in chunks:
        if not ch.choices:
            continue
        for d in ch.choices[0].delta.tool_calls or []:
            e = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            e["id"] = d.id or e["id"]
            e["name"] += (d.function.name or "") if d.function else ""
            e["arguments"] += (d.function.arguments or "") if d.function else ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls", chunks[-1]
    assert len(calls) >= 1, chunks
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"], call
    args = json.loads(call["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    msgs = ASK + [
        {
            "role": "assistant",
            "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
    ]
    text = "".join(
        c.choices[0].delta.content or ""
        for c in o.chat.completions.create(model=TOOLS, messages=msgs, temperature=0, max_tokens=60, stream=True)
        if c.choices
    )
    assert "18" in text, text


@test
def openai_tool_choice_required(o, **_):
    # a question that needs no tool: only enforcement makes the model call one
    msgs = [{"role": "user", "content": "Tell me a joke about cats."}]
    r = o.chat.completions.create(
        model=TOOLS, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=80
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        check_args(call, tool)


@test
def openai_tool_choice_named(o, **_):
    r = o.chat.completions.create(
        model=TOOLS,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=80,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls), r
    check_args(calls[0], TIME)


@test
def openai_tool_choice_none(o, **_):
    r = o.chat.completions.create(model=TOOLS, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls", r


@test
def openai_json_schema(o, **_):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer"},
            "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    }
    for model in (PLAIN, TOOLS):
        r = o.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a fictional programmer as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
            temperature=0,
            max_tokens=200,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = o.chat.completions.create(
        model=TOOLS,
        messages=[{"role": "user", "content": "Give me a JSON object with a cat's name and age."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
    )
    assert r.choices[0].finish_reason == "stop", r  # the object closed before the limit
    assert isinstance(json.loads(r.choices[0].message.content), dict), r


# ---------------------------------------------------------------- OpenAI Responses

WEATHER_R = {"type": "function", **WEATHER["function"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@test
def openai_responses_plain(o, **_):
    r = o.responses.create(model=PLAIN, input="Say hello.", max_output_tokens=12)
    assert r.object == "response" and r.status in ("completed", "incomplete"), r
    assert r.output_text.strip(), r
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12, r.usage
    r = o.responses.create(
        model=PLAIN,
        instructions="You answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Write a long story about a dragon."}]}],
        max_output_tokens=3,
        temperature=0,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 3, r.usage


@test
def openai_responses_stream(o, **_):
    ask = dict(model=PLAIN, input="Count to five.", max_output_tokens=16, temperature=0)
    events = list(o.responses.create(stream=True, **ask))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [e.sequence_number for e in events] == list(range(len(events))), events
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.text for e in events if e.type == "response.output_text.done"]
    full = o.responses.create(**ask).output_text
    assert streamed == full and done == [full], (streamed, done, full)
    assert events[-1].response.output_text == full, events[-1]


@test
def openai_responses_previous_response_id(o, **_):
    first = o.responses.create(
        model=TOOLS, input="My name is Ada Lovelace. Reply with OK.", temperature=0, max_output_tokens=10
    )
    second = o.responses.create(
        model=TOOLS, previous_response_id=first.id, input="What is my name?", temperature=0, max_output_tokens=20
    )
    # the stored conversation ran again before the new question
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens, (first.usage, second.usage)
    assert "Ada" in second.output_text, second.output_text
    try:
        o.responses.create(model=TOOLS, previous_response_id="resp_unknown", input="hi")
        raise AssertionError("an unknown previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert "resp_unknown" in e.message, e.message


@test
def openai_responses_function_tool_round_trip(o, **_):
    ask = "What is the weather like in Paris right now?"
    r = o.responses.create(model=TOOLS, input=ask, tools=[WEATHER_R], temperature=0, max_output_tokens=100)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id, r.output
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER_R["parameters"])
    assert "paris" in args["city"].lower(), args
    # the result, as a continuation of the stored response (no tools: a 0.5B model given
    # them again tends to call again)
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": RESULT}
    final = o.responses.create(model=TOOLS, previous_response_id=r.id, input=[out], temperature=0, max_output_tokens=60)
    assert "18" in final.output_text, final.output_text
    # the same conversation sent whole, streaming
    items = [
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
        out,
    ]
    events = list(o.responses.create(model=TOOLS, input=items, temperature=0, max_output_tokens=60, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text, (text, final.output_text)
    # a streamed call arrives as a function_call item with its arguments
    events = list(
        o.responses.create(model=TOOLS, input=ask, tools=[WEATHER_R], tool_choice="required", temperature=0, max_output_tokens=100, stream=True)
    )
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done and done[0].name == "get_weather", [e.type for e in events]
    jsonschema.validate(json.loads(done[0].arguments), WEATHER_R["parameters"])


@test
def openai_responses_json_schema(o, **_):
    r = o.responses.create(
        model=TOOLS,
        input="Describe a fictional programmer as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        temperature=0,
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(r.output_text), PERSON)


@test
def openai_errors(o, url_open, **_):
    try:
        o.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert "no-such-model" in e.message, e.message
    try:
        o.chat.completions.create(model=PLAIN, messages=[{"role": "user", "content": "word " * 5000}])
        raise AssertionError("over-long prompt accepted")
    except openai.BadRequestError as e:
        assert "context" in e.message, e.message
    r = httpx.post(url_open + "/v1/chat/completions", content=b'{"model": "smollm2", "messages": [', timeout=30)
    assert r.status_code == 400, r
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"], err
    try:
        o.chat.completions.create(model=PLAIN, messages=[{"role": "wizard", "content": "hi"}])
        raise AssertionError("bad role accepted")
    except openai.BadRequestError as e:
        assert "wizard" in e.message, e.message


# ---------------------------------------------------------------- Anthropic


@test
def anthropic_messages(a, **_):
    r = a.messages.create(
        model=PLAIN, max_tokens=12, system="You are terse.", messages=[{"role": "user", "content": "Say hello."}]
    )
    assert r.type == "message" and r.role == "assistant", r
    assert r.content and r.content[0].type == "text" and r.content[0].text.strip(), r
    assert r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12, r.usage


@test
def anthropic_stream(a, **_):
    with a.messages.stream(model=PLAIN, max_tokens=16, messages=[{"role": "user", "content": "Count to five."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text.strip() and final.content[0].text == text, (text, final)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


@test
def anthropic_stop_sequences(a, **_):
    msgs = [{"role": "user", "content": "List the days of the week."}]
    full = a.messages.create(model=PLAIN, max_tokens=40, extra_body={"temperature": 0}, messages=msgs).content[0].text
    stop = full[12:16]
    r = a.messages.create(model=PLAIN, max_tokens=40, extra_body={"temperature": 0}, messages=msgs, stop_sequences=[stop])
    assert r.content[0].text == full[: full.find(stop)], (r.content, full, stop)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop, (r.stop_reason, r.stop_sequence)


@test
def anthropic_tool_use(a, **_):
    tools = [{"name": "get_weather", "description": WEATHER["function"]["description"], "input_schema": WEATHER["function"]["parameters"]}]
    msgs = [{"role": "user", "content": ASK[0]["content"]}]
    r = a.messages.create(model=TOOLS, max_tokens=100, extra_body={"temperature": 0}, tools=tools, messages=msgs)
    assert r.stop_reason == "tool_use", r
    use = [b for b in r.content if b.type == "tool_use"][0]
    jsonschema.validate(use.input, WEATHER["function"]["parameters"])
    msgs += [
        {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    final = a.messages.create(model=TOOLS, max_tokens=60, extra_body={"temperature": 0}, messages=msgs)
    assert final.stop_reason in ("end_turn", "max_tokens") and "18" in final.content[0].text, final
    # streaming, forced with tool_choice
    with a.messages.stream(
        model=TOOLS, max_tokens=100, extra_body={"temperature": 0}, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Hello!"}],
    ) as s:
        m = s.get_final_message()
    assert m.stop_reason == "tool_use", m
    jsonschema.validate([b for b in m.content if b.type == "tool_use"][0].input, WEATHER["function"]["parameters"])


@test
def anthropic_output_format(a, **_):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer"}}, "required": ["city", "population"], "additionalProperties": False}
    r = a.messages.create(
        model=PLAIN, max_tokens=100, extra_body={"temperature": 0},
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Give me a city and its population."}],
    )
    jsonschema.validate(json.loads(r.content[0].text), schema)


@test
def anthropic_errors(a, url_open, **_):
    try:
        a.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", e.body
    try:
        a.messages.create(model=PLAIN, max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
        raise AssertionError("over-long prompt accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
    r = httpx.post(url_open + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


# ---------------------------------------------------------------- Ollama


@test
def ollama_chat(ol, **_):
    r = ol.chat(model=PLAIN, messages=[{"role": "user", "content": "Say hello."}], options={"num_predict": 12})
    assert r.message.role == "assistant" and r.message.content.strip(), r
    assert r.done and r.done_reason in ("stop", "length"), r
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= 12, r
    parts = list(ol.chat(model=PLAIN, messages=[{"role": "user", "content": "Say hello."}], stream=True, options={"num_predict": 12, "temperature": 0}))
    assert parts[-1].done and "".join(p.message.content for p in parts).strip(), parts
    again = ol.chat(model=PLAIN + ":latest", messages=[{"role": "user", "content": "Say hello."}], options={"num_predict": 12, "temperature": 0})
    assert again.message.content == "".join(p.message.content for p in parts), (again, parts)


@test
def ollama_generate_tags_show(ol, **_):
    r = ol.generate(model=PLAIN, prompt="The capital of France is", raw=True, options={"num_predict": 5, "temperature": 0})
    assert "Paris" in r.response, r
    names = [m.model for m in ol.list().models]
    assert PLAIN + ":latest" in names and TOOLS + ":latest" in names, names
    s = ol.show(TOOLS)
    assert s.modelinfo["general.architecture"] == "qwen2", s.modelinfo
    assert "tools" in (s.capabilities or []), s.capabilities


@test
def ollama_tools_and_format(ol, **_):
    r = ol.chat(model=TOOLS, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 100})
    calls = r.message.tool_calls
    assert calls and calls[0].function.name == "get_weather", r
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER["function"]["parameters"])
    msgs = ASK + [r.message, {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    final = ol.chat(model=TOOLS, messages=msgs, options={"temperature": 0, "repeat_penalty": 1.0, "num_predict": 60})
    assert "18" in final.message.content, final
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}}, "required": ["city", "country"]}
    j = ol.chat(model=PLAIN, messages=[{"role": "user", "content": "Name a city and its country as JSON."}], format=schema, options={"temperature": 0, "num_predict": 100})
    jsonschema.validate(json.loads(j.message.content), schema)


@test
def ollama_errors(ol, url_open, **_):
    try:
        ol.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("unknown model accepted")
    except ollama.ResponseError as e:
        assert e.status_code == 404 and "no-such-model" in e.error, (e.status_code, e.error)
    r = httpx.post(url_open + "/api/chat", content=b"[", timeout=30)
    assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
    try:
        ol.chat(model=PLAIN, messages=[{"role": "user", "content": "word " * 5000}])
        raise AssertionError("over-long prompt accepted")
    except ollama.ResponseError as e:
        assert e.status_code == 400 and "context" in e.error, (e.status_code, e.error)


@test
def sixteen_concurrent_streams(o, **_):
    import concurrent.futures

    def one(i):
        chunks = list(
            o.chat.completions.create(
                model=PLAIN,
                messages=[{"role": "user", "content": f"Tell story number {i}."}],
                max_tokens=24,
                temperature=0.7,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for text, n, finish in results:
        assert text.strip() and n == 24 and finish == "length", (text, n, finish)
    # each stream got its own text (seeded differently)
    assert len({t for t, _, _ in results}) > 8, results


# ---------------------------------------------------------------- keys and limits


@test
def keys_and_rate_limits(url_keyed, **_):
    # the keyed server starts open; its first key (made from loopback) is an admin key
    admin = httpx.post(url_keyed + "/admin/keys", json={"name": "admin"}, timeout=30).json()
    assert admin["key"]["admin"] is True, admin
    limited = httpx.post(
        url_keyed + "/admin/keys", json={"name": "app", "rpm": 2}, headers={"Authorization": "Bearer " + admin["secret"]}, timeout=30
    ).json()
    msgs = [{"role": "user", "content": "hi"}]
    # no key at all, in each API's shape
    body = {"model": PLAIN, "max_tokens": 2, "messages": msgs}
    r = httpx.post(url_keyed + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.post(url_keyed + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    r = httpx.post(url_keyed + "/api/chat", json={"model": PLAIN, "messages": msgs}, timeout=30)
    assert r.status_code == 401 and isinstance(r.json()["error"], str), r.text
    # a wrong key, through the clients
    for key, label in (("sk-shoal-wrong", "wrong"),):
        o = openai.OpenAI(base_url=url_keyed + "/v1", api_key=key, max_retries=0)
        try:
            o.chat.completions.create(model=PLAIN, messages=msgs, max_tokens=2)
            raise AssertionError(f"{label} key accepted")
        except openai.AuthenticationError as e:
            assert e.body["type"] == "invalid_request_error" or e.status_code == 401, e.body
        a = anthropic.Anthropic(base_url=url_keyed, api_key=key, max_retries=0)
        try:
            a.messages.create(model=PLAIN, max_tokens=2, messages=msgs)
            raise AssertionError(f"{label} key accepted (anthropic)")
        except anthropic.AuthenticationError as e:
            assert e.body["error"]["type"] == "authentication_error", e.body
        ol = ollama.Client(host=url_keyed, headers={"Authorization": "Bearer " + key})
        try:
            ol.chat(model=PLAIN, messages=msgs, options={"num_predict": 2})
            raise AssertionError(f"{label} key accepted (ollama)")
        except ollama.ResponseError as e:
            assert e.status_code == 401 and e.error, e
    # a valid key works, then hits its limit of 2 per minute with Retry-After
    o = openai.OpenAI(base_url=url_keyed + "/v1", api_key=limited["secret"], max_retries=0)
    for _ in range(2):
        o.chat.completions.create(model=PLAIN, messages=msgs, max_tokens=2)
    try:
        o.chat.completions.create(model=PLAIN, messages=msgs, max_tokens=2)
        raise AssertionError("rate limit not enforced")
    except openai.RateLimitError as e:
        assert int(e.response.headers["retry-after"]) >= 1, e.response.headers
        assert e.body["type"] == "rate_limit_error" or "rate limit" in e.message, e.body
    a = anthropic.Anthropic(base_url=url_keyed, api_key=limited["secret"], max_retries=0)
    try:
        a.messages.create(model=PLAIN, max_tokens=2, messages=msgs)
        raise AssertionError("rate limit not enforced (anthropic)")
    except anthropic.RateLimitError as e:
        assert e.body["error"]["type"] == "rate_limit_error", e.body
    ol = ollama.Client(host=url_keyed, headers={"Authorization": "Bearer " + limited["secret"]})
    try:
        ol.chat(model=PLAIN, messages=msgs, options={"num_predict": 2})
        raise AssertionError("rate limit not enforced (ollama)")
    except ollama.ResponseError as e:
        assert e.status_code == 429, e
    # the admin key has no limit and can revoke
    r = httpx.delete(url_keyed + "/admin/keys/" + limited["key"]["id"], headers={"Authorization": "Bearer " + admin["secret"]}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        o.chat.completions.create(model=PLAIN, messages=msgs, max_tokens=2)
        raise AssertionError("revoked key accepted")
    except openai.AuthenticationError:
        pass


# ---------------------------------------------------------------- thinking
#
# The THINKING server replays output written in Qwen3's format (tests/data/thinking-qwen3.json)
# through smollm2 given Qwen3's chat template: no model that thinks is on the package
# registries. The replay picks its output by whether thinking is on and tools are offered.

THINKER = "smollm2"
MATH = [{"role": "user", "content": "What is 17 times 23?"}]
MATH_REASONING = "Okay, 17 times 23. 17 times 20 is 340, and 17 times 3 is 51.\n\n340 plus 51 is 391."
MATH_ANSWER = "17 \u00d7 23 = **391**."
WEATHER_REASONING = (
    "The user wants the weather in Paris. I have a get_weather tool that takes a city, "
    'so I should call it with "Paris" instead of guessing.'
)


@test
def openai_thinking(ot, **_):
    r = ot.chat.completions.create(model=THINKER, messages=MATH)
    m = r.choices[0].message
    assert m.reasoning_content == MATH_REASONING and m.content == MATH_ANSWER, m
    assert r.usage.completion_tokens_details.reasoning_tokens > 0, r.usage
    reasoning, content = "", ""
    for c in ot.chat.completions.create(model=THINKER, messages=MATH, stream=True):
        if not c.choices:
            continue
        d = c.choices[0].delta
        if getattr(d, "reasoning_content", None):
            assert not content, "reasoning after the answer began"
            reasoning += d.reasoning_content
        content += d.content or ""
    assert (reasoning, content) == (MATH_REASONING, MATH_ANSWER), (reasoning, content)
    # a tool call after the reasoning, streamed
    reasoning, calls = "", {}
    for c in ot.chat.completions.create(model=THINKER, messages=ASK, tools=[WEATHER], stream=True):
        d = c.choices[0].delta if c.choices else None
        if d is None:
            continue
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, "")
            calls[tc.index] += tc.function.arguments or ""
    assert reasoning == WEATHER_REASONING, reasoning
    assert [json.loads(a) for a in calls.values()] == [{"city": "Paris"}], calls
    # thinking off
    r = ot.chat.completions.create(model=THINKER, messages=MATH, reasoning_effort="none")
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) is None and m.content == "17 \u00d7 23 = 391.", m


@test
def openai_responses_thinking(ot, **_):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    r = ot.responses.create(model=THINKER, input=ASK[0]["content"], tools=tools, reasoning={"effort": "high"})
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "function_call"], r.output
    assert r.output[0].content[0].text == WEATHER_REASONING, r.output[0]
    assert json.loads(r.output[1].arguments) == {"city": "Paris"}, r.output[1]
    assert r.usage.output_tokens_details.reasoning_tokens > 0, r.usage
    with ot.responses.stream(model=THINKER, input=MATH[0]["content"]) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.reasoning_text.delta")
        final = s.get_final_response()
    assert deltas == MATH_REASONING, deltas
    assert [o.type for o in final.output] == ["reasoning", "message"], final.output
    assert final.output[0].content[0].text == MATH_REASONING and final.output_text == MATH_ANSWER, final
    off = ot.responses.create(model=THINKER, input=MATH[0]["content"], reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"], off.output


@test
def anthropic_thinking(at, **_):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    r = at.messages.create(model=THINKER, max_tokens=2048, thinking=thinking, messages=MATH)
    assert [b.type for b in r.content] == ["thinking", "text"], r.content
    assert r.content[0].thinking == MATH_REASONING and r.content[1].text == MATH_ANSWER, r.content
    tools = [{"name": "get_weather", "description": "Current weather for a city.", "input_schema": WEATHER["function"]["parameters"]}]
    with at.messages.stream(model=THINKER, max_tokens=2048, thinking=thinking, tools=tools, messages=ASK) as s:
        streamed = "".join(e.thinking for e in s if e.type == "thinking")
        m = s.get_final_message()
    assert streamed == WEATHER_REASONING, streamed
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use", m
    assert m.content[0].thinking == WEATHER_REASONING and m.content[1].input == {"city": "Paris"}, m.content
    # the thinking block goes back with the tool result
    msgs = ASK + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id, "content": RESULT}]},
    ]
    assert at.messages.count_tokens(model=THINKER, messages=msgs, tools=tools).input_tokens > 0
    off = at.messages.create(model=THINKER, max_tokens=256, thinking={"type": "disabled"}, messages=MATH)
    assert [b.type for b in off.content] == ["text"], off.content


@test
def ollama_thinking(olt, **_):
    r = olt.chat(model=THINKER, messages=MATH, think=True)
    assert r.message.thinking == MATH_REASONING and r.message.content == MATH_ANSWER, r.message
    thinking, calls = "", []
    for c in olt.chat(model=THINKER, messages=ASK, tools=[WEATHER], think=True, stream=True):
        thinking += c.message.thinking or ""
        calls += c.message.tool_calls or []
    assert thinking == WEATHER_REASONING, thinking
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})], calls
    off = olt.chat(model=THINKER, messages=MATH, think=False)
    assert not off.message.thinking and off.message.content == "17 \u00d7 23 = 391.", off.message
    assert "thinking" in olt.show(THINKER).capabilities


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--open", required=True)
    p.add_argument("--keyed", required=True)
    p.add_argument("--thinking", required=True, help="a server replaying a thinking model's output")
    p.add_argument("-k", default="", help="run only tests whose name contains this")
    args = p.parse_args()
    ctx = {
        "o": openai.OpenAI(base_url=args.open + "/v1", api_key="unused", max_retries=0, timeout=300),
        "a": anthropic.Anthropic(base_url=args.open, api_key="unused", max_retries=0, timeout=300),
        "ol": ollama.Client(host=args.open, timeout=300),
        "ot": openai.OpenAI(base_url=args.thinking + "/v1", api_key="unused", max_retries=0, timeout=300),
        "at": anthropic.Anthropic(base_url=args.thinking, api_key="unused", max_retries=0, timeout=300),
        "olt": ollama.Client(host=args.thinking, timeout=300),
        "url_open": args.open,
        "url_keyed": args.keyed,
    }
    failed = 0
    for t in TESTS:
        if args.k not in t.__name__:
            continue
        t0 = time.time()
        try:
            t(**ctx)
            print(f"ok    {t.__name__} ({time.time() - t0:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL  {t.__name__} ({time.time() - t0:.1f} s)", flush=True)
            traceback.print_exc()
    print(f"{failed} failed", flush=True)
    sys.exit(min(failed, 100))


if __name__ == "__main__":
    main()
