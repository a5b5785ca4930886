"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2   # vLLM's _MAX_TEMP: 0 < temperature < 1e-2 is sampled at 1e-2 (dividing by less overflows fp32)


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 means greedy (argmax); 0 < temperature < 1e-2 is raised to 1e-2, as vLLM does (logits divided by
    less overflow). top_k=-1 and top_p=1.0 switch those filters off.
    seed gives the request its own random generator, so its random draws do not depend on the rest of the batch
    (its logits may, at near-ties: see `llmso_lab.engine.sampler`).
    n > 1 returns n completions of one prompt: the prompt is computed once and its KV blocks are shared
    (copy-on-write). Sample i draws from a generator seeded `seed + i`, so `n=4, seed=s` gives what four
    requests with n=1 and seeds s, s+1, s+2, s+3 give.

    What the OpenAI API adds (vLLM's meanings; `engine.sampler.process_logits` applies them, greedy included):
    `repetition_penalty` (> 1 discourages every token already in the prompt or the output: a positive logit is
    divided by it, a negative one multiplied, as Hugging Face does), `frequency_penalty` / `presence_penalty`
    (subtracted from a token's logit per occurrence in the output / once if it occurs there, as OpenAI defines them),
    `min_p` (after temperature: drop tokens whose probability is below min_p times the top token's), `min_tokens`
    (EOS and the stop ids are masked until that many tokens are out), `stop` (strings: the answer ends before the
    first one that appears in its text; needs a tokenizer), `logprobs` (k: each output token's log-probability and
    the k most likely tokens', from the model's raw distribution, as vLLM reports them by default).
    """

    n: int = 1
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop: list[str] | str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise ValueError with a helpful message if a field is out of range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (the number of completions), got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:   # vLLM's rule: below 1e-2 the division overflows; sample at 1e-2
            self.temperature = MIN_TEMPERATURE
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int64 (-2**63 <= seed < 2**63), got {self.seed!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and 0 <= t < 2**63 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (OpenAI's range), got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an int in [0, 20] (top tokens per position), got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Does this request change its logits before sampling (a penalty or min_tokens)?"""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)
