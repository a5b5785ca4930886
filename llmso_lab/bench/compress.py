"""`llmso-lab bench compress`: what each compression method costs in quality on SmolLM2, in one run (lecture 1-3).

Perplexity on the first 2,048 tokens of the eval text (`llmso_lab.quality`, windows of 512; `--quick`: 512 tokens)
after each of ~30 transformations (the whole 8.8K-token text, as `bench quant` scores it, would take ~8 s per model
here instead of ~2 s):

- `bits`: weight-only RTN, AWQ and GPTQ at 8 / 4 / 3 / 2 bits, symmetric, groups of 64 — a grid that does *not*
  align with the checkpoint's own Q4_1 blocks (group 32, asymmetric), which RTN reproduces exactly (rows
  "RTN 4 g32 asym"). Calibration (never scored), in rows of 128 tokens: `data/eval/calib_text.txt` (Python
  documentation, another domain than the scored prose), 512 tokens for AWQ, all ~3,100 for GPTQ; plus GPTQ rows
  calibrated in-domain ("calib": "eval 2048-4095", eval tokens that are not scored) — GPTQ fits its calibration
  data, AWQ only picks scales from it. Fake quantization in fp32 (the weights the kernels would multiply by); the
  lm_head (tied embedding) stays fp32.
- `smoothquant`: W8A8 int8 (per-token activations, per-channel weights) without and with SmoothQuant, alpha swept;
  `fp8`: W8A8 in FP8 e4m3 / e5m2 (simulated: values cast, math in fp32).
- `prune_unstructured` (magnitude, per matrix), `prune_2_4`, `prune_mlp` (structured: MLP channels removed).
- `distill`: a tiny student trained 200 steps on the teacher's top-64 logits (+ one "rest" logit; KL at T = 1) vs on
  the text's tokens (CE), same data, same seed; held-out perplexity (`llmso_lab.quant.distill.compare_soft_hard`),
  with two training slices: the 1,663 in-domain tokens after the held-out ones, and all 7,808 (mostly Python docs).
"""
from __future__ import annotations

import copy
import time

from llmso_lab.bench import harness

__all__ = ["run"]


def _jobs(quick: bool, bits_list, calib, calib_all, in_domain) -> list[tuple[str, dict, object]]:
    """(table, row, transform of a model copy): every compression the bench scores, in the order it scores them."""
    from llmso_lab.quant.awq import awq_quantize_model
    from llmso_lab.quant.calibration import linear_names
    from llmso_lab.quant.gptq import gptq_quantize_model
    from llmso_lab.quant.prune import prune_2_4, prune_mlp_channels, prune_unstructured
    from llmso_lab.quant.rtn import fake_quantize
    from llmso_lab.quant.w8a8 import quantize_linears_w8a8, smooth_model

    def rtn(m, bits, group, sym):
        mods = dict(m.named_modules())
        for name in linear_names(m):
            mods[name].weight.data.copy_(fake_quantize(mods[name].weight.data, bits, group_size=group, symmetric=sym))

    jobs = []
    for bits in bits_list:
        jobs.append(("bits", {"method": "RTN", "bits": bits, "group": 64, "symmetric": True},
                     lambda m, b=bits: rtn(m, b, 64, True)))
        jobs.append(("bits", {"method": "AWQ", "bits": bits, "group": 64, "symmetric": True},
                     lambda m, b=bits: awq_quantize_model(m, calib, b, 64, True)))
        jobs.append(("bits", {"method": "GPTQ", "bits": bits, "group": 64, "symmetric": True},
                     lambda m, b=bits: gptq_quantize_model(m, calib_all, b, 64, True, max_tokens=len(calib_all))))
    for bits in (4, 3):
        jobs.append(("bits", {"method": "GPTQ", "bits": bits, "group": 64, "symmetric": True, "calib": "eval 2048-4095"},
                     lambda m, b=bits: gptq_quantize_model(m, in_domain, b, 64, True, max_tokens=len(in_domain))))
    jobs.append(("bits", {"method": "RTN", "bits": 4, "group": 32, "symmetric": False}, lambda m: rtn(m, 4, 32, False)))
    jobs.append(("bits", {"method": "RTN", "bits": 4, "group": 64, "symmetric": False}, lambda m: rtn(m, 4, 64, False)))
    jobs.append(("bits", {"method": "AWQ", "bits": 4, "group": 64, "symmetric": False},
                 lambda m: awq_quantize_model(m, calib, 4, 64, False)))
    jobs.append(("bits", {"method": "RTN", "bits": 4, "group": "channel", "symmetric": True},
                 lambda m: rtn(m, 4, None, True)))
    for alpha in (None, 0.25, 0.5, 0.75, 1.0):
        jobs.append(("smoothquant", {"scheme": "W8A8 int8", "alpha": alpha},
                     lambda m, a=alpha: (a is not None and smooth_model(m, calib, a), quantize_linears_w8a8(m, "int8"))))
    for fmt in ("e4m3", "e5m2"):
        jobs.append(("fp8", {"scheme": f"W8A8 FP8 {fmt}"}, lambda m, f=fmt: quantize_linears_w8a8(m, f)))
    for sp in ((0.0, 0.3, 0.5, 0.7) if quick else (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)):
        jobs.append(("prune_unstructured", {"sparsity": sp}, lambda m, s=sp: prune_unstructured(m, s)))
    jobs.append(("prune_2_4", {"pattern": "2:4", "sparsity": 0.5}, lambda m: prune_2_4(m)))
    for fr in ((0.0, 0.2, 0.5) if quick else (0.0, 0.1, 0.2, 0.3, 0.5)):
        jobs.append(("prune_mlp", {"fraction": fr}, lambda m, f=fr: prune_mlp_channels(m, f, calib)))
    return jobs


def _distill(model, tok, quick: bool, steps: int) -> list[dict]:
    """Soft (top-64 logits) against hard (tokens) distillation of a tiny student, per training slice."""
    from llmso_lab.quant.distill import compare_soft_hard

    distill = []
    for max_train in ((1663,) if quick else (1663, None)):
        d = compare_soft_hard(model, tok, heldout_tokens=1024, max_train_tokens=max_train, steps=steps,
                              eval_every=max(1, steps // 6))
        distill.append({
            "steps": steps, "heldout_tokens": 1024, "train_tokens": d["train_tokens"], "k": 64, "T": 1.0, "alpha": 1.0,
            "student": "2-layer Llama, hidden 64, tied embedding = PCA of SmolLM2's (frozen)",
            "teacher_ppl": round(d["teacher_ppl"], 3), "topk_mass": round(d["topk_mass"], 4),
            **{mode: {"heldout_ppl": round(d[mode].heldout_ppl, 3), "seconds": round(d[mode].seconds, 1),
                      "heldout_curve": [(s, round(p, 3)) for s, p in d[mode].heldout_curve],
                      "final_loss": round(d[mode].losses[-1], 4)} for mode in ("soft", "hard")}})
    return distill


def _ratios(tables: dict, distill: list[dict], base: float, bits_list) -> dict:
    """Perplexity ratios (< 1: the first loses less): AWQ and GPTQ over RTN, the checkpoint's own grid and W8A8 over
    fp32, SmoothQuant over plain W8A8, 2:4 over unstructured pruning, soft over hard distillation."""
    by = {(r["method"], r["bits"], r["group"], r["symmetric"]): r["ppl"] for r in tables["bits"] if "calib" not in r}
    in_dom = {r["bits"]: r["ppl"] for r in tables["bits"] if "calib" in r}
    ratios = {}
    for bits in bits_list:
        for method in ("AWQ", "GPTQ"):
            ratios[f"{method.lower()}_over_rtn_ppl_{bits}bit_g64_sym"] = round(
                by[(method, bits, 64, True)] / by[("RTN", bits, 64, True)], 4)
    for bits, p in in_dom.items():
        ratios[f"gptq_in_domain_over_rtn_ppl_{bits}bit_g64_sym"] = round(p / by[("RTN", bits, 64, True)], 4)
    ratios["awq_over_rtn_ppl_4bit_g64_asym"] = round(by[("AWQ", 4, 64, False)] / by[("RTN", 4, 64, False)], 4)
    ratios["rtn_4bit_g32_asym_over_fp32_ppl"] = round(by[("RTN", 4, 32, False)] / base, 4)   # the GGUF's own grid
    sq = {r["alpha"]: r["ppl"] for r in tables["smoothquant"]}
    ratios["w8a8_int8_over_fp32_ppl"] = round(sq[None] / base, 4)
    ratios["w8a8_smoothquant_0.5_over_w8a8_ppl"] = round(sq[0.5] / sq[None], 4)
    un = {r["sparsity"]: r["ppl"] for r in tables["prune_unstructured"]}
    ratios["prune_2_4_over_unstructured_50_ppl"] = round(tables["prune_2_4"][0]["ppl"] / un[0.5], 4)
    for d in distill:
        ratios[f"distill_soft_over_hard_heldout_ppl_{d['train_tokens']}_train_tokens"] = round(
            d["soft"]["heldout_ppl"] / d["hard"]["heldout_ppl"], 4)
    return ratios


def run(quick: bool = False, *, distill_steps: int | None = None) -> dict:
    from tqdm.auto import tqdm

    from llmso_lab.models import load_model
    from llmso_lab.quality import calibration_token_ids, eval_token_ids, perplexity

    t_start = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    ids = eval_token_ids(tok, 512 if quick else 2048)
    calib, calib_all = calibration_token_ids(tok, 512), calibration_token_ids(tok)
    in_domain = eval_token_ids(tok)[2048:4096]   # never scored (the full run scores the first 2,048 tokens)
    ppl = lambda m: round(perplexity(m, ids, window=512), 3)  # noqa: E731
    bits_list = (8, 4, 3) if quick else (8, 4, 3, 2)
    jobs = _jobs(quick, bits_list, calib, calib_all, in_domain)
    tables: dict[str, list] = {}
    for table, row, transform in tqdm(jobs, desc="compress + perplexity"):
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        transform(m)
        row = {**row, "ppl": ppl(m), "seconds": round(time.perf_counter() - t0, 1)}
        tables.setdefault(table, []).append(row)
        del m
    distill = _distill(model, tok, quick, distill_steps or (20 if quick else 200))
    base = ppl(model)
    ratios = _ratios(tables, distill, base, bits_list)
    table = tables.pop("bits")
    return harness.result("compress", quick, eval_tokens=len(ids),
                          calib_tokens={"awq_smoothquant_prune": len(calib), "gptq": len(calib_all)}, ppl_fp32=base,
                          table=table, tables=tables, distill=distill, ratios=ratios,
                          seconds=round(time.perf_counter() - t_start, 1))
