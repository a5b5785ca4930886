"""The engine's MLA layers (DeepSeek-V2/V3 attention) over a latent paged cache.

Per token and layer the cache holds `[c_kv, k_pe]` (kv_lora_rank + qk_rope_head_dim numbers) in ONE tensor
`[num_blocks + 1, block_size, 1, r + dr]`; the value is its first r numbers (a view, never stored twice). The
attention backends see multi-query attention over it: query [q_nope_h @ W_UK[h], q_pe_h] per head, one KV head
(`llmso_lab.attention.mla` explains the absorption). Prefill and decode both run absorbed; W_UV is applied
to the attended latent, then o_proj. Math follows Hugging Face's DeepseekV3Attention (interleaved RoPE on the
small rotary part, RMSNorm on the latent, its softmax scale).

`MLAAttentionKind` plugs this into the model runner (its `attention_kind` seam; registered for DeepSeek-V3 in
`engine.features`): one "KV head" of r + dr numbers per token, the value its first r (`PagedKVStore(value_dim=r)`).
Its weights are not prepacked or quantized (`transforms_weights = False`); the features that assume separate K/V
heads (tensor parallelism, KV quantization, KV eviction, weight quantization) refuse MLA models in `EngineConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmso_lab.attention.mla import absorb_query
from llmso_lab.engine.ops import apply_rope, rms_norm, transposed


@dataclass(slots=True)
class MLAWeights:
    q: Tensor | None            # [hidden, H * (dn + dr)] (models without a query LoRA)
    q_a: Tensor | None          # [hidden, q_lora_rank] ...
    q_a_norm: Tensor | None
    q_a_eps: float
    q_b: Tensor | None          # ... [q_lora_rank, H * (dn + dr)]
    kv_a: Tensor                # [hidden, r + dr]: the latent and the rotary key, one matmul
    kv_a_norm: Tensor           # [r]
    kv_a_eps: float
    w_uk: Tensor                # [H, dn, r]: folded into the query
    w_uv: Tensor                # [H, dv, r]: applied to the attended latent
    o: Tensor                   # [H * dv, hidden]
    scale: float                # softmax scale: HF's (qk_nope + qk_rope)^-0.5, not (r + dr)^-0.5


@dataclass(slots=True)
class MLAShape:
    num_heads: int
    nope_dim: int       # dn
    rope_dim: int       # dr
    v_dim: int          # dv
    latent_dim: int     # r = kv_lora_rank
    interleave: bool    # DeepSeek's interleaved RoPE pairs

    @classmethod
    def from_config(cls, cfg) -> MLAShape:
        return cls(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.kv_lora_rank, bool(getattr(cfg, "rope_interleave", False)))

    @property
    def cache_dim(self) -> int:
        return self.latent_dim + self.rope_dim


def load_mla(attn, shape: MLAShape, dtype: torch.dtype, t) -> MLAWeights:
    """Weights of one HF DeepseekV3Attention; `t` turns an nn.Linear weight [out, in] into [in, out] in dtype."""
    H, dn, dv, r = shape.num_heads, shape.nope_dim, shape.v_dim, shape.latent_dim
    kv_b = attn.kv_b_proj.weight.detach().view(H, dn + dv, r)
    lora = attn.q_a_proj is not None
    return MLAWeights(
        q=None if lora else t(attn.q_proj.weight, dtype), q_a=t(attn.q_a_proj.weight, dtype) if lora else None,
        q_a_norm=attn.q_a_layernorm.weight.detach().to(dtype) if lora else None,
        q_a_eps=attn.q_a_layernorm.variance_epsilon if lora else 0.0,
        q_b=t(attn.q_b_proj.weight, dtype) if lora else None,
        kv_a=t(attn.kv_a_proj_with_mqa.weight, dtype), kv_a_norm=attn.kv_a_layernorm.weight.detach().to(dtype),
        kv_a_eps=attn.kv_a_layernorm.variance_epsilon,
        w_uk=kv_b[:, :dn].to(dtype).contiguous(), w_uv=kv_b[:, dn:].to(dtype).contiguous(),
        o=t(attn.o_proj.weight, dtype), scale=float(attn.scaling))


def rope_interleaved(x: Tensor, cos_half: Tensor, sin_half: Tensor) -> Tensor:
    """HF's `apply_rotary_pos_emb_interleave` for x [T, heads, dr], cos/sin_half [T, 1, dr/2]: pairs (x0, x1),
    (x2, x3), ... each rotated by one frequency, output laid out as [rotated evens, rotated odds]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos_half - x2 * sin_half, x2 * cos_half + x1 * sin_half], dim=-1)


@dataclass(slots=True)
class MLAAttention:
    """One MLA layer in the model runner's attention protocol (`project` -> cache write and attention -> `output`)."""
    w: MLAWeights
    shape: MLAShape
    sliding_window = None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] (normed) -> the absorbed query [T, H, r + dr], the key [T, 1, r + dr] (what the cache stores)
        and the value [T, 1, r] (a view of the key: the latent). cos/sin [T, 1, dr] (sin signed for `apply_rope`)."""
        q_nope, q_pe, key = self.queries_and_key(x, cos, sin)
        return absorb_query(q_nope, q_pe, self.w.w_uk), key, key[..., :self.shape.latent_dim]

    def queries_and_key(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] (normed) -> q_nope [T, H, dn], q_pe [T, H, dr] (rotated) and the cached key
        [T, 1, r + dr] = [c_kv, k_pe]: the query before W_UK is folded into it."""
        w, shape = self.w, self.shape
        T, H, dn, dr, r = x.shape[0], shape.num_heads, shape.nope_dim, shape.rope_dim, shape.latent_dim
        q = x @ w.q if w.q is not None else rms_norm(x @ w.q_a, w.q_a_norm, w.q_a_eps) @ w.q_b
        q = q.view(T, H, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        latent = x @ w.kv_a                                                   # [T, r + dr]
        c_kv = rms_norm(latent[:, :r], w.kv_a_norm, w.kv_a_eps)               # [T, r]
        k_pe = latent[:, None, r:]                                            # [T, 1, dr]
        if shape.interleave:
            half = dr // 2
            cos_h, sin_h = cos[..., :half], sin[..., half:]                   # the table is cat(f, f); sin unsigned there
            q_pe, k_pe = rope_interleaved(q_pe, cos_h, sin_h), rope_interleaved(k_pe, cos_h, sin_h)
        else:
            q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
        key = torch.cat([c_kv[:, None], k_pe], dim=-1)                        # [T, 1, r + dr]
        return q_nope, q_pe, key

    def output(self, o_latent: Tensor) -> Tensor:
        """The attended latent [T, H, r] -> W_UV -> [T, H, dv] -> o_proj -> [T, hidden]."""
        out = torch.einsum("thr,hvr->thv", o_latent, self.w.w_uv)
        return out.reshape(o_latent.shape[0], self.shape.num_heads * self.shape.v_dim) @ self.w.o

    def matrices(self) -> list:
        w = self.w
        return [m for m in (w.q, w.q_a, w.q_b, w.kv_a, w.o) if m is not None]


class MLAAttentionKind:
    """The model runner's `attention_kind` for DeepSeek-V2/V3 attention: a latent cache of r + dr numbers per token."""
    transforms_weights = False

    def __init__(self, cfg, group) -> None:
        self.shape = MLAShape.from_config(cfg)
        self.num_heads = cfg.num_attention_heads
        self.cache_heads, self.cache_dim, self.value_dim = 1, self.shape.cache_dim, self.shape.latent_dim

    def backend_args(self, model) -> dict:
        return dict(num_heads=self.num_heads, num_kv_heads=1, head_dim=self.cache_dim, v_head_dim=self.value_dim,
                    latent=True, scale=float(model.model.layers[0].self_attn.scaling))

    def load(self, layer, window: int | None, dtype: torch.dtype) -> tuple[MLAAttention, dict]:
        m = layer.mlp
        bias = lambda lin: getattr(lin, "bias", None)  # noqa: E731
        mlp = {"gate": m.gate_proj.weight, "up": m.up_proj.weight, "down": m.down_proj.weight,
               "gate_bias": bias(m.gate_proj), "up_bias": bias(m.up_proj), "down_bias": bias(m.down_proj)}
        return MLAAttention(load_mla(layer.self_attn, self.shape, dtype, transposed), self.shape), mlp


# ---- Lab 05's harness: a student's absorbed decode inside the engine -------------------------------------
def generate_with_decode(decode_fn, prompt_lens: list[int], max_tokens: int, seed: int = 0) -> dict:
    """Harness of Lab 05's `mla_decode_absorbed`: serve a tiny random DeepSeek-V3 (`tiny_deepseek_v3(seed=seed)`)
    on this engine with every decode token's attention computed by `decode_fn`.

    For each decode sequence and layer the engine calls `decode_fn(q_nope [1, H, dn], q_pe [1, H, dr] (rotated),
    c_kv [S, r], k_pe [S, dr], w_uk [H, dn, r], w_uv [H, dv, r], scale)`, with the sequence's S cached latents read
    from the paged cache through its block table, and uses the returned [1, H, dv] in place of its own attention
    (prefill stays on the engine's path). Greedy decoding of random prompts of `prompt_lens` tokens, batched.
    Returns {"tokens": per prompt, "equal_to_engine": tokens == the plain engine's, "equal_to_hf": tokens == Hugging
    Face's naive MLA (`generate`), "decode_calls": how many times decode_fn ran}."""
    from llmso_lab.attention.varlen import gather_paged_kv
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models.tiny import tiny_deepseek_v3

    model = tiny_deepseek_v3(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model, max_model_len=128).generate(prompts, params, use_tqdm=False)]

    llm = LLM(model, max_model_len=128)
    runner, state = llm.model_runner, {"calls": 0}
    r = runner.attention_kind.shape.latent_dim

    class StudentDecode:
        """Wraps one MLA layer: keeps q_nope/q_pe for the backend, and puts decode_fn's outputs in place of the
        engine's decode rows before o_proj."""
        sliding_window = None

        def __init__(self, attn: MLAAttention) -> None:
            self.attn = attn

        def project(self, x, cos, sin):
            q_nope, q_pe, key = self.attn.queries_and_key(x, cos, sin)
            state.update(attn=self.attn, q_nope=q_nope, q_pe=q_pe, decoded=None)
            return absorb_query(q_nope, q_pe, self.attn.w.w_uk), key, key[..., :r]

        def output(self, o_latent):
            w, out = self.attn.w, torch.einsum("thr,hvr->thv", o_latent, self.attn.w.w_uv)
            if state["decoded"] is not None:
                out = torch.cat([state["decoded"], out[state["decoded"].shape[0]:]])
            return out.reshape(out.shape[0], -1) @ w.o

        def matrices(self):
            return self.attn.matrices()

    def decode(q, k_cache, v_cache, meta, window):
        w, rows = state["attn"].w, []
        for b in range(q.shape[0]):
            cached = gather_paged_kv(k_cache, meta.block_tables[b], meta.context_lens_host[b])[:, 0]   # [S, r + dr]
            o = decode_fn(state["q_nope"][b:b + 1].clone(), state["q_pe"][b:b + 1].clone(), cached[:, :r].clone(),
                          cached[:, r:].clone(), w.w_uk.clone(), w.w_uv.clone(), w.scale)
            if not isinstance(o, Tensor) or tuple(o.shape) != (1, w.w_uv.shape[0], w.w_uv.shape[1]):
                raise ValueError(f"decode_fn returned {getattr(o, 'shape', type(o).__name__)}, expected "
                                 f"[1, H, dv] = [1, {w.w_uv.shape[0]}, {w.w_uv.shape[1]}]")
            rows.append(o.to(q.dtype))
            state["calls"] += 1
        state["decoded"] = torch.cat(rows)
        return q.new_zeros(q.shape[0], q.shape[1], r)   # unused: `output` takes decode_fn's rows

    for layer in runner.layers:
        layer.attn = StudentDecode(layer.attn)
    runner.backend._decode = decode
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return {"tokens": tokens, "equal_to_engine": tokens == plain,
            "equal_to_hf": tokens == [hf_greedy(model, p, max_tokens) for p in prompts], "decode_calls": state["calls"]}


def decode_exercise(decode_fn, what: str, *args):
    """Harness of Lab 05's `mla_decode_absorbed`. what="one token": `decode_fn(*args)` for one decode token (a
    tensor [1, H, dv]); what="engine": `generate_with_decode(decode_fn, *args)` (the function inside the engine)."""
    if what == "one token":
        return decode_fn(*args)
    if what == "engine":
        return generate_with_decode(decode_fn, *args)
    raise ValueError(f"what must be 'one token' or 'engine', got {what!r}")
