"""`llmso-lab bench quant`: weight-only quantization in the engine — bytes, perplexity, decode and prefill speed
(lecture 1-3), with torchao as the peer, in one run.

For SmolLM2 in fp32 and with every matmul weight (q/k/v, o, gate/up, down, LM head) quantized at load time
(`LLM(quantization=...)`: int8 per channel, int4 group 32 / 64, round-to-nearest; int4 group 64 on the
AWQ-folded model, `awq_fold_for_engine`):

1. `weight_MB`: the bytes of those matrices, i.e. what one decode step reads (plus the KV cache);
2. `ppl`: perplexity on the eval text (`llmso_lab.quality`, windows of 512) of the Hugging Face model whose weights
   are exactly those the kernels multiply by (`dequantized_copy`, fp32 activations: the kernels' own 512-row
   matmuls are slow on CPU, see `prefill_ms`);
3. `b1_tok_s` / `b16_tok_s`: engine greedy decode tokens/s at batch 1 and 16 (chat prompts, EOS ignored; the
   engines take steps in turn, so a busy machine slows them alike; speed = batch / median decode-step time);
4. `matmuls_b1_ms`: one token through the 121 matrices alone (the ceiling the rest of the step eats into);
5. `prefill_ms`: one 512-token prompt's forward. Prefill multiplies 512 rows by each weight: it is compute bound
   (Lab 00's roofline), so reading fewer weight bytes barely helps, and unpacking costs time.

The torchao peer (`torchao_peer`, run in the peers venv in the same run) quantizes the Hugging Face model with
torchao's weight-only configs and measures `generate` and perplexity the same way. Ratios: `int8_vs_fp32_batch1`,
`int4_vs_fp32_batch1` (int4 = group 32 RTN), their batch-16 forms, `int8_ppl_over_fp32`, `int4_ppl_over_fp32`, and
`torchao_*` versions of each (torchao's quantized HF model over HF fp32).
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmso_lab.bench import harness

__all__ = ["run", "FULL", "QUICK", "chat_prompts", "SCHEMES"]

FULL = dict(ppl_tokens=None, peer_ppl_tokens=2048, ppl_window=512, b1_tokens=48, batch=16, new_tokens=24, repeats=3, prefill=512)
QUICK = dict(ppl_tokens=1024, peer_ppl_tokens=512, ppl_window=512, b1_tokens=16, batch=16, new_tokens=8, repeats=1, prefill=256)

# (label, LLM quantization=, bits, group): round-to-nearest; `schemes()` adds AWQ
SCHEMES = [("fp32", None, 32, "-"), ("int8 per-channel", "int8", 8, "channel"),
           ("int4 g32 RTN", "int4", 4, 32), ("int4 g64 RTN", "int4-g64", 4, 64)]

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in one paragraph.",
             "Write a haiku about autumn.", "How do vaccines work?", "Give three tips for learning a language.",
             "Why is the sky blue?", "What does a CPU cache do?", "Summarise the plot of Romeo and Juliet.",
             "How do I boil an egg?", "What is the difference between weather and climate?",
             "Name five animals that live in the ocean.", "What is a prime number?", "How does a bicycle stay upright?",
             "Describe a good morning routine.", "What causes the seasons?", "Why do we sleep?"]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` chat-templated user questions as token ids (the same in every run)."""
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _weight_bytes(runner) -> int:
    """Bytes of the matrices one decode step multiplies by (what it reads besides the KV cache)."""
    return sum(w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
               for w in runner.weight_matrices())


def _matmuls_ms(runner, repeats: int = 8) -> float:
    """Median ms of one token through the runner's matrices alone (q/k/v, o, gate/up, down per layer, LM head)."""
    from llmso_lab.engine.ops import linear
    ws = runner.weight_matrices()
    xs = [torch.ones(1, w.shape[0] if isinstance(w, torch.Tensor) else w.in_features) for w in ws]
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for x, w in zip(xs, ws):
                linear(x, w)
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[1:])


def _prefill_ms(llm, prompt: list[int], repeats: int) -> float:
    from llmso_lab.engine import SamplingParams
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _peer(quick: bool) -> dict:
    """Run `torchao_peer` in the peers venv; {"rows": [...]} or {"error": why}."""
    root = Path(__file__).resolve().parents[2]
    python = Path(os.environ.get("LLMSO_LAB_PEERS_PYTHON", root / ".venv-peers" / "bin" / "python"))
    if not python.exists():
        return {"error": f"no peers venv at {python}: run `make setup` (it builds .venv-peers with torchao)"}
    cmd = [str(python), "-m", "llmso_lab.bench.torchao_peer"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LLMSO_PEER_JSON ")), None)
    if proc.returncode or line is None:
        return {"error": f"torchao peer failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"}
    return json.loads(line.split(" ", 1)[1])


def schemes() -> list[tuple[str, str | None, int, object, object]]:
    """(label, quantization, bits, group, model transform or None): the RTN rows, then AWQ int4 group 64 (group 32
    asymmetric is the checkpoint's own Q4_1 grid, which RTN already reproduces exactly: nothing for AWQ to win)."""
    from llmso_lab.quant.awq import awq_fold_for_engine
    rows = [(label, q, bits, group, None) for label, q, bits, group in SCHEMES]
    return rows + [("int4 g64 AWQ", "int4-g64", 4, 64, lambda m, c: awq_fold_for_engine(m, c, 4, 64))]


def _quality_rows(model, todo, ids, calib, window: int) -> tuple[dict, dict, dict]:
    """Per scheme: the model it runs (AWQ folds scales into a copy), its `LLM` keyword arguments, and a row with the
    perplexity of the weights its kernels multiply by (`dequantized_copy`)."""
    from tqdm.auto import tqdm

    from llmso_lab.quality import perplexity
    from llmso_lab.quant.weight_only import dequantized_copy

    models, kwargs, rows = {}, {}, {}
    for label, q, bits, group, transform in tqdm(todo, desc="quantize + perplexity"):
        m = model if transform is None else transform(copy.deepcopy(model), calib)
        models[label], kwargs[label] = m, {"quantization": q}
        hf = m if q is None else dequantized_copy(m, *_method_group(q))
        rows[label] = {"scheme": label, "bits": bits, "group": group,
                       "ppl": round(perplexity(hf, ids, window=window), 3)}
        del hf
    return models, kwargs, rows


def _ratios(rows: dict, B: int) -> dict:
    """Each RTN scheme over fp32 (speeds at batch 1 and `B`, perplexity, bytes) and AWQ over RTN at the same bits and
    group."""
    fp, ratios = rows["fp32"], {}
    for key, label in (("int8", "int8 per-channel"), ("int4", "int4 g32 RTN"), ("int4_g64", "int4 g64 RTN")):
        r = rows[label]
        ratios[f"{key}_vs_fp32_batch1"] = round(r["b1_tok_s"] / fp["b1_tok_s"], 3)
        ratios[f"{key}_vs_fp32_batch{B}"] = round(r[f"b{B}_tok_s"] / fp[f"b{B}_tok_s"], 3)
        ratios[f"{key}_ppl_over_fp32"] = round(r["ppl"] / fp["ppl"], 4)
        ratios[f"{key}_matmuls_speedup_batch1"] = round(fp["matmuls_b1_ms"] / r["matmuls_b1_ms"], 3)
        ratios[f"{key}_prefill_speedup"] = round(fp["prefill_ms"] / r["prefill_ms"], 3)
        ratios[f"{key}_weight_bytes_over_fp32"] = round(r["weight_MB"] / fp["weight_MB"], 4)
    for label in rows:
        if "AWQ" in label:   # AWQ against RTN at the same bits and group
            rtn = rows[label.replace("AWQ", "RTN")]
            ratios[f"{label.replace(' ', '_').lower()}_ppl_over_rtn"] = round(rows[label]["ppl"] / rtn["ppl"], 4)
    return ratios


def _add_peer(result: dict, quick: bool, fp: dict, B: int) -> None:
    """Run the torchao peer and add its table, versions and ratios to `result` (its quantized HF model over HF fp32;
    our fp32 engine's row `fp` over HF fp32)."""
    got = _peer(quick)
    ratios = result["ratios"]
    peer_rows = got.get("rows") or [{"scheme": "torchao", "status": got.get("error")}]
    result["tables"]["torchao peer (Hugging Face generate)"] = peer_rows
    result["peer_versions"] = {k: got[k] for k in ("torch", "torchao", "ppl_tokens") if k in got}
    base = next((r for r in peer_rows if r["scheme"] == "HF fp32" and "ppl" in r), None)
    for r in peer_rows:
        key = "torchao_int8" if "int8" in r["scheme"] else "torchao_int4" if "Prototype" in r["scheme"] else None
        if base and key and "ppl" in r:
            ratios[f"{key}_vs_fp32_batch1"] = round(r["b1_tok_s"] / base["b1_tok_s"], 3)
            ratios[f"{key}_vs_fp32_batch{B}"] = round(r[f"b{B}_tok_s"] / base[f"b{B}_tok_s"], 3)
            ratios[f"{key}_ppl_over_fp32"] = round(r["ppl"] / base["ppl"], 4)
    if base:   # our engine against HF generate, both fp32, same run
        ratios["engine_fp32_vs_hf_fp32_batch1"] = round(fp["b1_tok_s"] / base["b1_tok_s"], 3)


def run(quick: bool = False, *, peer: bool = True, **overrides) -> dict:
    """The benchmark (keyword overrides: the keys of `FULL`)."""
    from llmso_lab.bench.kv_heads import decode_speeds
    from llmso_lab.engine import LLM
    from llmso_lab.models import load_model
    from llmso_lab.quality import calibration_token_ids, eval_token_ids

    cfg = {**(QUICK if quick else FULL), **overrides}
    model, tok = load_model("smollm2-135m")
    ids = eval_token_ids(tok, cfg["ppl_tokens"])
    calib = calibration_token_ids(tok, 512)
    prompts = chat_prompts(tok, cfg["batch"])
    long_prompt = (ids * 2)[:cfg["prefill"]]
    todo = schemes()
    models, kwargs, rows = _quality_rows(model, todo, ids, calib, cfg["ppl_window"])
    b1 = decode_speeds(models, tok, prompts[:1], cfg["b1_tokens"], kwargs)
    bB = decode_speeds(models, tok, prompts, cfg["new_tokens"], kwargs)
    for label, q, *_ in todo:
        llm = LLM(models[label], tok, max_num_seqs=1, max_model_len=cfg["prefill"] + 8, quantization=q)
        rows[label].update(weight_MB=round(_weight_bytes(llm.model_runner) / 1e6, 1),
                           b1_tok_s=round(b1[label]["tok_s"], 1), **{f"b{cfg['batch']}_tok_s": round(bB[label]["tok_s"], 1)},
                           matmuls_b1_ms=round(_matmuls_ms(llm.model_runner), 2),
                           prefill_ms=round(_prefill_ms(llm, long_prompt, cfg["repeats"]), 1))
        del llm
    result = harness.result("quant", quick, config=cfg, eval_tokens=len(ids), table=list(rows.values()),
                            ratios=_ratios(rows, cfg["batch"]), tables={})
    if peer:
        _add_peer(result, quick, rows["fp32"], cfg["batch"])
    return result


def _method_group(q: str) -> tuple[str, int]:
    from llmso_lab.engine.config import parse_quantization
    method, group = parse_quantization(q)
    return method, group or 32


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
