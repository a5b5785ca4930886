"""Beam search (vLLM's `LLM.beam_search` / `BeamSearchParams`), scored as Hugging Face `generate` scores it.

A request keeps `beam_width` live beams. Each step every live beam gives the log-probabilities of its next
token; the candidates are all (beam, token) pairs scored by `beam's cumulative log-prob + log p(token)`.
The engine side (`LLM.beam_search`) turns the chosen candidates into KV operations: a beam chosen k times is
forked k - 1 times (its blocks shared copy-on-write), a beam chosen 0 times is pruned (its blocks freed).

The rules follow Hugging Face `generate(num_beams=W, do_sample=False, early_stopping=True)`:
- the best K = max(2, 1 + #EOS ids) x W candidates are ranked;
- a candidate that ends with EOS, or reaches `max_tokens`, is a finished hypothesis if it ranks among the
  best W candidates, scored `cum_logprob / generated_len ** length_penalty` (EOS counted in the length);
- the best W other candidates are the next live beams;
- the search stops when W hypotheses have finished (early_stopping=True) or when every candidate finished.
vLLM's own beam search scores differently: it divides by the whole sequence's length, prompt included, and
leaves EOS out of that length; with prompts of different lengths that can rank finished beams differently.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from llmso_lab.engine.sequence import Sequence


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]         # prompt + output (vLLM's convention)
    cum_logprob: float        # sum of the output tokens' log-probabilities
    score: float              # cum_logprob / output_len ** length_penalty: what the beams are ranked by
    text: str = ""            # the decoded output (without the prompt)
    finish_reason: str = ""   # "stop" (EOS) | "length" (max_tokens)


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first; beam_width of them


@dataclass(slots=True)
class Candidate:
    parent: int        # index of the live beam it extends
    token: int
    cum_logprob: float


@dataclass(eq=False)
class BeamSearchGroup:
    """One prompt's search state. `beams[i]` is live with cumulative log-prob `scores[i]`."""
    request_id: str
    prompt_len: int
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    beams: list[Sequence] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    pending: dict[int, Tensor] = field(default_factory=dict)   # seq_id -> log-probs [V] of its next token
    done: bool = False

    def ready(self) -> bool:
        """Has every live beam given its next-token log-probs?"""
        return not self.done and all(b.seq_id in self.pending for b in self.beams)

    def step(self) -> list[Candidate]:
        """Rank the candidates, record the finished hypotheses; return the next live beams' candidates
        (best first). Sets `done` when the search is over."""
        W, V = self.params.beam_width, next(iter(self.pending.values())).shape[-1]
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        acc = torch.stack([self.pending[b.seq_id] + s for b, s in zip(self.beams, self.scores)])   # [B, V] fp32
        self.pending.clear()
        values, indices = acc.flatten().topk(min(max(2, 1 + len(eos)) * W, acc.numel()))
        gen_len = len(self.beams[0].token_ids) - self.prompt_len + 1
        was_full, live, hits = len(self.finished) == W, [], 0
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            parent, token = divmod(index, V)
            if token in eos or gen_len >= self.params.max_tokens:
                hits += 1
                if rank < W and not was_full:   # only the best W may finish (the rest are spares)
                    self.finished.append(BeamSearchSequence(
                        self.beams[parent].token_ids + [token], value, value / gen_len ** self.params.length_penalty,
                        finish_reason="stop" if token in eos else "length"))
            elif len(live) < W:
                live.append(Candidate(parent, token, value))
        self.finished = sorted(self.finished, key=lambda h: h.score, reverse=True)[:W]
        self.done = len(self.finished) == W or hits == len(values)
        return [] if self.done else live
