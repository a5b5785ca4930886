"""`llmso-lab bench kv-store`: what to store per token — low-rank latents, cross-layer sharing, sliding windows,
MLA — and what each costs SmolLM2 without training (lecture 1-2).

On SmolLM2-135M (fp32; perplexity on `data/eval/eval_text.txt`, windows of 1,024 tokens so that a 256-token
sliding window matters; `--quick`: the first 1,024 tokens only and fewer variants):
1. SVD latent: each layer's [W_k; W_v] (384 x 576) through rank r (`models.low_rank_kv`), r = 16 .. 384:
   perplexity, the squared singular values kept, bytes per token (r numbers per layer instead of 384).
2. Cross-layer KV sharing (CLA, `models.kv_sharing`): pairs / triples of layers on one KV.
3. Sliding window 256: every layer local, or every 2nd / 3rd layer global; KV bytes at 8K / 32K. Without
   training, WHICH layers stay global matters: every 2nd helps, every 3rd is worse than none (measured); models
   built as hybrids (Gemma, gpt-oss) are trained with their pattern.
4. MQA two ways (a diagnostic for `bench kv-heads`): the 3 KV heads mean-pooled (GQA's init) vs head 0 kept.
5. MLA (tiny seeded DeepSeek-V3 in the engine, `engine.mla`): bytes per token and layer read from the engine's
   own cache tensors vs a Llama of the same width as MHA and as GQA.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from llmso_lab.bench import harness

RANKS_FULL, RANKS_QUICK = (16, 32, 64, 128, 192, 256, 320, 384), (32, 128, 384)


def _mqa_keep_first(model):
    """MQA by keeping KV head 0 for every query head (instead of the group mean)."""
    import torch

    from llmso_lab.models.kv_heads import to_mqa

    out, D = to_mqa(model), model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for src, dst in zip(model.model.layers, out.model.layers):
            for name in ("k_proj", "v_proj"):
                getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight[:D])
    return out


def mla_bytes() -> list[dict]:
    """Per token and layer, fp32, read from the engines' cache tensors: MLA latent vs MHA / GQA of the same width."""
    from llmso_lab.engine import LLM
    from llmso_lab.models import tiny_deepseek_v3, tiny_llama

    slot = lambda cache: cache[0, 0, 0].numel() * cache.element_size()  # noqa: E731
    rows = []
    mla = LLM(tiny_deepseek_v3(hidden_size=64, num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8), max_model_len=64)
    rows.append({"model": "MLA (r=32, rope=8)", "bytes_per_token_layer": slot(mla.model_runner.k_cache)})
    for kv in (4, 1):
        llm = LLM(tiny_llama(num_heads=4, num_kv_heads=kv), max_model_len=64)
        rows.append({"model": f"{'MHA' if kv == 4 else 'MQA'} ({kv} KV heads x 16)",
                     "bytes_per_token_layer": slot(llm.model_runner.k_cache) + slot(llm.model_runner.v_cache)})
    return rows


def _layout_schemes(quick: bool) -> list[tuple[str, dict]]:
    """(name, `share_kv` / `kv_bytes` arguments): the model as trained, cross-layer sharing, sliding windows."""
    schemes = [("full (as trained)", {}), ("CLA pairs", {"share_every": 2}), ("window 256, all local", {"window": 256}),
               ("window 256, every 2nd layer global", {"window": 256, "global_every": 2}),
               ("window 256, every 3rd layer global", {"window": 256, "global_every": 3})]
    if not quick:
        schemes.insert(2, ("CLA triples", {"share_every": 3}))
    return schemes


def run(quick: bool = False) -> dict:
    from llmso_lab.hardware import kv_cache_bytes
    from llmso_lab.models import load_model
    from llmso_lab.models.kv_heads import to_mqa
    from llmso_lab.models.kv_sharing import kv_bytes, share_kv
    from llmso_lab.models.low_rank_kv import energy_kept, low_rank_kv
    from llmso_lab.quality import eval_token_ids, perplexity

    model, tok = load_model("smollm2-135m")
    cfg = model.config
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    ids = eval_token_ids(tok, 1024 if quick else 2687)   # the authored part (as recorded; Lab 06 grew the text)
    ppl = lambda m: perplexity(m, ids, window=1024)  # noqa: E731
    base_ppl = ppl(model)
    full_token = kv_cache_bytes(L, Hkv, D, 4, 1)
    svd = [{"rank": r, "perplexity": ppl(low_rank_kv(model, r)), "energy_kept": round(energy_kept(model, r), 4),
            "bytes_per_token_fp32": L * r * 4, "vs_full_kv": round(L * r * 4 / full_token, 3)}
           for r in tqdm(RANKS_QUICK if quick else RANKS_FULL, desc="svd ranks")]
    layout = [{"scheme": name, "perplexity": base_ppl if not kw else ppl(share_kv(model, **kw)),
               "kv_MB_8k": round(kv_bytes(L, Hkv, D, 8192, 4, **kw) / 1e6, 1),
               "kv_MB_32k": round(kv_bytes(L, Hkv, D, 32768, 4, **kw) / 1e6, 1)}
              for name, kw in tqdm(_layout_schemes(quick), desc="layouts")]
    mqa = [{"mqa": "mean of the 3 KV heads (GQA init)", "perplexity": ppl(to_mqa(model))},
           {"mqa": "KV head 0 only", "perplexity": ppl(_mqa_keep_first(model))}]
    by_rank = {r["rank"]: r["perplexity"] for r in svd}
    by_scheme = {r["scheme"]: r["perplexity"] for r in layout}
    return harness.result(   # no "command": the CLI records the command line it ran
        "kv-store", None, workload={"model": "smollm2-135m", "eval_tokens": len(ids), "ppl_window": 1024},
        baseline_perplexity=base_ppl, table=svd,
        tables={"layouts: KV bytes and perplexity": layout, "MQA two ways": mqa,
                "MLA vs MHA/MQA (engine caches)": mla_bytes()},
        ratios={**{f"ppl_rank{r}_over_full": by_rank[r] / base_ppl for r in by_rank},
                **{f"ppl_{k.replace(',', '').replace(' ', '_')}_over_full": v / base_ppl
                   for k, v in by_scheme.items() if k != "full (as trained)"}})
