"""Scheduling policies as sort keys — one definition for the engine and the simulator.

The smallest key is served first (admission order of the waiting queue); the largest is preempted first
(the victim when KV blocks run out).

  fcfs      (arrival_time, index)                  vLLM's default; preempts the latest arrival
  priority  (priority, arrival_time, index)        lower value first (vLLM --scheduling-policy priority)
  sjf       (predicted_len - aging * waited_s, arrival_time, index)
            shortest predicted job first. `predicted_len` is the predicted number of output tokens still
            to generate; `aging` (tokens per second waited, `waited_s = now - arrival_time`) lets a long
            job's key fall until it beats newly arrived short jobs, so its wait is bounded (no starvation).
            aging = 0 is textbook SJF.

`llmso_lab.engine` calls these with its own clock (`engine/policy.py` predicts `predicted_len`), the
simulator with simulated time, and Lab 02's exercises re-implement `pick_victim` and the SJF order.
"""
from __future__ import annotations

from typing import Iterable, Protocol, TypeVar

__all__ = ["POLICIES", "Schedulable", "policy_key", "pick_victim", "serve_order"]

POLICIES = ("fcfs", "priority", "sjf")


class Schedulable(Protocol):
    arrival_time: float
    priority: int
    predicted_len: float  # predicted output tokens still to generate (sjf)
    index: int            # position in the workload / engine sequence id: the final tie-breaker


S = TypeVar("S", bound=Schedulable)


def policy_key(seq: Schedulable, policy: str, now: float = 0.0, aging: float = 0.0) -> tuple:
    """Sort key of `seq` under `policy` at time `now` (s)."""
    if policy == "fcfs":
        return (seq.arrival_time, seq.index)
    if policy == "priority":
        return (seq.priority, seq.arrival_time, seq.index)
    if policy == "sjf":
        waited = max(0.0, now - seq.arrival_time)
        return (seq.predicted_len - aging * waited, seq.arrival_time, seq.index)
    raise ValueError(f"unknown scheduling_policy {policy!r}; valid: {', '.join(POLICIES)}")


def serve_order(queue: Iterable[S], policy: str, now: float = 0.0, aging: float = 0.0) -> list[S]:
    """`queue` in the order the policy serves it."""
    return sorted(queue, key=lambda s: policy_key(s, policy, now, aging))


def pick_victim(candidates: Iterable[S], policy: str, now: float = 0.0, aging: float = 0.0) -> S:
    """The sequence to preempt: the one the policy would serve last."""
    return max(candidates, key=lambda s: policy_key(s, policy, now, aging))
