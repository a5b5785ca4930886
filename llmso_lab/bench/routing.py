"""`llmso-lab bench routing`: round-robin vs least-loaded vs prefix-aware (plain and bounded-load) routing.

(a) Real engines: `num_replicas` engines (`LLM`, tiny random model, prefix caching on, a small KV cache each)
    in one process. Requests = one of a few 512-token system prompts (Zipf popularity) + their own tokens,
    Poisson arrivals. The engines make every decision (batches, prefix-cache hits, evictions); each step
    advances its replica's own timeline by the roofline time of that step's work for the replica of (b)
    (`engine_cluster`), so the figures are deterministic and the same on any machine. The arrival rate is
    `load` x the replicas' capacity, measured on one replica serving a burst.
(b) Simulator at scale (`llmso_lab.sim.cluster`): 16 replicas of Llama-3-8B on an L4 (roofline step times,
    the KV that fits beside the weights: ~42k tokens per replica), 256 system prompts of 256-2048 tokens with
    Zipf popularity, Poisson arrivals at 16 and 24 requests/s (moderate and high load).

For each router: prefix hit rate (prompt tokens reused / prompt tokens), TTFT p50/p99, load imbalance
(max/mean requests per replica). The lecture's point: round-robin spreads every prefix over every replica,
so each cache holds a share of them and misses the rest; the one it implies: pure prefix affinity sends all
of a popular prefix to one replica, which overloads; a load bound (c x mean) keeps most of the hits and the
balance. `engine_cluster(..., step_cost=None)` times the engines by the wall clock instead.
"""
from __future__ import annotations

import datetime
import math
import time
from typing import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from llmso_lab.bench.attention import _device_name
from llmso_lab.hardware import get_accelerator
from llmso_lab.models.shapes import LLAMA3_8B
from llmso_lab.routing import ROUTERS, make_router, prefix_key
from llmso_lab.sim.cluster import ClusterConfig, simulate_cluster
from llmso_lab.sim.cost import CostModel, StepCost
from llmso_lab.workloads import percentiles, poisson_arrivals, shared_prefix_workload, zipf_weights

__all__ = ["run", "engine_cluster", "engine_workload", "sim_cost"]

ENGINE = dict(num_replicas=4, num_requests=160, num_prefixes=16, prefix_len=512, suffix_len=(8, 24), max_tokens=8,
              num_kv_blocks=224, block_size=16, max_num_seqs=4, max_model_len=1024, load=0.7, zipf_s=1.0, c=1.25)
ENGINE_QUICK = dict(ENGINE, num_replicas=3, num_requests=48, num_prefixes=9)
SIM = dict(num_replicas=16, num_requests=6000, num_prefixes=256, rates=(16.0, 24.0), zipf_s=1.0, c=1.25)
SIM_QUICK = dict(SIM, num_requests=1500)


def sim_cost() -> StepCost:
    """One replica of the simulated cluster: Llama-3-8B in bf16 on an L4 (50% of peak FLOP/s, 80% of peak
    bandwidth: assumed efficiencies, not measured)."""
    return StepCost(get_accelerator("L4"), LLAMA3_8B, dtype_bytes=2, compute_efficiency=0.5, bandwidth_efficiency=0.8)


def engine_workload(num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: tuple[int, int],
                    vocab_size: int, zipf_s: float = 1.0, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, system prompt index) per request: one of `num_prefixes` random system prompts of
    `prefix_len` tokens, picked with Zipf popularity, then its own `suffix_len` (inclusive range) random tokens."""
    rng = np.random.default_rng(seed)
    systems = rng.integers(3, vocab_size, size=(num_prefixes, prefix_len)).tolist()
    picks = rng.choice(num_prefixes, size=num_requests, p=zipf_weights(num_prefixes, zipf_s)).tolist()
    own = [rng.integers(3, vocab_size, size=rng.integers(suffix_len[0], suffix_len[1] + 1)).tolist() for _ in picks]
    return [systems[k] + o for k, o in zip(picks, own)], picks


class _ReplicaClock:
    """A replica's own time: `base` between steps; during a step, `base` + the wall time spent in it so far
    (with `timer=None` it stands still during a step, and the caller adds a modelled step time)."""

    def __init__(self, timer: Callable[[], float] | None) -> None:
        self.timer, self.base, self.wall0 = timer, 0.0, None

    def __call__(self) -> float:
        return self.base if self.wall0 is None else self.base + (self.timer() - self.wall0)

    def start(self) -> None:
        self.wall0 = self.timer() if self.timer else None

    def stop(self) -> float:
        self.base, self.wall0 = self(), None
        return self.base


def step_work(llm, trace) -> tuple[list[tuple[int, int]], list[int]]:
    """What the step just run by `llm` computed, as a cost model takes it: (new tokens, tokens already in KV) per
    prefill chunk, and the context length of each decode (read from the sequences, still held after the step)."""
    seqs = {s.request_id: s for s in llm.scheduler.running}
    prefill = [(n, seqs[rid].num_computed_tokens - n) for rid, n in trace.prefill.items()]
    return prefill, [seqs[rid].num_computed_tokens for rid in trace.decode]


def engine_cluster(model, router, prompts: Sequence[list[int]], arrivals: Sequence[float], max_tokens: int,
                   step_cost: CostModel | None = None, timer: Callable[[], float] = time.perf_counter,
                   desc: str | None = None, **llm_kwargs) -> dict:
    """Serve `prompts` (arriving at `arrivals`, seconds) on `router.num_replicas` engines (`LLM(model,
    enable_prefix_caching=True, **llm_kwargs)`) in one process, exactly `max_tokens` tokens each (EOS ignored).

    Discrete events over the replicas' own timelines: the next event is either an arrival (routed with the loads
    of that moment: requests routed to a replica and not yet returned by its `step()`) or the step of the busy
    replica whose timeline is furthest behind. A step advances its replica's timeline by `step_cost.step_time`
    of the work the engine really scheduled (`step_work`: its batches and prefix-cache hits are real, the
    seconds modelled), or, with `step_cost=None`, by the wall time `timer` measured. A request's first token
    counts at the end of the step that sampled it.
    Returns per request its replica, output and TTFT, and the summary figures.
    """
    from llmso_lab.engine import LLM, SamplingParams

    n = router.num_replicas
    clocks = [_ReplicaClock(None if step_cost else timer) for _ in range(n)]
    llms = [LLM(model, enable_prefix_caching=True, clock=clocks[i], **llm_kwargs) for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    order = sorted(range(len(prompts)), key=lambda j: arrivals[j])
    loads, where, outs, first = [0] * n, {}, {}, {}
    k = 0
    with tqdm(total=len(prompts), desc=desc, disable=desc is None) as bar:
        while k < len(order) or any(llm.has_unfinished_requests() for llm in llms):
            busy = [i for i in range(n) if llms[i].has_unfinished_requests()]
            next_step = min((clocks[i].base for i in busy), default=math.inf)
            if k < len(order) and arrivals[order[k]] <= next_step:      # an arrival
                j, k = order[k], k + 1
                i = router.route(prefix_key(prompts[j], llms[0].config.block_size), loads)
                if i not in busy:
                    clocks[i].base = max(clocks[i].base, arrivals[j])
                rid = llms[i].add_request({"prompt_token_ids": prompts[j]}, params, arrival_time=arrivals[j])
                where[(i, rid)], loads[i] = j, loads[i] + 1
                continue
            i = min(busy, key=lambda b: clocks[b].base)                 # a step of the replica furthest behind
            clocks[i].start()
            finished, trace = llms[i].step()
            end = clocks[i].stop() + (step_cost.step_time(*step_work(llms[i], trace)) if step_cost else 0.0)
            clocks[i].base = end
            for s in llms[i].scheduler.running:
                if s.num_output_tokens and (i, s.request_id) not in first:
                    first[i, s.request_id] = end
            for o in finished:
                outs[where[(i, o.request_id)]] = (i, o)
            loads[i] -= len(finished)
            bar.update(len(finished))
    replica = [outs[j][0] for j in range(len(prompts))]
    res = [outs[j][1] for j in range(len(prompts))]
    ttfts = [first[outs[j][0], outs[j][1].request_id] - arrivals[j] for j in range(len(prompts))]
    counts = np.bincount(replica, minlength=n)
    ttft = percentiles(ttfts, (50, 99))
    return {"router": router.name, "replica": replica, "outputs": res, "ttft": ttfts,
            "hit_rate": sum(o.num_cached_tokens for o in res) / sum(len(o.prompt_token_ids) for o in res),
            "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "load_imbalance": float(counts.max() / counts.mean())}


def _engine_rows(cfg: dict) -> tuple[list[dict], float]:
    """(a): one row per router, and the arrival rate used (requests/s)."""
    from llmso_lab.models import load_model

    net, cost = load_model("tiny-llama")[0], sim_cost()
    prompts, _ = engine_workload(cfg["num_requests"], cfg["num_prefixes"], cfg["prefix_len"], cfg["suffix_len"],
                                 net.config.vocab_size, cfg["zipf_s"])
    llm_kw = {k: cfg[k] for k in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len")}
    # capacity: one replica serving a burst (also warms up the code paths); the cluster gets `load` of n of them
    warm = prompts[:32]
    burst = engine_cluster(net, make_router("round_robin", 1), warm, [0.0] * len(warm), cfg["max_tokens"], cost,
                           **llm_kw)
    per_replica = len(warm) / max(o.metrics.finish_time for o in burst["outputs"])   # requests/s
    rate = cfg["load"] * cfg["num_replicas"] * per_replica
    arrivals = poisson_arrivals(rate, len(prompts), seed=1)
    rows = []
    for name in ROUTERS:
        router = make_router(name, cfg["num_replicas"], **({"c": cfg["c"]} if name == "prefix_aware_bounded" else {}))
        r = engine_cluster(net, router, prompts, arrivals, cfg["max_tokens"], cost, desc=f"engines: {name}", **llm_kw)
        rows.append({"experiment": f"engines x{cfg['num_replicas']}",
                     **{k: v for k, v in r.items() if k not in ("replica", "outputs", "ttft")}})
    return rows, rate


def _sim_rows(cfg: dict) -> list[dict]:
    """(b): one row per router and arrival rate on the simulated cluster."""
    cost = sim_cost()
    cluster = ClusterConfig(num_replicas=cfg["num_replicas"], kv_capacity_tokens=cost.kv_capacity_tokens(0.9))
    rows = []
    for rate in cfg["rates"]:
        reqs = shared_prefix_workload(cfg["num_requests"], cfg["num_prefixes"], rate, cfg["zipf_s"])
        for name in tqdm(ROUTERS, desc=f"simulated cluster, {rate:g} requests/s"):
            kw = {"c": cfg["c"]} if name == "prefix_aware_bounded" else {}
            s = simulate_cluster(reqs, make_router(name, cfg["num_replicas"], **kw), cost, cluster).summary()
            rows.append({"experiment": f"sim x{cfg['num_replicas']} @{rate:g}/s", **s})
    return rows


def run(quick: bool = False, *, engine: dict | None = None, sim: dict | None = None) -> dict:
    """The routing benchmark. `engine` / `sim` override the workload settings (`ENGINE`, `SIM`)."""
    ecfg = {**(ENGINE_QUICK if quick else ENGINE), **(engine or {})}
    scfg = {**(SIM_QUICK if quick else SIM), **(sim or {})}
    engine_rows, rate = _engine_rows(ecfg)
    sim_rows = _sim_rows(scfg)
    table = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in engine_rows + sim_rows]
    by = {(r["experiment"], r["router"]): r for r in table}
    ratios = {}
    for exp in dict.fromkeys(r["experiment"] for r in table):   # "engines x4", "sim x16 @16/s", ...
        rr, pa, pb = by[exp, "round_robin"], by[exp, "prefix_aware"], by[exp, "prefix_aware_bounded"]
        tag = "engines" if exp.startswith("engines") else f"sim_{exp.split('@')[1].replace('/s', 'rps')}"
        ratios.update({f"{tag}_hit_rate_prefix_aware_over_round_robin": pa["hit_rate"] / max(rr["hit_rate"], 1e-9),
                       f"{tag}_hit_rate_bounded_over_round_robin": pb["hit_rate"] / max(rr["hit_rate"], 1e-9),
                       f"{tag}_load_imbalance_prefix_aware": pa["load_imbalance"],
                       f"{tag}_load_imbalance_bounded": pb["load_imbalance"],
                       f"{tag}_ttft_p99_prefix_aware_over_bounded": pa["ttft_p99_s"] / pb["ttft_p99_s"],
                       f"{tag}_ttft_p99_round_robin_over_bounded": rr["ttft_p99_s"] / pb["ttft_p99_s"]})
    return {"name": "routing", "table": table, "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "device": _device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "llmso-lab bench routing" + (" --quick" if quick else ""),
            "engine_workload": {**ecfg, "model": "tiny-llama", "arrival_rate_per_s": round(rate, 2)},
            "sim_workload": {**scfg, "replica": "Llama-3-8B bf16 on L4 (roofline)",
                             "kv_capacity_tokens_per_replica": sim_cost().kv_capacity_tokens(0.9)},
            "note": "hit rate and load imbalance are counts; TTFTs come from the roofline cost model of the simulated "
                    "replica (engines: of the steps the engines really ran), not from this machine's clock"}


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1))
