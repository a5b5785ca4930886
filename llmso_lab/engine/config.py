"""EngineConfig: the engine's settings (the keyword arguments of `LLM`), checked up front, and the KV-cache
sizing that depends on the model. The scheduler and the model runner are built from it."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from llmso_lab import hardware as hw
from llmso_lab.engine import compat
from llmso_lab.engine.attention import ATTENTION_BACKENDS
from llmso_lab.engine.kv_cache import kivi_window_blocks
from llmso_lab.engine.cache_sizing import (check_model_config, kv_cache_bytes_per_block, kv_cache_fixed_bytes,
                                           sliding_windows)
from llmso_lab.kv.quant import KV_FORMATS
from llmso_lab.kv.block_manager import cdiv
from llmso_lab.kv.streaming import StreamingEviction
from llmso_lab.policies import POLICIES
from llmso_lab.spec.config import SpeculativeConfig

BATCHING_MODES = ("static", "dynamic", "continuous")
PREFIX_CACHING_ALGOS = ("hash", "radix")   # chained block hashes (vLLM, the core) | token radix tree (`kv.radix_cache`)
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}   # and "auto"


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None          # None: kv_cache_memory_bytes / bytes per block
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None          # None: the model's max_position_embeddings
    batching: str = "continuous"
    batch_window_s: float = 0.05
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    prefix_caching_algo: str = "hash"         # "hash": chained block hashes (vLLM) | "radix": token radix tree (SGLang)
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space_blocks: int | None = None      # None: as many as num_kv_blocks (swap mode only)
    attention_backend: str = "torch"
    seed: int = 0
    kv_cache_memory_bytes: int = 1 << 30
    sjf_predictor: str | Callable = "oracle"
    sjf_aging: float = 0.0                    # sjf: predicted tokens forgiven per second waited
    share_kv_blocks: bool = True              # n > 1 / beams share blocks copy-on-write; False: each its own copy
    dtype: str = "float32"                    # "auto" | "float32" | "bfloat16" | "float16" (vLLM's --dtype)
    quantization: str | None = None           # weight-only: "int8" (per channel) | "int4" (group 32) | "int4-g64"
    speculative_config: dict | None = None    # {"method": "ngram" | "draft_model" | ..., "num_speculative_tokens": k, ...}
    tensor_parallel_size: int = 1             # ranks (processes) that each hold 1/N of every layer (`parallel.tensor`)
    tp_timeout_s: float = 300.0               # a TP rank that does not answer within this many seconds fails the engine
    kv_cache_dtype: str = "auto"              # "auto" | "fp8_e4m3" | "fp8_e5m2" | "int8" | "kivi4" | "kivi2" (`kv.quant`)
    kv_fp8_scales: str = "tensor"             # fp8: a static scale per layer ("tensor") or per layer and KV head ("head")
    calculate_kv_scales: bool = False         # fp8: scales from the first forward's K/V (vLLM's name); False: 1.0
    kivi_residual_length: int = 32            # kivi: recent tokens kept in full precision (a multiple of block_size)
    kivi_window_blocks: int = field(default=0, init=False)              # kivi: the full-precision window pool's blocks
    kv_eviction: dict | None = None           # {"method": "streaming", "num_sink_blocks": s, "window_blocks": w} (kv.streaming)
    quantization_group_size: int = field(default=0, init=False)         # int4's group, parsed from `quantization`
    spec: SpeculativeConfig | None = field(default=None, init=False)    # `speculative_config`, checked
    num_speculative_tokens: int = field(default=0, init=False)          # k (0: no speculative decoding)
    torch_dtype: torch.dtype | None = field(default=None, init=False)   # what `dtype` resolved to
    dtype_reason: str = field(default="", init=False)                   # why (for "auto": what was detected)
    eviction: StreamingEviction | None = field(default=None, init=False)   # `kv_eviction`, checked

    @classmethod
    def from_engine_args(cls, engine_args: dict) -> EngineConfig:
        """`EngineConfig(**engine_args)`, with an error that lists the valid names for a misspelt one."""
        valid = [f.name for f in fields(cls) if f.init]
        unknown = sorted(set(engine_args) - set(valid))
        if unknown:
            raise TypeError(f"unknown engine argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"valid: {', '.join(valid)}")
        return cls(**engine_args)

    def __post_init__(self) -> None:
        """Checks that need no model. Raises ValueError listing the valid choices."""
        for name, valid in (("batching", BATCHING_MODES), ("scheduling_policy", POLICIES),
                            ("preemption_mode", PREEMPTION_MODES), ("attention_backend", ATTENTION_BACKENDS),
                            ("prefix_caching_algo", PREFIX_CACHING_ALGOS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(valid)}")
        if isinstance(self.dtype, torch.dtype):   # vLLM also takes a torch dtype
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: auto, {', '.join(DTYPES)}")
        if self.quantization is not None:
            self.quantization, self.quantization_group_size = parse_quantization(self.quantization)
        if self.speculative_config is not None:
            self.spec = SpeculativeConfig.from_dict(self.speculative_config)
            self.num_speculative_tokens = self.spec.num_speculative_tokens
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        self._check_kv_cache_dtype()
        if self.kv_eviction is not None:
            self.eviction = StreamingEviction.from_dict(self.kv_eviction)
        compat.check(self)   # the features that cannot run together: one table (`engine.compat`)

    def _check_kv_cache_dtype(self) -> None:
        """kv_cache_dtype and its options (which features refuse a quantized cache: `engine.compat`)."""
        kv = self.kv_cache_dtype
        if kv not in KV_FORMATS:
            raise ValueError(f"unknown kv_cache_dtype {kv!r}; valid: {', '.join(KV_FORMATS)}")
        if self.kv_fp8_scales not in ("tensor", "head"):
            raise ValueError(f"unknown kv_fp8_scales {self.kv_fp8_scales!r}; valid: tensor, head")
        if kv == "auto":
            return
        r, bs = self.kivi_residual_length, self.block_size
        if kv.startswith("kivi") and (not isinstance(r, int) or r < 0 or r % bs):
            raise ValueError(f"kivi_residual_length must be a non-negative multiple of block_size ({bs}), got {r!r}: "
                             "KIVI here quantizes whole blocks (one key group per block)")

    def resolve(self, model_config, device: torch.device) -> None:
        """Fill in torch_dtype, max_model_len, num_kv_blocks and swap_space_blocks for this model on `device`;
        check they can work."""
        check_model_config(model_config)
        compat.check(self, model_config)   # now with the model's own features (MLA)
        self.torch_dtype, self.dtype_reason = resolve_dtype(self.dtype, device, self.attention_backend)
        dtype = self.torch_dtype
        limit = model_config.max_position_embeddings
        self.max_model_len = self.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        if self.batching == "continuous" and not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={self.max_model_len} with "
                             "chunked prefill off: a long prompt could never be scheduled; raise max_num_batched_tokens, "
                             "lower max_model_len or set enable_chunked_prefill=True")
        if self.tensor_parallel_size > 1:
            check_tensor_parallel(model_config, self.tensor_parallel_size)
        per_seq = cdiv(self.max_model_len, self.block_size)   # blocks one max-length sequence needs
        fixed = 0   # KIVI: the full-precision window pool, a fixed cost taken from the budget first
        if self.kv_cache_dtype.startswith("kivi"):
            self.kivi_window_blocks = kivi_window_blocks(self.max_num_seqs, self.max_num_batched_tokens, self.block_size,
                                                         self.kivi_residual_length)
            fixed = kv_cache_fixed_bytes(model_config, self.block_size, dtype, self.kv_cache_dtype,
                                         self.kivi_window_blocks)
        if self.eviction is not None:   # StreamingLLM: a sequence never holds more than sinks + window + 1 blocks
            check_eviction_model(model_config, self.max_model_len)
            per_seq = min(per_seq, self.eviction.max_blocks_per_seq)
        if self.num_kv_blocks is None:   # kv_cache_memory_bytes is per rank (per GPU in vLLM): TP adds capacity
            budget = max(0, self.kv_cache_memory_bytes - fixed) // kv_cache_bytes_per_block(
                model_config, self.block_size, dtype, self.tensor_parallel_size, self.kv_cache_dtype)
            if budget < per_seq:
                raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds {budget} blocks but one sequence "
                                 f"of max_model_len={self.max_model_len} needs {per_seq}"
                                 + (f" (after the KIVI window pool's {fixed} bytes: {self.kivi_window_blocks} blocks for "
                                    "max_num_seqs, kivi_residual_length and max_num_batched_tokens)" if fixed else "")
                                 + "; raise it or lower max_model_len"
                                 + (" or the kv_eviction window" if self.eviction else ""))
            self.num_kv_blocks = min(budget, self.max_num_seqs * per_seq)   # more could never be used
        if self.eviction is not None and self.num_kv_blocks < per_seq:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} cannot hold one sequence under kv_eviction: it keeps up to "
                             f"num_sink_blocks + window_blocks + 1 = {per_seq} blocks; raise num_kv_blocks or shrink the window")
        if self.num_kv_blocks < per_seq:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} ({self.num_kv_blocks * self.block_size} tokens) cannot hold "
                             f"one sequence of max_model_len={self.max_model_len}: it needs {per_seq} blocks of "
                             f"{self.block_size} tokens; raise num_kv_blocks or lower max_model_len")
        if self.preemption_mode != "swap":
            self.swap_space_blocks = 0
        elif self.swap_space_blocks is None:
            self.swap_space_blocks = self.num_kv_blocks


def check_eviction_model(model_config, max_model_len: int) -> None:
    """Raise ValueError for models whose attention block eviction would break: sliding-window layers (their window is
    counted in positions, the cache's indices are not). (MLA: `engine.compat`.)"""
    if any(w is not None for w in sliding_windows(model_config, max_model_len)):
        raise ValueError(f"kv_eviction cannot be combined with a sliding-window model (sliding_window="
                         f"{model_config.sliding_window}): its window would be measured in cache slots, not positions; "
                         "lower max_model_len to the window or use kv_eviction=None")


def check_tensor_parallel(model_config, tp: int) -> None:
    """Raise ValueError unless `tp` ranks can split this model's heads and MLP (`parallel.heads.shard_heads`)."""
    from llmso_lab.parallel.heads import shard_heads
    shard_heads(model_config.num_attention_heads, model_config.num_key_value_heads, tp)
    if model_config.intermediate_size % tp:
        raise ValueError(f"intermediate_size={model_config.intermediate_size} does not split over "
                         f"tensor_parallel_size={tp}; choose a size dividing it")


def parse_quantization(spec: str) -> tuple[str, int]:
    """"int8" -> ("int8", 0); "int4" -> ("int4", 32); "int4-g64" -> ("int4", 64). Raises ValueError otherwise."""
    valid = 'valid: "int8", "int4" (group 32), "int4-g64" (or "int4-gN" for a group N dividing every input size), None'
    method, _, group = str(spec).partition("-g")
    if method == "int8" and not group:
        return "int8", 0
    if method == "int4" and (not group or group.isdigit()):
        g = int(group or 32)
        if g < 2 or g & (g - 1):
            raise ValueError(f"quantization={spec!r}: the int4 group must be a power of two >= 2 (32 or 64 for SmolLM2); {valid}")
        return "int4", g
    raise ValueError(f"unknown quantization {spec!r}; {valid}")


def resolve_dtype(dtype: str, device: torch.device, attention_backend: str = "torch") -> tuple[torch.dtype, str]:
    """The torch dtype the engine runs in for `dtype` on `device`, and why. "auto": bf16 where the hardware
    multiplies it natively, else fp32 (`hardware.auto_dtype`, which also measures a CPU's bf16 matmuls).
    Raises ValueError for what cannot work; warns when an explicit choice will be slow."""
    device = torch.device(device)
    if dtype == "auto":
        chosen, why = hw.auto_dtype(device.type)
    else:
        chosen, why = DTYPES[dtype], f"{dtype}: requested"
    if chosen == torch.bfloat16 and attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("attention_backend='triton' cannot run bfloat16 under TRITON_INTERPRET=1 (the interpreter's "
                         "tl.dot gives wrong bf16 results): use dtype='float32' or 'float16' with the interpreter, "
                         "attention_backend='torch' for bf16 on a CPU, or a CUDA GPU")
    if device.type == "cpu" and dtype in ("bfloat16", "float16"):
        native, detected = hw.native_matmul(chosen, "cpu")
        if not native:
            warnings.warn(f"dtype={dtype!r} on this CPU runs emulated ({detected}) and is likely slower than float32; "
                          "use dtype='auto' to let the engine pick", stacklevel=4)
    return chosen, why
