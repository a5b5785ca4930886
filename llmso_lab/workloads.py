"""Request workloads for the engine benchmarks, the simulator and the labs, and what happened to them.

A workload is a list of `Request`s (arrival time in seconds, prompt and output length in tokens).
Every generator is deterministic for a given seed. The engine and the simulator both report a
`RequestMetrics` per request (TTFT, TPOT, E2E); `latency_summary` and `percentiles` summarise them.
"""
from __future__ import annotations

import csv
import inspect
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["Request", "poisson_arrivals", "uniform_lengths", "lognormal_lengths", "make_workload", "mixed_workload",
           "chat_length_mix", "write_chat_lengths",
           "SharedPrefixRequest", "zipf_weights", "shared_prefix_workload", "load_chat_lengths", "CHAT_LENGTHS_PATH",
           "load_trace", "save_trace", "RequestMetrics", "percentiles", "latency_summary"]

CHAT_LENGTHS_PATH = Path(__file__).resolve().parents[1] / "data" / "workloads" / "chat_lengths.json"


@dataclass(slots=True)
class Request:
    """One request of a workload. Times in seconds, lengths in tokens; lower priority value = served first."""

    request_id: int | str
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len and output_len must be >= 1, "
                             f"got {self.prompt_len} and {self.output_len}")
        if self.arrival_time < 0:
            raise ValueError(f"request {self.request_id}: arrival_time must be >= 0, got {self.arrival_time}")


@dataclass(slots=True)
class SharedPrefixRequest(Request):
    """A request whose prompt starts with shared prefix `prefix_id` (a system prompt) of `prefix_len` tokens."""

    prefix_id: int = 0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        Request.__post_init__(self)
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"request {self.request_id}: prefix_len must be in [0, prompt_len={self.prompt_len}], "
                             f"got {self.prefix_len}")


def poisson_arrivals(rate: float, n: int, seed: int = 0, start: float = 0.0) -> list[float]:
    """Arrival times (s) of `n` requests from a Poisson process of `rate` requests/s.

    `rate=math.inf` puts every arrival at `start` (an offline batch).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return [start] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return (start + np.cumsum(gaps)).tolist()


def uniform_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """`n` integer lengths drawn uniformly from [low, high] (both inclusive)."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    return np.random.default_rng(seed).integers(low, high + 1, size=n).tolist()


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int, seed: int = 0) -> list[int]:
    """`n` integer lengths from a log-normal (median `median`, log-space spread `sigma`), rounded and clipped
    to [low, high]. Long-tailed like real chat traffic: most requests short, a few very long."""
    if not 1 <= low <= high or median <= 0 or sigma < 0:
        raise ValueError(f"need 1 <= low <= high, median > 0 and sigma >= 0; got low={low}, high={high}, "
                         f"median={median}, sigma={sigma}")
    x = np.random.default_rng(seed).lognormal(math.log(median), sigma, size=n)
    return np.clip(np.rint(x), low, high).astype(int).tolist()


def chat_length_mix(n: int = 1000, prompt_median: float = 100.0, prompt_sigma: float = 1.0,
                    output_median: float = 250.0, output_sigma: float = 0.8, max_model_len: int = 2048,
                    max_tokens: int = 1024, seed: int = 0) -> list[tuple[int, int]]:
    """`n` (prompt_len, output_len) pairs of chat-like traffic: independent log-normal prompt and output lengths,
    outputs clipped to `max_tokens`, prompts to what leaves room for the output within `max_model_len`.

    The defaults (those of `data/workloads/chat_lengths.json`) put the means near what the vLLM paper (Kwon et
    al., SOSP 2023, Fig. 11) reports for ShareGPT conversations, about 161 prompt and 338 output tokens; the
    spreads (sigma) are our choice.
    """
    if max_tokens >= max_model_len:
        raise ValueError(f"max_tokens={max_tokens} must be < max_model_len={max_model_len} to leave room for a prompt")
    rng = np.random.default_rng(seed)
    s_pr, s_out = rng.integers(0, 2**31, size=2).tolist()   # one stream per quantity
    outputs = lognormal_lengths(n, output_median, output_sigma, 1, max_tokens, seed=s_out)
    prompts = lognormal_lengths(n, prompt_median, prompt_sigma, 1, max_model_len - 1, seed=s_pr)
    return [(min(p, max_model_len - o), o) for p, o in zip(prompts, outputs)]


def write_chat_lengths(path: str | Path = CHAT_LENGTHS_PATH) -> Path:
    """(Re)generate `data/workloads/chat_lengths.json` with `chat_length_mix`'s defaults (seeded: the same file
    every time)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {k: v.default for k, v in inspect.signature(chat_length_mix).parameters.items()}
    pairs = chat_length_mix(**params)
    doc = {"description": "chat-like KV length mix: [prompt_len, output_len] per request, log-normal, seeded",
           "generator": "llmso_lab.workloads.chat_length_mix", "regenerate": "llmso_lab.workloads.write_chat_lengths()",
           "params": params, "mean_prompt_len": round(float(np.mean([p for p, _ in pairs])), 1),
           "mean_output_len": round(float(np.mean([o for _, o in pairs])), 1), "lengths": pairs}
    text = json.dumps({k: v for k, v in doc.items() if k != "lengths"}, indent=1)[:-2]
    rows = ",\n  ".join(f"[{p}, {o}]" for p, o in pairs)     # one request per line: readable diffs
    path.write_text(f'{text},\n "lengths": [\n  {rows}\n ]\n}}\n')
    return path


def load_chat_lengths(path: str | Path = CHAT_LENGTHS_PATH) -> tuple[list[tuple[int, int]], dict]:
    """The chat length mix: ([(prompt_len, output_len), ...], its params incl. max_model_len and max_tokens)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} is missing: regenerate it with llmso_lab.workloads.write_chat_lengths()")
    doc = json.loads(path.read_text())
    return [(int(p), int(o)) for p, o in doc["lengths"]], doc["params"]


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Popularity of `n` items under Zipf's law: the k-th most popular (k = 1..n) has weight 1/k^s, normalised."""
    if n < 1 or s < 0:
        raise ValueError(f"need n >= 1 and s >= 0, got n={n}, s={s}")
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def shared_prefix_workload(n: int, num_prefixes: int, rate: float, zipf_s: float = 1.0,
                           prefix_len: tuple[int, int] = (256, 2048), suffix_median: float = 50.0,
                           output_median: float = 150.0, sigma: float = 0.8, max_len: int = 1024,
                           seed: int = 0) -> list[SharedPrefixRequest]:
    """`n` requests, each = one of `num_prefixes` system prompts (Zipf popularity, exponent `zipf_s`; prefix 0 the
    most popular; its length uniform in `prefix_len`, fixed per prefix) + its own log-normal suffix (median
    `suffix_median`), with a log-normal output (median `output_median`); both clipped to [1, max_len]. Poisson
    arrivals at `rate` requests/s."""
    rng = np.random.default_rng(seed)
    s_arr, s_pick, s_plen, s_suf, s_out = rng.integers(0, 2**31, size=5).tolist()   # one stream per quantity
    lens = np.random.default_rng(s_plen).integers(prefix_len[0], prefix_len[1] + 1, size=num_prefixes)
    picks = np.random.default_rng(s_pick).choice(num_prefixes, size=n, p=zipf_weights(num_prefixes, zipf_s))
    suffix = lognormal_lengths(n, suffix_median, sigma, 1, max_len, seed=s_suf)
    output = lognormal_lengths(n, output_median, sigma, 1, max_len, seed=s_out)
    arrivals = poisson_arrivals(rate, n, s_arr)
    return [SharedPrefixRequest(i, arrivals[i], int(lens[k]) + suffix[i], output[i], prefix_id=int(k),
                                prefix_len=int(lens[k])) for i, k in enumerate(picks.tolist())]


def make_workload(n: int, rate: float = math.inf, prompt_len: tuple[int, int] = (32, 512),
                  output_len: tuple[int, int] = (16, 256), priorities: Sequence[int] | None = None,
                  seed: int = 0) -> list[Request]:
    """`n` requests with Poisson arrivals and uniform prompt/output lengths (inclusive ranges)."""
    rng = np.random.default_rng(seed)
    s_arr, s_pr, s_out = rng.integers(0, 2**31, size=3).tolist()  # one stream per quantity
    arrivals = poisson_arrivals(rate, n, s_arr)
    prompts = uniform_lengths(n, *prompt_len, seed=s_pr)
    outputs = uniform_lengths(n, *output_len, seed=s_out)
    prio = list(priorities) if priorities is not None else [0] * n
    if len(prio) != n:
        raise ValueError(f"got {len(prio)} priorities for {n} requests")
    return [Request(i, arrivals[i], prompts[i], outputs[i], prio[i]) for i in range(n)]


def mixed_workload(n: int = 64, rate: float = math.inf, seed: int = 0) -> list[Request]:
    """The engine benchmark's workload: prompts 32-512 tokens, outputs 16-256 tokens."""
    return make_workload(n, rate, (32, 512), (16, 256), seed=seed)


def load_trace(source: str | Path | Iterable[Mapping | Sequence]) -> list[Request]:
    """Replay a trace: a CSV or JSON file, or a list of dicts / (id, arrival, prompt, output[, priority]) rows.

    Dict rows and CSV headers use `Request`'s field names. The result is sorted by arrival time.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".json":
            rows = json.loads(path.read_text())
        elif path.suffix == ".csv":
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f))
        else:
            raise ValueError(f"trace file must end in .json or .csv, got {path.name}")
    else:
        rows = list(source)
    names = [f.name for f in fields(Request)]
    requests = []
    for row in rows:
        d = dict(row) if isinstance(row, Mapping) else dict(zip(names, row))
        rid = d["request_id"]
        requests.append(Request(int(rid) if str(rid).lstrip("-").isdigit() else rid, float(d["arrival_time"]),
                                int(d["prompt_len"]), int(d["output_len"]), int(d.get("priority") or 0)))
    return sorted(requests, key=lambda r: r.arrival_time)


def save_trace(requests: Sequence[Request], path: str | Path) -> None:
    """Write requests as a .json or .csv trace that `load_trace` reads back."""
    path = Path(path)
    rows = [asdict(r) for r in requests]
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Request)])
            w.writeheader()
            w.writerows(rows)
    else:
        raise ValueError(f"trace file must end in .json or .csv, got {path.name}")


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean": ..., "p50": ..., "p90": ..., "p99": ...} of `values` (linear interpolation; NaN if empty)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"mean": math.nan, **{f"p{p:g}": math.nan for p in ps}}
    return {"mean": float(v.mean()), **{f"p{p:g}": float(np.percentile(v, p)) for p in ps}}


@dataclass(slots=True)
class RequestMetrics:
    """What happened to one request, in the engine or in the simulator. Times in seconds on one clock."""

    request_id: int | str
    arrival_time: float
    first_token_time: float
    finish_time: float                     # when the whole answer was returned
    prompt_len: int
    output_len: int
    num_preemptions: int = 0
    first_scheduled_time: float | None = None   # engine: the first step that computed the request
    token_times: list[float] | None = None      # engine: when each output token was sampled (sim: None)
    sample_token_times: list[list[float]] | None = None   # engine, n > 1: each sample's own token times

    @property
    def ttft(self) -> float:
        """Time to first token: arrival -> first output token."""
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        """Arrival -> first scheduled (NaN where not recorded)."""
        return math.nan if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Time per output token after the first (mean inter-token latency); 0 for a one-token answer."""
        if self.sample_token_times is not None:   # n samples: each one's gaps, not the gaps between samples
            gaps = self.itl
            return sum(gaps) / len(gaps) if gaps else 0.0
        if self.output_len < 2:
            return 0.0
        last = self.token_times[-1] if self.token_times else self.finish_time
        return (last - self.first_token_time) / (self.output_len - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies between consecutive output tokens of the same sample (needs `token_times`): with
        n > 1 samples each sample's own gaps, one after the other (vLLM times each sample as its own request)."""
        if self.token_times is None:
            raise ValueError("itl needs per-token times; the simulator records only the first and the last token")
        timelines = self.sample_token_times if self.sample_token_times is not None else [self.token_times]
        return [b - a for times in timelines for a, b in zip(times, times[1:])]

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival -> whole answer returned."""
        return self.finish_time - self.arrival_time


def latency_summary(metrics: Iterable[RequestMetrics], ps: Sequence[float] = (50, 90, 99)) -> dict[str, dict[str, float]]:
    """{"ttft_s": percentiles, "tpot_s": ..., "e2e_s": ...}; TPOT over requests with more than one token."""
    metrics = list(metrics)
    return {"ttft_s": percentiles([m.ttft for m in metrics], ps),
            "tpot_s": percentiles([m.tpot for m in metrics if m.output_len > 1], ps),
            "e2e_s": percentiles([m.e2e for m in metrics], ps)}
