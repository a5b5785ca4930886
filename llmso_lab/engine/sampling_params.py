"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 means greedy (argmax). top_k=-1 and top_p=1.0 switch those filters off.
    seed gives the request its own random generator, so its random draws do not depend on the rest of the batch
    (its logits may, at near-ties: see `llmso_lab.engine.sampler`).
    n > 1 returns n completions of one prompt: the prompt is computed once and its KV blocks are shared
    (copy-on-write). Sample i draws from a generator seeded `seed + i`, so `n=4, seed=s` gives what four
    requests with n=1 and seeds s, s+1, s+2, s+3 give.
    """

    n: int = 1
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise ValueError with a helpful message if a field is out of range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (the number of completions), got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
