"""Model shapes: parameter counts, weight and KV-cache bytes, and FLOPs per token from a config.

A `ModelShape` is all the simulator and the roofline labs need to know about a Llama-family model
(GQA attention, SwiGLU MLP, optional sparse MoE). Units: parameters, bytes, FLOPs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from llmso_lab import hardware

__all__ = ["ModelShape", "SMOLLM2_135M", "LLAMA3_8B", "LLAMA2_70B", "LLAMA3_70B", "MODEL_SHAPES"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Shape of a decoder-only Llama-family transformer."""

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

    def __post_init__(self) -> None:
        assert self.mlp == "swiglu", f"only the 'swiglu' MLP is modelled, got {self.mlp!r}"
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert (self.num_experts == 0) == (self.experts_per_token == 0), "set both MoE fields or neither"

    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> "ModelShape":
        """Build from a Hugging Face config object (LlamaConfig, MixtralConfig, ...) or its dict."""
        c: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
        heads = c["num_attention_heads"]
        return cls(
            name=name or c.get("_name_or_path") or c.get("model_type", "model"),
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            num_experts=c.get("num_local_experts") or 0, experts_per_token=c.get("num_experts_per_tok") or 0,
        )

    # ---- parameters -------------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """q, k, v and o projections of one layer (no biases)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size

    @property
    def expert_params(self) -> int:
        """One SwiGLU MLP (gate, up, down) of one layer."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def head_params(self) -> int:
        """The LM head [vocab, hidden] (shared with the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one layer; `active=True` counts only the experts one token uses."""
        experts = self.experts_per_token if active else self.num_experts
        mlp = self.expert_params * experts + self.hidden_size * self.num_experts if self.num_experts else self.expert_params
        return self.attn_params + mlp + 2 * self.hidden_size  # + two RMSNorm weights

    @property
    def param_count(self) -> int:
        """All parameters: embedding, layers, final norm, and the head unless tied."""
        head = 0 if self.tie_word_embeddings else self.head_params
        return self.head_params + self.num_layers * self.layer_params() + self.hidden_size + head

    def body_matmul_params(self, active: bool = True) -> int:
        """Weights used in matmuls by every token: all layers' projections (norms excluded)."""
        return self.num_layers * (self.layer_params(active) - 2 * self.hidden_size)

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
        unused = (e - touched) * self.expert_params * self.num_layers
        return (self.param_count - unused) * bytes_per_param

    # ---- KV cache and FLOPs -----------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_elem: float = 2) -> int:
        """KV-cache bytes one token adds (K and V, every layer, every KV head)."""
        return hardware.kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_elem)

    def attention_flops(self, context_len: int) -> int:
        """Score (QK^T) and value (PV) FLOPs of one query token over `context_len` keys, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context_len

    def flops_per_token(self, context_len: int = 0) -> int:
        """Forward FLOPs of one token: 2 x matmul params (active experts, head included) + attention."""
        return 2 * (self.body_matmul_params(active=True) + self.head_params) + self.attention_flops(context_len)

    def max_tokens_in(self, mem_bytes: float, bytes_per_param: float = 2, kv_bytes_per_elem: float = 2) -> int:
        """How many KV tokens fit beside the weights in `mem_bytes` (0 when the weights do not fit)."""
        free = mem_bytes - self.weight_bytes(bytes_per_param)
        return max(0, math.floor(free / self.kv_bytes_per_token(kv_bytes_per_elem)))


SMOLLM2_135M = ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True)
LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA2_70B = ModelShape("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000)
LLAMA3_70B = ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256)
MODEL_SHAPES: dict[str, ModelShape] = {s.name.lower(): s for s in (SMOLLM2_135M, LLAMA3_8B, LLAMA2_70B, LLAMA3_70B)}
