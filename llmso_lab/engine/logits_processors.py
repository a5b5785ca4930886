"""What a request does to its logits before the sampler draws (`SamplingParams`' penalties and min_tokens), and the
log-probabilities it may ask for. A leaf (torch and SamplingParams only)."""
from __future__ import annotations

import torch
from torch import Tensor

from llmso_lab.engine.sampling_params import SamplingParams


def process_logits(logits: Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   eos_token_ids=frozenset()) -> Tensor:
    """fp32 logits [V] -> the logits this request samples from: the repetition penalty over prompt and output
    tokens (Hugging Face's RepetitionPenaltyLogitsProcessor), the frequency and presence penalties over output tokens
    (OpenAI's definition: logit - count * frequency - [count > 0] * presence), and while fewer than `min_tokens` are
    out, EOS (unless ignore_eos) and the stop ids masked (vLLM's MinTokensLogitsProcessor)."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64)
        vals = logits[seen]
        logits[seen] = torch.where(vals < 0, vals * params.repetition_penalty, vals / params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    if len(output_ids) < params.min_tokens:
        banned = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))
        if banned:
            logits[torch.tensor(sorted(banned), dtype=torch.int64)] = float("-inf")
    return logits


def token_logprobs(logits: Tensor, token: int, k: int) -> dict:
    """{"token_id", "logprob", "top": [(id, logprob) x k]} from the raw logits [V] (vLLM's default raw log-probs)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, k) if k else None
    return {"token_id": token, "logprob": float(lp[token]),
            "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []}


def finite_logits(logits: Tensor) -> Tensor:
    """Logits a draw can use: an extreme penalty or temperature (repetition_penalty 1e-300 divides a logit by it) can
    give +inf or nan; +inf becomes the largest float (the order stays), nan -inf, and a row with nothing left is
    uniform. Rows that are already finite (every usual request) come back as they are."""
    if bool(torch.isfinite(logits).all()):
        return logits
    out = logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    return out if bool(torch.isfinite(out).any()) else torch.zeros_like(out)
