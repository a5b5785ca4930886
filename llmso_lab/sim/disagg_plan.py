"""Lab 09's planning at scale, on the PD event model (`sim.disagg`): Llama-3-70B in fp16 on H100 nodes.

  capacity_plan       the capacity argument: one instance's prefill and decode tokens/s from the roofline, then
                      `best_pd_ratio` (the lab's exercise) and the requests/s it sustains
  lecture_workload    the lecture's fixed shapes (4000 in / 100 out, 200 / 2000), Poisson at `load` x that capacity
  plan_pd             sweep x:y (and TP per pool) in the event model, next to colocated replicas on the same GPUs
  link_table          KV size, transfer and prefill time, exposed time whole vs layer by layer, per link and prompt
  small_cluster_comparison   2 nodes: PD's splits against colocated replicas with a tuned chunked-prefill budget
  autoscale_vs_fixed  a mix that changes in time: queue-driven autoscaling against every fixed split
  predict_disaggregated / calibrated_cost   1P:1D on this CPU, from step costs fitted to the real engine's traces

Planning defaults (ours, stated so they can be argued with): 50 % of the H100's dense BF16 peak in matmuls (MFU),
80 % of its HBM bandwidth, 2 ms of fixed time per step (scheduling, launches, sampling), 90 % of memory for weights
+ KV, TP4 instances (fp16 70B needs two H100s for the weights alone; TP4 leaves ~37 GB of KV per GPU), one 400 Gb/s
InfiniBand NIC per GPU between instances, SLOs of 1 s TTFT and 50 ms TPOT.
"""
from __future__ import annotations

from typing import Any, Sequence

from llmso_lab.disagg.transfer import exposed_transfer_time
from llmso_lab.hardware import Accelerator, Link, get_accelerator, get_link
from llmso_lab.models.shapes import LLAMA3_70B, SMOLLM2_135M, ModelShape
from llmso_lab.sim.calibrate import calibrate, records_from_engine_traces
from llmso_lab.sim.comm import TPCost, send_time
from llmso_lab.sim.cost import CostModel, StepCost
from llmso_lab.sim.disagg import (Autoscaler, PDResult, best_pd_ratio, fixed_workload, pd_capacity,
                                  simulate_colocated, simulate_pd)
from llmso_lab.workloads import Request

__all__ = ["h100_instance", "instance_rates", "capacity_plan", "lecture_workload", "plan_pd", "link_table",
           "small_cluster_comparison", "autoscale_vs_fixed", "predict_disaggregated", "calibrated_cost"]

SLO = dict(ttft_slo_s=1.0, tpot_slo_s=0.05)


def h100_instance(tp: int = 4, shape: ModelShape = LLAMA3_70B, hardware: Accelerator | str = "H100-SXM",
                  compute_efficiency: float = 0.5, bandwidth_efficiency: float = 0.8, overhead_s: float = 0.002,
                  dtype_bytes: float = 2) -> TPCost:
    """One serving instance: `tp` GPUs over NVLink running `shape` (the module's planning defaults)."""
    acc = get_accelerator(hardware) if isinstance(hardware, str) else hardware
    return TPCost(StepCost(acc, shape, dtype_bytes, None, compute_efficiency, bandwidth_efficiency, overhead_s), tp)


def instance_rates(cost_prefill: CostModel, cost_decode: CostModel, input_len: int, output_len: int,
                   max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                   gpu_memory_utilization: float = 0.9) -> tuple[float, float]:
    """(prompt tokens/s of a busy prefill instance, generated tokens/s of a busy decode instance) for requests of
    this shape: a prefill step of as many whole prompts as the budget holds (a longer prompt in chunks); a decode
    batch of as many requests as the slots and the KV (prompt + output each) allow, at mid-answer context."""
    if input_len <= max_num_batched_tokens:
        k = max_num_batched_tokens // input_len
        prefill = k * input_len / cost_prefill.step_time([(input_len, 0)] * k)
    else:
        chunks = range(0, input_len, max_num_batched_tokens)
        prefill = input_len / sum(cost_prefill.step_time([(min(max_num_batched_tokens, input_len - c), c)]) for c in chunks)
    kv = cost_decode.kv_capacity_tokens(gpu_memory_utilization)
    batch = min(max_num_seqs, kv // (input_len + output_len)) if kv else max_num_seqs
    if batch < 1:
        raise ValueError(f"one request ({input_len} + {output_len} tokens) does not fit a decode instance's KV ({kv})")
    decode = batch / cost_decode.step_time((), [input_len + output_len // 2] * batch)
    return prefill, decode


def capacity_plan(input_len: int, output_len: int, num_instances: int, cost: CostModel | None = None,
                  **rate_kwargs) -> dict[str, Any]:
    """The capacity argument for `num_instances` identical instances (`cost`, default `h100_instance()`): their
    tokens/s (`instance_rates`), the best split (`best_pd_ratio`) and the requests/s it sustains (`pd_capacity`)."""
    cost = cost or h100_instance()
    pre, dec = instance_rates(cost, cost, input_len, output_len, **rate_kwargs)
    x, y = best_pd_ratio(num_instances, input_len, output_len, pre, dec)
    return {"x": x, "y": y, "prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
            "capacity_rps": pd_capacity(x, y, input_len, output_len, pre, dec)}


def lecture_workload(input_len: int, output_len: int, total_gpus: int = 32, tp: int = 4, load: float = 0.8,
                     duration_s: float = 60.0, seed: int = 0, cost: CostModel | None = None,
                     start: float = 0.0, first_id: int = 0) -> tuple[list[Request], float]:
    """(requests, rate): the lecture's fixed shape with Poisson arrivals for `duration_s` seconds at `load` times
    what the capacity argument says `total_gpus` GPUs in TP`tp` instances serve at their best PD split. A load
    below 1 keeps the best split out of overload; worse splits and colocated replicas may not keep up."""
    if not 0 < load:
        raise ValueError(f"load must be > 0 (a fraction of the cluster's capacity), got {load!r}")
    cap = capacity_plan(input_len, output_len, total_gpus // tp, cost or h100_instance(tp))
    rate = load * cap["capacity_rps"]
    return fixed_workload(max(1, round(rate * duration_s)), rate, input_len, output_len, seed, start, first_id), rate


def _row(res: PDResult, **keys) -> dict[str, Any]:
    return {**keys, **res.summary(), "ttft_slo_s": res.ttft_slo_s, "tpot_slo_s": res.tpot_slo_s}


def _best(rows: Sequence[dict]) -> dict:
    """Most goodput; on a tie, the most slack: the smaller sum of p99 latencies over their SLOs."""
    return max(rows, key=lambda r: (round(r["goodput"], 9), -(r["ttft_p99"] / r["ttft_slo_s"] + r["tpot_p99"] / r["tpot_slo_s"])))


def plan_pd(workload: Sequence[Request], total_gpus: int = 32, *, tps: Sequence[tuple[int, int]] = ((4, 4),),
            colocated_tp: int = 4, colocated_budgets: Sequence[int] = (2048,), link: Link | str = "IB-NDR",
            layerwise: bool = True, instance=h100_instance, **sim_kwargs) -> dict[str, Any]:
    """Every x:y split of `total_gpus` into x prefill instances of TP tp_p and y decode instances of TP tp_d (for
    each (tp_p, tp_d) in `tps`), run on `workload` (`simulate_pd`), and colocated replicas of TP `colocated_tp`
    on the same GPUs, one run per chunked-prefill budget (`simulate_colocated`). `instance(tp)` builds one
    instance's cost model. Returns {"rows": one per split (x, y, tp's, goodput, SLO attainment, TTFT / TPOT
    p50 / p99, utilisation, TTFT split), "best", "colocated": one row per budget, "best_colocated",
    "capacity": `capacity_plan` for the first tps at the workload's mean lengths}."""
    link = get_link(link) if isinstance(link, str) else link
    sim_kwargs = {**SLO, **sim_kwargs}
    rows = []
    for tp_p, tp_d in tps:
        cp, cd = instance(tp_p), instance(tp_d)
        for x in range(1, total_gpus // tp_p):
            rest = total_gpus - x * tp_p
            if rest >= tp_d and rest % tp_d == 0:
                res = simulate_pd(workload, x, rest // tp_d, cp, cd, link, layerwise=layerwise, **sim_kwargs)
                rows.append(_row(res, x=x, y=rest // tp_d, tp_prefill=tp_p, tp_decode=tp_d))
    if not rows:
        raise ValueError(f"no split of {total_gpus} GPUs into TP{tps} prefill and decode instances: check tps")
    co_kwargs = {k: v for k, v in sim_kwargs.items() if k in ("max_num_seqs", "ttft_slo_s", "tpot_slo_s",
                                                              "gpu_memory_utilization")}
    cc = instance(colocated_tp)
    colocated = [_row(simulate_colocated(workload, total_gpus // colocated_tp, cc, max_num_batched_tokens=b,
                                         **co_kwargs), replicas=total_gpus // colocated_tp, tp=colocated_tp, budget=b)
                 for b in colocated_budgets]
    mean_in = round(sum(r.prompt_len for r in workload) / len(workload))
    mean_out = round(sum(r.output_len for r in workload) / len(workload))
    return {"rows": rows, "best": _best(rows), "colocated": colocated, "best_colocated": _best(colocated),
            "capacity": capacity_plan(mean_in, mean_out, total_gpus // tps[0][0], instance(tps[0][0]))}


def link_table(prompt_lens: Sequence[int] = (128, 1024, 8192),
               links: Sequence[Link | str] = ("NVLink4", "IB-NDR", "100GbE", "25GbE"),
               cost: TPCost | StepCost | None = None, streams: int = 1) -> list[dict[str, Any]]:
    """Per (link, prompt length): KV bytes of the prompt, its transfer time in one message, the prefill's time on
    `cost` (default a TP4 H100 instance of Llama-3-70B), and the transfer time the decode side waits for when it
    is sent whole after the prefill or layer by layer during it (`disagg.transfer.exposed_transfer_time`), also as
    a fraction of the prefill. `streams`: NICs sending in parallel (1: the lecture's one 400 Gb/s link per
    transfer; a TP group may use one per rank)."""
    cost = cost or h100_instance()
    layers, rows = cost.model.num_layers, []
    for link in links:
        link = get_link(link) if isinstance(link, str) else link
        for p in prompt_lens:
            nbytes = p * cost.kv_bytes_per_token
            whole = send_time(nbytes / streams, link)
            prefill = cost.step_time([(p, 0)])
            per_layer = [send_time(nbytes / layers / streams, link)] * layers
            exposed = exposed_transfer_time([prefill / layers] * layers, per_layer, layerwise=True)
            rows.append({"link": link.name, "prompt_len": p, "kv_GB": nbytes / 1e9, "transfer_s": whole,
                         "prefill_s": prefill, "exposed_whole_s": whole, "exposed_layerwise_s": exposed,
                         "whole_over_prefill": whole / prefill, "layerwise_over_prefill": exposed / prefill})
    return rows


def small_cluster_comparison(workload: Sequence[Request], total_gpus: int = 16, tp: int = 4,
                             budgets: Sequence[int] = (512, 1024, 2048, 8192), **plan_kwargs) -> dict[str, Any]:
    """Two nodes: PD's few possible splits against colocated replicas whose chunked-prefill budget is tuned
    (the lecture: at this scale, chunked prefill tuning is usually enough). `plan_pd` with those budgets, plus
    "pd_gain": best PD goodput / best colocated goodput."""
    plan = plan_pd(workload, total_gpus, tps=((tp, tp),), colocated_tp=tp, colocated_budgets=budgets, **plan_kwargs)
    plan["pd_gain"] = plan["best"]["goodput"] / plan["best_colocated"]["goodput"]
    return plan


def autoscale_vs_fixed(workload: Sequence[Request], total_gpus: int = 32, tp: int = 4,
                       start: tuple[int, int] | None = None, autoscaler: Autoscaler | None = None,
                       instance=h100_instance, link: Link | str = "IB-NDR", **sim_kwargs) -> dict[str, Any]:
    """`workload` (e.g. 4000/100 then 200/2000) on every fixed split of `total_gpus` in TP`tp` instances and on
    an autoscaled cluster starting at `start` (default: half and half). Returns {"fixed": rows, "best_fixed",
    "autoscaled": its row, "timeline" and "scaling": its pool sizes, queues and decisions over time}."""
    link = get_link(link) if isinstance(link, str) else link
    n, cost, sim_kwargs = total_gpus // tp, instance(tp), {**SLO, **sim_kwargs}
    fixed = [_row(simulate_pd(workload, x, n - x, cost, cost, link, **sim_kwargs), x=x, y=n - x) for x in range(1, n)]
    x0, y0 = start or (n // 2, n - n // 2)
    if x0 + y0 != n:
        raise ValueError(f"start={start} must split the {n} instances of TP{tp} on {total_gpus} GPUs")
    res = simulate_pd(workload, x0, y0, cost, cost, link, autoscaler=autoscaler or Autoscaler(), **sim_kwargs)
    return {"fixed": fixed, "best_fixed": _best(fixed), "autoscaled": _row(res, x=x0, y=y0),
            "timeline": res.timeline, "scaling": res.scaling}


def calibrated_cost(traces: Sequence[Any], model: ModelShape = SMOLLM2_135M, hardware: Accelerator | None = None,
                    skip_first: int = 1, num_cached_tokens: dict | None = None) -> StepCost:
    """A CPU step cost fitted to one engine run's `LLM.step()` traces, as Lab 02 does: `records_from_engine_traces`
    then `calibrate` on absolute errors (a run's time is the sum of its steps). `hardware`: this CPU's
    `measure_cpu()` (measured when None). Fit each pool on traces of the process that will run it."""
    records = records_from_engine_traces(traces, num_cached_tokens, skip_first)
    return calibrate(records, model, hardware, relative=False)


def predict_disaggregated(cost_prefill: CostModel, cost_decode: CostModel, link: Link | tuple[float, float],
                          requests: Sequence[Request], *, layerwise: bool = False, max_num_batched_tokens: int = 512,
                          prefill_max_num_seqs: int = 8, max_num_seqs: int = 8, **sim_kwargs) -> dict[str, Any]:
    """What the 1P:1D DisaggregatedLLM should measure on `requests`: `simulate_pd` with one instance per pool.
    `link`: a `hardware.Link` or (bandwidth bytes/s, latency s), e.g. `comm.measure_gloo_link()`. The engine
    settings must be the real ones. Returns {"summary": `PDResult.summary()`, "ttft_s", "tpot_s" (per request,
    in order), "phases": TTFT split, "result": the PDResult}. The first token counts as delivered when its KV
    reaches the decode side."""
    if not isinstance(link, Link):
        bandwidth, latency = link
        link = Link("given", float(bandwidth), float(latency))
    res = simulate_pd(requests, 1, 1, cost_prefill, cost_decode, link, layerwise=layerwise,
                      max_num_batched_tokens=max_num_batched_tokens, prefill_max_num_seqs=prefill_max_num_seqs,
                      max_num_seqs=max_num_seqs, **sim_kwargs)
    return {"summary": res.summary(), "ttft_s": [m.ttft for m in res.requests],
            "tpot_s": [m.tpot for m in res.requests], "phases": res.phases, "result": res}
