"""Lab 02 (scheduling) exercises and their public checks.

References: `llmso_lab.sim.budget:plan_token_budget` (the decode-first token budget),
`llmso_lab.policies` (`pick_victim`, `policy_key`) and `llmso_lab.serve.metrics:histogram_quantile` (PromQL's
`histogram_quantile` over a server's `/metrics` scrape). The policy exercises take plain data (lists of
dicts), so their expected values come from small oracles below that wrap the library's policy code.
"""
from __future__ import annotations

from types import SimpleNamespace

from llmso_lab.grading.compare import close, exact
from llmso_lab.grading.registry import Case, Exercise, register
from llmso_lab.policies import pick_victim, policy_key

same = exact()
INF = float("inf")
# The policy code the engine and the simulator sort with: disabled while a policy exercise is graded.
POLICY_CODE = ("llmso_lab.policies:policy_key", "llmso_lab.policies:pick_victim", "llmso_lab.policies:serve_order",
               "llmso_lab.engine.policy:SchedulingPolicy")


def _as_seqs(rows: list[dict]) -> list[SimpleNamespace]:
    """Dict rows -> objects with the attributes the policies read (the list position is `index`)."""
    return [SimpleNamespace(request_id=r["request_id"], arrival_time=r["arrival_time"], priority=r.get("priority", 0),
                            predicted_len=r.get("predicted_len", 0), index=i) for i, r in enumerate(rows)]


def victim_oracle(running: list[dict], policy: str, now: float = 0.0, aging: float = 0.0):
    """request_id that `pick_victim` preempts among `running` (None when nothing runs)."""
    seqs = _as_seqs(running)
    return pick_victim(seqs, policy, now, aging).request_id if seqs else None


def sjf_oracle(queue: list[dict], now: float = 0.0, aging: float = 0.0) -> list:
    """request_ids of `queue` in the order SJF with aging serves them (`policy_key(..., "sjf")`)."""
    return [s.request_id for s in sorted(_as_seqs(queue), key=lambda s: policy_key(s, "sjf", now, aging))]


def req(rid, arrival: float, priority: int = 0, predicted_len: float = 0) -> dict:
    return {"request_id": rid, "arrival_time": arrival, "priority": priority, "predicted_len": predicted_len}


_running = [req("a", 0.0, 1, 300), req("b", 2.0, 0, 20), req("c", 1.0, 2, 80), req("d", 0.5, 1, 120)]
_sjf_queue = [req(0, 0.0, predicted_len=500), req(1, 4.0, predicted_len=50), req(2, 6.0, predicted_len=200),
              req(3, 7.0, predicted_len=50)]

register(
    Exercise("plan_token_budget", "02", 45, "llmso_lab.sim.budget:plan_token_budget", [
        Case("3 decodes, then prompts chunked into the leftover 29 tokens",
             (["d1", "d2", "d3"], [("a", 10), ("b", 100), ("c", 5)], 32)),
        Case("chunked prefill off: 'b' does not fit whole, and 'c' may not jump the queue",
             (["d1"], [("a", 10), ("b", 100), ("c", 5)], 32), {"enable_chunked_prefill": False}),
        Case("max_num_seqs=3 caps the batch", ([0, 1], [("p", 3), ("q", 3)], 100), {"max_num_seqs": 3}),
        Case("no decodes: a 2048-token budget over a long prompt", ([], [("long", 5000), ("short", 8)], 2048)),
    ], compare=same, tripwires=("llmso_lab.sim.budget:prefill_chunk", "llmso_lab.batching:prefill_chunk"),
        description="one step's decode-first token budget: decodes take 1 token each, prefills chunk the rest"),
    Exercise("choose_victim", "02", 25, "llmso_lab.policies:pick_victim", [
        Case("fcfs preempts the latest arrival", (_running, "fcfs")),
        Case("priority preempts the largest (priority, arrival)", (_running, "priority")),
        Case("sjf preempts the longest predicted job", (_running, "sjf")),
    ], compare=same, oracle="llmso_lab.grading.specs.lab02:victim_oracle", tripwires=POLICY_CODE,
        description="which running request to preempt when KV blocks run out, by policy"),
    Exercise("sjf_order", "02", 15, "llmso_lab.policies:policy_key", [
        Case("no aging: shortest predicted output first, ties by arrival", (_sjf_queue,), {"now": 8.0}),
        Case("aging 80 tokens/s at t=8: the 500-token job has waited 8 s (640 tokens of credit) and moves up",
             (_sjf_queue,), {"now": 8.0, "aging": 80.0}),
    ], compare=same, oracle="llmso_lab.grading.specs.lab02:sjf_oracle", tripwires=POLICY_CODE,
        description="the order in which shortest-job-first with aging serves a waiting queue"),
    Exercise("histogram_quantile", "02", 15, "llmso_lab.serve.metrics:histogram_quantile", [
        Case("p50 of a TTFT histogram: interpolated inside the (0.1, 0.25] bucket",
             (0.5, [[0.05, 2.0], [0.1, 5.0], [0.25, 14.0], [0.5, 18.0], [INF, 20.0]])),
        Case("p99 falls in the +Inf bucket: the highest finite bound",
             (0.99, [[0.05, 2.0], [0.1, 5.0], [0.25, 14.0], [0.5, 18.0], [INF, 20.0]])),
        Case("p90 in the first bucket: its lower bound is 0", (0.9, [[1.0, 10.0], [2.0, 10.0], [INF, 10.0]])),
        Case("no observations yet: NaN", (0.5, [[0.1, 0.0], [INF, 0.0]])),
    ], compare=close(atol=1e-9, rtol=1e-9), tripwires=("llmso_lab.serve.metrics:histogram_buckets",),
        description="PromQL histogram_quantile: the q-quantile from cumulative buckets by linear interpolation"),
)
