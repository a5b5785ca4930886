"""The engine's optional native path (`native.cpp`, compiled on first use): a whole forward step in C++, what makes
batch-1 decode reach the memory-bandwidth ceiling on a CPU and a batched step reach its matmul ceiling.

Why (Lab 00 §6, `llmso-lab bench llamacpp`; Lab 01 §9, `llmso-lab bench vllm`): at batch 1 a decode step reads every
weight once, so its time should be the weights' bytes over the memory bandwidth; with 16 sequences or a prefill chunk
it should be the FLOPs over the matmul rate. The engine's torch step is far from both: its bf16 step spends ~4-5 ms
on ~1,000 small torch ops (norms, RoPE, cache writes, attention, residual adds; a few µs of dispatch each) beside the
matmuls, and its attention gathers every sequence's blocks into a padded batch first. Three pieces:
- `NativeStep`: a whole forward step (any varlen batch: decodes, prefill chunks, prefix hits, or a mix) as ONE C++
  call: one OpenMP parallel region, 6 barriers per layer, every product split over the threads by blocks of outputs,
  and the work between the products on vectors of 16 on data already in cache (llama.cpp's way; what CUDA-graph
  capture buys on a GPU); attention reads keys and values through the block tables (no gather), each key once for
  the query heads that share it. fp32, bf16 (AVX512-BF16), and int4 weights with fp32 activations
  (`quantization="int4"`, group 32: codes repacked once into the tile's layout, unpacked in registers by table lookup
  into bf16 and multiplied with `dpbf16`, one unpacking for 4 rows of x). It reads the runner's own weights and KV
  cache, so it and the torch path can take turns on the same sequences. `NativeStep.step.profile()` says where the time went, by phase and thread.
- `NativeLinear`: each weight packed once into blocks of 32 outputs (`pack`), multiplied by a register-tiled kernel
  (12 rows of x by 32 outputs in 24 vector registers: every weight loaded serves 12 rows); the step reads the same
  packed copies, and products outside the step take it up to `MAX_ROWS` rows (the engine's usual kernel beyond).
- `paged_decode`: decode attention for the torch path's decode rows where the step does not run (a sliding window,
  a bias), read through the block tables (no gather, no padding to the longest row).
Numbers follow the torch path (same roundings, fp32 accumulation): greedy tokens equal Hugging Face's in fp32 with
the native path on (the exactness suite). int4 rounds its products and logits to bf16 as torch's int4 kernel does:
its tokens equal the torch int4 path's on the test models, while on SmolLM2 the two best logits often round to
the same bf16 number (an exact tie: 3 of 7 prompts part within 64 greedy tokens, as the torch int4 path's own
batch-1 and batched runs part on 2 of them).

Opt-in: `LLMSO_LAB_NATIVE=1` when the engine is built (`engine.features.native_step` / `matmul_kernel`), because
the code is compiled with the C++ compiler on first use (`torch.utils.cpp_extension`, ~30 s, then cached in
`~/.cache/torch_extensions`), which a student's laptop may not have and a graded run must not wait for, and because
a lab's own attention, backend or runner must run its own code: `NativeStep.unsupported` takes only the engine's
exact classes. Where it cannot be built (no AVX-512, no compiler or ninja, not x86-64) `load()` says why and the
engine warns and keeps its torch path.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from llmso_lab.engine.attention import TorchAttentionBackend
from llmso_lab.engine.ops import linear

__all__ = ["load", "NativeLinear", "NativeStep", "requested", "enabled", "MAX_ROWS", "ENV"]

SOURCE = Path(__file__).with_name("native.cpp")
ENV = "LLMSO_LAB_NATIVE"
# Rows up to which the packed kernel beat the engine's own kernel on SmolLM2's matrices here (ms, native / oneDNN):
# bf16 1.1-1.3x faster at 16 rows, even at 64, 0.93x at 512; fp32 faster at every size (1.1-1.3x at 512).
MAX_ROWS = {torch.float32: 1 << 30, torch.bfloat16: 64}
# A whole step in C++ (`NativeStep`) beat the torch path at every size measured on SmolLM2 (ms per step, native /
# torch): bf16 8.6 / 11.9 at 1 sequence, 17.9 / 25.5 at 16, 34.6 / 45.8 at 32, a 512-token prefill 362 / 422, 4 x 512
# tokens 1516 / 1915; fp32 16.5 / 20.4, 33.8 / 40.6, 60.1 / 69.1, 584 / 706, 2347 / 2818; int4 weights (fp32
# activations) 2.6 / 9.5 at 1 sequence, 3.1 / 10.9 at 2, 4.6 / 13.8 at 4, 15.8 / 37.5 at 16, a 512-token prefill
# 377 / 814. So it takes every step it can compute (`NativeStep.accepts`).
K_MULTIPLE = {torch.float32: 1, torch.bfloat16: 2}


def requested() -> bool:
    return os.environ.get(ENV, "") == "1"


@contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Engines built inside the block use the native path (`on=True`) or not, whatever the environment says."""
    old = os.environ.get(ENV)
    os.environ[ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


@functools.lru_cache(maxsize=None)
def load():
    """(the compiled module, "why") or (None, why it is not available). Compiles once per machine and source."""
    from llmso_lab import hardware as hw

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the native path is x86-64 only (this is {platform.machine()})"
    flags = hw.cpu_flags()
    if "avx512f" not in flags:
        return None, "the native path needs AVX-512 (this CPU has none): the engine keeps its torch path"
    key = hashlib.sha1((SOURCE.read_text() + torch.__version__ + " ".join(sorted(flags))).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load as build
        mod = build(f"llmso_lab_native_{key}", [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:   # no compiler, no ninja, a read-only cache: say so and keep torch's kernels
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, (f"the native path could not be built ({type(exc).__name__}: {first[:200]}); it needs a C++ "
                      "compiler and ninja (`pip install ninja`)")
    bf16 = " and bf16 (AVX512-BF16)" if mod.has_bf16() else " (bf16: this CPU has no AVX512-BF16)"
    return mod, f"native path built for fp32{bf16}"


def supports(w_t: Tensor) -> bool:
    """Can the kernel multiply by this engine weight ([in, out])? fp32, or bf16 with an even `in` (bf16 only where it
    was built with AVX512-BF16)."""
    mod, _ = load()
    if mod is None or w_t.dtype not in MAX_ROWS or w_t.device.type != "cpu":
        return False
    if w_t.dtype == torch.bfloat16 and not mod.has_bf16():
        return False
    return w_t.shape[0] % K_MULTIPLE[w_t.dtype] == 0


class NativeLinear:
    """x [T, in] -> [T, out]: up to `MAX_ROWS` rows through the native kernel (the weight packed once into blocks of
    32 outputs, `native.cpp`), more rows through `big` (the engine's usual kernel: a prepacked `OneDNNLinear` or the
    plain [in, out] weight). `NativeStep` reads the packed copy."""

    def __init__(self, w_t: Tensor, big=None) -> None:
        self.mod, _ = load()
        assert self.mod is not None and supports(w_t), "check native.supports(w) first"
        self.packed = self.mod.pack(w_t.t().contiguous())    # from [out, in]
        self.big = w_t if big is None else big
        self.shape, self.dtype = tuple(w_t.shape), w_t.dtype
        self.max_rows = MAX_ROWS[w_t.dtype]

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] <= self.max_rows and x.dtype == self.dtype:
            return self.mod.gemm(x.contiguous(), self.packed, self.shape[1])
        return linear(x, self.big)

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def out_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes one decode step reads (the packed copy; the copy for many rows is not read then)."""
        return self.packed.numel() * self.packed.element_size()


class NativeStep:
    """A whole forward step in C++ for one `ModelRunner` (`native.cpp`, `Step`): what `ModelRunner.forward` computes
    for a varlen batch (decodes, prefill chunks, or both), in one call: one OpenMP parallel region, 6 barriers per
    layer, instead of ~55 torch ops per layer. It reads the runner's own weights (the packed copies, the int4 codes)
    and KV cache, so the torch path and this one can take turns on the same sequences."""

    def __init__(self, runner, mod) -> None:
        layers = []
        for w in runner.layers:
            layers += [w.input_norm, *_matrix(w.attn.qkv), *_matrix(w.attn.o), w.post_norm, *_matrix(w.gate_up),
                       *_matrix(w.down)]
        k, v = zip(*runner.kv_store.layer_caches)
        self.step = mod.Step(layers, runner.embed, runner.final_norm, *_matrix(runner.lm_head), runner.cos, runner.sin,
                             list(k), list(v), runner.num_heads, runner.num_kv_heads, runner.head_dim,
                             runner.layers[0].down.in_features, runner.lm_head.out_features, runner.eps,
                             runner.backend.scale)
        self.num_steps = 0

    @staticmethod
    def unsupported(runner) -> str | None:
        """Why this runner cannot take the native step (None: it can)."""
        from llmso_lab.engine.kv_cache import PagedKVStore
        from llmso_lab.engine.model_runner import LlamaAttention, LlamaAttentionKind, SingleProcess
        # exact types: a subclass (a lab's own attention, backend or group) must run its own code, never be bypassed
        if (type(runner.attention_kind) is not LlamaAttentionKind or type(runner.group) is not SingleProcess
                or any(type(w.attn) is not LlamaAttention for w in runner.layers)):
            return "only Llama-family attention in one process"
        if type(runner.backend) is not TorchAttentionBackend:
            return f"attention_backend={runner.backend.name!r} runs its own kernels"
        if type(runner.kv_store) is not PagedKVStore or runner.kv_store.latent:
            return "only a plain paged KV cache (kv_cache_dtype='auto')"
        if any(w.attn.sliding_window or w.attn.qkv_bias is not None or w.attn.o_bias is not None
               or w.gate_up_bias is not None or w.down_bias is not None for w in runner.layers):
            return "no sliding windows or biases"
        if not all(isinstance(m, NativeLinear) or (runner.dtype == torch.float32 and _is_int4(m))
                   for m in runner.weight_matrices()):
            return ("every weight must go through the native kernel (fp32, or bf16 with AVX512-BF16) or be int4 in "
                    "groups of 32 (quantization='int4', dtype='float32', AVX512-BF16)")
        if runner.layers[0].down.in_features % 32:
            return f"intermediate_size {runner.layers[0].down.in_features} is not a multiple of 32"
        if runner.head_dim % 16 or runner.head_dim > 512:
            return f"head_dim {runner.head_dim} is not a multiple of 16 up to 512"
        return None

    def accepts(self, runner, input_ids: Tensor, meta, logits_indices: Tensor, inputs_embeds) -> bool:
        """Is this forward one the native step computes exactly as the torch path would? Any varlen batch of real
        tokens (no lock-step padding or idle rows: each sequence's query tokens are exactly its new cache entries);
        no hooks, no embeddings."""
        if inputs_embeds is not None or runner.kv_hook is not None or runner.final_hidden_hook is not None:
            return False
        return all(q == c - s for q, c, s in zip(meta.query_lens, meta.context_lens_host, meta.start_positions))

    def run(self, input_ids: Tensor, positions: Tensor, meta, logits_indices: Tensor) -> tuple[Tensor, Tensor]:
        """(fp32 logits [N, V], final-normed hidden states [N, hidden]) at `logits_indices`; the new K/V are written
        to the cache."""
        self.num_steps += 1
        return self.step.run(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
                             meta.cu_seqlens_q, logits_indices)


def _is_int4(m) -> bool:
    from llmso_lab.quant.weight_only import WeightOnlyInt4
    mod, _ = load()
    return (isinstance(m, WeightOnlyInt4) and m.group_size == 32 and m.in_features % 32 == 0 and not m.use_cuda
            and m.bias is None and mod is not None and mod.has_bf16())


def _matrix(m) -> tuple[Tensor, Tensor]:
    """(weight, scales and zeros) as `Step` takes a matrix: a `NativeLinear`'s packed copy and an empty tensor, or an
    int4 matrix's codes [out, in / 2] (uint8, two per byte) and its bf16 scale and zero per group [out, in / 32, 2],
    which `Step` repacks into its tile's layout (a second copy beside the engine's, ~0.6 byte per weight)."""
    if isinstance(m, NativeLinear):
        return m.packed, torch.empty(0)
    return m.qt.packed.contiguous(), m.scales_and_zeros.contiguous()


def attach(runner) -> NativeStep | None:
    """Put the native path into a runner (`engine.features.native_step`, when it is on): its torch attention backend's
    decode rows go through `paged_decode` (fp32 / bf16 caches; plain AVX-512 reads bf16), and the runner's whole decode step where
    `NativeStep.unsupported` finds nothing against it (returned; else None)."""
    mod, _ = load()
    if mod is None:
        return None
    backend = runner.backend
    if (type(backend) is TorchAttentionBackend and runner.dtype in (torch.float32, torch.bfloat16)
            and backend.head_dim % 16 == 0 and backend.head_dim <= 512 and not backend.latent):
        backend.native_decode = mod.paged_decode
    return None if NativeStep.unsupported(runner) else NativeStep(runner, mod)
