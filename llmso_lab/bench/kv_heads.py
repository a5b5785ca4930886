"""`llmso-lab bench kv-heads`: one model as MHA, GQA and MQA — quality, KV bytes and decode speed (lecture 1-2).

SmolLM2-135M has 9 query heads and 3 KV heads (GQA, as trained). From it (`llmso_lab.models.kv_heads`):
MHA = `to_mha` (each KV head copied for its 3 query heads: the same logits, 3x the cache), GQA = the model
itself, MQA = `to_mqa` (the 3 KV heads mean-pooled into 1, GQA's uptraining initialisation, *not* uptrained).
For each, in one run:

1. perplexity on `data/eval/eval_text.txt` (`llmso_lab.quality.perplexity`, windows of 512 tokens; its first
   2,687 tokens, the authored part, as recorded; `--quick`: its first 1,024);
2. KV bytes per token (`hardware.kv_cache_bytes`, in the engine's fp32 and in bf16) and how many sequences of
   the long context fit a 1 GiB KV cache as the engine sizes it;
3. engine decode tokens/s (`LLM`, fp32, torch attention, greedy, EOS ignored): batch 1 after a short prompt, and
   a large batch with long contexts (16 x 1,024 tokens; `--quick`: 8 x 512; `batch=32` works too but holds
   ~10 GB). The three engines take steps in turn (so a busy machine slows them alike); the speed is
   batch / median wall time of the steps that decode the whole batch and prefill nothing.

`batch_step_MB_read` is what one decode step of the large batch must read (`hardware.decode_bytes_per_step`: the
fp32 weights once + every sequence's KV): where decode is memory-bound, the speed-up follows its ratio.

Ratios (same run): KV bytes MHA/GQA and GQA/MQA, perplexity GQA/MHA and MQA/GQA, decode speed GQA/MHA and
MQA/GQA at batch 1 and at the large batch, and the bytes-read ratios they are to be compared with. Timings
depend on the machine and on what else runs on it.
"""
from __future__ import annotations

import gc
import statistics
import time

from llmso_lab.bench import harness
from llmso_lab.hardware import decode_bytes_per_step
from llmso_lab.models.shapes import ModelShape, kv_sizing_table

__all__ = ["run", "variants", "decode_speeds", "FULL", "QUICK"]

FULL = dict(ppl_tokens=2687, ppl_window=512, b1_prompt=128, b1_tokens=64, batch=16, context=1024, batch_tokens=16)
QUICK = dict(ppl_tokens=1024, ppl_window=512, b1_prompt=64, b1_tokens=16, batch=8, context=512, batch_tokens=8)
CACHE_BUDGET = 1 << 30   # bytes: the engine's default kv_cache_memory_bytes


def variants(model) -> dict[str, tuple[object, str]]:
    """{attention kind: (model, how it was made)} for MHA, the model as trained, and MQA (distinct KV head
    counts only: a model trained as MHA gives two entries)."""
    from llmso_lab.models.kv_heads import kv_head_counts, to_mha, to_mqa

    heads, kv = kv_head_counts(model)
    out: dict[str, tuple[object, str]] = {}
    if kv != heads:
        out["MHA"] = (to_mha(model), f"to_mha: {kv} KV heads copied to {heads}")
    out[ModelShape.from_hf_config(model.config).attention] = (model, f"as trained ({kv} KV heads)")
    if kv != 1:
        out["MQA"] = (to_mqa(model), f"to_mqa: {kv} KV heads mean-pooled into 1, not uptrained")
    return out


def decode_speeds(models: dict[str, object], tokenizer, prompts: list[list[int]], max_tokens: int,
                  engine_kwargs: dict[str, dict] | None = None) -> dict[str, dict]:
    """Greedy decode of `prompts` (all at once, EOS ignored) on one engine per model, each engine's cache sized
    to hold exactly them (`ModelShape.kv_cache_bytes`, fp32). The engines take steps in turn, one each, so that
    whatever else runs on the machine slows them alike.

    `engine_kwargs`: extra `LLM` keyword arguments per model name (e.g. {"int8": {"quantization": "int8"}}).
    Per model: "tok_s" (batch / median wall time of the steps that decode every sequence and prefill nothing),
    "steps" (how many such steps), "step_ms" (that median) and "token_ids" (each prompt's output)."""
    from llmso_lab.engine import LLM, SamplingParams

    block, B = 16, len(prompts)
    max_len = max(map(len, prompts)) + max_tokens
    engines, step_s, outputs = {}, {k: [] for k in models}, {k: {} for k in models}
    for name, model in models.items():
        budget = ModelShape.from_hf_config(model.config).kv_cache_bytes(-(-max_len // block) * block, B, bytes_per_elem=4)
        engines[name] = llm = LLM(model, tokenizer, block_size=block, max_model_len=max_len, max_num_seqs=B,
                                  kv_cache_memory_bytes=budget, max_num_batched_tokens=max(2048, max_len),
                                  **(engine_kwargs or {}).get(name, {}))
        for p in prompts:
            llm.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(llm.has_unfinished_requests() for llm in engines.values()):
        for name, llm in engines.items():
            if llm.has_unfinished_requests():
                finished, trace = llm.step()
                if not trace.prefill and len(trace.decode) == B:
                    step_s[name].append(trace.wall_time_s)
                outputs[name].update({o.request_id: o.outputs[0].token_ids for o in finished})
    result = {}
    for name in models:
        median = statistics.median(step_s[name])
        result[name] = {"tok_s": B / median, "steps": len(step_s[name]), "step_ms": 1e3 * median,
                        "token_ids": [outputs[name][k] for k in sorted(outputs[name], key=int)]}
    return result


def _prompts(ids: list[int], n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens cut from `ids` at different offsets (wrapping around)."""
    ids = ids * (-(-length // len(ids)) + 1)
    span = max(1, len(ids) - length)
    return [ids[(i * 97) % span:][:length] for i in range(n)]


def _rows(found: dict, cfg: dict, ppl_ids: list[int], b1: dict, big: dict) -> tuple[list[dict], dict]:
    """A table row per variant (perplexity measured here, the decode speeds `b1` and `big` given) and its raw
    figures for the ratios: KV bytes per token, perplexity, both speeds and the bytes one big-batch step reads."""
    from llmso_lab.quality import perplexity

    big_key = f"decode_tok_s_batch{cfg['batch']}x{cfg['context']}"
    table, raw = [], {}
    for kind, (m, made) in found.items():
        shape = ModelShape.from_hf_config(m.config)
        kv = shape.kv_bytes_per_token(4)                                                   # fp32, as the engine runs
        per_seq = shape.kv_cache_bytes(-(-cfg["context"] // 16) * 16, bytes_per_elem=4)   # whole 16-token blocks
        read = decode_bytes_per_step(shape.weight_bytes(4), [cfg["context"]] * cfg["batch"], kv)
        raw[kind] = {"kv": kv, "ppl": perplexity(m, ppl_ids, window=cfg["ppl_window"]), "b1": b1[kind]["tok_s"],
                     "big": big[kind]["tok_s"], "read": read}
        table.append({
            "attention": kind, "kv_heads": m.config.num_key_value_heads, "made_by": made,
            "perplexity": round(raw[kind]["ppl"], 3), "kv_bytes_per_token": kv,
            "kv_bytes_per_token_bf16": shape.kv_bytes_per_token(2),
            f"seqs_of_{cfg['context']}_in_1GiB": CACHE_BUDGET // per_seq,
            "decode_tok_s_batch1": round(b1[kind]["tok_s"], 2), big_key: round(big[kind]["tok_s"], 2),
            "batch_step_ms": round(big[kind]["step_ms"], 1), "batch_step_MB_read": round(read / 1e6, 1),
            "timed_steps": f"{b1[kind]['steps']} + {big[kind]['steps']}",
        })
    return table, raw


def _ratios(raw: dict, ref: str) -> dict:
    """What fewer KV heads save (bytes, bytes read) and cost (perplexity, speed): MHA against the model as trained
    (`ref`), and it against MQA."""
    ratios = {}
    for more, fewer in (("MHA", ref), (ref, "MQA")):   # the variant with more KV heads, the one with fewer
        if more in raw and fewer in raw and more != fewer:
            a, b = raw[more], raw[fewer]
            saved, cost = f"{more}_over_{fewer}".lower(), f"{fewer}_over_{more}".lower()
            ratios.update({f"kv_bytes_{saved}": a["kv"] / b["kv"], f"perplexity_{cost}": b["ppl"] / a["ppl"],
                           f"decode_batch1_{cost}": b["b1"] / a["b1"], f"decode_big_batch_{cost}": b["big"] / a["big"],
                           f"bytes_read_big_batch_{saved}": a["read"] / b["read"]})
    return harness.rounded(ratios)


def run(quick: bool = False, *, model: str = "smollm2-135m", **overrides) -> dict:
    """The benchmark (keyword overrides: the keys of `FULL`, e.g. `batch=16`)."""
    from llmso_lab.models import load_model
    from llmso_lab.quality import eval_token_ids

    unknown = set(overrides) - set(FULL)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; valid: {', '.join(FULL)}")
    cfg = {**(QUICK if quick else FULL), **overrides}
    t_start = time.perf_counter()
    net, tok = load_model(model)
    ids = eval_token_ids(tok)
    ppl_ids = ids[:cfg["ppl_tokens"]]
    b1_prompts = _prompts(ids, 1, cfg["b1_prompt"])
    big_prompts = _prompts(ids, cfg["batch"], cfg["context"])
    found = variants(net)
    ref = next(k for k, (m, _) in found.items() if m is net)   # the model as trained (GQA for SmolLM2)
    models = {kind: m for kind, (m, _) in found.items()}
    b1 = decode_speeds(models, tok, b1_prompts, cfg["b1_tokens"])
    gc.collect()
    big = decode_speeds(models, tok, big_prompts, cfg["batch_tokens"])
    gc.collect()
    table, raw = _rows(found, cfg, ppl_ids, b1, big)
    same = {k: big[k]["token_ids"] == big[ref]["token_ids"] for k in big if k != ref}
    return harness.result(
        "kv_heads", quick, table=table, ratios=_ratios(raw, ref), model=model, settings=cfg,
        eval_text={"file": "data/eval/eval_text.txt", "tokens": len(ids), "scored_tokens": len(ppl_ids)},
        greedy_outputs_equal_to_as_trained=same,
        tables={"KV sizing of real models (bf16 weights and cache; llmso_lab.models.shapes.kv_sizing_table)":
                kv_sizing_table()},
        wall_s=round(time.perf_counter() - t_start, 1),
        note="MHA = exact copies of the KV heads (same logits); MQA = mean-pooled without uptraining, which "
             "Ainslie et al. (GQA, 2023) follow with ~5% of pre-training compute; engine in fp32, torch attention")


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1, default=str))
