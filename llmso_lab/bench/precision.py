"""`llmso-lab bench precision`: the engine on SmolLM2 in fp32 vs bf16 (and fp16 where this machine multiplies it
natively), in one run. Lecture 1-3: precision is a first-order serving decision.

For each dtype (`LLM(dtype=...)`, one engine per dtype, the same seeded inputs):
- prefill tokens/s of one prompt of 256 and of 1024 tokens (best of `repeats`; one forward each);
- decode tokens/s at batch 1 and batch 16 (32-token prompts, `decode_tokens` new tokens each, EOS ignored;
  the rate after every row has its first token; best of `repeats`);
- the batching bench's continuous workload (`bench.batching`: 64 requests at t = 0, prompts 32-512, outputs
  16-256, max_num_seqs 16): output tokens/s and TTFT p50/p99, run `workload_rounds` times with the dtypes
  alternating (fp32, bf16, fp32, bf16, ...); the table keeps each dtype's best round, the round-by-round table
  the paired ratios (each round's bf16 against the same round's fp32);
- greedy agreement with the fp32 engine on that workload's outputs (`greedy_agreement`);
- the continuous throughput as a share of the workload's roofline bound: its prefill FLOPs at this dtype's
  measured matmul ceiling plus its decode reads (all weights once per decode step, for the fewest steps
  `max_num_seqs` allows, and every KV token each step reads) at the measured copy bandwidth.
Then greedy agreement on a few real chat prompts: engine bf16 vs Hugging Face bf16, vs the fp32 engine, and
Hugging Face bf16 vs fp32 (how much bf16 itself moves the tokens).

Ratios (same run): bf16_vs_fp32_prefill (256 tokens; _1024 too), bf16_vs_fp32_batch1, bf16_vs_fp32_batch16,
bf16_vs_fp32_continuous_throughput, fp32_over_bf16_ttft_p50 / _p99 (> 1: bf16 answers sooner), and the worst
round's paired bf16_vs_fp32_continuous_throughput_worst_round / fp32_over_bf16_ttft_p50_worst_round.
Each row names its `linear_kernel` (which matmul path ran: oneDNN's packed bf16 kernel or aten's matmul).
"""
from __future__ import annotations

import math
import statistics

import torch
from tqdm.auto import tqdm

from llmso_lab import hardware as hw
from llmso_lab.bench import batching, harness

__all__ = ["run", "greedy_agreement", "roofline_share"]

FULL = dict(prefill_lens=(256, 1024), decode_tokens=64, decode_batch=16, repeats=3, chat_tokens=32, chat_prompts=4,
            workload=batching.FULL, workload_rounds=2)
QUICK = dict(prefill_lens=(256, 1024), decode_tokens=16, decode_batch=16, repeats=2, chat_tokens=16, chat_prompts=2,
             workload=dict(batching.QUICK, num_requests=8), workload_rounds=1)
CHAT = ["Explain what a GPU does in two sentences.", "Write a haiku about the ocean.",
        "What is the capital of France, and why is it famous?", "List three tips for learning to program."]


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How far greedy outputs agree, request by request: tokens before the first difference.

    Returns `tokens_equal` (tokens generated before each request's first divergence, over all reference
    tokens: after a divergence the two continue from different text, so later matches are not counted),
    `identical` (requests equal throughout, as a fraction) and `first_divergence` (the position of the first
    difference in each request, None where identical)."""
    assert len(reference) == len(other), "one output per request on both sides"
    firsts = []
    for a, b in zip(reference, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        firsts.append(first)
    total = sum(map(len, reference))
    agreed = sum(len(a) if f is None else f for a, f in zip(reference, firsts))
    return {"tokens_equal": agreed / total if total else 1.0,
            "identical": sum(f is None for f in firsts) / len(firsts) if firsts else 1.0, "first_divergence": firsts}


def roofline_share(tok_s: float, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int, shape,
                   dtype_bytes: float, matmul_flops_s: float, copy_bytes_s: float) -> tuple[float, float]:
    """(bound tokens/s, measured `tok_s` as a share of it) for a workload run through a batching engine.

    Bound time = prefill FLOPs / matmul ceiling + decode bytes / copy bandwidth, where decode reads all weights
    once per step over the fewest steps possible (each request's first token comes from its prefill; a step
    decodes at most `max_num_seqs` requests) plus, each step, every cached KV token of every decoding request.
    """
    from llmso_lab.sim.cost import StepCost

    cost = StepCost(hw.Accelerator("bound", matmul_flops_s, copy_bytes_s, 0, "none", 0, 0), shape, dtype_bytes)
    prefill_flops = cost.work(prefill=[(p, 0) for p in prompt_lens])[0]
    decodes = [o - 1 for o in output_lens]
    steps = max(math.ceil(sum(decodes) / max_num_seqs), max(decodes))
    kv_reads = sum(p + j for p, d in zip(prompt_lens, decodes) for j in range(1, d + 1))
    decode_bytes = steps * shape.weight_bytes(dtype_bytes) + kv_reads * cost.kv_bytes_per_token
    bound = sum(output_lens) / (prefill_flops / matmul_flops_s + decode_bytes / copy_bytes_s)
    return bound, tok_s / bound


def _prefill_tok_s(llm, prompt: list[int], repeats: int) -> float:
    """Prompt tokens/s of one prompt in one forward (max_tokens=1), best of `repeats` (no warm-up run)."""
    from llmso_lab.engine import SamplingParams

    def once() -> None:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return len(prompt) / hw.best_seconds(once, 0, min_runs=repeats, warmup=False)


def _decode_tok_s(llm, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Generated tokens/s of `len(prompts)` requests decoding together, counted once every one of them has its
    first token (so the prefills are not in it), best of `repeats`."""
    from llmso_lab.engine import SamplingParams

    def once() -> float:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
        times = [o.metrics.token_times for o in outs]
        start, end = max(t[0] for t in times), max(t[-1] for t in times)
        return (end - start) / sum(len(t) - 1 for t in times)   # seconds per decoded token
    return 1.0 / hw.best_seconds(once, 0, min_runs=repeats, warmup=False, self_timed=True)


def _linear_kernel(llm) -> str:
    """Which matmul kernel the engine's weights go through: "oneDNN packed" (`OneDNNLinear`, bf16 on CPUs that
    multiply it natively) or "aten matmul" (plain `x @ w`)."""
    from llmso_lab.engine.ops import OneDNNLinear

    return "oneDNN packed" if isinstance(llm.model_runner.lm_head, OneDNNLinear) else "aten matmul"


def step_split(traces) -> dict:
    """Where a workload's time went: the steps that ran a prefill (whole or a chunk, decodes riding along) and the
    pure decode steps, with the mean decode batch (from `LLM.step()`'s traces)."""
    pre = [t for t in traces if t.prefill]
    dec = [t for t in traces if t.decode and not t.prefill]
    return {"prefill_steps": len(pre), "prefill_steps_s": sum(t.wall_time_s for t in pre),
            "decode_steps": len(dec), "decode_steps_s": sum(t.wall_time_s for t in dec),
            "decode_step_ms": 1e3 * sum(t.wall_time_s for t in dec) / max(1, len(dec)),
            "decode_batch_mean": sum(len(t.decode) for t in dec) / max(1, len(dec))}


def paired_rounds(by_round: list[dict]) -> list[dict]:
    """Per round, each dtype's continuous throughput and TTFT against fp32's in the same round: the ratios a
    machine's drift between rounds does not move (rows `by_round` as `run` collects them)."""
    ref = {x["round"]: x for x in by_round if x["dtype"] == "float32"}
    out = []
    for x in by_round:
        f = ref[x["round"]]
        y = {**x, "vs_fp32_tok_s": x["continuous_tok_s"] / f["continuous_tok_s"],
             "fp32_over_this_ttft_p50": f["ttft_p50_s"] / x["ttft_p50_s"]}
        for part in ("prefill_steps_s", "decode_steps_s"):   # > 1: that part ran faster than fp32's
            if x.get(part):
                y[f"fp32_over_this_{part[:-2]}"] = f[part] / x[part]
        out.append(y)
    return out


def _chat_agreement(tokenizer, engines: dict, hf: dict, n_prompts: int, new_tokens: int) -> dict:
    """Greedy outputs on real chat prompts: engine vs Hugging Face in the same dtype, bf16 vs fp32."""
    from llmso_lab.engine import SamplingParams

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for c in CHAT[:n_prompts]]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    eng = {d: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)] for d, llm in engines.items()}
    ref = {}
    with torch.inference_mode():
        for d, model in hf.items():
            ref[d] = [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, top_k=None, top_p=None, temperature=None)[0, len(p):].tolist()
                      for p in prompts]
    pairs = {"engine fp32 vs HF fp32": (ref["float32"], eng["float32"]),
             "engine bf16 vs HF bf16": (ref["bfloat16"], eng["bfloat16"]),
             "engine bf16 vs engine fp32": (eng["float32"], eng["bfloat16"]),
             "HF bf16 vs HF fp32": (ref["float32"], ref["bfloat16"])}
    return {k: greedy_agreement(*v) for k, v in pairs.items()}


def _inputs(net, cfg: dict) -> dict:
    """The seeded inputs: one long prompt per prefill length, `decode_batch` 32-token prompts, the continuous
    workload's requests and prompts, and the engines' max_model_len (micro runs; the workload's, as in
    `bench batching`)."""
    vocab, w, limit = net.config.vocab_size, cfg["workload"], net.config.max_position_embeddings
    g = torch.Generator().manual_seed(0)
    long_prompts = {n: torch.randint(3, vocab, (n,), generator=g).tolist() for n in cfg["prefill_lens"]}
    short = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(cfg["decode_batch"])]
    reqs, prompts = batching.workload(w["num_requests"], w["prompt_len"], w["output_len"], vocab)
    return {"long_prompts": long_prompts, "short": short, "reqs": reqs, "prompts": prompts,
            "max_model_len": min(limit, w["prompt_len"][1] + w["output_len"][1] + 16),
            "micro_len": min(limit, max(max(cfg["prefill_lens"]), 64 + cfg["chat_tokens"],
                                        32 + cfg["decode_tokens"]) + 1)}


def _micro_rows(net, tokenizer, dtypes, cfg: dict, inputs: dict) -> tuple[list[dict], dict, dict]:
    """One engine per dtype: prefill tokens/s per prompt length, decode tokens/s at batch 1 and `decode_batch`.
    Returns (a row per dtype, the fp32 and bf16 engines (for the chat agreement), each engine's torch dtype)."""
    from llmso_lab.engine import LLM

    rows, engines, dts = [], {}, {}
    long, short, reps, micro_len = inputs["long_prompts"], inputs["short"], cfg["repeats"], inputs["micro_len"]
    for name in tqdm(dtypes, desc="bench precision"):
        llm = LLM(net, tokenizer, dtype=name, max_num_seqs=cfg["decode_batch"], max_model_len=micro_len,
                  max_num_batched_tokens=max(2048, micro_len))
        if name in ("float32", "bfloat16"):   # kept for the chat agreement
            engines[name] = llm
        dts[name] = llm.dtype
        _prefill_tok_s(llm, long[cfg["prefill_lens"][0]], 1)   # warm-up: first-call allocations
        row = {"dtype": name, "linear_kernel": _linear_kernel(llm)}
        for n in cfg["prefill_lens"]:
            row[f"prefill_{n}_tok_s"] = round(_prefill_tok_s(llm, long[n], reps), 1)
        row["decode_b1_tok_s"] = round(_decode_tok_s(llm, short[:1], cfg["decode_tokens"], reps), 1)
        row[f"decode_b{cfg['decode_batch']}_tok_s"] = round(_decode_tok_s(llm, short, cfg["decode_tokens"], reps), 1)
        rows.append(row)
    return rows, engines, dts


def _continuous_rounds(net, tokenizer, dtypes, inputs: dict, max_num_seqs: int, rounds: int) -> tuple[list[dict], dict]:
    """The batching bench's continuous workload, on a fresh engine each time as there (warmed up on a full batch
    first), the dtypes alternating round by round (fp32, bf16, ..., fp32, bf16, ...): a machine whose speed drifts
    during the run (a shared host) then slows every dtype alike, and each round gives a paired ratio.
    Returns (a row per round and dtype, round 1's output tokens per dtype)."""
    from llmso_lab.workloads import latency_summary

    B, prompts, max_model_len, outputs = max_num_seqs, inputs["prompts"], inputs["max_model_len"], {}

    def measure(name: str, r: int) -> dict:
        batching.warm_up(net, tokenizer, prompts, B, max_model_len, name)
        cont, outs, traces = batching._engine(net, tokenizer, "continuous", inputs["reqs"], prompts, B, max_model_len,
                                              dtype=name)
        t = latency_summary([o.metrics for o in outs], (50, 99))["ttft_s"]   # unrounded (the row rounds to 10 ms)
        tokens = [o.outputs[0].token_ids for o in outs]
        outputs.setdefault(name, tokens)   # round 1's; greedy should repeat them, and each round says whether it did
        return {"round": r, "dtype": name, "continuous_tok_s": cont["output_tok_s"], "ttft_p50_s": t["p50"],
                "ttft_p99_s": t["p99"], **step_split(traces), "same_tokens_as_round_1": tokens == outputs[name]}
    by_round = list(harness.alternate(rounds, dtypes, measure, desc="continuous workload").values())
    return by_round, outputs


def _workload_columns(rows: list[dict], by_round: list[dict], outputs: dict, dts: dict, native: dict, cpu,
                      matmul_s: float, shape, inputs: dict, max_num_seqs: int) -> None:
    """Each dtype's row gets its best round of the continuous workload, its greedy agreement with fp32 there, and
    that throughput's share of the workload's roofline bound at this dtype's matmul ceiling (measured now)."""
    reqs = inputs["reqs"]
    for row in rows:
        name = row["dtype"]
        dt = dts[name]
        b = max((t for t in by_round if t["dtype"] == name), key=lambda t: t["continuous_tok_s"])   # best round
        row.update(continuous_tok_s=b["continuous_tok_s"], ttft_p50_s=round(b["ttft_p50_s"], 3),
                   ttft_p99_s=round(b["ttft_p99_s"], 3))
        agree = greedy_agreement(outputs["float32"], outputs[name])
        divergent = [f for f in agree["first_divergence"] if f is not None]
        row.update(tokens_equal_vs_fp32=round(agree["tokens_equal"], 3), identical_vs_fp32=round(agree["identical"], 3),
                   first_divergence_median=statistics.median(divergent) if divergent else "-")
        peak = cpu.peak_flops if dt == torch.float32 else hw.measure_matmul(dt, matmul_s)   # this dtype's ceiling
        bound, share = roofline_share(b["continuous_tok_s"], [r.prompt_len for r in reqs], [r.output_len for r in reqs],
                                      max_num_seqs, shape, dt.itemsize, peak, cpu.mem_bandwidth)
        row.update(matmul_TFLOP_s=round(peak / 1e12, 3), roofline_bound_tok_s=round(bound, 1),
                   roofline_share=round(share, 3),
                   cpu_flags="-" if dt == torch.float32 else ("native" if native[dt][0] else "none (emulated)"))


def _ratios(rows: list[dict], paired: list[dict], chat: dict, cfg: dict) -> dict:
    """bf16 against fp32 (empty without a bf16 row): each figure of the table, the worst paired round of the
    continuous workload, and the chat agreement."""
    by = {r["dtype"]: r for r in rows}
    if "bfloat16" not in by:
        return {}
    f, b, n0, bb = by["float32"], by["bfloat16"], cfg["prefill_lens"], f"decode_b{cfg['decode_batch']}_tok_s"
    ratios = {"bf16_vs_fp32_prefill": b[f"prefill_{n0[0]}_tok_s"] / f[f"prefill_{n0[0]}_tok_s"],
              **{f"bf16_vs_fp32_prefill_{n}": b[f"prefill_{n}_tok_s"] / f[f"prefill_{n}_tok_s"] for n in n0[1:]},
              "bf16_vs_fp32_batch1": b["decode_b1_tok_s"] / f["decode_b1_tok_s"],
              f"bf16_vs_fp32_batch{cfg['decode_batch']}": b[bb] / f[bb],
              "bf16_vs_fp32_continuous_throughput": b["continuous_tok_s"] / f["continuous_tok_s"],
              "fp32_over_bf16_ttft_p50": f["ttft_p50_s"] / b["ttft_p50_s"],
              "fp32_over_bf16_ttft_p99": f["ttft_p99_s"] / b["ttft_p99_s"],
              "bf16_tokens_equal_vs_fp32": b["tokens_equal_vs_fp32"]}
    bf16_rounds = [x for x in paired if x["dtype"] == "bfloat16"]
    ratios["bf16_vs_fp32_continuous_throughput_worst_round"] = min(x["vs_fp32_tok_s"] for x in bf16_rounds)
    ratios["fp32_over_bf16_ttft_p50_worst_round"] = min(x["fp32_over_this_ttft_p50"] for x in bf16_rounds)
    if chat:   # real chat prompts: far fewer near-ties than the workload's random-token prompts
        ratios["bf16_chat_tokens_equal_vs_fp32"] = chat["engine bf16 vs engine fp32"]["tokens_equal"]
    return harness.rounded(ratios)


def _targets(ratios: dict) -> dict:
    """The lecture's claims for bf16 over fp32, met or not in this run."""
    return {"continuous throughput >= 1.5x fp32": ratios.get("bf16_vs_fp32_continuous_throughput", 0) >= 1.5,
            "TTFT p50 >= 1.5x lower": ratios.get("fp32_over_bf16_ttft_p50", 0) >= 1.5,
            "both, in every round": min(ratios.get("bf16_vs_fp32_continuous_throughput_worst_round", 0),
                                        ratios.get("fp32_over_bf16_ttft_p50_worst_round", 0)) >= 1.5}


def run(quick: bool = False, *, model: str = "smollm2-135m", dtypes: tuple[str, ...] | None = None,
        measure_seconds: float | None = None, **overrides) -> dict:
    """Run the precision benchmark (quick=True: a smaller workload, a few minutes on 2 cores).

    `dtypes`: default float32 and bfloat16, plus float16 where this CPU's flags say it multiplies it natively
    (flags are not speed: AVX512-FP16 CPUs still run the engine's fp16 slower than fp32 here). `overrides`
    replace entries of FULL/QUICK (the tests use `model="tiny-llama"` and tiny sizes)."""
    from llmso_lab.models import load_model
    from llmso_lab.models.shapes import ModelShape

    cfg = {**(QUICK if quick else FULL), **overrides}
    native = {torch.bfloat16: hw.native_matmul(torch.bfloat16, "cpu"), torch.float16: hw.native_matmul(torch.float16, "cpu")}
    if dtypes is None:
        dtypes = ("float32", "bfloat16") + (("float16",) if native[torch.float16][0] else ())
    assert dtypes[0] == "float32", "fp32 is the reference every ratio and agreement is measured against"
    net, tokenizer = load_model(model)   # fp32; each engine casts its own copy of the weights
    shape = ModelShape.from_hf_config(net.config, name=model)
    inputs, B = _inputs(net, cfg), cfg["workload"]["max_num_seqs"]
    seconds = measure_seconds if measure_seconds is not None else (1.0 if quick else 3.0)
    cpu, matmul_s = hw.measure_cpu(seconds=seconds), seconds / 2   # fp32 ceiling and copy bandwidth
    rows, engines, dts = _micro_rows(net, tokenizer, dtypes, cfg, inputs)
    by_round, outputs = _continuous_rounds(net, tokenizer, dtypes, inputs, B, cfg["workload_rounds"])
    paired = paired_rounds(by_round)
    _workload_columns(rows, by_round, outputs, dts, native, cpu, matmul_s, shape, inputs, B)
    chat = {}
    if "bfloat16" in engines and tokenizer is not None:
        hf = {"float32": net, "bfloat16": load_model(model, dtype=torch.bfloat16)[0]}
        chat = _chat_agreement(tokenizer, {d: engines[d] for d in ("float32", "bfloat16")}, hf,
                               cfg["chat_prompts"], cfg["chat_tokens"])
    ratios = _ratios(rows, paired, chat, cfg)
    return harness.result(
        "precision", quick, table=rows, ratios=ratios, model=model, workload=harness.lists(cfg),
        targets=_targets(ratios),
        tables={"continuous workload, round by round (the dtypes alternate)": harness.rounded(paired)},
        chat_agreement=chat, cpu_flags={str(d)[6:]: why for d, (_, why) in native.items()},
        auto_dtype=hw.auto_dtype("cpu")[1], memory_bandwidth_GB_s=round(cpu.mem_bandwidth / 1e9, 2),
        **harness.shared_cpu())


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1, default=str))
