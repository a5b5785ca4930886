"""Sampler: penalties and min_tokens on the logits, then greedy, or temperature, min-p, top-k, top-p and a draw.

Each request draws from its own `torch.Generator` (one draw per sampled token), so a request's random draws
do not depend on which other requests share its batch. Its logits can: the batch's shape changes the order
of floating-point sums (decode length groups, BLAS blocking, prefill chunks), so the same seed can give a
different token in a different batch when two tokens nearly tie (greedy) or a draw lands at the edge between
two tokens' probability mass (sampling). The tests' tiny fp32 models show no such near-ties."""
from __future__ import annotations

import torch
from torch import Tensor

from llmso_lab.engine.logits_processors import finite_logits, process_logits, token_logprobs
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
    """Draw one token id from fp32 logits [V] (already processed): argmax if greedy; else temperature, then min-p
    (drop tokens below min_p times the top probability, vLLM's order), top-k / top-p, softmax and one draw."""
    logits = finite_logits(logits)
    if params.greedy:
        return int(logits.argmax())
    logits = finite_logits(logits / params.temperature)
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    probs = filter_logits(logits, params.top_k, params.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    def __init__(self, eos_token_ids=frozenset()) -> None:
        self.eos_token_ids = eos_token_ids

    @torch.inference_mode()
    def __call__(self, logits: Tensor, seqs: list) -> list[int]:
        """logits [N, V] fp32, one row per sequence -> N token ids. Greedy rows that process nothing share one argmax;
        a sequence that asked for logprobs gets this token's appended to `seq.logprobs`."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if not p.greedy or p.processes_logits:
                tokens[i] = self.sample(logits[i], seq)
            elif p.logprobs is not None:
                seq.logprobs.append(token_logprobs(logits[i], tokens[i], p.logprobs))
        return tokens

    def sample(self, logits: Tensor, seq) -> int:
        """One token for `seq` from its logits row [V] (per-request generators live on the host)."""
        p, row = seq.sampling_params, logits.float().cpu()
        processed = process_logits(row, p, seq.prompt_token_ids, seq.output_token_ids, self.eos_token_ids) \
            if p.processes_logits else row
        token = sample_token(processed, p, seq.generator)
        if p.logprobs is not None:
            seq.logprobs.append(token_logprobs(row, token, p.logprobs))
        return token
