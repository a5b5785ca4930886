"""A property-based fuzzer that keeps the server standing (issue 51).

Hypothesis builds request bodies from the API's fields — valid, boundary, out-of-range, wrong-typed and hostile
values (NaN, huge ints, lone surrogates, nested junk, unknown fields) — and sends each to the live server on
127.0.0.1 while a normal greedy request runs beside it. After every body: the answer is a 2xx, or a 4xx in OpenAI's
error shape (never a 5xx, never a hang past 30 s); the normal request got the offline engine's tokens; `/health` is
200; nothing is left running (`vllm:num_requests_running` back to 0, every KV block free). Bounded: 60 bodies.
"""
import json
import threading

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmso_lab.serve.metrics import parse_scrape
from test_serve import events, model, offline, server, wait_idle  # noqa: F401 - fixtures
from test_serve_hardening import BODY

HOSTILE_TEXT = st.sampled_from(["", "a\ud800b", "\udfff", "\x00", "abc" * 300, "é🙂", "<|im_end|>", "\n" * 50])
TEXT = st.one_of(st.text(max_size=30), HOSTILE_TEXT)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                 st.floats(allow_nan=True, allow_infinity=True), TEXT,
                 st.lists(st.integers(-5, 70), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
SMALL_INT = st.one_of(st.integers(-3, 40), st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1]))
REAL = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1e-40, 1e-320, 1e300, -0.0]),
                 st.floats(allow_nan=True, allow_infinity=True))
IDS = st.lists(st.one_of(st.integers(0, 63), st.integers(-2, 2 ** 64)), max_size=6)

SAMPLING = {
    "max_tokens": st.one_of(st.integers(-2, 24), st.sampled_from([511, 512, 10 ** 12]), JUNK),
    "temperature": st.one_of(REAL, JUNK), "top_p": st.one_of(REAL, JUNK), "top_k": st.one_of(SMALL_INT, JUNK),
    "min_p": REAL, "n": st.one_of(st.sampled_from([0, 1, 2, 3, 129, 10 ** 6]), JUNK),
    "seed": st.one_of(SMALL_INT, JUNK), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JUNK),
    "stop_token_ids": st.one_of(IDS, JUNK), "ignore_eos": st.one_of(st.booleans(), JUNK),
    "stream": st.booleans(), "stream_options": st.one_of(st.just({"include_usage": True}), JUNK),
    "presence_penalty": REAL, "frequency_penalty": REAL, "repetition_penalty": REAL,
    "min_tokens": st.one_of(st.integers(-2, 30), JUNK), "logit_bias": JUNK, "user": JUNK,
    "model": st.one_of(st.just("tiny"), TEXT, JUNK), "x_unknown_field": JUNK,
}
COMPLETION = {"prompt": st.one_of(TEXT, IDS, st.lists(TEXT, max_size=3), st.lists(IDS, max_size=3), JUNK),
              "logprobs": st.one_of(st.integers(-1, 25), JUNK), "echo": st.one_of(st.booleans(), JUNK),
              "best_of": JUNK, "suffix": JUNK}
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                 st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "x"])}), JUNK)
MESSAGE = st.one_of(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "bogus"]), JUNK),
     "content": st.one_of(TEXT, st.lists(PART, max_size=3), JUNK)},
    optional={"name": st.one_of(TEXT, JUNK), "extra": JUNK}), JUNK)
CHAT = {"messages": st.one_of(st.lists(MESSAGE, max_size=3), JUNK), "logprobs": st.one_of(st.booleans(), JUNK),
        "top_logprobs": st.one_of(st.integers(-1, 25), JUNK), "max_completion_tokens": st.one_of(st.integers(-1, 24), JUNK)}


def body(extra):
    """A body of some of the fields, each present or not (the required ones usually present)."""
    fields = {**SAMPLING, **extra}
    return st.fixed_dictionaries({}, optional=fields).map(lambda b: {"model": "tiny", **b} if "model" not in b else b)


REQUESTS = st.one_of(st.tuples(st.just("completions"), body(COMPLETION)),
                     st.tuples(st.just("chat/completions"), body(CHAT)))


def answer_is_served_or_refused_in_openai_shape(r: httpx.Response, streamed: list | None):
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code, err
        assert isinstance(err["message"], str) and err["message"]
    elif streamed is not None:
        assert streamed and streamed[-1] == "[DONE]", streamed[-3:]
        assert not any(isinstance(e, dict) and "error" in e for e in streamed), streamed
    else:
        assert isinstance(r.json()["choices"], list)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=REQUESTS)
def test_no_request_stops_the_server(server, model, request):
    path, payload = request
    normal = {}
    want = offline(model, BODY["prompt"], max_tokens=6, temperature=0, ignore_eos=True).text

    def beside():
        normal["r"] = httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=30)

    worker = threading.Thread(target=beside)
    worker.start()
    raw = json.dumps(payload, allow_nan=True).encode()   # NaN and Infinity as Python writes them; "\ud800" escaped
    headers = {"content-type": "application/json"}
    streamed = None
    try:
        if payload.get("stream") is True:
            with httpx.stream("POST", f"{server.base_url}/v1/{path}", content=raw, headers=headers, timeout=30) as r:
                if r.status_code == 200:
                    streamed = events(r)
                else:
                    r.read()
        else:
            r = httpx.post(f"{server.base_url}/v1/{path}", content=raw, headers=headers, timeout=30)
    finally:
        worker.join(timeout=60)
    answer_is_served_or_refused_in_openai_shape(r, streamed)
    assert "r" in normal and normal["r"].status_code == 200, normal
    assert normal["r"].json()["choices"][0]["text"] == want
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_idle(server.llm, timeout_s=30)
    scrape = parse_scrape(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    assert [v for _, v in scrape["vllm:num_requests_running"]] == [0.0]
    assert server.llm.engine.block_manager.num_used_blocks == 0
