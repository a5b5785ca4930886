"""The server against hostile requests (issue 51): no single request stops it, every error has OpenAI's shape, a
client that leaves is aborted streaming or not. Each test reproduces a fault found on the server of 9634bfe (one
curl each) and checks, after the bad request, that a normal greedy request still gets the offline engine's tokens,
`/health` is 200 and nothing is left in flight."""
import json
import time

import httpx
import pytest

from llmso_lab.serve import running_server
from test_serve import ENGINE, ToyTokenizer, model, offline, server, wait_idle  # noqa: F401 - fixtures

BODY = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def still_serving(server, model):
    """A normal request gets the offline engine's greedy tokens, /health is 200 and nothing stays in flight."""
    r = httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    want = offline(model, BODY["prompt"], max_tokens=6, temperature=0, ignore_eos=True)
    assert r.json()["choices"][0]["text"] == want.text
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_idle(server.llm)
    assert server.llm.engine.block_manager.num_used_blocks == 0


def openai_error(r, status, *words):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    for w in words:
        assert w in err["message"] or w == err["param"], err
    return err


# ---- 1. one request used to kill or hang the engine for everyone -------------------------------------------------
@pytest.mark.parametrize("field,value,param", [
    ("seed", 2 ** 64, "seed"),                       # raised in the engine thread before its try: every request hung
    ("seed", -2 ** 63 - 1, "seed"),
    ("stop_token_ids", [64], "stop_token_ids"),      # outside the vocabulary: min_tokens' mask indexed past it
    ("stop_token_ids", [2 ** 63], "stop_token_ids"),
    ("stop_token_ids", [-1], "stop_token_ids"),      # negative ids were accepted
    ("temperature", float("nan"), "temperature"),
    ("repetition_penalty", float("inf"), "repetition_penalty"),
])
def test_a_value_the_engine_cannot_serve_is_a_400_at_the_edge(server, model, field, value, param):
    body = {**BODY, field: value, "min_tokens": 2}
    if value != value or value in (float("inf"),):   # JSON has no nan / inf: send them as Python's json writes them
        r = httpx.post(f"{server.base_url}/v1/completions", content=json.dumps(body).encode(), timeout=30,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    openai_error(r, 400, param)
    still_serving(server, model)


@pytest.mark.parametrize("field,value", [("temperature", 1e-40), ("repetition_penalty", 1e-320),
                                         ("repetition_penalty", 1e-300)])
def test_extreme_but_valid_values_are_served(server, model, field, value):
    """vLLM's rules: 0 < temperature < 1e-2 samples at 1e-2; any repetition_penalty > 0 is valid (its logits may
    overflow, and the sampler keeps their order instead of failing)."""
    r = httpx.post(f"{server.base_url}/v1/completions", json={**BODY, "temperature": 0.5, "seed": 1, field: value},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    still_serving(server, model)


def test_a_failing_step_fails_its_requests_only_and_three_in_a_row_declare_the_engine_dead(model, monkeypatch):
    with running_server(model, ToyTokenizer(), served_model_name="tiny", **ENGINE) as s:
        real, failures = s.llm.engine.step, []

        def once():   # the next step raises, the later ones run
            if not failures:
                failures.append(1)
                raise RuntimeError("simulated failure serving one request")
            return real()
        monkeypatch.setattr(s.llm.engine, "step", once)
        r = httpx.post(f"{s.base_url}/v1/completions", json=BODY, timeout=30)
        openai_error(r, 500, "simulated failure")
        assert s.llm.dead is None
        still_serving(s, model)   # the engine kept stepping: the next request is served as usual

        def broken():
            raise RuntimeError("simulated kernel failure")
        monkeypatch.setattr(s.llm.engine, "step", broken)
        for _ in range(2):   # two more failing steps after the first: the engine is broken, not a request
            openai_error(httpx.post(f"{s.base_url}/v1/completions", json=BODY, timeout=30), 500)
        openai_error(httpx.post(f"{s.base_url}/v1/completions", json=BODY, timeout=30), 503, "simulated kernel failure")
        assert httpx.get(f"{s.base_url}/health").status_code == 503
        openai_error(httpx.post(f"{s.base_url}/v1/completions", json=BODY, timeout=30), 503, "restart the server")


def test_a_request_the_engine_refuses_to_queue_fails_alone(model, monkeypatch):
    with running_server(model, ToyTokenizer(), served_model_name="tiny", **ENGINE) as s:
        real = s.llm.engine.add_checked

        def refuse(ids, *args, **kwargs):
            if ids == [9, 9]:
                raise OverflowError("simulated: cannot queue this one")
            return real(ids, *args, **kwargs)
        monkeypatch.setattr(s.llm.engine, "add_checked", refuse)
        openai_error(httpx.post(f"{s.base_url}/v1/completions", json={**BODY, "prompt": [9, 9]}, timeout=30), 500,
                     "could not be queued")
        assert s.llm.num_in_flight == 0
        still_serving(s, model)


# ---- 2. a non-streaming client that disconnects is aborted too -------------------------------------------------
def test_a_non_streaming_client_that_leaves_is_aborted(model, monkeypatch):
    """The auth middleware (installed even without a key) hid the disconnect from request.is_disconnected(): an
    abandoned request ran to max_tokens. Each step is slowed to 20 ms, so the whole answer would take ~8 s."""
    with running_server(model, ToyTokenizer(), served_model_name="tiny", **ENGINE) as s:
        real = s.llm.engine.step

        def slow():
            time.sleep(0.02)
            return real()
        monkeypatch.setattr(s.llm.engine, "step", slow)
        before = s.llm.engine.num_generated_tokens
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.base_url}/v1/completions", json={**BODY, "max_tokens": 400}, timeout=0.5)
        wait_idle(s.llm, timeout_s=5)   # aborted within a poll or two of the disconnect, not after 400 steps
        assert s.llm.engine.num_generated_tokens - before < 200
        assert s.llm.engine.block_manager.num_used_blocks == 0
        text = httpx.get(f"{s.base_url}/metrics").text   # counted as vLLM counts it
        assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text


# ---- 3. lone surrogates --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("completions", {**BODY, "prompt": "a\ud800b"}, "prompt"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi\udfff"}], "max_tokens": 2},
     "messages.0"),
    ("completions", {**BODY, "model": "ti\ud800ny"}, "model"),
    ("completions", {**BODY, "stop": ["x\ud800"]}, "stop"),
])
def test_a_lone_surrogate_is_a_400_not_a_plain_text_500(server, model, path, body, param):
    raw = json.dumps(body).encode()   # escaped as JSON sends it: "\\ud800"
    openai_error(httpx.post(f"{server.base_url}/v1/{path}", content=raw, timeout=30,
                            headers={"content-type": "application/json"}), 400, param)
    still_serving(server, model)


# ---- 4. the body size is bounded ------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_tokenized(server, model):
    big = {**BODY, "prompt": "a" * (5 << 20)}
    openai_error(httpx.post(f"{server.base_url}/v1/completions", json=big, timeout=60), 413, "limit")
    still_serving(server, model)


# ---- 5. n is bounded -----------------------------------------------------------------------------------------
def test_n_has_an_upper_bound(server, model):
    openai_error(httpx.post(f"{server.base_url}/v1/completions", json={**BODY, "n": 4000}, timeout=30), 400, "n")
    still_serving(server, model)


# ---- 6. every error in OpenAI's shape ------------------------------------------------------------------------------
def test_every_error_has_openais_shape(server, model):
    base = server.base_url
    openai_error(httpx.get(f"{base}/v1/nothing-here"), 404)
    openai_error(httpx.get(f"{base}/v1/completions"), 405)
    openai_error(httpx.post(f"{base}/v1/completions", content=b'{"model": "tiny", "prompt": "\xff\xfe"}',
                            headers={"content-type": "application/json"}), 400)
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{base}/v1/completions", content=deep, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code in (400, 413) and "error" in r.json(), r.text[:200]
    openai_error(httpx.post(f"{base}/v1/completions", json={**BODY, "model": "gpt-4"}), 404, "model")
    openai_error(httpx.post(f"{base}/v1/completions", json={**BODY, "stream_options": {"include_usage": True}}),
                 400, "stream_options")
    still_serving(server, model)


# ---- 7. the API key, as vLLM checks it ------------------------------------------------------------------------------
def test_the_api_key_scheme_is_case_insensitive_and_errors_are_openai_shaped(model):
    with running_server(model, ToyTokenizer(), served_model_name="tiny", api_key="k3y", **ENGINE) as s:
        openai_error(httpx.post(f"{s.base_url}/v1/completions", json=BODY), 401, "API key")
        openai_error(httpx.post(f"{s.base_url}/v1/completions", json=BODY, headers={"Authorization": "Bearer k3"}), 401)
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.post(f"{s.base_url}/v1/completions", json=BODY, headers={"Authorization": f"{scheme} k3y"},
                           timeout=30)
            assert r.status_code == 200, (scheme, r.text)
        assert httpx.options(f"{s.base_url}/v1/completions").status_code != 401   # a CORS preflight carries no key


# ---- 7. vLLM's semantics -----------------------------------------------------------------------------------------
def test_an_answer_cut_inside_a_character_ends_before_it_and_stop_strings_wait_for_min_tokens():
    from llmso_lab.engine.detokenizer import IncrementalDetokenizer

    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")   # noqa: E731 - byte-level "tokens"
    d = IncrementalDetokenizer(decode)
    assert d.add(list("hé".encode())[:2], final=True) == "h"   # max_tokens cut after the first byte of é: no "\ufffd"
    assert d.text == "h"
    d = IncrementalDetokenizer(decode, stop=["S"], min_tokens=3)
    assert d.add(list(b"aS")) == "aS" and d.stopped_at is None   # 2 tokens out: too early for a stop string
    assert d.add(list(b"bS")) == "b" and d.stopped_at == "S"     # the next one counts
    assert d.text == "aSb"


def test_stop_strings_are_matched_only_after_min_tokens(server, model):
    body = {**BODY, "prompt": [3, 4], "max_tokens": 12}
    text = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    stop = text[1]   # a letter the greedy answer writes at its second token
    early = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stop": [stop]}, timeout=30).json()
    assert early["choices"][0]["text"] == text[:text.index(stop)] and early["choices"][0]["finish_reason"] == "stop"
    late = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stop": [stop], "min_tokens": 12},
                      timeout=30).json()
    assert late["choices"][0]["text"] == text and late["choices"][0]["finish_reason"] == "length"
    still_serving(server, model)
