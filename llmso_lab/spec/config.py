"""`speculative_config`: which drafter proposes tokens and how many (vLLM's names, `LLM(speculative_config={...})`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "medusa", "eagle", "custom")


@dataclass(slots=True)
class SpeculativeConfig:
    """- method "ngram": prompt lookup (no model): the tokens that followed the last `prompt_lookup_min`..`max`
      tokens the previous time they occurred in the sequence;
    - "draft_model": a small model with the target's tokenizer, `model` (a registry name or a Hugging Face model),
      optionally weight-quantized (`quantization`, as `LLM(quantization=...)`: "int4" makes the target itself a draft);
    - "medusa" / "eagle": draft heads on the target's hidden state, loaded from `model` (a path; None: the
      project's trained heads for SmolLM2 in data/spec/);
    - "custom": `drafter`, any object with the `spec.drafters.Drafter` methods (at least `propose`), e.g. a lab's
      own drafter: the seam a drafter written outside the library plugs into.
    `num_speculative_tokens` (k) drafts are verified per step in one forward of the target."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: Any = None
    quantization: str | None = None
    drafter: Any = None

    @classmethod
    def from_dict(cls, d: dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                             f"got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization", "drafter"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; valid: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config needs {key!r} (method: one of {', '.join(SPEC_METHODS)})")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; valid: {', '.join(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an int in [1, 32] (draft tokens per step), got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max (n-gram sizes), got {lo} and {hi}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method 'draft_model' needs 'model': a registry name (e.g. 'smollm2-135m' with "
                             "'quantization': 'int4') or a Hugging Face model sharing the target's tokenizer")
        if (self.method == "custom") != (self.drafter is not None):
            raise ValueError("'drafter' goes with method 'custom' and method 'custom' needs 'drafter' (an object with "
                             "a propose(items) method, see llmso_lab.spec.drafters.Drafter)")
        if self.drafter is not None and not callable(getattr(self.drafter, "propose", None)):
            raise ValueError(f"the drafter {type(self.drafter).__name__} has no propose(items) method "
                             "(see llmso_lab.spec.drafters.Drafter)")
