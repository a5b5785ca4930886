"""Sampler: greedy, temperature, top-k, top-p.

Each request draws from its own `torch.Generator` (one draw per sampled token), so a request's random draws
do not depend on which other requests share its batch. Its logits can: the batch's shape changes the order
of floating-point sums (decode length groups, BLAS blocking, prefill chunks), so the same seed can give a
different token in a different batch when two tokens nearly tie (greedy) or a draw lands at the edge between
two tokens' probability mass (sampling). The tests' tiny fp32 models show no such near-ties."""
from __future__ import annotations

import torch
from torch import Tensor

from llmso_lab.engine.sampling_params import SamplingParams


def filter_logits(logits: Tensor, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """logits [V] -> logits with the tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p   # the mass before this token already reaches top_p
        outside[0] = False                            # always keep the most likely token
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits.masked_fill(outside, float("-inf")))
    return logits


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token id from fp32 logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits / params.temperature, params.top_k, params.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
        """logits [N, V] fp32, one row per sequence -> N token ids. Greedy rows share one argmax."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:   # per-request generators live on the host
                tokens[i] = sample_token(logits[i].cpu(), p, g)
        return tokens
