"""How the engine applies a scheduling policy; the keys themselves live in `llmso_lab.policies`.

SJF needs a predicted output length. "oracle" uses the request's max_tokens (exact when EOS is ignored),
"mean" a running mean of finished output lengths (capped by max_tokens), or pass a callable(seq) -> float.
Before ordering, the policy writes each sequence's `predicted_len` (tokens still to generate). Aging is in
predicted tokens forgiven per second waited on the engine clock, as in the simulator.
"""
from __future__ import annotations

from typing import Callable, Iterable

from llmso_lab.engine.sequence import Sequence
from llmso_lab.policies import POLICIES, pick_victim, serve_order


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs", predictor: str | Callable[[Sequence], float] = "oracle",
                 aging: float = 0.0, prior_mean: float = 128.0) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown scheduling_policy {name!r}; valid: {', '.join(POLICIES)}")
        if not (callable(predictor) or predictor in ("oracle", "mean")):
            raise ValueError(f"unknown sjf predictor {predictor!r}; valid: 'oracle', 'mean' or a callable(seq) -> float")
        if aging < 0:
            raise ValueError(f"sjf_aging must be >= 0 (tokens per second waited), got {aging}")
        self.name, self.predictor, self.aging = name, predictor, aging
        self.mean, self.num_finished = prior_mean, 0

    def predict(self, seq: Sequence) -> float:
        """Predicted total output length of `seq`."""
        if callable(self.predictor):
            return float(self.predictor(seq))
        if self.predictor == "oracle":
            return float(seq.sampling_params.max_tokens)
        return min(self.mean, float(seq.sampling_params.max_tokens))

    def _refresh(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        seqs = list(seqs)
        if self.name == "sjf":
            for s in seqs:
                s.predicted_len = self.predict(s) - s.num_output_tokens
        return seqs

    def order(self, queue: Iterable[Sequence], now: float) -> list[Sequence]:
        return serve_order(self._refresh(queue), self.name, now, self.aging)

    def victim(self, running: Iterable[Sequence], now: float) -> Sequence:
        return pick_victim(self._refresh(running), self.name, now, self.aging)

    def on_finish(self, seq: Sequence) -> None:
        self.num_finished += 1   # running mean of observed output lengths ("mean" predictor)
        self.mean += (seq.num_output_tokens - self.mean) / self.num_finished
