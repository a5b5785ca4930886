"""Online serving (llmso_lab.serve): the OpenAI-compatible server on 127.0.0.1 in front of the engine, checked
against the offline engine's tokens, with streaming, stop strings, errors, aborts, overload and /metrics."""
import asyncio
import contextlib
import json
import math
import time

import httpx
import pytest

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.models.tiny import tiny_llama
from llmso_lab.serve import running_server
from llmso_lab.engine.detokenizer import IncrementalDetokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class ToyTokenizer:
    """Token i decodes to one letter (EOS, id 2, to nothing); text encodes letter by letter."""
    eos_token_id = 2
    chat_template = "role: content"

    def encode(self, text):
        return [3 + LETTERS.index(c) if c in LETTERS else 29 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 2 else LETTERS[i % 26] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("".join(f"{m['role']}{m['content']}" for m in messages) + "assistant")


ENGINE = dict(block_size=4, num_kv_blocks=256, max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64)


@pytest.fixture(scope="module")
def server(model):
    with running_server(model, ToyTokenizer(), served_model_name="tiny", **ENGINE) as s:
        yield s


def offline(model, prompt_ids, **params):
    out = LLM(model, ToyTokenizer(), **ENGINE).generate([prompt_ids], SamplingParams(**params), use_tqdm=False)[0]
    return out.outputs[0]


def events(response):
    """The JSON objects of a server-sent event stream, then the final marker."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def wait_idle(llm, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while llm.engine.has_unfinished_requests() or llm.num_in_flight:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.02)


def test_completion_equals_the_offline_engine_streamed_or_not(server, model):
    ref = offline(model, [5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == ref.text
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=30,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        ev = events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 12 and ev[-2]["choices"] == []
    chunks = [e["choices"][0] for e in ev[:-2]]
    assert len(chunks) > 1 and "".join(c["text"] for c in chunks) == ref.text
    assert [c["finish_reason"] for c in chunks][-1] == "length" and all(c["finish_reason"] is None for c in chunks[:-1])
    wait_idle(server.llm)
    assert server.llm.engine.block_manager.num_used_blocks == 0


def test_text_prompts_chat_and_n_samples(server, model):
    ref = offline(model, ToyTokenizer().encode("userhiassistant"), max_tokens=6, ignore_eos=True)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        ev = events(r)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1]) == ref.text
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "abc", "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7,
                         "ignore_eos": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(len(c["text"]) == 5 for c in choices)
    samples = LLM(model, ToyTokenizer(), **ENGINE).generate(["abc"], SamplingParams(n=2, max_tokens=5, temperature=1.0,
                                                                                      seed=7, ignore_eos=True), use_tqdm=False)
    assert [c["text"] for c in choices] == [o.text for o in samples[0].outputs]


def test_stop_strings_end_the_answer_before_them_and_free_the_blocks(server, model):
    ref = offline(model, [9, 10, 11], max_tokens=40, ignore_eos=True).text
    stop = ref[10:12]   # two letters the greedy answer reaches
    cut = ref.index(stop)
    for stream in (False, True):
        body = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stop": [stop, "zzzzzz"], "stream": stream}
        if stream:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
                chunks = [e["choices"][0] for e in events(r)[:-1]]
            text, reason = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
        else:
            choice = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        assert (text, reason) == (ref[:cut], "stop")
        wait_idle(server.llm)
        assert server.llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("body,param,words", [
    ({"model": "other", "prompt": [1, 2]}, "model", "does not exist"),
    ({"model": "tiny", "prompt": [1, 2], "max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
    ({"model": "tiny", "prompt": [1, 2], "best_of": 2}, "best_of", "not supported by this server"),
    ({"model": "tiny", "prompt": [1, 2], "presence_penalty": 3}, "presence_penalty", "must be in [-2, 2]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs: true"),
    ({"model": "tiny", "prompt": [1] * 600}, None, "prompt has 600 tokens but max_model_len is 512"),
    ({"model": "tiny", "prompt": [1, 2], "max_tokens": 511}, None, "maximum context length is 512"),
    ({"model": "tiny", "prompt": [1, 99999]}, None, "token ids must be ints in [0, 64)"),
    ({"model": "tiny", "messages": []}, "messages", "at least 1"),
])
def test_bad_input_gets_an_openai_error_that_names_the_field(server, body, param, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    status, kind = (404, "NotFoundError") if param == "model" else (400, "BadRequestError")   # vLLM: unknown model 404
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == status and err["param"] == param and words in err["message"]


def test_penalties_and_logprobs_pass_through_as_the_offline_engine_gives_them(server, model):
    params = dict(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5,
                  min_tokens=2, logprobs=2)
    ref = offline(model, [5, 6, 7, 8], **params)
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], **params},
                   timeout=30).json()["choices"][0]
    assert r["text"] == ref.text != offline(model, [5, 6, 7, 8], max_tokens=8, ignore_eos=True).text
    lp = r["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-6)
    assert "".join(lp["tokens"]) == ref.text and all(len(top) <= 2 for top in lp["top_logprobs"])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as resp:
        content = [c for e in events(resp)[1:-1] for c in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    ref = offline(model, ToyTokenizer().encode("userhiassistant"), max_tokens=4, ignore_eos=True, logprobs=3)
    assert [c["logprob"] for c in content] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-6)
    assert all(len(c["top_logprobs"]) == 3 and c["bytes"] == list(c["token"].encode()) for c in content)


def test_malformed_json_and_the_server_keeps_serving(server):
    r = httpx.post(f"{server.base_url}/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": [3], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(server):
    body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    before = server.llm.engine.num_generated_tokens
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    wait_idle(server.llm)   # the response closed after one chunk of a 200-token answer
    assert server.llm.engine.block_manager.num_used_blocks == 0
    assert server.llm.engine.num_generated_tokens - before < 200   # aborted, not run to the end


def test_api_key_overload_and_metrics(model):
    with running_server(model, ToyTokenizer(), served_model_name="tiny", api_key="k3y", max_queue=0,
                        **{**ENGINE, "max_num_seqs": 1}) as s:
        body = {"model": "tiny", "prompt": [7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{s.base_url}/v1/completions", json=body).status_code == 401
        assert httpx.get(f"{s.base_url}/health").status_code == 200   # only /v1 wants the key
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(f"{s.base_url}/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        for _ in range(3):
            assert httpx.post(f"{s.base_url}/v1/completions", json=body, headers=auth, timeout=30).status_code == 200
        async def two_at_once():   # the second arrives while the first (250 engine steps) still runs
            async with httpx.AsyncClient(base_url=s.base_url, headers=auth, timeout=30) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={**body, "max_tokens": 250})
                                              for _ in range(2)))
        ok, busy = sorted(asyncio.run(two_at_once()), key=lambda r: r.status_code)
        assert (ok.status_code, busy.status_code) == (200, 503)   # in flight: max_num_seqs + max_queue = 1
        assert "retry later" in busy.json()["error"]["message"]
        wait_idle(s.llm)
        text = httpx.get(f"{s.base_url}/metrics").text
        metric = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        tiny = '{model_name="tiny"}'
        assert metric[f"vllm:time_to_first_token_seconds_count{tiny}"] == 4   # the refused one never started
        assert metric[f"vllm:e2e_request_latency_seconds_count{tiny}"] == 4
        assert metric[f"vllm:inter_token_latency_seconds_count{tiny}"] == 3 * 3 + 249
        assert metric[f"vllm:prompt_tokens_total{tiny}"] == 4 * 2
        assert metric[f"vllm:generation_tokens_total{tiny}"] == 3 * 4 + 250
        assert metric['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 4
        assert metric[f"vllm:num_requests_running{tiny}"] == 0 and metric[f"vllm:kv_cache_usage_perc{tiny}"] == 0
        for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                     "vllm:prefix_cache_hits_total"):
            assert f"{name}{tiny}" in metric


def test_incremental_detokenizer_waits_for_whole_characters_and_hides_stop_strings():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")   # noqa: E731 - byte-level "tokens"
    d = IncrementalDetokenizer(decode)
    word = list("héllo".encode())   # é is two bytes
    assert [d.add([b]) for b in word] == ["h", "", "é", "l", "l", "o"]
    d = IncrementalDetokenizer(decode, stop=["STOP"])
    out = [d.add([b]) for b in b"abcSTO"]
    assert "".join(out) == "abc" and d.stopped_at is None   # "STO" may still become the stop string
    assert d.add(list(b"Pxyz")) == "" and d.stopped_at == "STOP" and d.text == "abc"
    d = IncrementalDetokenizer(decode, stop=["STOP"])
    assert "".join(d.add([b]) for b in b"abcST") + d.add(list(b"ay"), final=True) == "abcSTay"


def test_the_cli_serves_on_localhost_and_stops(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:   # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llmso_lab.cli", "serve", "tiny-llama", "--port", str(port),
                             "--max-model-len", "128", "--block-size", "8", "--no-enable-prefix-caching"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "tiny-llama", "prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["max_model_len"] == 128
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_bench_serve_measures_what_a_client_sees_and_agrees_with_the_server(server):
    from llmso_lab.bench.serve import measure, prompts

    reqs = prompts("random", 6, seed=3, token_range=(3, 60))
    assert reqs == prompts("random", 6, seed=3, token_range=(3, 60))   # every server gets the same requests
    shared = prompts("shared-prefix", 4, token_range=(3, 60))
    assert all(ids[:512] == shared[0][0][:512] and len(ids) > 512 for ids, _ in shared)
    with pytest.raises(ValueError, match="valid: random, chat, shared-prefix"):
        prompts("sharegpt", 2)
    rows = measure(server.base_url, rates=(math.inf, 40.0), num_prompts=6, workload="random", token_range=(3, 60), seed=3,
                   slo_ttft_ms=60_000, slo_tpot_ms=60_000)
    for row in rows:
        assert row["completed"] == 6 and row["failed"] == 0 and row["goodput_req_per_s"] == row["request_throughput"]
        assert row["output_tokens_per_s"] * row["duration_s"] == pytest.approx(sum(m for _, m in reqs))
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["e2e_p99_ms"] and row["tpot_p50_ms"] > 0
        # the server's histogram over the same requests: a little below the client's (no HTTP hop), never above
        assert 0 < row["server_ttft_mean_ms"] <= row["ttft_mean_ms"] * 1.05 + 5
    strict = measure(server.base_url, rates=(math.inf,), num_prompts=4, workload="random", token_range=(3, 60),
                     slo_ttft_ms=0.001, slo_tpot_ms=0.001)[0]
    assert strict["completed"] == 4 and strict["goodput_req_per_s"] == 0


def test_bench_serve_counts_failures_and_stops():
    from llmso_lab.bench.serve import measure

    with socket_free_port() as port:   # nothing listens there
        row = measure(f"http://127.0.0.1:{port}", rates=(math.inf,), num_prompts=3, model="x", timeout_s=20)[0]
    assert row["completed"] == 0 and row["failed"] == 3 and "errors" in row


@contextlib.contextmanager
def socket_free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_the_openai_client_streams_and_not(server, model):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    ref = offline(model, [5, 6, 7, 8], max_tokens=10, ignore_eos=True)
    done = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == ref.text and done.usage.completion_tokens == 10
    parts = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=10, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in parts if c.choices) == ref.text
    chat_ref = offline(model, ToyTokenizer().encode("userhiassistant"), max_tokens=6, ignore_eos=True)
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == chat_ref.text and reply.choices[0].message.role == "assistant"
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert chunks[-1].usage.completion_tokens == 6
    from openai import NotFoundError
    with pytest.raises(NotFoundError, match="does not exist"):   # vLLM and OpenAI: an unknown model is a 404
        client.completions.create(model="nope", prompt=[1], max_tokens=2)


def test_many_streams_at_once_get_the_offline_greedy_tokens(server, model):
    prompts = [[3 + i, 10 + 2 * i, 7, 40 - i] for i in range(12)]
    refs = LLM(model, ToyTokenizer(), **ENGINE).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                                                          use_tqdm=False)

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            async def one(p):
                body = {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                text = ""
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(all_at_once()) == [r.outputs[0].text for r in refs]   # 12 streams, max_num_seqs 4: queued
    wait_idle(server.llm)
    assert server.llm.engine.block_manager.num_used_blocks == 0


def test_bench_options_belong_to_bench_serve():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "bench", "cow", "--rate", "2"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "benchmark 'cow' has no --rate" in proc.stderr


def test_vllm_serve_peer_says_how_to_build_it_when_missing(tmp_path, capsys):
    from llmso_lab.bench.serve import vllm_server

    with vllm_server({"max_num_seqs": 4}, python=tmp_path / "no-venv" / "bin" / "python") as url:
        assert url is None
    assert "make peers-vllm" in capsys.readouterr().out


def test_the_bench_client_also_runs_inside_an_event_loop(server):
    """A Jupyter cell runs inside the kernel's event loop, where asyncio.run is refused."""
    from llmso_lab.bench.serve import measure

    async def cell():
        return measure(server.base_url, rates=(math.inf,), num_prompts=2, workload="random", token_range=(3, 60))
    assert asyncio.run(cell())[0]["completed"] == 2


def test_a_bench_server_process_dies_with_the_bench(tmp_path):
    """`bench serve` runs each server (the engine's, vLLM's) as a process of its own: stopped on leaving the block,
    and even when the bench itself is killed by a signal that skips its `finally` (no server outlives the bench)."""
    import subprocess
    import sys

    (tmp_path / "health").write_text("ok")   # a stand-in server: /health answers 200
    script = (
        "import os, sys, time\n"
        "from llmso_lab.bench.serve import _server_process\n"
        "from llmso_lab.parallel.launcher import free_port\n"
        "port = free_port()\n"
        f"cmd = [sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1', '--directory', {str(tmp_path)!r}]\n"
        "with _server_process('stand-in', cmd, dict(os.environ), port, None, 60) as url:\n"
        "    print(url, flush=True)\n"
        "    time.sleep(120)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        url = bench.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        bench.kill()   # SIGKILL: no finally, no atexit in the bench
        bench.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the server outlived the bench that started it")
