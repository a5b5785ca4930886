"""Where the engine's features are registered: the core (`core`, `scheduler`, `model_runner`, `sequence`,
`kv.block_manager`) names none of them; each lives in its own module and is looked up here.

Strategies, picked once from the config:
- `make_scheduler`: continuous (the core) or lock-step batches (`engine.lockstep`, static / dynamic batching); the
  block manager with a hash-chain prefix cache (the core) or a radix tree (`kv.radix_cache`); preemption by
  recompute (the core) or swap (`engine.swap`);
- `model_runner`: one `ModelRunner`, or the tensor-parallel executor (`parallel.tensor`);
- `attention_kind(model_config)`: the attention a model family needs beside Llama's (MLA: `engine.mla`);
- `matmul_kernel(config, dtype, device)`: what the runner turns each weight matrix into;
- the KV stores (plain, latent, quantized, KIVI) are picked in `engine.kv_cache.make_kv_store`.
Features with hooks in the loop (`engine_features`): beam search (`engine.beam_search`), speculative decoding
(`spec.engine`), KV eviction (`kv.streaming`), and the request checks of lock-step batching. Which of all these
combine: `engine.compat`. Adding a feature: its module, plus one line here.
"""
from __future__ import annotations

from typing import Callable

import torch


def attention_kind(model_config):
    """The runner's `attention_kind` for this model, or None for Llama-family attention."""
    if model_config.model_type == "deepseek_v3":   # MLA: a latent cache (engine.mla)
        from llmso_lab.engine.mla import MLAAttentionKind
        return MLAAttentionKind
    return None


def matmul_kernel(config, dtype: torch.dtype, device: torch.device) -> Callable | None:
    """What each weight matrix [in, out] becomes: a weight-only quantized matmul (`quantization=`, lecture 1-3:
    `quant.weight_only`; activations cast to bf16 for the kernel only), a oneDNN prepacked weight where that measured
    faster on this CPU (`hardware.onednn_linear_available`), or None: plain `x @ w`. With `LLMSO_LAB_NATIVE=1`
    (opt-in) products go through the native kernel first, up to the rows where it measured faster (`engine.native`)."""
    if config.quantization:
        from llmso_lab.quant.weight_only import quantize_weight
        method, group = config.quantization, config.quantization_group_size
        return lambda w_t: quantize_weight(w_t.t().float(), method, group_size=group)   # [in, out] -> [out, in]
    from llmso_lab import hardware as hw
    base = None
    if hw.onednn_linear_available(dtype, device):
        from llmso_lab.engine.ops import OneDNNLinear
        base = OneDNNLinear
    from llmso_lab.engine import native
    if native.requested() and torch.device(device).type == "cpu":   # opt-in: LLMSO_LAB_NATIVE=1
        mod, why = native.load()
        if mod is None:
            import warnings
            warnings.warn(f"{native.ENV}=1: {why}", stacklevel=2)
        else:
            def kernel(w_t):   # rows through the native kernel, past its MAX_ROWS through the usual one
                usual = base(w_t) if base else w_t
                return native.NativeLinear(w_t, usual) if native.supports(w_t) else usual
            return kernel
    return base


def native_step(runner):
    """The native path (`engine.native`, on with `LLMSO_LAB_NATIVE=1`): the runner's whole forward step in C++
    (`NativeStep`, returned) where it applies, and the torch backend's decode attention read through the block tables;
    None where the step does not apply (the torch path runs those steps)."""
    from llmso_lab.engine import native
    if not native.requested() or runner.device.type != "cpu":
        return None
    return native.attach(runner)


def model_runner(model, config):
    """What runs step 4: one `ModelRunner`, or the tensor-parallel executor (lecture 2-2, `parallel.tensor`: N rank
    processes hold the shards; this process schedules and samples)."""
    if config.tensor_parallel_size > 1:
        from llmso_lab.parallel.tensor import TensorParallelExecutor
        return TensorParallelExecutor(model, config)
    from llmso_lab.engine.model_runner import ModelRunner
    return ModelRunner(model, config)


def make_scheduler(config, eos_token_ids, clock):
    """The scheduler for `config`, with its block manager and preemption strategy."""
    from llmso_lab.engine.scheduler import Scheduler
    from llmso_lab.kv.block_manager import BlockManager
    cls, bm_cls = Scheduler, BlockManager
    if config.batching != "continuous":
        from llmso_lab.engine.lockstep import LockstepScheduler
        cls = LockstepScheduler
    if config.enable_prefix_caching and config.prefix_caching_algo == "radix":
        from llmso_lab.kv.radix_cache import RadixBlockManager
        bm_cls = RadixBlockManager
    bm = bm_cls(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
    preemption = None
    if config.preemption_mode == "swap":
        from llmso_lab.engine.swap import SwapPreemption
        preemption = SwapPreemption(bm, config.swap_space_blocks)
    return cls(config, eos_token_ids, clock, block_manager=bm, preemption=preemption)


# Reported by `LLM.stats()` whatever the config (vLLM's dashboards expect them), unless a feature reports them.
ALWAYS_REPORTED = {"num_preemptions_swap": 0, "kv_evicted_blocks": 0}


# The features with hooks in the loop: (is it on for this config?, "module:class"), in the order their hooks run.
# Adding one: a module with a class taking the engine, and one line here.
HOOKED = [
    (lambda c: True, "llmso_lab.engine.beam_search:BeamSearch"),                      # LLM.beam_search (lecture 1-2)
    (lambda c: True, "llmso_lab.engine.stop_strings:StopStrings"),                    # SamplingParams.stop
    (lambda c: c.batching != "continuous", "llmso_lab.engine.lockstep:LockstepBatching"),   # static / dynamic (1-1)
    (lambda c: c.eviction is not None, "llmso_lab.kv.streaming:StreamingKVEviction"),   # StreamingLLM blocks (2-4)
    (lambda c: c.spec is not None, "llmso_lab.spec.engine:SpeculativeDecoding"),       # speculative decoding (2-1)
]


def engine_features(engine) -> list:
    """The features whose hooks the engine's loop calls (`LLMEngine._step`), for `engine.config`, built from `HOOKED`.
    A feature has a `name` (its `EngineConfig` field or API), `stats()`, and any of: `on_retire(seqs)`,
    `after_schedule(out)`, `on_block_copies(mapping)`, `take_logits(rows, logits, hidden)`,
    `after_sample(out, sampled)`, `after_update(now)`, `check_request(params)` (refuse a request it cannot serve),
    `check_search()`. It may also fill a seam of the scheduler or the runner when it is built."""
    import importlib
    found = []
    for is_on, where in HOOKED:
        if is_on(engine.config):
            module, name = where.split(":")
            found.append(getattr(importlib.import_module(module), name)(engine))
    return found
