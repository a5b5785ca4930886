"""`llmso-lab bench parallel`: tensor, pipeline, expert and context parallelism on real local processes (gloo).

In one run on SmolLM2 (and tiny seeded models for EP / CP):
- `tables["link"]`: this machine's loopback gloo "link", fitted from timed all_reduces (latency, bandwidth);
- `tables["tp"]`: the engine at tensor_parallel_size 1 vs 3 (9 query / 3 KV heads: 3 divides both), greedy decode
  tokens/s at batch 1 and 8 (the engines take turns, best of the rounds), all-reduces per forward and the time
  per all-reduce measured inside the ranks, next to the cost model's prediction from the fitted link, and whether
  the tokens equal TP 1's; `tables["tp2_same_shape"]`: TP 2 on a random model of SmolLM2's size with 8 / 4 heads,
  2 ranks on 2 cores (TP 3 puts 3 ranks on 2 cores: each all-reduce then also waits for a descheduled rank);
- `tables["pp"]`: a 2-stage pipeline over SmolLM2's 30 layers: prefill with 1 / 2 / 4 / 8 micro-batches and
  greedy decoding with 1 and 2 batches in flight, measured bubble vs (p - 1) / (m + p - 1); `timelines` keeps
  three of them for the notebook's plot;
- `tables["ep"]`: tiny Mixtral (8 experts, top 2) on 2 ranks: load per expert, imbalance, dropped choices and
  all-to-all bytes at capacity factors 1.0 / 1.25 / none;
- `tables["cp"]`: ring attention on 4 ranks: (query, key) pairs per rank for the contiguous and zig-zag splits.
Ratios: `tp3_vs_tp1_batch1`, `tp3_vs_tp1_batch8`, `pp_bubble_m1`, `pp_bubble_m4` (measured), `cp_contiguous_imbalance`.

`tp_step_breakdown` (Lab 08's live cell, not part of the recorded run) splits one TP decode step into compute, the
all-reduce's link time (one all-reduce of that size timed alone), the time ranks wait for each other inside it, and
the driver's share.
"""
from __future__ import annotations

import datetime
import time

import torch

from llmso_lab.bench.attention import _device_name

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Explain what a GPU is in one sentence.", "Once upon a time,",
           "The quick brown fox", "Translate 'good morning' into Spanish:"]


def _decode_run(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    """(generated tokens per second of wall time, token ids) for one greedy batch."""
    from llmso_lab.engine import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, ids)) / dt, ids


def bench_tp(model, tokenizer, link, rounds: int, max_tokens: int) -> tuple[list[dict], dict]:
    from llmso_lab.engine import LLM
    from llmso_lab.sim import comm

    cfg = model.config
    engines = {1: LLM(model, tokenizer, max_model_len=512), 3: LLM(model, tokenizer, max_model_len=512,
                                                                  tensor_parallel_size=3)}
    try:
        for llm in engines.values():
            _decode_run(llm, PROMPTS[:2], 4)   # warm-up
        best, tokens = {}, {}
        for _ in range(rounds):
            for batch in (1, 8):
                for tp, llm in engines.items():   # the engines take turns: both see the same machine state
                    rate, ids = _decode_run(llm, PROMPTS[:batch], max_tokens)
                    best[tp, batch] = max(best.get((tp, batch), 0.0), rate)
                    tokens[tp, batch] = ids
        stats = engines[3].stats()
    finally:
        engines[3].shutdown()
    per_forward = stats["tp_all_reduces_per_rank"] / max(stats["tp_num_forwards"], 1)
    ar_s = max(stats["tp_all_reduce_s_per_rank"]) / max(stats["tp_all_reduces_per_rank"], 1)
    fwd_s = max(stats["tp_forward_s_per_rank"]) / max(stats["tp_num_forwards"], 1)
    rows = []
    for batch in (1, 8):
        nbytes = cfg.hidden_size * 4 * batch   # one decode step's all-reduce: [batch, hidden] fp32
        model_ar = comm.allreduce_time(nbytes, 3, link)
        rows.append({"batch": batch, "tp1_tokens_per_s": round(best[1, batch], 2),
                     "tp3_tokens_per_s": round(best[3, batch], 2),
                     "tp3_vs_tp1": round(best[3, batch] / best[1, batch], 3),
                     "allreduce_bytes": nbytes, "model_allreduce_us": round(model_ar * 1e6, 1),
                     "model_allreduce_ms_per_step": round(per_forward * model_ar * 1e3, 2),
                     "tokens_equal_tp1": tokens[1, batch] == tokens[3, batch]})
    summary = {"allreduces_per_forward": per_forward, "measured_allreduce_us": round(ar_s * 1e6, 1),
               "measured_forward_ms": round(fwd_s * 1e3, 2),
               "allreduce_share_of_forward": round(per_forward * ar_s / fwd_s, 3)}
    return rows, summary


def bench_tp2(rounds: int, max_tokens: int) -> list[dict]:
    """TP 2 without oversubscription: a random Llama of SmolLM2's size (30 layers, hidden 576, MLP 1536) but 8 query /
    4 KV heads so that 2 ranks split it; 2 ranks x 1 thread on 2 cores vs one process with 2 threads and with 1."""
    from llmso_lab.engine import LLM
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=30, hidden_size=576, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                       vocab_size=49152, initializer_range=0.02)
    prompts = [[1 + 7 * i + j for j in range(12)] for i in range(8)]
    engines = {"tp1 (2 threads)": LLM(model, max_model_len=256), "tp2 (2 ranks x 1 thread)":
               LLM(model, max_model_len=256, tensor_parallel_size=2)}
    try:
        for llm in engines.values():
            _decode_run(llm, prompts[:2], 4)
        best = {}
        for _ in range(rounds):
            for batch in (1, 8):
                for name, llm in engines.items():
                    rate, _ = _decode_run(llm, prompts[:batch], max_tokens)
                    best[name, batch] = max(best.get((name, batch), 0.0), rate)
        stats = engines["tp2 (2 ranks x 1 thread)"].stats()
    finally:
        engines["tp2 (2 ranks x 1 thread)"].shutdown()
    ar_us = 1e6 * max(stats["tp_all_reduce_s_per_rank"]) / max(stats["tp_all_reduces_per_rank"], 1)
    fwd_ms = 1e3 * max(stats["tp_forward_s_per_rank"]) / max(stats["tp_num_forwards"], 1)
    return [{"batch": b, **{name: round(best[name, b], 2) for name in engines},
             "tp2_vs_tp1": round(best["tp2 (2 ranks x 1 thread)", b] / best["tp1 (2 threads)", b], 3),
             "measured_allreduce_us": round(ar_us, 1), "measured_forward_ms": round(fwd_ms, 2)} for b in (1, 8)]


def bench_pp(model, tokenizer, quick: bool) -> tuple[list[dict], dict]:
    from llmso_lab.parallel.pipeline import PipelineJob, bubble_fraction, measured_bubble, pipeline_run

    ids = tokenizer(PROMPTS[:8] if not quick else PROMPTS[:4], return_tensors="pt", padding="max_length",
                    max_length=16, truncation=True)["input_ids"]
    ids = torch.cat([ids] * (8 // ids.shape[0]), dim=0) if ids.shape[0] < 8 else ids
    prompt = ids.repeat(1, 4)[:, :48 if not quick else 32]   # 8 sequences of the same length
    jobs = [PipelineJob("prefill", prompt, m) for m in (1, 2, 4, 8)]
    jobs += [PipelineJob("generate", prompt, m, 6 if quick else 12) for m in (1, 2)]
    p = 2
    results = pipeline_run(model, jobs, p)
    rows, timelines = [], {}
    for job, (_, timeline) in zip(jobs, results):
        makespan = max(i.t_end for i in timeline) - min(i.t_start for i in timeline)
        row = {"kind": job.kind, "stages": p, "microbatches": job.num_microbatches,
               "measured_bubble": round(measured_bubble(timeline, p), 3), "makespan_s": round(makespan, 3)}
        if job.kind == "prefill":
            row["formula_bubble"] = round(bubble_fraction(p, job.num_microbatches), 3)
            row["tokens_per_s"] = round(prompt.numel() / makespan, 1)
        else:
            row["formula_bubble"] = round(max(0, p - job.num_microbatches) / p, 3)   # in-flight decode batches
            row["tokens_per_s"] = round(prompt.shape[0] * job.max_new_tokens / makespan, 2)
        rows.append(row)
        if (job.kind, job.num_microbatches) in (("prefill", 4), ("generate", 2), ("generate", 1)):
            timelines[f"{job.kind}_m{job.num_microbatches}"] = [list(i) for i in timeline]
    return rows, timelines


def bench_ep() -> list[dict]:
    from llmso_lab.models.tiny import tiny_mixtral
    from llmso_lab.parallel.moe import expert_parallel_forward

    model = tiny_mixtral(num_experts=8, experts_per_token=2, num_layers=2)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    rows = []
    for cf in (None, 1.25, 1.0):
        logits, stats = expert_parallel_forward(model, ids, 2, capacity_factor=cf)
        for layer, s in enumerate(stats):
            rows.append({"capacity_factor": cf, "layer": layer, "tokens_per_expert": [int(x) for x in s.routed],
                         "imbalance": round(float(s.imbalance), 3), "dropped": int(s.dropped),
                         "dispatch_bytes": int(s.dispatch_bytes), "combine_bytes": int(s.combine_bytes),
                         "max_abs_diff_vs_hf": float((logits - ref).abs().max())})
    return rows


def bench_cp() -> list[dict]:
    from llmso_lab.parallel.ring import ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 256, 32, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = []
    for split in ("contiguous", "zigzag"):
        o, stats = ring_attention(q, k, v, 4, split=split)
        rows.append({"split": split, "ranks": 4, "pairs_per_rank": list(stats["pairs"]),
                     "skipped_blocks": list(stats["skipped_blocks"]),
                     "imbalance": round(max(stats["pairs"]) / (sum(stats["pairs"]) / len(stats["pairs"])), 3),
                     "max_abs_diff_vs_sdpa": float((o - ref).abs().max())})
    return rows


def run(quick: bool = False, **overrides) -> dict:
    from llmso_lab.models import load_model
    from llmso_lab.sim import comm

    t_start = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    link = comm.measure_gloo_link(world_size=3, budget_s=0.1 if quick else 0.3)
    tp_rows, tp_summary = bench_tp(model, tokenizer, link, rounds=1 if quick else 3, max_tokens=8 if quick else 24)
    tp2_rows = bench_tp2(rounds=1 if quick else 3, max_tokens=8 if quick else 24)
    pp_rows, timelines = bench_pp(model, tokenizer, quick)
    ep_rows, cp_rows = bench_ep(), bench_cp()
    b1, b8 = tp_rows
    prefill = {r["microbatches"]: r for r in pp_rows if r["kind"] == "prefill"}
    table = [{"what": f"TP 3 vs 1, batch {r['batch']}", "tp1_tok_s": r["tp1_tokens_per_s"],
              "tp3_tok_s": r["tp3_tokens_per_s"], "ratio": r["tp3_vs_tp1"]} for r in tp_rows]
    table += [{"what": f"PP 2 stages prefill, m={m}", "measured_bubble": r["measured_bubble"],
               "formula": r["formula_bubble"]} for m, r in prefill.items()]
    return {"name": "parallel", "device": _device_name(), "date": datetime.date.today().isoformat(),
            "command": "llmso-lab bench parallel" + (" --quick" if quick else ""),
            "table": table,
            "tables": {"link": [{"name": link.name, "latency_us": round(link.latency * 1e6, 1),
                                 "bandwidth_GBps": round(link.bandwidth / 1e9, 3)}],
                       "tp": tp_rows, "tp_summary": [tp_summary], "tp2_same_shape": tp2_rows, "pp": pp_rows, "ep": ep_rows, "cp": cp_rows},
            "timelines": timelines,   # (stage, microbatch, kind, t_start, t_end, step) per interval
            "ratios": {"tp3_vs_tp1_batch1": b1["tp3_vs_tp1"], "tp3_vs_tp1_batch8": b8["tp3_vs_tp1"],
                       "tp2_vs_tp1_batch1": tp2_rows[0]["tp2_vs_tp1"], "tp2_vs_tp1_batch8": tp2_rows[1]["tp2_vs_tp1"],
                       "pp_bubble_m1": prefill[1]["measured_bubble"], "pp_bubble_m4": prefill[4]["measured_bubble"],
                       "cp_contiguous_imbalance": cp_rows[0]["imbalance"]},
            "seconds": round(time.perf_counter() - t_start, 1)}


def tp_step_breakdown(model, tp: int = 2, batch: int = 1, max_tokens: int = 16, rounds: int = 3,
                      progress=None) -> dict:
    """Where one decode step's time goes under TP on this machine, next to TP 1 (the engine, greedy, `batch` prompts
    of 12 tokens, `max_tokens` each; engines take turns for `rounds` rounds, the fastest round of each is kept).

    Per forward (one prefill, then decode steps), in ms:
    - "tp1 (2 threads)" / "tp1 (1 thread)": the whole model in one process; "compute" = ModelRunner.forward;
    - f"tp{tp}": "compute" = a rank's forward minus its time inside all_reduce (mean over ranks), "all-reduce: link"
      = all-reduces per forward x one all_reduce of that size timed alone between `tp` ranks that start together
      (`comm.measure_gloo_allreduce`: latency + bytes / bandwidth, nothing else), "all-reduce: waiting" = the rest
      of the time inside all_reduce (a rank that arrives first waits for the slower one: scheduling, unequal work);
    - "driver + pipes" = the step's wall time minus the model forward (rank 0's for TP): scheduling, sampling, and
      for TP the batch sent to every rank and the logits coming back through pipes.
    `progress(message)`, when given, is called before each timed run (a notebook prints it: the cell takes a while).
    Returns {"rows": [{config, step_ms, compute_ms, link_ms, wait_ms, driver_ms, tokens_per_s}],
             "allreduce_bytes", "allreduce_alone_us", "allreduces_per_forward"}."""
    from llmso_lab.engine import LLM
    from llmso_lab.sim import comm

    prompts = [[1 + 7 * i + j for j in range(12)] for i in range(batch)]
    threads = torch.get_num_threads()
    engines = {"tp1 (2 threads)": LLM(model, max_model_len=256),
               f"tp{tp} ({tp} ranks x 1 thread)": LLM(model, max_model_len=256, tensor_parallel_size=tp)}
    tp_name = f"tp{tp} ({tp} ranks x 1 thread)"
    best: dict[str, dict] = {}
    try:
        for llm in engines.values():
            _decode_run(llm, prompts[:1], 4)   # warm-up
        for round_ in range(rounds):
            for name in ("tp1 (2 threads)", "tp1 (1 thread)", tp_name):
                if progress is not None:
                    progress(f"round {round_ + 1}/{rounds}: {name}")
                llm = engines["tp1 (2 threads)" if name.startswith("tp1") else tp_name]
                runner = llm.model_runner
                if name == "tp1 (1 thread)":
                    torch.set_num_threads(1)
                try:
                    before = runner.rank_stats() if name == tp_name else {"fwd": runner.forward_s,
                                                                          "n": runner.num_forwards}
                    t0 = time.perf_counter()
                    rate, _ = _decode_run(llm, prompts, max_tokens)
                    wall = time.perf_counter() - t0
                    after = runner.rank_stats() if name == tp_name else {"fwd": runner.forward_s,
                                                                         "n": runner.num_forwards}
                finally:
                    torch.set_num_threads(threads)
                if name == tp_name:
                    n = after[0]["forwards"] - before[0]["forwards"]
                    fwd = [(a["forward_s"] - b["forward_s"]) / n for a, b in zip(after, before)]
                    ar = [(a["all_reduce_s"] - b["all_reduce_s"]) / n for a, b in zip(after, before)]
                    per_fwd = (after[0]["all_reduces"] - before[0]["all_reduces"]) / n
                    row = {"step_ms": wall / n, "compute_ms": sum(f - a for f, a in zip(fwd, ar)) / tp,
                           "allreduce_ms": sum(ar) / tp, "driver_ms": wall / n - fwd[0], "per_fwd": per_fwd}
                else:
                    n = after["n"] - before["n"]
                    fwd = (after["fwd"] - before["fwd"]) / n
                    row = {"step_ms": wall / n, "compute_ms": fwd, "allreduce_ms": 0.0, "driver_ms": wall / n - fwd}
                row["tokens_per_s"] = rate
                if name not in best or row["step_ms"] < best[name]["step_ms"]:
                    best[name] = row
    finally:
        engines[tp_name].shutdown()
    nbytes = model.config.hidden_size * 4 * batch          # one decode all-reduce: [batch, hidden] fp32
    alone_s = comm.measure_gloo_allreduce(tp, sizes=(nbytes,), budget_s=0.1)[0][1]
    per_fwd = best[tp_name].pop("per_fwd")
    rows = []
    for name, r in best.items():
        link = per_fwd * alone_s if name == tp_name else 0.0
        rows.append({"config": name, "step_ms": round(1e3 * r["step_ms"], 2), "compute_ms": round(1e3 * r["compute_ms"], 2),
                     "link_ms": round(1e3 * link, 2), "wait_ms": round(1e3 * max(0.0, r["allreduce_ms"] - link), 2),
                     "driver_ms": round(1e3 * r["driver_ms"], 2), "tokens_per_s": round(r["tokens_per_s"], 1)})
    return {"rows": rows, "allreduce_bytes": nbytes, "allreduce_alone_us": round(alone_s * 1e6, 1),
            "allreduces_per_forward": per_fwd}
