"""Scheduling policies as sort keys: the smallest key is served first, the largest is preempted first.

  fcfs      (arrival_time,)                       vLLM's default; preempts the latest arrival
  priority  (priority, arrival_time)              lower value first (vLLM --scheduling-policy priority)
  sjf       (predicted_output_len - aging * waited_s, arrival_time)
            shortest predicted job first; `aging` (tokens per second waited) lets a long job's key
            fall until it beats newly arrived short jobs, so its wait is bounded (no starvation)
"""
from __future__ import annotations

from typing import Iterable, Protocol, TypeVar

__all__ = ["POLICIES", "policy_key", "pick_victim"]

POLICIES = ("fcfs", "priority", "sjf")


class Schedulable(Protocol):
    arrival_time: float
    priority: int
    predicted_len: float
    index: int           # position in the workload: the final tie-breaker


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
    raise ValueError(f"unknown scheduling_policy {policy!r}; use one of {POLICIES}")


def pick_victim(candidates: Iterable[S], policy: str, now: float = 0.0, aging: float = 0.0) -> S:
    """The sequence to preempt: the one the policy would serve last."""
    return max(candidates, key=lambda s: policy_key(s, policy, now, aging))
