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
    # Malformed JSON straight over HTTP.
    req = urllib.request.Request(URL + "/v1/chat/completions", data=b"{nope",
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("malformed JSON accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert json.loads(e.read())["error"]["type"] == "invalid_request_error"


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
    assert metrics()["glmflash_kv_tokens_used"] > 0
    stream.close()
    deadline = time.time() + 30
    while True:
        m = metrics()
        if m["glmflash_running_requests"] == 0 and m["glmflash_kv_tokens_used"] == 0:
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
