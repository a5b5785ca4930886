"""Speculative decoding (lecture 07): verify a draft model's tokens against the target by rejection sampling.

- verify: `target_probs` (the sampler's distribution), `speculative_verify` (one request, its own generator),
  `greedy_verify` (temperature 0), the batched torch reference `verify_batch_reference` and the dispatcher
  `verify_batch`, and the closed forms `expected_tokens_per_step` and `speculative_speedup`.
- drafters: what proposes the tokens (`Drafter`; n-gram prompt lookup with a per-sequence index, a draft model,
  Medusa, EAGLE); `speculative_config={"method": "custom", "drafter": ...}` plugs in one written elsewhere, and
  `harness.run_drafter` runs one in the engine against plain decoding (how Lab 07 grades a student's drafter).
- triton_verify: `verify_batch_triton`, the batched verification as one Triton kernel (bit-exact with the
  reference; on CPU it runs under the Triton interpreter: set TRITON_INTERPRET=1 before triton is imported).
"""
import importlib

from llmso_lab.spec.verify import (expected_tokens_per_step, greedy_verify, race_scores, speculative_speedup,
                                   speculative_verify, target_probs, verify_batch, verify_batch_reference)

__all__ = ["target_probs", "speculative_verify", "greedy_verify", "verify_batch_reference", "verify_batch",
           "verify_batch_triton", "race_scores", "expected_tokens_per_step", "speculative_speedup"]


def __getattr__(name: str):
    """Import the Triton kernel on first use (PEP 562): importing this package does not import triton."""
    if name != "verify_batch_triton":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    fn = importlib.import_module("llmso_lab.spec.triton_verify").verify_batch_triton
    globals()[name] = fn
    return fn
