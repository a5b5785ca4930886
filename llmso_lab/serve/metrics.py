"""`GET /metrics`: the engine's state in Prometheus text, under vLLM's metric names (so a dashboard built for
`vllm serve` reads this server too). Gauges are read after every engine step; histograms get one observation per
finished request (TTFT, end-to-end) or per output token gap (inter-token latency), with vLLM's bucket bounds."""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmso_lab.workloads import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM 0.x's bucket bounds (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            c = Counter(name, doc, labels + list(extra), registry=r)
            return c if extra else c.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.model_name = model_name
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (new or preempted).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (a running request lost its KV blocks).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens generated.")
        self.success = counter("vllm:request_success", "Finished requests, by finish reason.", ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the whole answer.", E2E_BUCKETS)
        self._last: dict[str, float] = {}

    def after_step(self, stats: dict, num_running: int, num_waiting: int) -> None:
        """Gauges from the engine's queues, counters from the growth of `LLMEngine.stats()`'s totals."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(stats["kv_cache_usage"])
        for counter, key in ((self.preemptions, "num_preemptions_total"), (self.prefix_queries, "prefix_cache_queried_tokens"),
                             (self.prefix_hits, "prefix_cache_hit_tokens"), (self.prompt_tokens, "num_prompt_tokens"),
                             (self.generation_tokens, "num_generated_tokens")):
            grown = stats[key] - self._last.get(key, 0)
            if grown > 0:
                counter.inc(grown)
            self._last[key] = stats[key]

    def finished(self, m: RequestMetrics, finish_reason: str) -> None:
        if m.token_times:
            self.ttft.observe(m.ttft)
            for gap in m.itl:
                self.itl.observe(gap)
        self.e2e.observe(m.e2e)
        self.success.labels(self.model_name, finish_reason).inc()

    def aborted(self) -> None:
        """A request the client left (or the server aborted) before it finished."""
        self.success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_scrape(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {metric name: [(labels, value), ...]} (comments skipped; `le="+Inf"` kept as a label)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part) if rest else {}
        out.setdefault(name, []).append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def histogram_buckets(scrape: dict, name: str) -> list[tuple[float, float]]:
    """[(upper bound `le`, cumulative count)] of histogram `name` in a parsed scrape, summed over its other labels,
    sorted by bound (+Inf last)."""
    sums: dict[float, float] = {}
    for labels, value in scrape.get(f"{name}_bucket", []):
        le = float(labels["le"])   # float("+Inf") is inf
        sums[le] = sums.get(le, 0.0) + value
    return sorted(sums.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The q-quantile from cumulative histogram buckets [(le, count)], as PromQL's `histogram_quantile` computes it:
    the bucket where the rank q * total falls, and linear interpolation inside it (its lower bound is the previous
    bucket's bound, 0 for the first). A rank in the +Inf bucket gives the highest finite bound; no observations, NaN."""
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    i = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if i == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[i]
    lower, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
    if i == 0 and upper <= 0:
        return upper
    if count == below:   # an empty bucket at rank 0: Prometheus computes 0/0
        return math.nan
    return lower + (upper - lower) * (rank - below) / (count - below)
