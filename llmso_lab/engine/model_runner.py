"""Model runner: step 4 of the loop. Runs Hugging Face Llama-family weights itself on one flattened batch.

Supported: Llama (SmolLM2), Mistral (sliding window), Qwen2 (q/k/v bias), and DeepSeek-V3's MLA attention with
dense MLPs (`llmso_lab.engine.mla`: a latent cache, absorbed attention). Llama family: embed -> L x [RMSNorm ->
fused QKV -> RoPE -> paged-cache write -> attention -> o_proj -> residual -> RMSNorm -> fused gate/up ->
SwiGLU -> down -> residual] -> RMSNorm -> LM head (tied or not). Weights are read once from the HF module
(q/k/v and gate/up concatenated so each is a single matmul) and cast to the engine's dtype; the HF forward is
never called. In bf16/fp16, as in Hugging Face: weights, activations and the KV cache in that dtype; RMSNorm's
statistics, RoPE's tables (then cast) and the returned logits in fp32; softmax inside SDPA accumulates in fp32.
The KV cache is `[num_layers][num_blocks + 1, block_size, Hkv, D]` for K and for V; the extra last block
is the null block that padding tokens write to.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from llmso_lab.engine.attention import AttentionMetadata, make_attention_backend
from llmso_lab import hardware as hw
from llmso_lab.engine.kv_cache import KiviBlockEvents, layer_caches
from llmso_lab.engine.mla import MLAShape, MLAWeights, load_mla, mla_layer
from llmso_lab.kv.quant import QuantizedPagedKV, kv_bytes_per_token

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig
    from llmso_lab.engine.scheduler import SchedulerOutput

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v3")


@dataclass(slots=True)
class LayerWeights:
    input_norm: Tensor            # [hidden]
    qkv: Tensor | None            # [hidden, (H + 2 Hkv) * D]: q, k, v projections in one matmul (None: MLA)
    qkv_bias: Tensor | None       # Qwen2
    o: Tensor | None              # [H * D, hidden]
    o_bias: Tensor | None
    post_norm: Tensor             # [hidden]
    gate_up: Tensor               # [hidden, 2 * I]: gate and up projections in one matmul
    gate_up_bias: Tensor | None
    down: Tensor                  # [I, hidden]
    down_bias: Tensor | None
    sliding_window: int | None    # Mistral / Qwen2 sliding-window layers
    mla: MLAWeights | None = None  # DeepSeek MLA attention instead of qkv / o


@dataclass(slots=True)
class BatchRow:
    """One sequence's part of a forward: `token_ids` computed at positions start.. (their K/V written through
    `block_table`), `num_pad` padding tokens after them (static batching), logits for the last `num_logits`.
    `num_evicted` (kv_eviction): tokens dropped from the cache before `start` (`kv.streaming`); the row's tokens
    sit at cache index position - num_evicted, while RoPE still gets their positions."""
    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1
    num_pad: int = 0
    idle: bool = False     # static batching: a finished row, computed on one padding token
    num_evicted: int = 0

    @property
    def num_query_tokens(self) -> int:
        return 1 if self.idle else len(self.token_ids) + self.num_pad


def _cat(*ts: Tensor | None) -> Tensor | None:
    return None if ts[0] is None else torch.cat([t.detach() for t in ts]).contiguous()


def _t(w: Tensor, dtype: torch.dtype) -> Tensor:
    """HF Linear weight [out, in] -> [in, out] contiguous in `dtype`: `x @ w` is then ~15% faster on CPU for few rows."""
    return w.detach().to(dtype).t().contiguous()


def linear(x: Tensor, w_t, bias: Tensor | None = None) -> Tensor:
    """x [T, in] @ w_t [in, out] (+ bias) -> [T, out]. `w_t` may instead be a weight-only quantized matmul
    (`llmso_lab.quant.weight_only`), called on x."""
    if not isinstance(w_t, Tensor):
        y = w_t(x)
        return y if bias is None else y + bias
    return x @ w_t if bias is None else torch.addmm(bias, x, w_t)


class OneDNNLinear:
    """A weight prepacked once into oneDNN's blocked layout for its linear kernel (what PyTorch's CPU compiler emits,
    and what vLLM's CPU backend does at load: `onednn_mm`): x [T, in] -> [T, out]. bf16: on CPUs with AMX /
    AVX512-BF16 the plain `x @ w` takes a slow matrix-vector path for a few rows (batch-1 decode ran at half fp32's
    speed although it reads half the bytes). fp32: the packed kernel ran SmolLM2's gate/up matrix ~1.9x faster at 1
    row, ~1.3x at 16 and ~1.2x at 512 than `x @ w` here (Lab 01, section 9), so it is used where a quick measurement
    on this CPU says it wins (`hardware.packed_fp32_speedup`). `llmso-lab bench precision` reports which kernel ran."""

    def __init__(self, w_t: Tensor) -> None:
        self.shape, self.dtype = tuple(w_t.shape), w_t.dtype   # [in, out], as the engine's other weights
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w_t.t().contiguous(), 1)   # [out, in], blocked layout

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        """A CPU with PyTorch's oneDNN build, and: bf16 that the CPU multiplies natively, or fp32 where the packed
        kernel measured faster than `x @ w` (`hardware.packed_fp32_speedup` >= 1.1 at 16 rows, x86-64 only)."""
        if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            return False
        if dtype == torch.float32:
            return hw.packed_fp32_speedup() >= 1.1
        return dtype == torch.bfloat16 and hw.native_matmul(dtype, "cpu")[0]


def rope_cos_sin(config, max_positions: int) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_positions, D] in fp32, as HF's rotary embedding computes them."""
    params = getattr(config, "rope_parameters", None)
    if not params:   # transformers 4.x keeps them in rope_theta + rope_scaling
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = 1.0
    if rope_type == "llama3":   # Llama 3.1: stretch low frequencies by `factor`, blend the middle band
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        inv_freq = torch.where(is_mid, smoothed, scaled)
    elif rope_type != "default":   # linear, dynamic, yarn, longrope: use HF's own initialiser
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]    # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                      # [P, D]
    return emb.cos() * scaling, emb.sin() * scaling


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale (bitwise equal to HF's module).
    (`F.rms_norm` gives the same bits in fp32 but launches more kernels: it is slower for decode batches.)"""
    h = x.float()
    h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)   # h * h: the same bits as HF's h.pow(2), and on
    return weight * h.to(x.dtype)                               # CPU ~10x cheaper for one token (pow is slow there)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, D], cos/signed_sin [T, 1, D]. HF's `x * cos + rotate_half(x) * sin` with
    rotate_half(x) = cat(-x2, x1) = swap_halves(x) * [-1.., +1..]: the sign lives in `signed_sin` (bitwise
    equal). Swapping the halves is one flip of a [.., 2, D/2] view: one kernel instead of roll's three."""
    T, heads, D = x.shape
    swapped = x.reshape(T, heads, 2, D // 2).flip(2).view(T, heads, D)
    return x * cos + swapped * signed_sin


class BatchBuilder:
    """Turns scheduled sequences into one flattened varlen batch for `forward`. Needs only the block size, the
    null block and the device: the tensor-parallel executor (`llmso_lab.parallel.tensor`) builds batches in the
    driver process this way and ships them to the ranks that hold the weights."""

    block_size: int
    null_block: int
    device: torch.device

    # ---- batch construction ------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Flatten the scheduled sequences into one varlen batch (the scheduler put the one-token rows first).
        A speculative decode row computes its last token and its draft tokens, and returns logits at all of them."""
        rows = []
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            if item.idle:   # static batching: a finished row is still computed, on a padding token
                rows.append(BatchRow([], start, seq.block_table, 1, 1, idle=True))
            else:
                tokens = seq.token_ids[start:start + item.num_new_tokens - len(item.spec_token_ids)] + item.spec_token_ids
                logits = (1 + len(item.spec_token_ids)) if item.sample else 0
                rows.append(BatchRow(tokens, start, seq.block_table, logits, item.num_pad_tokens,
                                     num_evicted=seq.num_evicted_blocks * self.block_size))
        return self.prepare_rows(rows, out.num_decodes)

    def prepare_rows(self, rows: list[BatchRow], num_decodes: int) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """The varlen batch for `rows` (the first `num_decodes` of them one token each): input ids, positions,
        attention metadata, and the indices of the tokens whose logits `forward` returns. Positions are the tokens'
        places in their sequence; slots, start positions, context lengths and block tables count tokens in the cache
        (fewer under kv_eviction: `BatchRow.num_evicted`)."""
        bs, null_slot = self.block_size, self.null_block * self.block_size
        ids, pos, slots, logit_rows = [], [], [], []
        starts, qlens, ctxs, tables = [], [], [], []
        for row in rows:
            start, table = row.start - row.num_evicted, row.block_table   # in cache coordinates
            ctx = start + len(row.token_ids)
            new = range(start, ctx)
            ids += row.token_ids + [0] * row.num_pad
            pos += list(range(row.start, row.start + len(row.token_ids))) + [0] * row.num_pad
            slots += [table[p // bs] * bs + p % bs for p in new] + [null_slot] * row.num_pad
            last = len(ids) - 1 - (0 if row.idle else row.num_pad)
            logit_rows += range(last - row.num_logits + 1, last + 1)   # the last real tokens (idle: the padding)
            starts.append(start)
            qlens.append(row.num_query_tokens)
            ctxs.append(ctx)
            tables.append(table[:-(-ctx // bs)])
        assert all(q == 1 for q in qlens[:num_decodes]), "the decode rows must come first"
        width = max(map(len, tables))
        i32, i64, dev = torch.int32, torch.int64, self.device
        block_tables = torch.tensor([t + [self.null_block] * (width - len(t)) for t in tables], dtype=i32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=i64, device=dev), block_tables=block_tables,
            context_lens=torch.tensor(ctxs, dtype=i32, device=dev),
            cu_seqlens_q=torch.tensor([0] + qlens, dtype=i32, device=dev).cumsum(0, dtype=i32),
            cu_seqlens_k=torch.tensor([0] + ctxs, dtype=i32, device=dev).cumsum(0, dtype=i32),
            num_decodes=num_decodes, max_seqlen_q=max(qlens), max_seqlen_k=max(ctxs),
            start_positions=starts, query_lens=qlens, context_lens_host=ctxs)
        return (torch.tensor(ids, dtype=i64, device=dev), torch.tensor(pos, dtype=i64, device=dev), meta,
                torch.tensor(logit_rows, dtype=i64, device=dev))

    def execute(self, out: SchedulerOutput) -> Tensor:
        """One forward over the scheduled batch. Returns fp32 logits [N, V], one row per sampling sequence
        (and per idle static row), in the order of `out.scheduled`."""
        return self.forward(*self.prepare(out))

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices: Tensor,
                inputs_embeds: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def commit_kv(self, out: SchedulerOutput) -> None:
        """After a step: settle the KV cache's state (a KIVI cache quantizes what left its window). Plain: nothing."""


class ModelRunner(BatchBuilder):
    """Step 4 for one model: its weights, the paged KV cache and swap pool sized by the (resolved) `EngineConfig`."""

    def __init__(self, model, config: EngineConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        cfg, block_size, num_kv_blocks = model.config, config.block_size, config.num_kv_blocks
        max_model_len = config.max_model_len
        check_model_config(cfg)
        self.num_layers, self.num_heads, self.num_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Tensor parallelism (`llmso_lab.parallel.tensor`): this runner holds rank tp_rank's heads and MLP slice,
        # and sums the row-parallel outputs (o_proj, down_proj) over the ranks: two all-reduces per layer.
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_all_reduces, self.all_reduce_s, self.num_forwards, self.forward_s = 0, 0.0, 0, 0.0
        if tp_size > 1:
            from llmso_lab.parallel.tensor import head_slices
            q_heads, kv_heads = head_slices(self.num_heads, self.num_kv_heads, tp_rank, tp_size)
            self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)
        self.eps, self.vocab_size = cfg.rms_norm_eps, cfg.vocab_size
        self.dtype, self.device = config.torch_dtype, model.get_input_embeddings().weight.device
        self.block_size, self.null_block = block_size, num_kv_blocks
        self.mla = MLAShape.from_config(cfg) if cfg.model_type == "deepseek_v3" else None
        if self.mla is None:
            self.backend = make_attention_backend(config.attention_backend, num_heads=self.num_heads,
                                                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=block_size)
        else:   # the latent cache: one "KV head" of r + dr numbers per token, the value its first r
            self.num_kv_heads, self.head_dim = 1, self.mla.cache_dim
            self.backend = make_attention_backend(
                config.attention_backend, num_heads=self.num_heads, num_kv_heads=1, head_dim=self.mla.cache_dim,
                block_size=block_size, v_head_dim=self.mla.latent_dim, latent=True,
                scale=float(model.model.layers[0].self_attn.scaling))
        windows = sliding_windows(cfg, max_model_len)
        with torch.no_grad():
            self.layers = [self._load_layer(layer, w, self.mla) for layer, w in zip(model.model.layers, windows)]
            self.embed = model.get_input_embeddings().weight.detach().to(self.dtype)   # [V, hidden]
            self.final_norm = model.model.norm.weight.detach().to(self.dtype)
            self.lm_head = _t(model.get_output_embeddings().weight, self.dtype)       # [hidden, V] (a copy even when tied)
            if config.quantization:
                self._quantize_weights(config.quantization, config.quantization_group_size)
            elif self.mla is None and OneDNNLinear.available(self.dtype, self.device):
                for w in self.layers:
                    w.qkv, w.o, w.gate_up, w.down = (OneDNNLinear(m) for m in (w.qkv, w.o, w.gate_up, w.down))
                self.lm_head = OneDNNLinear(self.lm_head)
            cos, sin = rope_cos_sin(cfg, max_model_len)
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)                   # signed for apply_rope
            self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)   # [max_model_len, D]
        shape = (self.num_layers, num_kv_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        swap_shape = (self.num_layers, config.swap_space_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_store: QuantizedPagedKV | None = None   # kv_cache_dtype != "auto": the compressed cache
        if config.kv_cache_dtype != "auto":
            self._quantized_kv_cache(config)
        elif self.mla is None:
            self.k_cache, self.v_cache = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            self.k_swap, self.v_swap = (torch.zeros(swap_shape, dtype=self.dtype) for _ in range(2))   # host memory
        else:   # one latent tensor; the "V cache" is a view of its first r numbers (nothing stored twice)
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_cache = self.k_cache[..., :self.mla.latent_dim]
            self.k_swap = torch.zeros(swap_shape, dtype=self.dtype)
            self.v_swap = self.k_swap[..., :self.mla.latent_dim]
        if self.kv_store is None:
            self.layer_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0)))   # per-layer views, made once
            self.cache_pairs = [(self.k_cache, self.k_swap)] + ([(self.v_cache, self.v_swap)] if self.mla is None else [])
        self.kv_hook = None   # called with the layer index once that layer's KV is written (`llmso_lab.disagg`)
        self.last_hidden: Tensor | None = None   # the final-normed hidden states of the last forward's logits rows
        self.feature_cache = None   # EAGLE: every token's final-normed hidden state, paged like the KV cache
        if config.spec is not None and config.spec.method == "eagle":
            hidden = cfg.hidden_size
            self.feature_cache = torch.zeros(1, num_kv_blocks + 1, block_size, hidden, dtype=self.dtype, device=self.device)
            self.cache_pairs.append((self.feature_cache, torch.zeros(1, config.swap_space_blocks, block_size, hidden,
                                                                    dtype=self.dtype)))

    def _quantized_kv_cache(self, config: EngineConfig) -> None:
        """The cache as a `QuantizedPagedKV` (codes + scales, `engine.kv_cache`) instead of plain K/V tensors: the backends get
        per-layer `LayerKV` objects, swapping and copy-on-write copy every per-block tensor (codes AND scales)."""
        kivi = config.kv_cache_dtype.startswith("kivi")
        self.k_cache = self.v_cache = self.k_swap = self.v_swap = None
        self.kv_store = QuantizedPagedKV(
            config.kv_cache_dtype, self.num_layers, self.null_block + 1, self.block_size, self.num_kv_heads,
            self.head_dim, self.dtype, fp8_scales=config.kv_fp8_scales, device=self.device,
            residual_length=config.kivi_residual_length if kivi else 0,
            num_window_blocks=config.kivi_window_blocks if kivi else None)
        self.layer_caches = layer_caches(self.kv_store, config.calculate_kv_scales)
        raw = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in self.kv_store.per_block.values()]  # fp8: bytes
        self.cache_pairs = [(t, torch.zeros((t.shape[0], config.swap_space_blocks, *t.shape[2:]), dtype=t.dtype))
                            for t in raw]

    def commit_kv(self, out: SchedulerOutput) -> None:
        """After a step (KIVI): quantize the blocks of the sequences that advanced once they leave the window."""
        if self.kv_store is None or not self.kv_store.fmt.name.startswith("kivi"):
            return
        for item in out.scheduled:
            seq = item.seq
            if not item.idle and seq.block_table:
                self.kv_store.commit(torch.tensor(seq.block_table), seq.num_computed_tokens)

    def _load_layer(self, layer, window: int | None, mla: MLAShape | None = None) -> LayerWeights:
        dtype = self.dtype
        cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        if mla is not None:
            m = layer.mlp
            bias = lambda lin: getattr(lin, "bias", None)  # noqa: E731
            return LayerWeights(
                input_norm=cast(layer.input_layernorm.weight), qkv=None, qkv_bias=None, o=None, o_bias=None,
                post_norm=cast(layer.post_attention_layernorm.weight),
                gate_up=_t(_cat(m.gate_proj.weight, m.up_proj.weight), dtype),
                gate_up_bias=cast(_cat(bias(m.gate_proj), bias(m.up_proj))),
                down=_t(m.down_proj.weight, dtype), down_bias=cast(_cat(bias(m.down_proj))), sliding_window=window,
                mla=load_mla(layer.self_attn, mla, dtype, _t))
        from llmso_lab.parallel.tensor import shard_llama_layer   # tp_size 1: the whole layer
        w = shard_llama_layer(layer, self.tp_rank, self.tp_size, self.head_dim)
        return LayerWeights(
            input_norm=cast(layer.input_layernorm.weight),
            qkv=_t(_cat(w["q"], w["k"], w["v"]), dtype), qkv_bias=cast(_cat(w["q_bias"], w["k_bias"], w["v_bias"])),
            o=_t(w["o"], dtype), o_bias=cast(w["o_bias"]),
            post_norm=cast(layer.post_attention_layernorm.weight),
            gate_up=_t(_cat(w["gate"], w["up"]), dtype), gate_up_bias=cast(_cat(w["gate_bias"], w["up_bias"])),
            down=_t(w["down"], dtype), down_bias=cast(w["down_bias"]), sliding_window=window)

    def _quantize_weights(self, method: str, group_size: int) -> None:
        """Weight-only quantization of every matmul (q/k/v, o, gate/up, down, LM head); the embedding lookup,
        norms and the KV cache stay in the engine's dtype."""
        from llmso_lab.quant.weight_only import quantize_weight
        if self.mla is not None:
            raise ValueError("quantization is implemented for Llama-family attention, not MLA; use quantization=None")
        q = lambda w_t: quantize_weight(w_t.t().float(), method, group_size=group_size)  # noqa: E731  [in, out] -> [out, in]
        for w in self.layers:
            w.qkv, w.o, w.gate_up, w.down = q(w.qkv), q(w.o), q(w.gate_up), q(w.down)
        self.lm_head = q(self.lm_head)

    def weight_matrices(self) -> list[Tensor]:
        """The matrices one forward multiplies by, in order: q/k/v, o, gate/up, down per layer, then the LM head."""
        attn = lambda w: (w.qkv, w.o) if w.mla is None else tuple(  # noqa: E731
            m for m in (w.mla.q, w.mla.q_a, w.mla.q_b, w.mla.kv_a, w.mla.o) if m is not None)
        return [m for w in self.layers for m in (*attn(w), w.gate_up, w.down)] + [self.lm_head]

    # ---- the forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices: Tensor,
                inputs_embeds: Tensor | None = None) -> Tensor:
        """Logits [N, V] fp32 at `logits_indices`; their final-normed hidden states are kept in `last_hidden`.
        `inputs_embeds` [T, hidden] replaces the embedding lookup (an EAGLE head feeds its own inputs)."""
        t_start = time.perf_counter()
        T, H, Hkv, D = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        h = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds.to(self.dtype)   # [T, hidden]
        cos = self.cos.index_select(0, positions)[:, None]                      # [T, 1, D]
        sin = self.sin.index_select(0, positions)[:, None]
        self.backend.plan(meta)
        for i, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, self.layer_caches)):
            x = rms_norm(h, w.input_norm, self.eps)
            if w.mla is not None:
                h = h + mla_layer(x, w.mla, self.mla, self.backend, k_cache, v_cache, meta, cos, sin, rms_norm, apply_rope)
                if self.kv_hook is not None:
                    self.kv_hook(i)
                x = rms_norm(h, w.post_norm, self.eps)
                gate, up = linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
                h = h + linear(F.silu(gate) * up, w.down, w.down_bias)
                continue
            qkv = linear(x, w.qkv, w.qkv_bias)                               # [T, (H + 2 Hkv) * D]
            qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin)   # q and k heads in one go
            q, k = qk[:, :H], qk[:, H:]                                      # [T, H, D], [T, Hkv, D]
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            self.backend.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
            if self.kv_hook is not None:   # disaggregation: layer i's KV is complete, ship it while i + 1 computes
                self.kv_hook(i)
            o = self.backend.forward(q, k, v, k_cache, v_cache, meta, w.sliding_window)  # [T, H, D]
            h = h + self.all_reduce(linear(o.reshape(T, H * D), w.o, w.o_bias))   # TP: sum the ranks' partials
            x = rms_norm(h, w.post_norm, self.eps)
            gate, up = linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)     # [T, I] each (TP: I / tp)
            h = h + self.all_reduce(linear(F.silu(gate) * up, w.down, w.down_bias))
        if self.feature_cache is not None:   # every token's feature, for the EAGLE head (rejected drafts' are overwritten later)
            features = rms_norm(h, self.final_norm, self.eps)
            self.feature_cache.view(-1, features.shape[-1]).index_copy_(0, meta.slot_mapping, features)
            h = features.index_select(0, logits_indices)
        else:
            h = rms_norm(h.index_select(0, logits_indices), self.final_norm, self.eps)   # [N, hidden]
        self.last_hidden = h
        logits = linear(h, self.lm_head).float() if self.tp_rank == 0 else None   # [N, V] (TP: rank 0 only)
        self.num_forwards += 1
        self.forward_s += time.perf_counter() - t_start
        return logits

    def all_reduce(self, partial: Tensor) -> Tensor:
        """Sum a row-parallel output over the tensor-parallel ranks, in place (gloo), counted and timed."""
        if self.tp_size == 1:
            return partial
        import torch.distributed as dist
        t0 = time.perf_counter()
        dist.all_reduce(partial)
        self.all_reduce_s += time.perf_counter() - t0
        self.num_all_reduces += 1
        return partial

    # ---- swapping ----------------------------------------------------------------------------
    @torch.inference_mode()
    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to the swap pool: mapping [(device block, swap block)]."""
        if mapping:
            src, dst = (torch.tensor(x) for x in zip(*mapping))
            for cache, pool in self.cache_pairs:
                pool.index_copy_(1, dst, cache.index_select(1, src.to(self.device)).cpu())

    @torch.inference_mode()
    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy device blocks to device blocks, mapping [(source block, destination block)]."""
        if mapping and self.kv_store is not None:   # every per-block tensor, and KIVI's window / sealed state
            self.kv_store.copy_blocks(mapping)
        elif mapping:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*mapping))
            for cache, _ in self.cache_pairs:
                cache.index_copy_(1, dst, cache.index_select(1, src))

    @torch.inference_mode()
    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy swap blocks back to device blocks: mapping [(swap block, device block)]."""
        if mapping:
            src, dst = (torch.tensor(x) for x in zip(*mapping))
            for cache, pool in self.cache_pairs:
                cache.index_copy_(1, dst.to(self.device), pool.index_select(1, src).to(self.device))


def check_model_config(cfg) -> None:
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; valid: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; the engine implements SwiGLU (silu)")
    if cfg.model_type == "deepseek_v3":
        if cfg.first_k_dense_replace < cfg.num_hidden_layers:
            raise ValueError(f"this DeepSeek config has MoE layers (first_k_dense_replace={cfg.first_k_dense_replace} < "
                             f"num_hidden_layers={cfg.num_hidden_layers}); the engine serves MLA with dense MLPs: set "
                             "first_k_dense_replace = num_hidden_layers")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"MLA with rope_type {rope.get('rope_type')!r} is not supported; use rope_scaling=None")


def sliding_windows(cfg, max_model_len: int) -> list[int | None]:
    """Per-layer sliding window (None = full attention); a window that covers max_model_len is dropped."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or window >= max_model_len:
        return [None] * cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    return [window if t == "sliding_attention" else None for t in types] if types else [window] * cfg.num_hidden_layers


def kv_cache_bytes_per_block(cfg, block_size: int, dtype: torch.dtype, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block (`block_size` tokens, every layer) on one rank: `hardware.kv_cache_bytes` over the
    rank's KV heads (`parallel.heads.shard_heads` at tensor-parallel size `tp`), or its MLA form (one latent
    [c_kv, k_pe] per token and layer, no separate V). A quantized `kv_cache_dtype`: what the store's own per-block
    tensors (codes, scales, zero points) take (`kv.quant.kv_bytes_per_token`)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    if kv_cache_dtype != "auto":
        per_token = kv_bytes_per_token(kv_cache_dtype, cfg.num_key_value_heads, _head_dim(cfg), cfg.num_hidden_layers,
                                       block_size, dtype)
        return round(per_token * block_size)
    if cfg.model_type == "deepseek_v3":
        return hw.mla_kv_cache_bytes(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, elem, block_size)
    head_dim = _head_dim(cfg)
    kv_heads = cfg.num_key_value_heads
    if tp > 1:
        from llmso_lab.parallel.heads import shard_heads
        kv_heads = shard_heads(cfg.num_attention_heads, kv_heads, tp).kv_heads_per_rank
    return hw.kv_cache_bytes(cfg.num_hidden_layers, kv_heads, head_dim, elem, block_size)


def kv_cache_fixed_bytes(cfg, block_size: int, dtype: torch.dtype, kv_cache_dtype: str, num_window_blocks: int) -> int:
    """Bytes of a quantized cache that do not grow with its blocks (KIVI's window pool, FP8's static scales),
    measured on a store built on the meta device (no memory)."""
    store = QuantizedPagedKV(kv_cache_dtype, cfg.num_hidden_layers, 1, block_size, cfg.num_key_value_heads,
                             _head_dim(cfg), dtype, num_window_blocks=num_window_blocks, device="meta")
    return store.fixed_bytes()


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
