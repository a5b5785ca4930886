"""The delegation scan: which library callables would answer an exercise for the student?

While an exercise is graded its reference, its oracle and its `tripwires` are disabled. A submission can still
call any *other* function of the library that happens to compute the same thing (Lab 10's StreamingLLM keep-set
was also `kv.streaming.streaming_block_keep`, in blocks). `delegation_scan` finds them: for each exercise, every
function and class of the student's library copy (the package without `grading/`, `bench/`, `cli` and `demo`)
whose signature accepts the exercise's public cases is called on them, with the exercise's references disabled
as in its grading job; a callable that passes every public case is reported, and must join the exercise's
`tripwires`. `tests/test_grading_delegation.py` runs it over every lab.

Calls run in a worker process (one thread, a time limit per call, killed and restarted when a call hangs), so a
candidate that loops, forks or allocates far too much costs only its own verdict.
"""
from __future__ import annotations

import importlib
import inspect
import multiprocessing as mp
import pkgutil
from collections.abc import Iterable, Sequence

from llmso_lab.grading.registry import Exercise, resolve

__all__ = ["SKIPPED_MODULES", "SHARED_HELPERS", "library_callables", "candidates", "delegation_scan",
           "reference_dependencies"]

# Not scanned: the grader itself (its specs are not in the grading job's library), benchmark drivers (minutes each,
# they print and write files), the command line and the demo.
SKIPPED_MODULES = ("llmso_lab.grading", "llmso_lab.bench", "llmso_lab.cli", "llmso_lab.demo", "llmso_lab.__main__",
                   # its functions compile C++ on first use (~30 s, under a file lock): a scan call timed out and
                   # killed mid-build leaves the lock behind, and every later build waits on it
                   "llmso_lab.engine.native")


def library_callables() -> list[str]:
    """'module:name' of every function and class defined at module level in the scanned part of the package."""
    import llmso_lab

    refs = []
    for info in pkgutil.walk_packages(llmso_lab.__path__, "llmso_lab."):
        if info.name.startswith(SKIPPED_MODULES):
            continue
        try:
            mod = importlib.import_module(info.name)
        except Exception:   # noqa: BLE001 - e.g. a Triton module on a machine without triton: nothing to call
            continue
        for name, obj in vars(mod).items():
            if name.startswith("__") or getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                refs.append(f"{info.name}:{name}")
    return sorted(set(refs))


def _fits(obj: Any, ex: Exercise, cases: Sequence) -> bool:
    """Does `obj` accept every case's arguments (and, for a class exercise, have the methods the cases call)?"""
    if ex.kind == "class" and not inspect.isclass(obj):
        return False
    if ex.kind == "function" and inspect.isclass(obj) and issubclass(obj, BaseException):
        return False
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    params = list(sig.parameters.values())
    if not [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]:
        return False   # (*args, **kwargs) alone: a wrapper, it says nothing about what it computes
    for case in cases:
        try:
            sig.bind(*case.args, **case.kwargs)
        except TypeError:
            return False
        if ex.kind == "class" and not all(callable(getattr(obj, m, None)) for m, _, _ in case.calls or []):
            return False
    return True


def _fits_harness(obj: Any, ex: Exercise) -> bool:
    """A mechanism exercise's candidate plays the student's object: a class where the reference is one (with its public
    methods), else a function, either taking as many positional arguments as the reference requires."""
    ref = resolve(ex.reference)
    if inspect.isclass(ref) != inspect.isclass(obj) or (inspect.isclass(obj) and issubclass(obj, BaseException)):
        return False
    try:
        sig, ref_sig = inspect.signature(obj), inspect.signature(ref)
    except (TypeError, ValueError):
        return False
    if not [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]:
        return False
    required = [p for p in ref_sig.parameters.values() if p.default is p.empty and p.kind in
                (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    try:
        sig.bind(*[None] * len(required))
    except TypeError:
        return False
    methods = [n for n, v in vars(ref).items() if callable(v) and not n.startswith("_")] if inspect.isclass(ref) else []
    return all(callable(getattr(obj, m, None)) for m in methods)


def candidates(ex: Exercise, refs: Iterable[str]) -> list[str]:
    """The callables of `refs` that fit the exercise's public cases and are not disabled for it already."""
    disabled = set(ex.disabled)
    public = [c for c in ex.cases if not c.hidden]
    out = []
    for ref in refs:
        if ref in disabled:
            continue
        try:
            obj = resolve(ref)
        except (ImportError, AttributeError):
            continue
        if _fits_harness(obj, ex) if ex.harness else _fits(obj, ex, public):
            out.append(ref)
    return out


# ---- what a reference's answer depends on ------------------------------------------------------------------------
# Library code that references call and that a student may call too: argument checks, integer helpers, masks, value
# classes and kernel plumbing. They compute no part of an answer on their own; anything else a reference calls must
# be disabled with it (`reference_dependencies` finds them, tests/test_grading_delegation.py holds the line).
SHARED_HELPERS = {
    "llmso_lab.kv.fragmentation:_check", "llmso_lab.quant.rtn:_check", "llmso_lab.sim.comm:_check",
    "llmso_lab.kv.evict:_check_budget", "llmso_lab.spec.verify:_check_alpha_k",     # argument checks
    "llmso_lab.kv.block_manager:cdiv", "llmso_lab.sim.step_logic:_blocks_for",      # ceil division
    "llmso_lab.attention.reference:causal_mask", "llmso_lab.attention.mla:_mask",  # the causal mask
    "llmso_lab.quant.rtn:_groups", "llmso_lab.quant.prune:_groups_of_4",           # reshapes into groups
    "llmso_lab.kv.radix:_common_len",                                               # the length of a common prefix
    "llmso_lab.batching:prefill_chunk",   # min(remaining, budget): the scheduler loop may use it (Lab 02's budget
                                          # exercise, where it is the answer's core, disables it)
    "llmso_lab.engine.sampling_params:SamplingParams", "llmso_lab.engine.sequence:Sequence",
    "llmso_lab.kv.radix:RadixMatch", "llmso_lab.kv.radix:RadixNode", "llmso_lab.quant.distill:TopK",
    "llmso_lab.kv.streaming:StreamingEviction",                                     # value classes
    "llmso_lab.attention.backend:check_kernel_inputs", "llmso_lab.attention.triton_common:dot_precision",
    "llmso_lab.attention.triton_flash:_default_blocks",                             # a kernel's launch plumbing
}


def _names_in(fn) -> set[str]:
    names, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        names |= set(code.co_names)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    return names


def reference_dependencies(ex: Exercise) -> list[str]:
    """The package's functions and classes (outside the grader) that the exercise's reference calls directly, other
    than those disabled with it and the `SHARED_HELPERS`: each would let a submission compose the answer from the
    reference's own parts (a helper plus one op), so each must be disabled too."""
    from llmso_lab.grading.tripwire import _functions

    found = set()
    for fn in _functions(resolve(ex.reference)):
        names = _names_in(fn)
        objs = [fn.__globals__.get(n) for n in names]
        objs += [getattr(m, n, None) for m in objs if inspect.ismodule(m) and m.__name__.startswith("llmso_lab")
                 for n in names]
        for obj in objs:
            module = getattr(obj, "__module__", None) or ""
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and module.startswith("llmso_lab.") \
                    and not module.startswith(SKIPPED_MODULES):
                found.add(f"{module}:{obj.__qualname__}")
    return sorted(found - set(ex.disabled) - SHARED_HELPERS)


# ---- the worker ---------------------------------------------------------------------------------------
def _worker(conn) -> None:
    import torch

    from llmso_lab.grading import judge
    from llmso_lab.grading.protocol import attempt, attempt_call
    from llmso_lab.grading.registry import get_exercise
    from llmso_lab.grading.remote import ChannelClosed, LocalSession
    from llmso_lab.grading.tripwire import Armed, DispatcherTripwire, tripwire

    torch.set_num_threads(1)
    while True:
        try:
            key, ref, index, disabled = conn.recv()
        except EOFError:
            return
        ex = get_exercise(key)
        if ex.harness:   # the candidate plays the student's object, the harness runs around it as in check()
            arm = Armed(disabled, ex.key)

            def run(thunk, raw=False):
                with arm:
                    return attempt_call(thunk, None, raw=raw)
            try:
                outcome = judge.outcome(ex, LocalSession(resolve(ref), run, timeout_s=30.0), ex.cases[index])
            except ChannelClosed as closed:
                outcome = {"ok": False, "category": "error", "error": str(closed)}
        else:
            with tripwire(disabled, ex.key), DispatcherTripwire(disabled, ex.key):
                outcome = attempt(resolve(ref), ex.cases[index], ex.kind, None)   # as the grader's child runs it
        conn.send(outcome)


class _Pool:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s, self.ctx, self.proc, self.conn = timeout_s, mp.get_context("spawn"), None, None

    def call(self, key: str, ref: str, index: int, disabled: tuple[str, ...]) -> dict:
        if self.proc is None:
            self.conn, child = self.ctx.Pipe()
            self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
            self.proc.start()
            child.close()
        try:
            self.conn.send((key, ref, index, disabled))
            if self.conn.poll(self.timeout_s):
                return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            pass
        self.close()   # hung or died: a fresh worker for the next call
        return {"ok": False, "category": "error", "error": "timed out or crashed"}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.proc, self.conn = None, None


def delegation_scan(exs: Sequence[Exercise], refs: Sequence[str] | None = None,
                    timeout_s: float = 10.0) -> dict[str, list[str]]:
    """{exercise key: the candidate callables that pass every public case} (only exercises with such a callable)."""
    from llmso_lab.grading.grader import expected_values
    from llmso_lab.grading.protocol import verdict

    refs = library_callables() if refs is None else list(refs)
    found: dict[str, list[str]] = {}
    pool = _Pool(timeout_s)
    try:
        for ex in exs:
            public = [i for i, c in enumerate(ex.cases) if not c.hidden]
            cands = candidates(ex, refs)
            if not cands or not public:
                continue
            expected = expected_values(ex)
            for ref in cands:
                for i in public:
                    if verdict(ex, ex.cases[i], pool.call(ex.key, ref, i, ex.disabled), expected[i]) is not None:
                        break
                else:
                    found.setdefault(ex.key, []).append(ref)
    finally:
        pool.close()
    return found
