"""Model shapes: parameter counts, weight and KV-cache bytes, and FLOPs per token from a config.

A `ModelShape` is all the simulator and the roofline labs need to know about a decoder-only transformer:
attention with `num_kv_heads` K/V heads (MHA, GQA or MQA) or DeepSeek's multi-head latent attention (MLA),
a SwiGLU MLP, optionally sparse MoE (Mixtral; DeepSeek with shared experts and dense first layers).
Units: parameters, bytes, FLOPs. KV-cache bytes come from `llmso_lab.hardware` (the one home of that formula).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from llmso_lab import hardware

__all__ = ["ModelShape", "SMOLLM2_135M", "LLAMA3_8B", "LLAMA2_70B", "LLAMA3_70B", "MISTRAL_7B", "QWEN25_7B",
           "DEEPSEEK_V2", "DEEPSEEK_V3", "MODEL_SHAPES", "KV_SIZING_PRESETS", "kv_sizing_table"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Shape of a decoder-only transformer (Llama family, Qwen2, Mixtral, DeepSeek-V2/V3).

    MLA models (`kv_lora_rank > 0`): `head_dim` is the q.k width per head (qk_nope_head_dim +
    qk_rope_head_dim), `v_head_dim` the value width, and `num_kv_heads = num_heads` as in their HF configs
    (the decompressed form); the cache holds the latent instead (`kv_bytes_per_token`).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    mlp: str = "swiglu"           # gate, up and down projections
    num_experts: int = 0          # 0: dense MLP; >0: sparse MoE with a router
    experts_per_token: int = 0
    qkv_bias: bool = False        # biases on q, k and v (Qwen2)
    num_shared_experts: int = 0   # experts every token runs besides its routed ones (DeepSeek)
    moe_intermediate_size: int = 0   # one expert's width; 0: intermediate_size
    first_dense_layers: int = 0   # MoE models: the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)
    kv_lora_rank: int = 0         # MLA: width of the cached latent c_KV per layer; 0: plain K/V heads
    qk_rope_head_dim: int = 0     # MLA: width of the decoupled RoPE key (cached, shared by all heads)
    q_lora_rank: int = 0          # MLA: width of the query's low-rank bottleneck; 0: q straight from the hidden state
    v_head_dim: int = 0           # value width per head; 0: head_dim

    def __post_init__(self) -> None:
        assert self.mlp == "swiglu", f"only the 'swiglu' MLP is modelled, got {self.mlp!r}"
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert (self.num_experts == 0) == (self.experts_per_token == 0), "set both MoE fields or neither"
        assert (self.kv_lora_rank == 0) == (self.qk_rope_head_dim == 0), "MLA: set kv_lora_rank and qk_rope_head_dim"

    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> "ModelShape":
        """Build from a Hugging Face config object (LlamaConfig, Qwen2Config, MixtralConfig, DeepseekV3Config,
        ...) or its dict."""
        c: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        if c.get("kv_lora_rank"):   # MLA: q.k runs over the no-RoPE and the RoPE parts of each head
            head_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        return cls(
            name=name or c.get("_name_or_path") or c.get("model_type", "model"),
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            num_experts=c.get("num_local_experts") or c.get("n_routed_experts") or 0,
            experts_per_token=c.get("num_experts_per_tok") or 0,
            qkv_bias=c.get("model_type") == "qwen2",
            num_shared_experts=c.get("n_shared_experts") or 0,
            moe_intermediate_size=c.get("moe_intermediate_size") or 0,
            first_dense_layers=c.get("first_k_dense_replace") or 0,
            kv_lora_rank=c.get("kv_lora_rank") or 0, qk_rope_head_dim=c.get("qk_rope_head_dim") or 0,
            q_lora_rank=c.get("q_lora_rank") or 0, v_head_dim=c.get("v_head_dim") or 0,
        )

    @property
    def attention(self) -> str:
        """"MLA", "MHA" (a K/V head per query head), "MQA" (one K/V head) or "GQA" (groups share one)."""
        if self.kv_lora_rank:
            return "MLA"
        return "MHA" if self.num_kv_heads == self.num_heads else "MQA" if self.num_kv_heads == 1 else "GQA"

    # ---- parameters -------------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """One layer's attention: projections, plus q/k/v biases (Qwen2) or MLA's two latent RMSNorm weights."""
        return self._attn_matmul_params + self._attn_vector_params

    @property
    def _attn_matmul_params(self) -> int:
        h, H, D, Dv = self.hidden_size, self.num_heads, self.head_dim, self.v_head_dim or self.head_dim
        if not self.kv_lora_rank:   # q, k, v and o
            return h * (H * D + 2 * self.num_kv_heads * D) + H * Dv * h
        r, rope = self.kv_lora_rank, self.qk_rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * H * D if self.q_lora_rank else h * H * D
        kv_down = h * (r + rope)                     # hidden -> latent c_KV and the shared RoPE key
        kv_up = r * H * (D - rope + Dv)              # latent -> every head's no-RoPE key and value
        return q + kv_down + kv_up + H * Dv * h

    @property
    def _attn_vector_params(self) -> int:
        if self.kv_lora_rank:
            return self.q_lora_rank + self.kv_lora_rank     # RMSNorms on the two latents
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU MLP (gate, up, down); for a dense model, its one MLP."""
        return 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)

    @property
    def num_moe_layers(self) -> int:
        """Layers with a MoE MLP (all but `first_dense_layers`; 0 for a dense model)."""
        return self.num_layers - self.first_dense_layers if self.num_experts else 0

    def mlp_params(self, moe: bool = True, active: bool = False) -> int:
        """One layer's MLP. Dense (a dense model, or `moe=False`): one SwiGLU of intermediate_size. MoE: the
        routed experts (all, or the `experts_per_token` one token runs when `active`), the shared experts and
        the router [hidden, num_experts]."""
        if not (moe and self.num_experts):
            return 3 * self.hidden_size * self.intermediate_size
        routed = self.experts_per_token if active else self.num_experts
        return self.expert_params * (routed + self.num_shared_experts) + self.hidden_size * self.num_experts

    @property
    def head_params(self) -> int:
        """The LM head [vocab, hidden] (shared with the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one layer (a MoE layer in a MoE model); `active=True` counts only the experts one
        token uses."""
        return self.attn_params + self.mlp_params(True, active) + 2 * self.hidden_size  # + two RMSNorm weights

    def body_params(self, active: bool = False) -> int:
        """All layers: the dense ones and the MoE ones."""
        dense = self.num_layers - self.num_moe_layers
        return (self.num_layers * (self.attn_params + 2 * self.hidden_size) + dense * self.mlp_params(False)
                + self.num_moe_layers * self.mlp_params(True, active))

    @property
    def param_count(self) -> int:
        """All parameters: embedding, layers, final norm, and the head unless tied."""
        head = 0 if self.tie_word_embeddings else self.head_params
        return self.head_params + self.body_params() + self.hidden_size + head

    def body_matmul_params(self, active: bool = True) -> int:
        """Weights used in matmuls by every token: all layers' projections (norms and biases excluded)."""
        return self.body_params(active) - self.num_layers * (2 * self.hidden_size + self._attn_vector_params)

    def weight_bytes(self, bytes_per_param: float = 2) -> float:
        """Bytes of all weights (the memory footprint)."""
        return self.param_count * bytes_per_param

    def weight_bytes_read(self, num_tokens: int, bytes_per_param: float = 2) -> float:
        """Bytes of weights one forward over `num_tokens` tokens reads from memory.

        Dense: every weight once. MoE: the experts hit by at least one token, in expectation for
        uniform routing: E * (1 - (1 - k/E)^T) of E experts per layer.
        """
        if not self.num_experts:
            return self.weight_bytes(bytes_per_param)
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1 - (1 - k / e) ** max(num_tokens, 1))
        unused = (e - touched) * self.expert_params * self.num_moe_layers
        return (self.param_count - unused) * bytes_per_param

    # ---- KV cache and FLOPs -----------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_elem: float = 2) -> int:
        """KV-cache bytes one token adds: K and V of every KV head in every layer, or for MLA the latent
        c_KV + the shared RoPE key per layer (`hardware.kv_bytes_per_token` / `hardware.mla_kv_bytes_per_token`)."""
        if self.kv_lora_rank:
            return hardware.mla_kv_bytes_per_token(self.num_layers, self.kv_lora_rank, self.qk_rope_head_dim, bytes_per_elem)
        return hardware.kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_elem)

    def kv_cache_bytes(self, num_tokens: int, batch: int = 1, bytes_per_elem: float = 2) -> int:
        """KV-cache bytes of `batch` sequences of `num_tokens` tokens each (`hardware.kv_cache_bytes` or its MLA form)."""
        if self.kv_lora_rank:
            return hardware.mla_kv_cache_bytes(self.num_layers, self.kv_lora_rank, self.qk_rope_head_dim, bytes_per_elem,
                                               num_tokens, batch)
        return hardware.kv_cache_bytes(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_elem, num_tokens, batch)

    def attention_flops(self, context_len: int) -> int:
        """Score (QK^T) and value (PV) FLOPs of one query token over `context_len` keys, all layers
        (MLA: in its decompressed form, q.k over head_dim and PV over v_head_dim)."""
        return 2 * self.num_layers * self.num_heads * (self.head_dim + (self.v_head_dim or self.head_dim)) * context_len

    def flops_per_token(self, context_len: int = 0) -> int:
        """Forward FLOPs of one token: 2 x matmul params (active experts, head included) + attention."""
        return 2 * (self.body_matmul_params(active=True) + self.head_params) + self.attention_flops(context_len)

    def max_tokens_in(self, mem_bytes: float, bytes_per_param: float = 2, kv_bytes_per_elem: float = 2) -> int:
        """How many KV tokens fit beside the weights in `mem_bytes` (0 when the weights do not fit)."""
        free = mem_bytes - self.weight_bytes(bytes_per_param)
        return max(0, math.floor(free / self.kv_bytes_per_token(kv_bytes_per_elem)))

    def max_batch_in(self, mem_bytes: float, context_len: int, bytes_per_param: float = 2,
                     kv_bytes_per_elem: float = 2) -> int:
        """The most sequences of `context_len` tokens whose KV cache fits beside the weights in `mem_bytes`
        (0 when the weights alone do not fit). An upper bound: activations and the runtime take some memory too."""
        free = mem_bytes - self.weight_bytes(bytes_per_param)
        return max(0, math.floor(free / self.kv_cache_bytes(context_len, 1, kv_bytes_per_elem)))


# Published configs (each model's config.json on its Hugging Face page). Llama 3.1 8B / 70B have the same shapes
# as Llama 3 (with a 128K context); Mistral-7B-v0.3 has no sliding window (v0.1 has a 4096-token window).
SMOLLM2_135M = ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True)
LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA2_70B = ModelShape("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000)
LLAMA3_70B = ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256)
MISTRAL_7B = ModelShape("Mistral-7B-v0.3", 32, 4096, 32, 8, 128, 14336, 32768)
QWEN25_7B = ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True)
DEEPSEEK_V2 = ModelShape("DeepSeek-V2", 60, 5120, 128, 128, 192, 12288, 102400, num_experts=160, experts_per_token=6,
                         num_shared_experts=2, moe_intermediate_size=1536, first_dense_layers=1,
                         kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536, v_head_dim=128)
DEEPSEEK_V3 = ModelShape("DeepSeek-V3", 61, 7168, 128, 128, 192, 18432, 129280, num_experts=256, experts_per_token=8,
                         num_shared_experts=1, moe_intermediate_size=2048, first_dense_layers=3,
                         kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536, v_head_dim=128)
MODEL_SHAPES: dict[str, ModelShape] = {s.name.lower(): s for s in (
    SMOLLM2_135M, LLAMA3_8B, LLAMA2_70B, LLAMA3_70B, MISTRAL_7B, QWEN25_7B, DEEPSEEK_V2, DEEPSEEK_V3)}
KV_SIZING_PRESETS = (LLAMA3_8B, LLAMA3_70B, MISTRAL_7B, QWEN25_7B, DEEPSEEK_V2, DEEPSEEK_V3, SMOLLM2_135M)


def kv_sizing_table(shapes: Sequence[ModelShape] = KV_SIZING_PRESETS, context_lens: Sequence[int] = (8192, 32768, 131072),
                    accelerators: Sequence[str] = ("H100-SXM", "H200"), bytes_per_param: float = 2,
                    kv_bytes_per_elem: float = 2) -> list[dict]:
    """One row per model: its attention, KV bytes per token, KV GB (1e9 bytes) of one sequence at each of
    `context_lens`, weight GB, and on each accelerator the most such sequences that fit beside the weights
    (0: the weights alone do not fit). Default: bf16 weights and KV cache; contexts 8K / 32K / 128K."""
    rows = []
    for m in shapes:
        kv_heads = f"latent {m.kv_lora_rank}+{m.qk_rope_head_dim}" if m.kv_lora_rank else m.num_kv_heads
        row: dict = {"model": m.name, "attention": m.attention, "layers": m.num_layers, "q_heads": m.num_heads,
                     "kv_heads": kv_heads, "kv_bytes_per_token": m.kv_bytes_per_token(kv_bytes_per_elem)}
        for n in context_lens:
            row[f"kv_GB_{n // 1024}K"] = round(m.kv_cache_bytes(n, 1, kv_bytes_per_elem) / 1e9, 3)
        row["weights_GB"] = round(m.weight_bytes(bytes_per_param) / 1e9, 1)
        for name in accelerators:
            acc = hardware.get_accelerator(name)
            for n in context_lens:
                row[f"max_batch_{name}_{n // 1024}K"] = m.max_batch_in(acc.mem_bytes, n, bytes_per_param, kv_bytes_per_elem)
        rows.append(row)
    return rows
