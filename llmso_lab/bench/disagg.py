"""`llmso-lab bench disagg`: prefill-decode disaggregation on SmolLM2, real processes (gloo between them).

In one run:
- `tables["equal"]`: a 1P:1D DisaggregatedLLM vs one colocated LLM, greedy: tokens equal per request, and the KV
  bytes each request sent vs 2 x layers x kv_heads x head_dim x 4 B x (prompt - tokens the decode side had cached);
  a second wave shares a system prompt with the first, so its cached blocks are not sent again;
- `tables["pipelining"]`: one long prompt, the prefill and decode workers pinned to one core each, over a link
  throttled to a few bandwidths, the KV sent layer by layer vs whole after the prefill: the prefill's last forward,
  the transfer time exposed after it (decode side's last layer received - prefill end), and what
  `disagg.transfer.exposed_transfer_time` predicts from the measured per-layer compute and send times;
  `timelines` keeps the per-layer events of one run of each mode for the notebook's plot;
- `tables["interference"]`: 8 short requests decoding while 3 long prompts arrive: colocated on both cores
  (chunked prefill off / on) vs disaggregated (prefill on core 0, decode on core 1): inter-token latency of the
  short requests (p50 / p99 / max), the long prompts' TTFT, and the same short requests alone;
- `tables["calibration"]`: the simulator's 1P:1D prediction (`sim.disagg_plan.predict_disaggregated`, step cost
  fitted to a 1-thread engine run) next to the measured disaggregated run of the interference workload.
Ratios: `itl_p99_colocated_vs_disagg`, `itl_p99_chunked_vs_disagg`, `exposed_whole_vs_layerwise` (at the slowest
link), `bytes_exact` (1.0 when every request's bytes equal the formula).
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import numpy as np
import torch

from llmso_lab.bench.attention import _device_name

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Explain what a GPU is in one sentence.", "Once upon a time,",
           "The quick brown fox", "Translate 'good morning' into Spanish:"]
SYSTEM = ("You are a careful assistant for a course on serving large language models. Answer briefly, name the "
          "mechanism involved, and give one number when you can. ")


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def bench_equal(model, tokenizer, quick: bool) -> list[dict]:
    from llmso_lab.disagg import DisaggregatedLLM, kv_transfer_bytes
    from llmso_lab.engine import LLM, SamplingParams

    cfg, sp = model.config.to_dict(), SamplingParams(max_tokens=8 if quick else 24, ignore_eos=True)
    first = [PROMPTS[0]]
    second = [SYSTEM + p for p in PROMPTS[1:]]
    wave1 = [SYSTEM + first[0]]
    ref = _ids(LLM(model, tokenizer, max_model_len=1024).generate(wave1 + second, sp, use_tqdm=False))
    rows = []
    with DisaggregatedLLM(model, 1, 1, tokenizer=tokenizer, max_model_len=1024, enable_prefix_caching=True) as d:
        outs = d.generate(wave1, sp) + d.generate(second, sp)   # wave 2 finds the system prompt cached
        recs = d.request_records()
        for o, r_ids in zip(outs, ref):
            rec = recs[int(o.request_id)]
            n, cached = len(o.prompt_token_ids), rec.get("num_cached_tokens", 0)
            rows.append({"request": int(o.request_id), "prompt_tokens": n, "cached_on_decode": cached,
                         "bytes_sent": rec["bytes_sent"], "bytes_received": rec["bytes_received"],
                         "formula_bytes": kv_transfer_bytes(cfg, n, cached, 4),
                         "tokens_equal_colocated": o.outputs[0].token_ids == r_ids})
    return rows


def _long_prompt(tokenizer, n: int, offset: int = 0) -> list[int]:
    from llmso_lab.quality import eval_token_ids

    ids = eval_token_ids(tokenizer)
    return ids[offset:offset + n]


def bench_pipelining(model, tokenizer, quick: bool) -> tuple[list[dict], dict]:
    from llmso_lab.disagg import DisaggregatedLLM, exposed_transfer_time
    from llmso_lab.engine import SamplingParams

    n = 512 if quick else 1024
    bandwidths = [None, 25e6, 8e6] if not quick else [None, 8e6]
    repeats = 1 if quick else 2
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    rows, timelines = [], {}
    affinity = [[0], [1]] if len(os.sched_getaffinity(0)) >= 2 else None
    with DisaggregatedLLM(model, 1, 1, tokenizer=tokenizer, max_model_len=2048, cpu_affinity=affinity) as d:
        d.generate([_long_prompt(tokenizer, 64)], sp)   # warm-up
        for bw in bandwidths:
            for layerwise in (True, False):
                d.set_link(layerwise=layerwise, bandwidth_bytes_per_s=bw)
                got = []
                for k in range(repeats):
                    out = d.generate([_long_prompt(tokenizer, n, offset=97 * k)], sp)[0]
                    rec = d.request_records()[int(out.request_id)]
                    done = [rec["forward_start"]] + rec["layer_done"]
                    compute = [b - a for a, b in zip(done, done[1:])]
                    compute[-1] += rec["prefill_end"] - done[-1]   # the last layer carries the LM head and sampling
                    sends = [e - s for s, e in rec["send_spans"]]
                    got.append({"forward_s": rec["prefill_end"] - rec["forward_start"],
                                "exposed_s": max(0.0, rec["recv_end"] - rec["prefill_end"]),   # < 0: all hidden
                                "predicted_s": exposed_transfer_time(compute, sends, layerwise),
                                "transfer_total_s": sum(sends), "ttft_s": out.metrics.ttft})
                    timelines[f"{'layerwise' if layerwise else 'whole'}_{'loopback' if bw is None else int(bw / 1e6)}"] = {
                        "forward_start": rec["forward_start"], "layer_done": rec["layer_done"],
                        "prefill_end": rec["prefill_end"], "send_spans": rec["send_spans"],
                        "layer_recv": rec["layer_recv"], "ready": rec["ready"]}
                med = {k: statistics.median(g[k] for g in got) for k in got[0]}
                rows.append({"bandwidth_MBps": "loopback" if bw is None else bw / 1e6, "layerwise": layerwise,
                             "prompt_tokens": n, "kv_MB": round(rec["bytes_received"] / 1e6, 2),
                             **{k: round(v, 4) for k, v in med.items()}})
    return rows, timelines


def interference_workload(tokenizer, quick: bool):
    """8 short chat prompts decoding from t = 0 and long prompts arriving while they decode."""
    from llmso_lab.engine import SamplingParams

    short = PROMPTS
    n_long, long_len = (2, 512) if quick else (3, 1024)
    longs = [_long_prompt(tokenizer, long_len, offset=300 * i) for i in range(n_long)]
    prompts = short + longs
    params = [SamplingParams(max_tokens=32 if quick else 64, ignore_eos=True)] * len(short) + \
             [SamplingParams(max_tokens=4, ignore_eos=True)] * n_long
    arrivals = [0.0] * len(short) + [0.5 + 1.0 * i for i in range(n_long)]
    return prompts, params, arrivals, len(short)


def _itl_summary(outs, num_short: int) -> dict:
    itl = np.concatenate([np.diff(o.metrics.token_times) for o in outs[:num_short]])
    return {"itl_p50_ms": round(float(np.percentile(itl, 50)) * 1e3, 1),
            "itl_p99_ms": round(float(np.percentile(itl, 99)) * 1e3, 1),
            "itl_max_ms": round(float(itl.max()) * 1e3, 1),
            "long_ttft_s": round(float(np.mean([o.metrics.ttft for o in outs[num_short:]])), 3) if len(outs) > num_short else None}


def bench_interference(model, tokenizer, quick: bool) -> tuple[list[dict], dict]:
    from llmso_lab.disagg import DisaggregatedLLM

    prompts, params, arrivals, k = interference_workload(tokenizer, quick)
    both = sorted(os.sched_getaffinity(0))[:2]
    split = [[both[0]], [both[-1]]]
    configs = [("colocated, no chunked prefill", 0, [both], {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}),
               ("colocated, chunked prefill (256)", 0, [both], {"enable_chunked_prefill": True, "max_num_batched_tokens": 256}),
               ("disaggregated 1P:1D", 1, split, {"max_num_batched_tokens": 2048})]
    rows, runs, series = [], {}, {}
    for name, num_prefill, affinity, kw in configs:
        with DisaggregatedLLM(model, num_prefill, 1, tokenizer=tokenizer, max_model_len=2048, cpu_affinity=affinity,
                              **kw) as d:
            d.generate(PROMPTS[:2], params[0])   # warm-up
            alone = d.generate(prompts[:k], params[:k])
            mixed = d.generate(prompts, params, arrival_times=arrivals)
            st = d.stats()
        runs[name] = mixed
        t0 = min(o.metrics.arrival_time for o in mixed)
        series[name] = {"short": [[round(t - t0, 4) for t in o.metrics.token_times] for o in mixed[:k]],
                        "long_arrival": [round(o.metrics.arrival_time - t0, 4) for o in mixed[k:]],
                        "long_first_token": [round(o.metrics.first_token_time - t0, 4) for o in mixed[k:]]}
        rows.append({"config": name, "cores": affinity, **_itl_summary(mixed, k),
                     "alone_itl_p50_ms": _itl_summary(alone, k)["itl_p50_ms"],
                     "ttft_transfer_s": round(st["ttft_transfer_s"], 4) if num_prefill else 0.0})
    return rows, runs, series


def bench_calibration(model, tokenizer, quick: bool, measured) -> list[dict]:
    """Fit the simulator's step cost to a 1-thread engine run, predict the 1P:1D run, compare."""
    from llmso_lab.engine import LLM
    from llmso_lab.sim.comm import measure_gloo_link
    from llmso_lab.sim.disagg_plan import calibrated_cost, predict_disaggregated
    from llmso_lab.workloads import Request

    prompts, params, arrivals, k = interference_workload(tokenizer, quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # each pool has one core
    try:
        llm = LLM(model, tokenizer, max_model_len=2048, max_num_batched_tokens=2048)
        t0 = time.perf_counter()
        for p, sp, a in zip(prompts, params, arrivals):
            llm.add_request(p, sp, arrival_time=t0 + a)
        traces = []
        while llm.has_unfinished_requests():
            traces.append(llm.step()[1])
        cost = calibrated_cost(traces)
    finally:
        torch.set_num_threads(threads)
    link = measure_gloo_link(world_size=2, budget_s=0.1)
    lens = [len(tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts]
    reqs = [Request(i, a, n, sp.max_tokens) for i, (a, n, sp) in enumerate(zip(arrivals, lens, params))]
    pred = predict_disaggregated(cost, cost, link, reqs, layerwise=True, max_num_batched_tokens=2048,
                                 prefill_max_num_seqs=32, max_num_seqs=32)
    meas_ttft = [o.metrics.ttft for o in measured]
    meas_tpot = [o.metrics.tpot for o in measured[:k]]
    return [{"what": "long prompts: mean TTFT (s)", "measured": round(float(np.mean(meas_ttft[k:])), 3),
             "predicted": round(float(np.mean(pred["ttft_s"][k:])), 3)},
            {"what": "short requests: mean TTFT (s)", "measured": round(float(np.mean(meas_ttft[:k])), 3),
             "predicted": round(float(np.mean(pred["ttft_s"][:k])), 3)},
            {"what": "short requests: mean TPOT (ms)", "measured": round(float(np.mean(meas_tpot)) * 1e3, 1),
             "predicted": round(float(np.mean(pred["tpot_s"][:k])) * 1e3, 1)}]


def run(quick: bool = False, **overrides) -> dict:
    from llmso_lab.models import load_model

    t_start = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    equal = bench_equal(model, tokenizer, quick)
    pipe, timelines = bench_pipelining(model, tokenizer, quick)
    inter, runs, series = bench_interference(model, tokenizer, quick)
    calib = bench_calibration(model, tokenizer, quick, runs["disaggregated 1P:1D"])
    by = {r["config"]: r for r in inter}
    dis = by["disaggregated 1P:1D"]
    slow = min((r for r in pipe if r["bandwidth_MBps"] != "loopback"), key=lambda r: r["bandwidth_MBps"])
    whole = next(r for r in pipe if r["bandwidth_MBps"] == slow["bandwidth_MBps"] and not r["layerwise"])
    layer = next(r for r in pipe if r["bandwidth_MBps"] == slow["bandwidth_MBps"] and r["layerwise"])
    return {"name": "disagg", "device": _device_name(), "date": datetime.date.today().isoformat(),
            "command": "llmso-lab bench disagg" + (" --quick" if quick else ""),
            "table": inter,
            "tables": {"equal": equal, "pipelining": pipe, "interference": inter, "calibration": calib},
            "timelines": timelines,   # per-layer events of one long prompt per link mode (perf_counter s)
            "token_times": series,    # interference runs: each short request's token times, the long prompts' arrivals
            "ratios": {"itl_p99_colocated_vs_disagg": round(by["colocated, no chunked prefill"]["itl_p99_ms"] / dis["itl_p99_ms"], 2),
                       "itl_p99_chunked_vs_disagg": round(by["colocated, chunked prefill (256)"]["itl_p99_ms"] / dis["itl_p99_ms"], 2),
                       "exposed_whole_vs_layerwise": round(whole["exposed_s"] / max(layer["exposed_s"], 1e-3), 2),
                       "bytes_exact": float(all(r["bytes_sent"] == r["bytes_received"] == r["formula_bytes"] for r in equal)),
                       "tokens_equal": float(all(r["tokens_equal_colocated"] for r in equal))},
            "seconds": round(time.perf_counter() - t_start, 1)}
