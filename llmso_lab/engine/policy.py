"""Scheduling policies: who is admitted first, and who is preempted first when KV blocks run out.

- fcfs: admission in arrival order (the waiting queue's order: preempted requests go back to its front);
  victim = the latest arrival (vLLM's default).
- priority: lower `priority` value first, ties by arrival; victim = largest (priority, arrival).
- sjf: shortest predicted job first. The job length is a predicted output length: "oracle" uses the
  request's max_tokens (exact when EOS is ignored), "mean" a running mean of finished output lengths
  (capped by max_tokens). Aging guards against starvation: every step a request waits lowers its key by
  `aging` tokens, so a long job is eventually admitted however many short ones keep arriving.
"""
from __future__ import annotations

from typing import Callable, Iterable

from llmso_lab.engine.sequence import Sequence

POLICIES = ("fcfs", "priority", "sjf")


class FCFSPolicy:
    name = "fcfs"

    def order(self, queue: Iterable[Sequence]) -> list[Sequence]:
        return list(queue)

    def victim(self, running: Iterable[Sequence]) -> Sequence:
        return max(running, key=lambda s: (s.arrival_time, s.seq_id))

    def on_finish(self, seq: Sequence) -> None:
        pass


class PriorityPolicy(FCFSPolicy):
    name = "priority"

    @staticmethod
    def key(s: Sequence) -> tuple:
        return (s.priority, s.arrival_time, s.seq_id)

    def order(self, queue: Iterable[Sequence]) -> list[Sequence]:
        return sorted(queue, key=self.key)

    def victim(self, running: Iterable[Sequence]) -> Sequence:
        return max(running, key=self.key)


class SJFPolicy(FCFSPolicy):
    name = "sjf"

    def __init__(self, predictor: str | Callable[[Sequence], float] = "oracle", aging: float = 1.0,
                 prior_mean: float = 128.0) -> None:
        if not (callable(predictor) or predictor in ("oracle", "mean")):
            raise ValueError(f"unknown sjf predictor {predictor!r}; valid: 'oracle', 'mean' or a callable(seq) -> float")
        self.predictor, self.aging = predictor, aging
        self.mean, self.num_finished = prior_mean, 0

    def predict(self, s: Sequence) -> float:
        """Predicted total output length of `s`."""
        if callable(self.predictor):
            return float(self.predictor(s))
        if self.predictor == "oracle":
            return float(s.sampling_params.max_tokens)
        return min(self.mean, float(s.sampling_params.max_tokens))

    def key(self, s: Sequence) -> tuple:
        remaining = self.predict(s) - s.num_output_tokens
        return (remaining - self.aging * s.num_waiting_steps, s.arrival_time, s.seq_id)

    def order(self, queue: Iterable[Sequence]) -> list[Sequence]:
        return sorted(queue, key=self.key)

    def victim(self, running: Iterable[Sequence]) -> Sequence:
        return max(running, key=lambda s: (self.predict(s) - s.num_output_tokens, s.arrival_time, s.seq_id))

    def on_finish(self, seq: Sequence) -> None:
        self.num_finished += 1   # running mean of observed output lengths
        self.mean += (seq.num_output_tokens - self.mean) / self.num_finished


def make_policy(name: str, **kwargs) -> FCFSPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "sjf":
        return SJFPolicy(**kwargs)
    raise ValueError(f"unknown scheduling_policy {name!r}; valid: {', '.join(POLICIES)}")
