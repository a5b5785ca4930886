"""Hugging Face `generate` as the reference the engine is checked (and benchmarked) against."""
from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_token_ids: list[int], max_tokens: int, eos_token_id: int | list[int] | None = None) -> list[int]:
    """Greedy output tokens of `model.generate` for one prompt (batch 1, no padding).

    eos_token_id=None generates exactly `max_tokens` tokens (like the engine's `ignore_eos=True`: an EOS
    may be produced and generation goes on); otherwise generation stops after the EOS, which is kept.
    """
    ids = torch.tensor([prompt_token_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=0 if eos_token_id is None else eos_token_id,
                         top_k=None, top_p=None, temperature=None)
    new = out[0, len(prompt_token_ids):].tolist()
    if eos_token_id is not None:   # drop the padding after an early EOS
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        new = new if stop is None else new[:stop + 1]
    return new
