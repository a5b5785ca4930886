"""Request workloads for the engine benchmarks, the simulator and the labs, and what happened to them.

A workload is a list of `Request`s (arrival time in seconds, prompt and output length in tokens).
Every generator is deterministic for a given seed. The engine and the simulator both report a
`RequestMetrics` per request (TTFT, TPOT, E2E); `latency_summary` and `percentiles` summarise them.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["Request", "poisson_arrivals", "uniform_lengths", "make_workload", "mixed_workload",
           "load_trace", "save_trace", "RequestMetrics", "percentiles", "latency_summary"]


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
        if self.output_len < 2:
            return 0.0
        last = self.token_times[-1] if self.token_times else self.finish_time
        return (last - self.first_token_time) / (self.output_len - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies between consecutive output tokens (needs `token_times`)."""
        if self.token_times is None:
            raise ValueError("itl needs per-token times; the simulator records only the first and the last token")
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

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
