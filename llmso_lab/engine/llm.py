"""LLM: the engine's front door (vLLM's offline API), built on the core loop `engine.core.LLMEngine`."""
from __future__ import annotations

from llmso_lab.engine.beam_search import BeamSearchOutput, BeamSearchParams
from llmso_lab.engine.core import LLMEngine
from llmso_lab.engine.inputs import Prompt, _eos_token_ids, _resolve_model, as_batch, prompt_token_ids

__all__ = ["LLM", "as_batch", "prompt_token_ids", "_resolve_model", "_eos_token_ids"]


class LLM(LLMEngine):
    """A small serving engine: continuous batching over a paged KV cache, run on a HF Llama-family model.

    `LLM(model, tokenizer=None, **engine_args)`: `model` is a registry name ("smollm2-135m", "tiny-llama") or a
    Hugging Face PreTrainedModel; `engine_args` are `EngineConfig`'s fields, vLLM's names (`block_size`,
    `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `enable_prefix_caching`, `enable_chunked_prefill`,
    `scheduling_policy`, `preemption_mode`, `dtype`, `quantization`, `kv_cache_dtype`, `speculative_config`,
    `tensor_parallel_size`, ...: `engine.config`); `clock` replaces `time.perf_counter`. `num_kv_blocks=None` sizes
    the cache from `kv_cache_memory_bytes` (capped at what `max_num_seqs` sequences of `max_model_len` can use).

    The loop (`step()`, `engine.core`): retire, count free blocks, schedule (`engine.scheduler`), run one forward
    (`engine.model_runner`) and sample. Each feature lives in its own module with its lecture notes, registered in
    `engine.features`: static / dynamic batching (`engine.lockstep`), preemption by swap (`engine.swap`), the
    radix prefix cache (`kv.radix_cache`), beam search (`engine.beam_search`), speculative decoding (`spec.engine`),
    tensor parallelism (`parallel.tensor`), MLA (`engine.mla`), weight-only quantization (`quant.weight_only`),
    KV-cache quantization and KIVI (`engine.kv_cache`, `kv.quant`), StreamingLLM eviction (`kv.streaming`). Which
    of them combine: `engine.compat.matrix()`.

    `dtype` (vLLM's `--dtype`): "float32" (the default here; vLLM's is "auto", but the labs compare the engine with
    Hugging Face fp32 token for token), "bfloat16", "float16" or "auto": bf16 where the hardware multiplies it
    natively (`llm.dtype_reason` says why), with weights prepacked for oneDNN where that measured faster
    (`engine.ops.OneDNNLinear`; `llmso-lab bench precision` reports which kernel ran).

    Sharing (lecture 1-2): `SamplingParams(n=N)` computes the prompt once and forks N samples that share its KV
    blocks (copy-on-write; `share_kv_blocks=False` copies every block at the fork instead).

    Determinism: every request samples from its own generator (seeded by `SamplingParams.seed`, else by
    `seed` and its order of arrival), so its random draws do not depend on the rest of the batch; its logits
    can, at near-ties, because the batch's shape changes the order of floating-point sums (`sampler`).
    """

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's `LLM.beam_search`), all prompts batched together: beams fork by
        copy-on-write and free their blocks when pruned; Hugging Face's scoring (`engine.beam_search`). Returns, per
        prompt, its `beam_width` best sequences, best first."""
        return self.feature("beam_search").run(prompts, params, use_tqdm)
