"""The official `openai` Python client against a running `glmflash-node demo`.

Usage: GLMFLASH_E2E_URL=http://127.0.0.1:PORT python e2e/openai_client_test.py
(e2e/api_check.sh builds the binary, starts the server and runs this.)

The server is expected to run with --max-batch-size 8 --max-waiting 16. The demo model has
random weights, so the checks are about shapes, status codes, determinism and the
scheduler, not about what the text says. Ends with a line 'N passed, N failed'.
"""

import json
import os
import sys
import threading
import time
import traceback
import urllib.request

import openai

URL = os.environ["GLMFLASH_E2E_URL"].rstrip("/")
MODEL = os.environ.get("GLMFLASH_E2E_MODEL", "glm-5.3-flash")
client = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=120)
MESSAGES = [{"role": "user", "content": "Why are experts cached in VRAM?"}]

TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def metrics():
    with urllib.request.urlopen(URL + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@test
def models_list():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids
    assert client.models.retrieve(MODEL).id == MODEL


@test
def chat_non_streaming():
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, seed=3)
    assert r.object == "chat.completion"
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length", "tool_calls"), c.finish_reason
    assert 1 <= r.usage.completion_tokens <= 16, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # reasoning_content is an extra field the client keeps.
    assert "reasoning_content" in c.message.model_dump()


@test
def chat_streaming_with_usage():
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"], finishes
    assert chunks[-1].usage.completion_tokens == 12, chunks[-1].usage
    assert chunks[-1].choices == []


@test
def chat_seed_reproducible_and_n():
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, seed=1234, temperature=0.9, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]


@test
def chat_logprobs():
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5, content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)


@test
def chat_thinking_off_and_tools_render():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=tools,
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@test
def forced_tool_call():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools,
                                       tool_choice="required", max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather", r
    assert "city" in json.loads(call.function.arguments), call.function.arguments
    assert r.choices[0].finish_reason == "tool_calls"
    streamed = {}
    for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, stream=True, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ):
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert streamed[0]["name"] == "get_weather", streamed
    assert "city" in json.loads(streamed[0]["arguments"]), streamed


@test
def forced_tool_call_obeys_the_parameter_schema():
    # Issue 15 item 12: an enum string parameter was free text, so a small max_tokens ran
    # out mid-value and no call came back; maxLength was ignored.
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "note", "days"],
        "properties": {"city": {"enum": ["Oslo", "Paris"]},
                       "note": {"type": "string", "maxLength": 4, "pattern": "^[a-z]+$"},
                       "days": {"type": "integer", "minimum": 1, "maximum": 5}}}}}]
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, seed=seed,
                                           tool_choice="required", max_tokens=64)
        assert r.choices[0].finish_reason == "tool_calls", r
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        assert args["city"] in ("Oslo", "Paris"), args
        assert isinstance(args["note"], str) and 1 <= len(args["note"]) <= 4, args
        assert args["note"].isascii() and args["note"].isalpha() and args["note"].islower(), args
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 5, args


@test
def bad_tool_schema_names_the_field():
    for params, field in [
        ({"type": "object", "properties": {"city": {"type": "string", "pattern": "[a-"}}},
         "tools[0].function.parameters.properties.city.pattern"),
        ({"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}},
         "tools[0].function.parameters.properties.ids.uniqueItems"),
    ]:
        tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": params}}]
        try:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools,
                                           tool_choice="required", max_tokens=8)
            raise AssertionError(f"{field} accepted")
        except openai.BadRequestError as e:
            err = e.body if "message" in (e.body or {}) else e.body["error"]
            assert err["param"] == field, err
            assert field in err["message"], err


@test
def completions_non_streaming_and_streaming():
    r = client.completions.create(model=MODEL, prompt="The experts", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="The experts", max_tokens=8,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        if c.choices
    )
    assert streamed == text, (streamed, text)


@test
def completions_stop_string_cut():
    base = dict(model=MODEL, prompt="Experts live in", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    mid = len(text) // 2
    stop = text[mid:mid + 3]
    r = client.completions.create(**base, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)], (text, stop, r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"


@test
def error_shapes_and_status_codes():
    try:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
        raise AssertionError("temperature 5 accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        err = e.body if "message" in (e.body or {}) else e.body["error"]
        assert err["param"] == "temperature", err
        assert "between 0 and 2" in err["message"], err
        assert err["type"] == "invalid_request_error"
    try:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404
        assert e.code == "model_not_found", e.body
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**9)
        raise AssertionError("max_tokens over the context accepted")
    except openai.BadRequestError as e:
        assert "maximum context length" in e.message, e.message
    # A schema the grammar compiler refuses names response_format.
    try:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 12}}})
        raise AssertionError("an invalid schema accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        err = e.body if "message" in (e.body or {}) else e.body["error"]
        assert err["param"] == "response_format", err
    # Malformed JSON straight over HTTP.
    req = urllib.request.Request(URL + "/v1/chat/completions", data=b"{nope",
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("malformed JSON accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert json.loads(e.read())["error"]["type"] == "invalid_request_error"


def matches(value, schema):
    """A small JSON Schema check: types, required keys, enums, closed objects, maxLength."""
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        if not isinstance(value, dict) or not all(k in value for k in schema.get("required", [])):
            return False
        return all(matches(v, props[k]) if k in props else schema.get("additionalProperties") is not False
                   for k, v in value.items())
    if t == "array":
        return isinstance(value, list) and all(matches(v, schema.get("items", {})) for v in value)
    if t == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    return True


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "days": {"type": "integer"},
    "unit": {"type": "string", "enum": ["c", "f"]},
    "alerts": {"type": "array", "items": {"type": "boolean"}}},
    "required": ["city", "days", "unit", "alerts"], "additionalProperties": False}


@test
def structured_output_json_schema_strict():
    # The random demo model writes valid JSON matching the schema: the grammar masks tokens.
    for stream in (False, True):
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=300, n=2, seed=5,
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "weather", "schema": WEATHER, "strict": True}})
        if stream:
            texts = ["", ""]
            for c in client.chat.completions.create(stream=True, **kw):
                for ch in c.choices:
                    texts[ch.index] += ch.delta.content or ""
        else:
            r = client.chat.completions.create(**kw)
            assert [c.finish_reason for c in r.choices] == ["stop", "stop"], r
            texts = [c.message.content for c in r.choices]
        for t in texts:
            value = json.loads(t)
            assert matches(value, WEATHER), t


@test
def structured_output_parse_with_pydantic():
    # The client's own helper: a pydantic model becomes a strict json_schema and the reply
    # is parsed back into the model.
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: Annotated[str, Field(max_length=30)]
        days: int
        unit: Literal["c", "f"]
        windy: bool

    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Forecast,
                                      max_tokens=300, seed=9)
    f = r.choices[0].message.parsed
    assert isinstance(f, Forecast) and f.unit in ("c", "f") and len(f.city) <= 30, r


@test
def structured_output_json_object():
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2000, seed=2,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@test
def reasoning_when_thinking_is_on():
    # As GLM-5's template, the generation prompt opens <think>: until </think> the output
    # is reasoning_content (the random model never closes it).
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=4)
    assert r.choices[0].message.model_dump().get("reasoning_content"), r
    off = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=4,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.model_dump().get("reasoning_content") is None, off
    assert off.choices[0].message.content, off


def run_streams(count, max_tokens, results, barrier):
    def one(i):
        barrier.wait()
        try:
            n = 0
            for c in client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True, seed=i,
                extra_body={"ignore_eos": True},
            ):
                if c.choices and c.choices[0].finish_reason:
                    n += 1
            results[i] = "ok" if n == 1 else "no-finish"
        except openai.RateLimitError as e:
            results[i] = "429" if e.status_code == 429 else repr(e)
        except Exception as e:  # noqa: BLE001 - recorded and asserted on
            results[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@test
def sixteen_concurrent_streams():
    results = {}
    run_streams(16, 16, results, threading.Barrier(16))
    assert sorted(set(results.values())) == ["ok"], results


@test
def queue_full_gives_429():
    results = {}
    run_streams(40, 256, results, threading.Barrier(40))
    values = list(results.values())
    assert values.count("429") >= 1, results
    assert values.count("ok") + values.count("429") == 40, results


@test
def cancel_mid_stream_frees_the_cache():
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=100000, stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 4:
            break
    m = metrics()
    assert m["glmflash_kv_tokens_used"] > 0 and m["glmflash_kv_bytes_used"] > 0, m
    assert m["glmflash_kv_bytes_used"] <= m["glmflash_kv_bytes_capacity"], m
    stream.close()
    deadline = time.time() + 30
    while True:
        m = metrics()
        if m["glmflash_running_requests"] == 0 and m["glmflash_kv_bytes_used"] == 0:
            break
        assert time.time() < deadline, m
        time.sleep(0.05)


@test
def cancelled_streams_leave_the_queue():
    # Issue 15 item 13: streams dropped after their first bytes kept their place in the queue
    # and turned the next clients away with 429. 24 streams fill the batch (8) and the queue
    # (16); all are dropped after the first chunk and 16 more (a full queue) come at once:
    # none is refused.
    before = metrics().get("glmflash_requests_cancelled_total")
    assert before is not None, "no glmflash_requests_cancelled_total"

    def drop_after_first_chunk(results, i):
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=100000, stream=True,
                extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()
            results[i] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded and asserted on
            results[i] = repr(e)

    dropped = {}
    threads = [threading.Thread(target=drop_after_first_chunk, args=(dropped, i)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(dropped.values())) == ["ok"], dropped
    results = {}
    run_streams(16, 4, results, threading.Barrier(16))
    assert sorted(set(results.values())) == ["ok"], results
    deadline = time.time() + 30
    while True:
        m = metrics()
        if m["glmflash_requests_cancelled_total"] - before >= 24 and m["glmflash_running_requests"] == 0:
            break
        assert time.time() < deadline, m
        time.sleep(0.05)


def main():
    passed = failed = 0
    for fn in TESTS:
        started = time.time()
        try:
            fn()
            passed += 1
            print(f"PASS {fn.__name__} ({time.time() - started:.1f}s)", flush=True)
        except Exception:  # noqa: BLE001 - every failure is reported
            failed += 1
            print(f"FAIL {fn.__name__}", flush=True)
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
