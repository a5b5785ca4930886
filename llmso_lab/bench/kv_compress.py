"""`llmso-lab bench kv-compress`: is a compressed KV cache still the same model? (lecture 2-4: validate every
lossy technique on your own data).

On SmolLM2-135M (fp32, greedy), two measurements for each method, budget and bit width:
1. Needle in a haystack (`kv.needle`): a 4-digit code hidden at a controlled depth of filler text from the eval
   text, the question at the end; for each (length, depth) the first seed whose needle the model answers with the
   full cache is used (`_answerable_needles`; the "full cache" row then shows them all answered). Eviction keeps `budget` of the prompt's tokens per layer and KV head (`kv.evict`): StreamingLLM, H2O,
   SnapKV (with its pooling and without), PyramidKV. "aware": the question is prefilled with the context, so it
   sits in the observation window when the cache is compressed (SnapKV's setting); "agnostic": the context alone
   is compressed, the question comes afterwards (kvpress's setting: one compressed cache for any question).
   Quantized KV (`kv.quant`, the engine's paged store): the prompt is prefilled at full precision, the cache is
   then stored in the format and every later token reads it back dequantized (what the engine does).
2. Perplexity of a continuation given a compressed context: windows of the eval text, `ctx` tokens of context
   whose cache is compressed (observation window = its last 16 tokens: no question), then `cont` tokens scored
   teacher-forced at their original positions (`evict.continuation_nll`).
3. Cache blending (`kv.blend`, CacheBlend): 512-token RAG prompts (the needle haystack in 4 chunks whose KV is
   precomputed alone), recomputing the r % most deviating chunk tokens, vs a random r % (the control).
`--quick`: 512-token needles at 3 depths, 2 perplexity windows of 512 + 128 tokens, 3 blend prompts.
The peer (NVIDIA kvpress) runs in its own venv (`make peers-kvpress`) through `bench.kvpress_runner`, on the same
needle texts and budgets; without that venv its columns are absent and the reason is printed.
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from llmso_lab.bench import harness

BUDGETS = (0.1, 0.25, 0.5)
# (label, eviction method, question-aware, extra compress_prefill arguments)
EVICTION_ROWS = [
    ("StreamingLLM", "streaming", True, {}),
    ("H2O (aware)", "h2o", True, {}),
    ("H2O (agnostic)", "h2o", False, {}),
    ("SnapKV (aware)", "snapkv", True, {}),
    ("SnapKV (agnostic)", "snapkv", False, {}),
    ("SnapKV, no pooling (aware)", "snapkv", True, {"kernel_size": 1}),
    ("PyramidKV (aware)", "pyramidkv", True, {}),
]
QUANT_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "kivi4", "kivi2")
WINDOW, RESIDUAL, BLOCK = 16, 32, 16    # observation / recent window; KIVI's full-precision window and group


def quantize_cache_(cache, kv_cache_dtype: str) -> None:
    """Replace every layer's K/V in a Hugging Face cache (batch 1) by what the paged store in `kv_cache_dtype`
    gives back (`kv.quant.roundtrip_kv`: FP8 calibrated on the data, KIVI with a 32-token exact window)."""
    from llmso_lab.kv.quant import roundtrip_kv

    for layer in cache.layers:
        k, v = (x[0].transpose(0, 1) for x in (layer.keys, layer.values))             # [T, Hkv, D]
        k_hat, v_hat = roundtrip_kv(kv_cache_dtype, k, v, BLOCK, RESIDUAL)
        layer.keys = k_hat.transpose(0, 1)[None].to(layer.keys.dtype)
        layer.values = v_hat.transpose(0, 1)[None].to(layer.values.dtype)


def answer(model, context_ids, question_ids, method: str = "full", budget: int | None = None, aware: bool = True,
           kv_cache_dtype: str = "auto", max_new_tokens: int = 7, **kw) -> list[int]:
    """Greedy answer with the prompt's cache evicted to `budget` tokens (method "full": kept whole) and then
    stored in `kv_cache_dtype`. The first token comes from the (full-precision) prefill, as in the engine."""
    from llmso_lab.kv import evict

    if kv_cache_dtype == "auto":
        return evict.generate_compressed(model, context_ids, question_ids, method, budget or 10 ** 9,
                                         question_aware=aware, max_new_tokens=max_new_tokens, **kw)
    if not aware:
        raise ValueError("quantized runs here are question-aware (the whole prompt is prefilled, then stored)")
    ids = torch.cat([context_ids, question_ids], dim=1)
    cache, logits = evict.compress_prefill(model, ids, method, budget or ids.shape[1], **kw)
    quantize_cache_(cache, kv_cache_dtype)
    first = int(logits.argmax())
    return [first] + evict.greedy_continue(model, cache, torch.tensor([[first]]), ids.shape[1], max_new_tokens - 1)


def _answerable_needles(model, tok, lengths, depths, max_seed: int = 8):
    """One needle per (length, depth): the first seed whose needle SmolLM2 answers with the full cache (the task
    must be solvable before compression is blamed). Returns (needles, seeds used)."""
    from llmso_lab.kv.needle import make_needle, needle_correct, needle_ids

    cases, seeds = [], []
    for n in lengths:
        for d in depths:
            for seed in range(max_seed):
                needle = make_needle(tok, n, d, seed=seed)
                if needle_correct(tok.decode(answer(model, *needle_ids(tok, needle))), needle):
                    cases.append(needle)
                    seeds.append(seed)
                    break
            else:
                raise RuntimeError(f"no needle of {n} tokens at depth {d} is answered with the full cache (seeds 0..{max_seed - 1})")
    return cases, seeds


def _needle_runs(model, tok, cases, budgets):
    """{row label: {budget fraction (1.0 for the full / quantized rows): correct answers}}"""
    from llmso_lab.kv.needle import needle_correct, needle_ids

    rows: dict[str, dict[float, int]] = {}
    jobs = [("full cache", "full", True, {}, "auto", (1.0,))]
    jobs += [(label, m, aware, kw, "auto", budgets) for label, m, aware, kw in EVICTION_ROWS]
    jobs += [(f"KV {fmt}", "full", True, {}, fmt, (1.0,)) for fmt in QUANT_FORMATS]
    jobs += [("SnapKV (aware) + KV kivi4", "snapkv", True, {}, "kivi4", budgets)]
    total = sum(len(j[5]) for j in jobs) * len(cases)
    with tqdm(total=total, desc="needles") as bar:
        for label, method, aware, kw, fmt, fracs in jobs:
            rows[label] = {}
            for frac in fracs:
                ok = 0
                for needle in cases:
                    c, q = needle_ids(tok, needle)
                    T = c.shape[1] + q.shape[1]
                    budget = None if frac == 1.0 else max(int(T * frac), WINDOW + 8)
                    out = answer(model, c, q, method, budget, aware, fmt, window=WINDOW, **kw)
                    ok += needle_correct(tok.decode(out), needle)
                    bar.update()
                rows[label][frac] = ok
    return rows


def _perplexity_runs(model, ids, windows, ctx, cont, budgets):
    """{row label: {budget fraction: perplexity of the continuations}}"""
    from llmso_lab.kv import evict

    jobs = [("full cache", "full", {}, "auto", (1.0,))]
    jobs += [(label.replace(" (aware)", ""), m, kw, "auto", budgets) for label, m, aware, kw in EVICTION_ROWS if aware]
    jobs += [(f"KV {fmt}", "full", {}, fmt, (1.0,)) for fmt in QUANT_FORMATS]
    jobs += [("SnapKV + KV kivi4", "snapkv", {}, "kivi4", budgets)]
    rows: dict[str, dict[float, float]] = {}
    with tqdm(total=sum(len(j[4]) for j in jobs) * windows, desc="perplexity") as bar:
        for label, method, kw, fmt, fracs in jobs:
            rows[label] = {}
            for frac in fracs:
                nll, n = 0.0, 0
                for w in range(windows):
                    start = w * (ctx + cont)
                    c = torch.tensor([ids[start:start + ctx]])
                    x = torch.tensor([ids[start + ctx:start + ctx + cont]])
                    budget = ctx if frac == 1.0 else int(ctx * frac)
                    cache, last = evict.compress_prefill(model, c, method, budget, window=WINDOW, **kw)
                    if fmt != "auto":
                        quantize_cache_(cache, fmt)
                    a, b = evict.continuation_nll(model, cache, last, x, ctx)
                    nll, n = nll + a, n + b
                    bar.update()
                rows[label][frac] = math.exp(nll / n)
    return rows


KVPRESS_PRESSES = ("StreamingLLMPress", "SnapKVPress", {"name": "SnapKVPress", "kwargs": {"window_size": WINDOW, "kernel_size": 7}},
                   "PyramidKVPress", "ExpectedAttentionPress", "KnormPress")
BLEND_RATIOS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)


def _kvpress(cases, ids, windows, ctx, cont, budgets, tok) -> dict | None:
    """The peer on the same needle texts (both modes) and the same perplexity windows (decoded to text: kvpress
    tokenizes them again, which can move a boundary token)."""
    from llmso_lab.bench.kvpress_runner import accuracy_table, run_kvpress

    ppl_cases = [{"name": f"window{w}", "context": tok.decode(ids[w * (ctx + cont):w * (ctx + cont) + ctx]),
                  "continuation": tok.decode(ids[w * (ctx + cont) + ctx:(w + 1) * (ctx + cont)])} for w in range(windows)]
    try:
        res = run_kvpress(cases, KVPRESS_PRESSES, [round(1 - b, 4) for b in budgets], timeout_s=7200,
                          modes=("agnostic", "aware"), perplexity=ppl_cases, max_new_tokens=7)
    except RuntimeError as exc:   # the peer crashed or timed out: keep our own results, say why
        print(f"kvpress peer failed: {exc}")
        return None
    if res is None:
        return None
    needle: dict[str, dict[float, int]] = {}
    for row in accuracy_table(res):
        label = f"kvpress {row['press']} ({row['mode']})"
        needle.setdefault(label, {})[1.0 if row["compression_ratio"] == 0 else round(1 - row["compression_ratio"], 4)] = row["correct"]
    acc: dict[str, dict[float, list[float]]] = {}
    for row in res["perplexity"]:
        if "error" not in row:
            frac = 1.0 if row["compression_ratio"] == 0 else round(1 - row["compression_ratio"], 4)
            a = acc.setdefault(f"kvpress {row['press']}", {}).setdefault(frac, [0.0, 0])
            a[0] += row["nll"] * row["continuation_tokens"]
            a[1] += row["continuation_tokens"]
    ppl = {k: {f: math.exp(a / n) for f, (a, n) in d.items()} for k, d in acc.items()}
    errors = sorted({r["error"] for r in res["rows"] + res["perplexity"] if "error" in r})
    return {"versions": res["versions"], "needle": needle, "perplexity": ppl, "errors": errors}


def _blend_runs(model, tok, depths, seeds) -> list[dict]:
    """CacheBlend (`kv.blend`) on 512-token RAG prompts cut into 4 chunks: answer accuracy and agreement with a
    full prefill, tokens recomputed and FLOPs, for each ratio, selecting by V deviation or at random."""
    import torch.nn.functional as F

    from llmso_lab.kv.blend import blend, full_prefill, greedy_answer, prefill_kv, rag_prompt
    from llmso_lab.kv.needle import needle_correct

    rows = {(r, sel): dict(correct=0, agree=0, kl=0.0, frac=0.0, flops=0.0)
            for r in BLEND_RATIOS for sel in ("deviation", "random") if not (sel == "random" and r in (0.0, 1.0))}
    cases = [(d, s) for s in seeds for d in depths]
    full_ok = 0
    for depth, seed in tqdm(cases, desc="blend"):
        pre, chunks, q, needle = rag_prompt(tok, 512, depth, 4, seed)
        ids = torch.cat([pre, *chunks, q], 1)
        fc, fl = full_prefill(model, ids)
        fa = greedy_answer(model, fc, fl, ids.shape[1], 6)
        full_ok += needle_correct(tok.decode(fa), needle)
        kv = [prefill_kv(model, c) for c in chunks]
        for (r, sel), row in rows.items():
            b = blend(model, pre, chunks, q, r, chunk_kv=kv, select=sel)
            a = greedy_answer(model, b.cache, b.logits, ids.shape[1], 6)
            row["correct"] += needle_correct(tok.decode(a), needle)
            row["agree"] += a == fa
            row["kl"] += float(F.kl_div(b.logits.log_softmax(-1), fl.log_softmax(-1), log_target=True, reduction="sum"))
            row["frac"] += b.recompute_fraction
            row["flops"] += b.flops / b.full_flops
    n = len(cases)
    return [{"recompute": f"{r:.0%}", "select": sel, "accuracy": f"{w['correct']}/{n}", "full_prefill_accuracy": f"{full_ok}/{n}",
             "same_answer_as_full": f"{w['agree']}/{n}", "kl_first_token": round(w["kl"] / n, 4),
             "tokens_recomputed": round(w["frac"] / n, 3), "flops_vs_full": round(w["flops"] / n, 3)}
            for (r, sel), w in rows.items()]


def _kv_bytes(cfg) -> dict[str, float]:
    """Bytes per token of each format (the engine's store, block 16) over fp16's."""
    from llmso_lab.kv.quant import kv_bytes_per_token

    D = cfg.hidden_size // cfg.num_attention_heads
    fp16 = kv_bytes_per_token("auto", cfg.num_key_value_heads, D, cfg.num_hidden_layers, BLOCK, torch.float16)
    return {fmt: kv_bytes_per_token(fmt, cfg.num_key_value_heads, D, cfg.num_hidden_layers, BLOCK) / fp16
            for fmt in QUANT_FORMATS}


def _cells(d: dict, fmt) -> dict:
    """{budget fraction: value} as table cells: "full" for the whole cache, else "10%", "25%", ..."""
    return {("full" if f == 1.0 else f"{f:.0%}"): fmt(v) for f, v in d.items()}


def _tables(needles: dict, ppl: dict, peer: dict | None, n: int) -> tuple[list[dict], list[dict]]:
    """The needle table (correct answers out of `n`) and the perplexity table, the kvpress peer's rows after ours."""
    needle_table = [{"method": k, **_cells(v, lambda x: f"{x}/{n}")} for k, v in needles.items()]
    ppl_table = [{"method": k, **_cells(v, lambda x: round(x, 3))} for k, v in ppl.items()]
    if peer is not None:
        needle_table += [{"method": k, **_cells(v, lambda x: f"{x}/{n}")} for k, v in peer["needle"].items()]
        ppl_table += [{"method": k, **_cells(v, lambda x: round(x, 3))} for k, v in peer["perplexity"].items()]
    return needle_table, ppl_table


def _ratios(needles: dict, ppl: dict, blend_rows: list[dict], n: int, n_blend: int) -> dict:
    """Needle accuracy (SnapKV at each budget), perplexity over the full cache's (each KV format, SnapKV and
    StreamingLLM at each budget), and how often blending answers as a full prefill does."""
    full_ppl = ppl["full cache"][1.0]
    acc = lambda label, f: needles[label][f] / n  # noqa: E731
    return {
        "needle_full_cache": acc("full cache", 1.0),
        **{f"needle_snapkv_aware_at_{int(f * 100)}": acc("SnapKV (aware)", f) for f in BUDGETS},
        **{f"needle_snapkv_agnostic_at_{int(f * 100)}": acc("SnapKV (agnostic)", f) for f in BUDGETS},
        **{f"ppl_{fmt}_over_full": ppl[f"KV {fmt}"][1.0] / full_ppl for fmt in QUANT_FORMATS},
        **{f"ppl_snapkv_at_{int(f * 100)}_over_full": ppl["SnapKV"][f] / full_ppl for f in BUDGETS},
        **{f"ppl_streaming_at_{int(f * 100)}_over_full": ppl["StreamingLLM"][f] / full_ppl for f in BUDGETS},
        **{f"blend_{r['recompute']}_same_answer_as_full": int(r["same_answer_as_full"].split("/")[0]) / n_blend
           for r in blend_rows if r["select"] == "deviation"},
    }


def run(quick: bool = False) -> dict:
    from llmso_lab.models import load_model
    from llmso_lab.quality import eval_token_ids

    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m")
    model.set_attn_implementation("sdpa")     # PyramidKV's uneven layers decode with SDPA (see evict.greedy_continue)
    lengths, depths = ((512,), (0.1, 0.5, 0.9)) if quick else ((512, 1024), (0.1, 0.5, 0.9))
    cases, seeds = _answerable_needles(model, tok, lengths, depths)
    needles = _needle_runs(model, tok, cases, BUDGETS)
    windows, ctx, cont = (2, 512, 128) if quick else (4, 1024, 128)
    ids = eval_token_ids(tok)
    ppl = _perplexity_runs(model, ids, windows, ctx, cont, BUDGETS)
    peer = _kvpress(cases, ids, windows, ctx, cont, BUDGETS, tok)
    blend_rows = _blend_runs(model, tok, depths, (0,) if quick else (0, 1))
    ratio = _kv_bytes(model.config)
    n_blend = len(depths) * (1 if quick else 2)
    n = len(cases)
    needle_table, ppl_table = _tables(needles, ppl, peer, n)
    return harness.result(   # no "command": the CLI records the command line it ran
        "kv-compress", None,
        workload={"model": "smollm2-135m fp32 greedy", "needle_lengths": list(lengths), "needle_depths": list(depths),
                  "needle_cases": n, "needle_seeds": seeds, "budgets": list(BUDGETS), "observation_window": WINDOW,
                  "kivi_residual": RESIDUAL, "block_size": BLOCK,
                  "ppl": {"windows": windows, "context": ctx, "continuation": cont},
                  "kvpress": None if peer is None else peer["versions"],
                  "kvpress_missing_reason": None if peer is not None else "no .venv-kvpress (make peers-kvpress)"},
        table=needle_table,
        tables={"perplexity of the continuation (compressed context)": ppl_table,
                "cache blending (CacheBlend), 512-token RAG prompts in 4 chunks": blend_rows,
                "KV bytes per token vs fp16 (engine store, block 16)": [
                    {"format": f, "bytes_vs_fp16": round(r, 3)} for f, r in ratio.items()]},
        needles={k: {str(f): v for f, v in d.items()} for k, d in needles.items()},
        perplexity={k: {str(f): v for f, v in d.items()} for k, d in ppl.items()},
        kvpress=peer, ratios=_ratios(needles, ppl, blend_rows, n, n_blend))
