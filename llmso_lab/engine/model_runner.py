"""Model runner: step 4 of the loop. Runs Hugging Face Llama-family weights itself on one flattened batch.

embed -> L x [RMSNorm -> attention (fused QKV -> RoPE -> paged-cache write -> attention -> o_proj) -> residual ->
RMSNorm -> SwiGLU MLP (fused gate/up) -> residual] -> RMSNorm -> LM head (tied or not). Weights are read once from
the HF module (q/k/v and gate/up concatenated so each is a single matmul) and cast to the engine's dtype; the HF
forward is never called. In bf16/fp16, as in Hugging Face: weights, activations and the KV cache in that dtype;
RMSNorm's statistics, RoPE's tables (then cast) and the returned logits in fp32; softmax inside SDPA accumulates
in fp32. Llama, Mistral (sliding window) and Qwen2 (q/k/v bias) run here as they are.

Seams (where the features plug in; `engine.features` registers them):
- `attention_kind`: how a model's attention layers are loaded and what their cache holds (`LlamaAttentionKind`
  here; another kind for another attention, with its own cache layout);
- `group`: the processes this runner is one of: which heads and which part of each layer it holds, and the sum of
  partial outputs over them (`SingleProcess` here: everything, nothing to sum);
- `matmul_kernel`: what each weight matrix becomes (e.g. a prepacked or a compressed matmul; None: plain `x @ w`);
- `kv_store`: the paged KV cache (`engine.kv_cache`): per-layer caches, block copies and moves, after-step work;
- `kv_hook(layer)` after each layer's KV is written and `final_hidden_hook(h, meta)` on every token's last hidden
  state, for those who read the cache or the hidden states as they are made.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from llmso_lab.engine.attention import AttentionMetadata, make_attention_backend
from llmso_lab.engine.cache_sizing import check_model_config, head_dim_of, sliding_windows
from llmso_lab.engine.kv_cache import make_kv_store
from llmso_lab.engine.ops import (OneDNNLinear, apply_rope, cat_weights, linear, rms_norm, rope_cos_sin,  # noqa: F401
                                  swiglu_mlp, transposed)

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig
    from llmso_lab.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class LayerWeights:
    input_norm: Tensor            # [hidden]
    attn: object                  # the layer's attention (`LlamaAttention`, or another kind's)
    post_norm: Tensor             # [hidden]
    gate_up: Tensor               # [hidden, 2 * I]: gate and up projections in one matmul
    gate_up_bias: Tensor | None
    down: Tensor                  # [I, hidden]
    down_bias: Tensor | None


@dataclass(slots=True)
class BatchRow:
    """One sequence's part of a forward: `token_ids` computed at positions start.. (their K/V written through
    `block_table`), `num_pad` padding tokens after them (a lock-step batch), logits for the last `num_logits`.
    `cache_offset`: tokens of the sequence no longer in the cache before `start` (blocks dropped from its table);
    the row's tokens sit at cache index position - cache_offset, while RoPE still gets their positions."""
    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1
    num_pad: int = 0
    idle: bool = False     # a finished row of a lock-step batch, computed on one padding token
    cache_offset: int = 0

    @property
    def num_query_tokens(self) -> int:
        return 1 if self.idle else len(self.token_ids) + self.num_pad


@dataclass(slots=True)
class LlamaAttention:
    """One Llama-family attention layer: fused QKV (+ Qwen2's bias) -> RoPE -> [cache write, attention] -> o_proj."""
    qkv: Tensor                   # [hidden, (H + 2 Hkv) * D]: q, k, v projections in one matmul
    qkv_bias: Tensor | None
    o: Tensor                     # [H * D, hidden]
    o_bias: Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None    # Mistral / Qwen2 sliding-window layers

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] (normed) -> q [T, H, D], k and v [T, Hkv, D], RoPE applied."""
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv, self.qkv_bias)                                # [T, (H + 2 Hkv) * D]
        qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin)   # q and k heads in one go
        return qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D:].view(T, Hkv, D)

    def output(self, o: Tensor) -> Tensor:
        """The attended values [T, H, D] -> [T, hidden] (a partial sum where the heads are split over processes)."""
        return linear(o.reshape(o.shape[0], -1), self.o, self.o_bias)

    def matrices(self) -> list:
        return [self.qkv, self.o]

    def transform(self, kernel: Callable) -> None:
        self.qkv, self.o = kernel(self.qkv), kernel(self.o)


class LlamaAttentionKind:
    """How Llama-family attention is loaded and cached: K and V of the group's KV heads, `head_dim` numbers each."""
    transforms_weights = True   # its matmuls (and the MLP's) may go through `matmul_kernel`

    def __init__(self, cfg, group) -> None:
        heads, kv_heads = group.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = len(heads), len(kv_heads), head_dim_of(cfg)
        self.cache_heads, self.cache_dim, self.value_dim = self.num_kv_heads, self.head_dim, None
        self.group = group

    def backend_args(self, model) -> dict:
        return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def load(self, layer, window: int | None, dtype: torch.dtype) -> tuple[LlamaAttention, dict]:
        """(the layer's attention, its MLP weights) as the group holds them, in HF orientation [out, in]."""
        w = self.group.layer_weights(layer, self.head_dim)
        cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        attn = LlamaAttention(transposed(cat_weights(w["q"], w["k"], w["v"]), dtype),
                              cast(cat_weights(w["q_bias"], w["k_bias"], w["v_bias"])),
                              transposed(w["o"], dtype), cast(w["o_bias"]),
                              self.num_heads, self.num_kv_heads, self.head_dim, window)
        return attn, w


def llama_layer_weights(layer) -> dict[str, Tensor | None]:
    """One HF Llama-family decoder layer's weights, HF orientation ([out, in]), by name (None: no such bias)."""
    a, m = layer.self_attn, layer.mlp
    bias = lambda lin: getattr(lin, "bias", None)  # noqa: E731
    return {"q": a.q_proj.weight, "k": a.k_proj.weight, "v": a.v_proj.weight, "q_bias": bias(a.q_proj),
            "k_bias": bias(a.k_proj), "v_bias": bias(a.v_proj), "o": a.o_proj.weight, "o_bias": bias(a.o_proj),
            "gate": m.gate_proj.weight, "up": m.up_proj.weight, "gate_bias": bias(m.gate_proj),
            "up_bias": bias(m.up_proj), "down": m.down_proj.weight, "down_bias": bias(m.down_proj)}


class SingleProcess:
    """The runner is alone: it holds every head and all of each layer, and a partial output is the whole output."""
    rank = 0

    @staticmethod
    def heads(num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        return range(num_heads), range(num_kv_heads)

    @staticmethod
    def layer_weights(layer, head_dim: int) -> dict[str, Tensor | None]:
        return llama_layer_weights(layer)

    @staticmethod
    def all_reduce(partial: Tensor) -> Tensor:
        return partial

    @staticmethod
    def stats() -> dict:
        return {}


class BatchBuilder:
    """Turns scheduled sequences into one flattened varlen batch for `forward`. Needs only the block size, the
    null block and the device, so an executor that runs the forward elsewhere (in other processes) builds its batches
    the same way and ships them."""

    block_size: int
    null_block: int
    device: torch.device

    # ---- batch construction ------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Flatten the scheduled sequences into one varlen batch (the scheduler put the one-token rows first).
        A row with lookahead tokens (guesses a feature appended for this step) computes its last token and them, and
        returns logits at all of them."""
        rows = []
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            if item.idle:   # a finished row of a lock-step batch is still computed, on a padding token
                rows.append(BatchRow([], start, seq.block_table, 1, 1, idle=True))
            else:
                extra = item.lookahead_token_ids
                tokens = seq.token_ids[start:start + item.num_new_tokens - len(extra)] + extra
                logits = (1 + len(extra)) if item.sample else 0
                rows.append(BatchRow(tokens, start, seq.block_table, logits, item.num_pad_tokens,
                                     cache_offset=seq.num_dropped_blocks * self.block_size))
        return self.prepare_rows(rows, out.num_decodes)

    def prepare_rows(self, rows: list[BatchRow], num_decodes: int) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """The varlen batch for `rows` (the first `num_decodes` of them one token each): input ids, positions,
        attention metadata, and the indices of the tokens whose logits `forward` returns. Positions are the tokens'
        places in their sequence; slots, start positions, context lengths and block tables count tokens in the cache
        (fewer where blocks were dropped from a table: `BatchRow.cache_offset`)."""
        bs, null_slot = self.block_size, self.null_block * self.block_size
        ids, pos, slots, logit_rows = [], [], [], []
        starts, qlens, ctxs, tables = [], [], [], []
        for row in rows:
            start, table = row.start - row.cache_offset, row.block_table   # in cache coordinates
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
        (and per idle row), in the order of `out.scheduled`."""
        return self.forward(*self.prepare(out))

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices: Tensor,
                inputs_embeds: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def after_step(self, out: SchedulerOutput) -> None:
        """After a step: let the KV store settle its state (`kv_cache` stores' `after_step`)."""

    def block_listener(self):
        """What must hear the block manager free or reuse a block (a KV store's per-block state), or None."""
        return None

    def stats(self) -> dict:
        """This runner's own counters for `LLM.stats()` (none here)."""
        return {}

    def shutdown(self) -> None:
        """Stop any processes this runner started (none here)."""


class ModelRunner(BatchBuilder):
    """Step 4 for one model: its weights and the paged KV cache sized by the (resolved) `EngineConfig`.
    `group`, `attention_kind`, `matmul_kernel`: the seams above (default: one process, Llama attention, and what
    `engine.features` picks for the config)."""

    def __init__(self, model, config: EngineConfig, group=None, attention_kind=None,
                 matmul_kernel: Callable | None | str = "auto") -> None:
        from llmso_lab.engine import features
        cfg, block_size, max_model_len = model.config, config.block_size, config.max_model_len
        check_model_config(cfg)
        self.group = group or SingleProcess()
        kind = attention_kind or features.attention_kind(cfg) or LlamaAttentionKind
        self.attention_kind = kind = kind(cfg, self.group)
        self.num_layers, self.num_heads, self.num_kv_heads = cfg.num_hidden_layers, kind.num_heads, kind.cache_heads
        self.head_dim = kind.cache_dim
        self.num_forwards, self.forward_s = 0, 0.0
        self.eps, self.vocab_size = cfg.rms_norm_eps, cfg.vocab_size
        self.dtype, self.device = config.torch_dtype, model.get_input_embeddings().weight.device
        self.block_size, self.null_block = block_size, config.num_kv_blocks
        self.backend = make_attention_backend(config.attention_backend, block_size=block_size, **kind.backend_args(model))
        windows = sliding_windows(cfg, max_model_len)
        with torch.no_grad():
            self.layers = [self._load_layer(layer, window) for layer, window in zip(model.model.layers, windows)]
            self.embed = model.get_input_embeddings().weight.detach().to(self.dtype)   # [V, hidden]
            self.final_norm = model.model.norm.weight.detach().to(self.dtype)
            self.lm_head = transposed(model.get_output_embeddings().weight, self.dtype)   # [hidden, V] (a copy even when tied)
            if matmul_kernel == "auto":
                matmul_kernel = features.matmul_kernel(config, self.dtype, self.device) if kind.transforms_weights else None
            if matmul_kernel is not None:
                for w in self.layers:
                    w.attn.transform(matmul_kernel)
                    w.gate_up, w.down = matmul_kernel(w.gate_up), matmul_kernel(w.down)
                self.lm_head = matmul_kernel(self.lm_head)
            cos, sin = rope_cos_sin(cfg, max_model_len)
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)                   # signed for apply_rope
            self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)   # [max_model_len, D]
        self.kv_store = make_kv_store(config, self.num_layers, kind.cache_heads, kind.cache_dim, self.dtype, self.device,
                                      kind.value_dim)
        self.kv_hook: Callable[[int], None] | None = None   # called with i once layer i's KV is written
        self.final_hidden_hook: Callable[[Tensor, AttentionMetadata], None] | None = None   # every token's last hidden
        self.last_hidden: Tensor | None = None   # the final-normed hidden states of the last forward's logits rows
        self.native_step = features.native_step(self)   # the whole forward step in C++ (opt-in: `engine.native`)

    @property
    def k_cache(self) -> Tensor | None:
        return self.kv_store.k_cache

    @property
    def v_cache(self) -> Tensor | None:
        return self.kv_store.v_cache

    def _load_layer(self, layer, window: int | None) -> LayerWeights:
        dtype = self.dtype
        cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        attn, w = self.attention_kind.load(layer, window, dtype)
        return LayerWeights(input_norm=cast(layer.input_layernorm.weight), attn=attn,
                            post_norm=cast(layer.post_attention_layernorm.weight),
                            gate_up=transposed(cat_weights(w["gate"], w["up"]), dtype),
                            gate_up_bias=cast(cat_weights(w["gate_bias"], w["up_bias"])),
                            down=transposed(w["down"], dtype), down_bias=cast(w["down_bias"]))

    def weight_matrices(self) -> list:
        """The matrices one forward multiplies by, in order: attention's, gate/up, down per layer, then the LM head."""
        return [m for w in self.layers for m in (*w.attn.matrices(), w.gate_up, w.down)] + [self.lm_head]

    # ---- the forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices: Tensor,
                inputs_embeds: Tensor | None = None) -> Tensor:
        """Logits [N, V] fp32 at `logits_indices` (None on a group member other than rank 0); their final-normed
        hidden states are kept in `last_hidden`. `inputs_embeds` [T, hidden] replaces the embedding lookup."""
        t_start = time.perf_counter()
        if self.native_step is not None and self.native_step.accepts(self, input_ids, meta, logits_indices, inputs_embeds):
            logits, self.last_hidden = self.native_step.run(input_ids, positions, meta, logits_indices)
            self.num_forwards += 1
            self.forward_s += time.perf_counter() - t_start
            return logits
        h = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds.to(self.dtype)   # [T, hidden]
        cos = self.cos.index_select(0, positions)[:, None]                      # [T, 1, D]
        sin = self.sin.index_select(0, positions)[:, None]
        self.backend.plan(meta)
        all_reduce = self.group.all_reduce   # sums partial outputs over the group (alone: returns them)
        for i, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, self.kv_store.layer_caches)):
            q, k, v = w.attn.project(rms_norm(h, w.input_norm, self.eps), cos, sin)
            self.backend.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
            if self.kv_hook is not None:   # layer i's KV is complete: e.g. ship it while i + 1 computes
                self.kv_hook(i)
            o = self.backend.forward(q, k, v, k_cache, v_cache, meta, w.attn.sliding_window)
            h = h + all_reduce(w.attn.output(o))
            x = rms_norm(h, w.post_norm, self.eps)
            h = h + all_reduce(swiglu_mlp(x, w.gate_up, w.gate_up_bias, w.down, w.down_bias))
        if self.final_hidden_hook is not None:   # someone reads every token's hidden state
            features = rms_norm(h, self.final_norm, self.eps)
            self.final_hidden_hook(features, meta)
            h = features.index_select(0, logits_indices)
        else:
            h = rms_norm(h.index_select(0, logits_indices), self.final_norm, self.eps)   # [N, hidden]
        self.last_hidden = h
        logits = linear(h, self.lm_head).float() if self.group.rank == 0 else None   # [N, V]
        self.num_forwards += 1
        self.forward_s += time.perf_counter() - t_start
        return logits

    def after_step(self, out: SchedulerOutput) -> None:
        self.kv_store.after_step(out)

    def block_listener(self):
        return self.kv_store.block_listener()

    # ---- block moves (the scheduler's, applied to the KV store) -------------------------------
    def move_blocks(self, out: SchedulerOutput) -> None:
        """Carry out the step's block moves, in order, before the forward overwrites any block."""
        for op, mapping in out.block_moves():
            getattr(self.kv_store, op)(mapping)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        self.kv_store.copy_blocks(mapping)
