"""The grader's side of the mechanism exercises: each library harness run HERE, on a proxy of the student's code.

`run(ex, session, case)` runs the harness of `ex` in the grading process with the student's function or class
replaced by a `remote` proxy, so the engine, the ranks' collectives, the pipeline's logical clock and the comparison
all live where student code cannot reach them (`remote`'s docstring says why). What the proxies send the child is
the arguments the harness would have passed (an engine sequence's fields, a cache to write into), as plain data.

Most harnesses take the proxy as they are (`Session.function()` behaves like the student's function). Those whose
student object is a class, mutates what it is given or runs as several ranks have an adapter here (`ADAPTERS`,
keyed by the harness): the drafter and the eviction policy become library-shaped classes whose methods forward; the
KV receiver writes into a copy of the caches that is copied back; the TP MLP's all-reduce is summed here (a star
all-reduce: each rank's contribution and count recorded by the grader); the pipeline stage's compute, send and recv
are carried out here on the logical clock. The reports are built by the same functions the in-notebook harnesses
use (`tensor.tp_mlp_report`, `pipeline.pipeline_stage_report`), so `check()` and the grade judge alike.
"""
from __future__ import annotations

import copy
from collections import deque
from typing import Any, Callable

import torch

from llmso_lab.grading.compare import to_plain
from llmso_lab.grading.protocol import describe
from llmso_lab.grading.registry import Case, Exercise, resolve
from llmso_lab.grading.remote import Callback, Namespace, Record, Session, StudentFailure

__all__ = ["ADAPTERS", "outcome", "run"]


def outcome(ex: Exercise, session: Session, case: Case) -> dict:
    """One case's outcome as the child reports one ({"ok": True, "value": plain data} or the error): the harness run
    here on the student's object. A child that is gone, too slow or malformed raises `ChannelClosed`."""
    try:
        value = run(ex, session, case)
    except StudentFailure as failure:
        return failure.outcome
    except Exception as exc:   # noqa: BLE001 - the harness refused what the student's code did (e.g. a bad proposal)
        return {"ok": False, **describe(exc, None)}
    try:
        return {"ok": True, "value": to_plain(value)}
    except TypeError as exc:
        return {"ok": False, "category": "type", "error": str(exc)}


def run(ex: Exercise, session: Session, case: Case) -> Any:
    """The harness of `ex` on case `case`, with the student's object living behind `session`."""
    args, kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    adapter = ADAPTERS.get(ex.harness)
    if adapter is not None:
        return adapter(session, *args, **kwargs)
    return resolve(ex.harness)(session.function(), *args, **kwargs)


# ---- engine sequences, as the student's code reads them ----------------------------------------------------------
SEQ_FIELDS = ("seq_id", "request_id", "prompt_token_ids", "token_ids", "num_computed_tokens", "num_cached_tokens",
              "block_table", "num_dropped_blocks", "num_tokens", "num_prompt_tokens", "num_output_tokens",
              "output_token_ids", "num_uncomputed_tokens", "is_prefill")


def seq_view(seq) -> Namespace:
    """A sequence's fields (properties included, as values) for the student's code: a copy, never the engine's."""
    return Namespace(**{f: copy.copy(getattr(seq, f)) for f in SEQ_FIELDS})


# ---- Lab 07: the drafter ----------------------------------------------------------------------------------------
def drafter(session: Session, *args, **kwargs) -> dict:
    from llmso_lab.spec.drafters import Drafter
    from llmso_lab.spec.harness import run_drafter

    class RemoteDrafter(Drafter):
        def __init__(self, *a) -> None:
            self.obj = session.new(*a)
            if "llmso_lab.spec.drafters.Drafter" not in self.obj.bases:
                raise ValueError("the drafter must subclass llmso_lab.spec.drafters.Drafter")

        def propose(self, items):
            wire = [Namespace(seq=seq_view(i.seq), num_lookahead=i.num_lookahead) for i in items]
            proposals, (after,), _ = self.obj.call("propose", wire, returns_args=(0,))
            if not isinstance(after, list) or len(after) != len(items) or any(
                    not isinstance(a, dict) or not isinstance(a.get("seq"), dict)
                    or a["seq"].get("token_ids") != list(i.seq.token_ids) for a, i in zip(after, items)):
                raise ValueError("propose changed seq.token_ids: the sequence's tokens belong to the engine, a drafter "
                                 "only reads them (drafts go in the returned list)")
            return proposals

        def observe(self, seq, hidden) -> None:
            self.obj.call("observe", seq_view(seq), hidden.detach().clone())

        def copy_blocks(self, mapping) -> None:
            self.obj.call("copy_blocks", [list(m) for m in mapping])

        def forget(self, seq_id: int) -> None:
            self.obj.call("forget", seq_id)

    return run_drafter(RemoteDrafter, *args, **kwargs)


# ---- Lab 10: the StreamingLLM eviction policy ------------------------------------------------------------------
def eviction_policy(session: Session, *args, **kwargs) -> dict:
    from llmso_lab.kv.streaming import run_policy_in_engine

    class RemotePolicy:
        """`cap(seq, n)` forwarded; the blocks the student's policy released (its `release` calls, logged in the
        child) are released here in order, then the table and drop count it left are put on the engine's sequence."""

        def __init__(self, num_sink_blocks, window_blocks, block_size, release) -> None:
            self.release = release
            self.obj = session.new(num_sink_blocks, window_blocks, block_size, Record("release"))

        def cap(self, seq, n: int) -> int:
            got, (after,), log = self.obj.call("cap", seq_view(seq), n, returns_args=(0,))
            for name, call_args in log:
                if name != "release" or len(call_args) != 1 or not isinstance(call_args[0], int):
                    raise ValueError(f"release takes one block id, got {call_args!r:.80}")
                self.release(call_args[0])
            table, dropped = after.get("block_table"), after.get("num_dropped_blocks")
            if not isinstance(table, list) or not all(b is None or type(b) is int for b in table) \
                    or type(dropped) is not int:
                raise ValueError("cap must leave seq.block_table a list of block ids and seq.num_dropped_blocks an int")
            seq.block_table[:] = table
            seq.num_dropped_blocks = dropped
            if isinstance(got, bool) or not isinstance(got, int):
                raise ValueError(f"cap must return the number of tokens (an int), got {type(got).__name__}")
            return got

    return run_policy_in_engine(RemotePolicy, *args, **kwargs)


# ---- Lab 09: the KV receiver (writes into the caches it is given) -------------------------------------------------
def kv_receiver(session: Session, *args, **kwargs) -> dict:
    from llmso_lab.disagg.handoff import run_receiver

    return run_receiver(session.function(returns_args=(0,)), *args, **kwargs)


# ---- Lab 08: the TP MLP, its all-reduce summed here -----------------------------------------------------------------
class StarAllReduce:
    """The ranks' `group.all_reduce`, carried out by the grader: contribution k of every rank is summed (rank order)
    and returned to all of them. `sent[r]` is what rank r contributed, recorded here."""

    def __init__(self, n: int) -> None:
        self.n, self.sent, self.waiting, self.done = n, [[] for _ in range(n)], {}, set()

    def request(self, rank: int, name: str, args: list) -> list:
        if name != "all_reduce" or len(args) != 1 or type(args[0]) is not torch.Tensor:
            return [(rank, TypeError(f"all_reduce takes one tensor, got {args!r:.80}"))]
        self.sent[rank].append(args[0].detach().clone())
        k = len(self.sent[rank]) - 1
        self.waiting[rank] = k
        late = [r for r in self.done if len(self.sent[r]) <= k]
        if late:
            return self._fail(k, f"rank {late[0]} returned after {len(self.sent[late[0]])} all-reduce(s)")
        if not all(len(self.sent[r]) > k for r in range(self.n)):
            return []
        parts = [self.sent[r][k] for r in range(self.n)]
        if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
            return self._fail(k, "the ranks handed all_reduce tensors of different shapes or dtypes "
                                 f"({sorted({(tuple(p.shape), str(p.dtype)) for p in parts})})")
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        out = [(r, total.clone()) for r in range(self.n)]
        for r in range(self.n):
            self.waiting.pop(r, None)
        return out

    def _fail(self, k: int, why: str) -> list:
        waiting = [r for r, kk in self.waiting.items() if kk == k]
        for r in waiting:
            self.waiting.pop(r)
        return [(r, RuntimeError(f"all_reduce #{k + 1} cannot complete: {why}; every rank must call all_reduce the "
                                 "same number of times, with tensors of one shape")) for r in waiting]

    def finished(self, rank: int) -> list:
        self.done.add(rank)
        stuck = [k for r, k in self.waiting.items() if len(self.sent[rank]) <= k]
        return self._fail(stuck[0], f"rank {rank} returned after {len(self.sent[rank])} all-reduce(s)") if stuck else []

    def stuck(self, ranks: list[int]) -> list:
        return [(r, RuntimeError("all_reduce cannot complete")) for r in ranks]


def tp_mlp(session: Session, tp: int, num_tokens: int = 5, hidden: int = 16, intermediate: int = 24,
           seed: int = 0) -> dict:
    from llmso_lab.parallel.tensor import tp_mlp_case, tp_mlp_report

    x, gate, up, down = tp_mlp_case(tp, num_tokens, hidden, intermediate, seed)
    star = StarAllReduce(tp)
    group = lambda r: Namespace(rank=r, size=tp, all_reduce=Callback("all_reduce", inplace=0))  # noqa: E731
    ys = session.ranks(tp, [(x, gate, up, down, group(r)) for r in range(tp)], star)
    return tp_mlp_report(x, gate, up, down, ys, star.sent)


# ---- Lab 08: a pipeline stage, its compute / send / recv carried out here on the logical clock --------------------
class LogicalPipeline:
    """compute, send and recv of every stage, with the logical clock of `pipeline._schedule_rank`: a compute takes one
    slot, a message carries its sender's clock, a receiver's clock moves to the message's stamp."""

    def __init__(self, p: int, rows: int, hidden: int, seed: int) -> None:
        self.p, self.rows, self.hidden, self.seed = p, rows, hidden, seed
        self.clock = [0.0] * p
        self.logical: list[list[tuple[float, float]]] = [[] for _ in range(p)]
        self.queues: dict[tuple[int, int], deque] = {}
        self.waiting: dict[int, int] = {}   # a stage blocked in recv -> the stage it waits for

    def _check(self, rank: int, t: Any, what: str) -> torch.Tensor:
        if type(t) is not torch.Tensor or tuple(t.shape) != (self.rows, self.hidden):
            raise ValueError(f"stage {rank}: {what} takes one micro-batch's activations [{self.rows}, {self.hidden}], "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        return t.detach().float()

    def _peer(self, rank: int, peer: Any, what: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.p or peer == rank:
            raise ValueError(f"stage {rank}: {what} stage {peer!r}; the stages are 0..{self.p - 1}")
        return peer

    def _take(self, rank: int, src: int) -> list:
        x, stamp = self.queues[(src, rank)].popleft()
        self.clock[rank] = max(self.clock[rank], stamp)
        return [(rank, x)]

    def request(self, rank: int, name: str, args: list) -> list:
        from llmso_lab.parallel.pipeline import stage_compute

        try:
            if name == "compute" and len(args) == 1:
                x = self._check(rank, args[0], "compute")
                with torch.no_grad():
                    y = stage_compute(rank, x, self.hidden, self.seed)
                self.logical[rank].append((self.clock[rank], self.clock[rank] + 1.0))
                self.clock[rank] += 1.0
                return [(rank, y)]
            if name == "send" and len(args) == 2:
                t, dst = self._check(rank, args[0], "send"), self._peer(rank, args[1], "send to")
                self.queues.setdefault((rank, dst), deque()).append((t.clone(), self.clock[rank]))
                out = [(rank, None)]
                if self.waiting.get(dst) == rank:
                    del self.waiting[dst]
                    out += self._take(dst, rank)
                return out
            if name == "recv" and len(args) == 1:
                src = self._peer(rank, args[0], "recv from")
                if self.queues.get((src, rank)):
                    return self._take(rank, src)
                self.waiting[rank] = src
                return []
            raise TypeError(f"stage {rank}: {name}() got {len(args)} argument(s)")
        except (ValueError, TypeError) as exc:
            return [(rank, exc)]

    def finished(self, rank: int) -> list:
        return []

    def stuck(self, ranks: list[int]) -> list:
        out = [(r, RuntimeError(f"stage {r} waits in recv({self.waiting.get(r)}) for a micro-batch that never comes "
                                "(every other stage is waiting or done: a deadlock)")) for r in ranks]
        self.waiting.clear()
        return out


def pipeline_stage(session: Session, num_stages: int, num_microbatches: int, rows: int = 2, hidden: int = 8,
                   seed: int = 0) -> dict:
    from llmso_lab.parallel.pipeline import pipeline_stage_inputs, pipeline_stage_report

    inputs = pipeline_stage_inputs(num_stages, num_microbatches, rows, hidden, seed)
    pipe = LogicalPipeline(num_stages, rows, hidden, seed)
    args = [(s, num_stages, num_microbatches, inputs if s == 0 else None, Callback("compute"), Callback("send"),
             Callback("recv")) for s in range(num_stages)]
    outs = session.ranks(num_stages, args, pipe)
    return pipeline_stage_report(outs[-1], pipe.logical, None, num_microbatches, rows, hidden, seed)


ADAPTERS: dict[str, Callable[..., Any]] = {
    "llmso_lab.spec.harness:run_drafter": drafter,
    "llmso_lab.kv.streaming:run_policy_in_engine": eviction_policy,
    "llmso_lab.disagg.handoff:run_receiver": kv_receiver,
    "llmso_lab.parallel.tensor:run_tp_mlp": tp_mlp,
    "llmso_lab.parallel.pipeline:run_pipeline_stage": pipeline_stage,
}
