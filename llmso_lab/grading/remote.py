"""Mechanism exercises judged outside the student's process: the harness runs in the grader, the student's code
in the sandbox, and only plain data crosses between them.

A mechanism exercise (`Exercise.harness`) hands the student's function or class to a library harness that runs
it where it belongs: the engine with the student's drafter, two gloo ranks with the student's TP MLP, ... If that
harness ran in the student's process, the student's code could rewrite it, read the expected answer from its
frames, hand the comparison an object that lies, or move the clock it measures with. So in the grader the harness
runs HERE (in the grading process, which never runs student code, with the real library) and the student's object
is replaced by a proxy: every call the harness makes on it becomes one message to the sandboxed child, which calls
the student's code and sends back plain data (`protocol.send`/`recv`: `torch.load(weights_only=True)`). What the
student's code returns is all it can say; the comparison, the expected values, every counter and clock stay here.

The child's side is `serve()`; the grader's side is `Session` (one per job) with:
- `Session.function(returns_args=...)`: a proxy of the student's function (the arguments it mutates, e.g. a cache it
  writes into, come back with the result and are copied into the caller's objects);
- `Session.new(*args)`: an instance of the student's class in the child, whose methods the proxy forwards;
- `Session.ranks(n, args_per_rank, handler)`: the student's function run as n concurrent ranks (threads of the
  child), whose calls to the callbacks they are given (`Callback("all_reduce")`, ...) come here, where `handler`
  carries them out (it sums an all-reduce, delivers a pipeline message, moves a logical clock).
Arguments may hold `Namespace(...)` (rebuilt in the child as an object with those attributes, e.g. an engine
sequence's fields), `Callback(name)` (a function calling back into `handler`) and `Record(name)` (a function whose
calls are logged in the child and returned with the next result, e.g. an eviction policy's `release`).
"""
from __future__ import annotations

import queue
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Namespace", "Callback", "Record", "StudentFailure", "ChannelClosed", "Session", "LocalSession", "serve"]


# ---- argument markers (grader -> child only; the child's answers are never decoded) -----------------------------
@dataclass(slots=True)
class Namespace:
    """An object with these attributes in the child (e.g. a sequence's `token_ids`, `block_table`)."""
    attrs: dict

    def __init__(self, **attrs: Any) -> None:
        self.attrs = attrs


@dataclass(slots=True)
class Callback:
    """A function in the child whose calls come back to the grader's rank handler (ranks mode only). `inplace`: the
    argument (a tensor) that the reply is also copied into, as `torch.distributed.all_reduce` sums in place."""
    name: str
    inplace: int | None = None


@dataclass(slots=True)
class Record:
    """A function in the child that only logs its calls; the log comes back with the next result."""
    name: str


def _encode(obj: Any) -> Any:
    if isinstance(obj, Namespace):
        return {"__ns__": {k: _encode(v) for k, v in obj.attrs.items()}}
    if isinstance(obj, Callback):
        return {"__cb__": obj.name, "inplace": obj.inplace}
    if isinstance(obj, Record):
        return {"__rec__": obj.name}
    if type(obj) in (list, tuple):
        return type(obj)(_encode(x) for x in obj)
    if type(obj) is dict:
        return {k: _encode(v) for k, v in obj.items()}
    return obj


class StudentFailure(Exception):
    """The student's code failed in the child (raised, returned something that is not plain data, tripped a
    tripwire): `outcome` is what the child reported, the case's outcome as it stands."""

    def __init__(self, outcome: dict) -> None:
        super().__init__(str(outcome.get("error", "the student's code failed"))[:2000])
        self.outcome = outcome


class ChannelClosed(BaseException):
    """The child is gone, too slow or talking nonsense: the exercise stops here. A BaseException, so that a harness's
    own `except Exception` cannot swallow it."""

    def __init__(self, why: BaseException | str) -> None:
        super().__init__(str(why))
        self.why = why


# ---- the grader's side --------------------------------------------------------------------------------------------
class Session:
    """The grader's end of one job's pipes (after the child's header). `send(msg)` / `recv()` move one message."""

    def __init__(self, send: Callable[[Any], None], recv: Callable[[], Any]) -> None:
        self._send, self._recv = send, recv

    def _exchange(self, msg: dict) -> dict:
        try:
            self._send(_encode(msg))
            reply = self._recv()
        except (TimeoutError, EOFError, BrokenPipeError, ValueError) as exc:
            raise ChannelClosed(exc) from None
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise ChannelClosed("malformed message from the exercise's process")
        if not reply["ok"]:
            raise StudentFailure(reply)
        return reply

    def call(self, handle: int | None, method: str | None, args: tuple, kwargs: dict,
             returns_args: tuple[int, ...] = ()) -> tuple[Any, list, list]:
        """(value, the state after the call of the arguments at `returns_args`, recorded callback calls)."""
        reply = self._exchange({"op": "call", "handle": handle, "method": method, "args": list(args),
                                "kwargs": dict(kwargs), "returns_args": list(returns_args)})
        after, log = reply.get("after", []), reply.get("log", [])
        if not isinstance(after, list) or len(after) != len(returns_args) or not isinstance(log, list):
            raise ChannelClosed("malformed message from the exercise's process")
        return reply.get("value"), after, log

    def function(self, returns_args: tuple[int, ...] = ()) -> Callable:
        """A proxy of the student's function. With `returns_args`, the arguments there (tensors, or lists of
        tensors) are updated in place from what the student's call left in them (shapes and dtypes must match)."""
        def proxy(*args, **kwargs):
            value, after, _ = self.call(None, None, args, kwargs, returns_args)
            for i, new in zip(returns_args, after):
                copy_into(args[i], new)
            return value
        return proxy

    def new(self, *args, **kwargs) -> "RemoteObject":
        """An instance of the student's class in the child."""
        value, _, log = self.call(None, None, args, kwargs)
        if not isinstance(value, dict) or not isinstance(value.get("handle"), int):
            raise ChannelClosed("malformed message from the exercise's process")
        return RemoteObject(self, value["handle"], [str(b) for b in value.get("bases", [])][:64], log)

    def ranks(self, n: int, args_per_rank: list[tuple], handler) -> list[Any]:
        """Run the student's function as `n` ranks at once, `fn(*args_per_rank[r])`; their Callback calls are
        answered by `handler` (`request(rank, name, args)`, `finished(rank)`, `stuck(ranks)`: each returns
        deliveries `(rank, value)` or `(rank, Exception)`). Returns every rank's value; a rank that failed raises
        StudentFailure with its outcome (the first failed rank's)."""
        try:
            self._send(_encode({"op": "ranks", "args": [list(a) for a in args_per_rank]}))
            results: dict[int, dict] = {}
            waiting: set[int] = set()
            while len(results) < n:
                msg = self._recv()
                rank = msg.get("rank") if isinstance(msg, dict) else None
                if not isinstance(rank, int) or not 0 <= rank < n or rank in results:
                    raise ChannelClosed("malformed message from the exercise's process")
                if "result" in msg:
                    if rank in waiting or not isinstance(msg["result"], dict):
                        raise ChannelClosed("malformed message from the exercise's process")
                    results[rank] = msg["result"]
                    deliveries = handler.finished(rank)
                elif isinstance(msg.get("callback"), str) and isinstance(msg.get("args"), list) and rank not in waiting:
                    waiting.add(rank)
                    deliveries = handler.request(rank, msg["callback"], msg["args"])
                else:
                    raise ChannelClosed("malformed message from the exercise's process")
                for r, value in deliveries:
                    self._deliver(r, value)
                    waiting.discard(r)
                if waiting and waiting | set(results) == set(range(n)):   # every live rank waits: nothing can move
                    for r, value in handler.stuck(sorted(waiting)):
                        self._deliver(r, value)
                        waiting.discard(r)
            self._send({"ranks_done": True})
        except (TimeoutError, EOFError, BrokenPipeError, ValueError) as exc:
            raise ChannelClosed(exc) from None
        for r in range(n):
            if not isinstance(results[r].get("ok"), bool) or not results[r]["ok"]:
                out = dict(results[r])
                out["error"] = f"rank {r}: {out.get('error', 'failed')}"
                raise StudentFailure(out)
        return [results[r].get("value") for r in range(n)]

    def _deliver(self, rank: int, value: Any) -> None:
        if isinstance(value, Exception):
            self._send({"rank": rank, "raise": type(value).__name__, "message": str(value)[:1000]})
        else:
            self._send(_encode({"rank": rank, "reply": value}))


class RemoteObject:
    """An instance of the student's class, living in the child; `call(method, *args)` forwards one call."""

    def __init__(self, session: Session, handle: int, bases: list[str], log: list) -> None:
        self.session, self.handle, self.bases, self.log = session, handle, bases, log

    def call(self, method: str, *args, returns_args: tuple[int, ...] = (), **kwargs) -> tuple[Any, list, list]:
        return self.session.call(self.handle, method, args, kwargs, returns_args)


def copy_into(target: Any, new: Any) -> None:
    """Copy a returned argument state into the caller's tensor (or list of tensors), refusing any change of shape or
    dtype (the caller's objects are the engine's: they keep their form)."""
    import torch

    if isinstance(target, torch.Tensor):
        if type(new) is not torch.Tensor or new.shape != target.shape or new.dtype != target.dtype:
            raise ValueError(f"the function changed the shape or dtype of a tensor it was given (expected "
                             f"{tuple(target.shape)} {target.dtype}): write into it in place")
        target.copy_(new)
        return
    if isinstance(target, list) and isinstance(new, list) and len(new) == len(target):
        for t, n in zip(target, new):
            copy_into(t, n)
        return
    raise ValueError("the function replaced a list it was given: write into its tensors in place")


# ---- the child's side ---------------------------------------------------------------------------------------------
_RAISABLE = {"ValueError": ValueError, "RuntimeError": RuntimeError, "TypeError": TypeError}


class _Child:
    """Serves the grader's calls on the student's object `obj` (see `serve`)."""

    def __init__(self, obj, send, recv, attempt: Callable[[Callable], dict]) -> None:
        self.obj, self._send_raw, self.recv, self.attempt = obj, send, recv, attempt
        self.lock = threading.Lock()
        self.handles: dict[int, Any] = {}
        self.log: list = []
        self.replies: dict[int, queue.Queue] = {}

    def send(self, msg: Any) -> None:
        with self.lock:
            self._send_raw(msg)

    def decode(self, obj: Any, rank: int | None = None) -> Any:
        if type(obj) is dict:
            if set(obj) == {"__ns__"}:
                return types.SimpleNamespace(**{k: self.decode(v, rank) for k, v in obj["__ns__"].items()})
            if set(obj) == {"__cb__", "inplace"}:
                return self._callback(obj["__cb__"], obj["inplace"], rank)
            if set(obj) == {"__rec__"}:
                name = obj["__rec__"]
                return lambda *a: self.log.append([name, list(a)])
            return {k: self.decode(v, rank) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.decode(x, rank) for x in obj)
        return obj

    def _callback(self, name: str, inplace: int | None, rank: int | None) -> Callable:
        import torch

        from llmso_lab.grading.compare import to_plain

        def call(*args):
            if rank is None:
                raise RuntimeError(f"{name} can only be called while the ranks run")
            self.send({"rank": rank, "callback": name, "args": to_plain(list(args))})
            reply = self.replies[rank].get()
            if "raise" in reply:
                raise _RAISABLE.get(reply["raise"], RuntimeError)(reply.get("message", ""))
            value = self.decode(reply.get("reply"), rank)
            if inplace is not None and inplace < len(args) and isinstance(args[inplace], torch.Tensor) \
                    and isinstance(value, torch.Tensor) and value.shape == args[inplace].shape:
                with torch.no_grad():
                    args[inplace].copy_(value)
                return args[inplace]
            return value
        return call

    @classmethod
    def _state(cls, obj: Any) -> Any:
        """An argument as the call left it, namespaces as dicts (what `returns_args` sends back)."""
        if isinstance(obj, types.SimpleNamespace):
            return {k: cls._state(v) for k, v in vars(obj).items()}
        if type(obj) in (list, tuple):
            return type(obj)(cls._state(x) for x in obj)
        return obj

    def call(self, msg: dict) -> dict:
        from llmso_lab.grading.compare import to_plain

        args, kwargs = self.decode(msg["args"]), self.decode(msg["kwargs"])
        handle, method = msg.get("handle"), msg.get("method")
        if handle is None and isinstance(self.obj, type):   # a new instance of the student's class, kept here
            out = self.attempt(lambda: self.obj(*args, **kwargs), raw=True)
            if out["ok"]:
                inst, h = out["value"], len(self.handles)
                self.handles[h] = inst
                out["value"] = {"handle": h, "bases": [f"{c.__module__}.{c.__qualname__}" for c in type(inst).__mro__]}
        elif handle is None:
            out = self.attempt(lambda: self.obj(*args, **kwargs))
        else:
            inst = self.handles[handle]
            out = self.attempt(lambda: getattr(inst, method)(*args, **kwargs))
        if out["ok"]:
            try:
                out["after"] = [to_plain(self._state(args[i])) for i in msg.get("returns_args", [])]
                out["log"] = to_plain(self.log)
            except TypeError as exc:
                out = {"ok": False, "category": "type", "error": f"an argument it was given now holds {exc}"[:500]}
        self.log = []
        return out

    def ranks(self, msg: dict) -> None:
        n = len(msg["args"])
        self.replies = {r: queue.Queue() for r in range(n)}

        def run(r: int) -> None:
            args = self.decode(msg["args"][r], r)
            self.send({"rank": r, "result": self.attempt(lambda: self.obj(*args))})

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        while True:   # route the grader's replies to the waiting ranks until it says all have finished
            reply = self.recv()
            if reply.get("ranks_done"):
                return
            self.replies[reply["rank"]].put(reply)


def serve(obj, send: Callable[[Any], None], recv: Callable[[], Any], attempt: Callable[..., dict]) -> None:
    """The child's loop for a mechanism exercise: answer the grader's calls on the student's `obj` until it says
    done. `attempt(thunk)` runs student code and returns its outcome ({"ok", "value"} as plain data, or the error);
    with raw=True the value is returned as it is (a new instance, kept here)."""
    child = _Child(obj, send, recv, attempt)
    while True:
        try:
            msg = recv()
        except EOFError:
            return
        if msg.get("done"):
            return
        if msg.get("op") == "ranks":
            child.ranks(msg)
        else:
            child.send(child.call(msg))


# ---- check(): the same judge and the same child, in one process ---------------------------------------------------
class LocalSession(Session):
    """`check()`'s session: the student's object lives in this process, served by the same `_Child` the grader's
    sandbox runs, and the harness is the same `judge.run`: so `check()` and the grade reach the same verdict by the
    same code. Calls are served at once; a ranks call serves its ranks from a thread while the judge answers their
    callbacks here. `attempt(thunk, raw=False)` runs the student's code (with the tripwires armed, see `check`)."""

    def __init__(self, obj, attempt: Callable[..., dict], timeout_s: float = 120.0) -> None:
        self._to_judge: queue.Queue = queue.Queue()
        self._to_child: queue.Queue = queue.Queue()
        self._child = _Child(obj, self._to_judge.put, self._to_child.get, attempt)
        self._thread: threading.Thread | None = None
        self._timeout_s = timeout_s
        super().__init__(self._local_send, self._local_recv)

    def _local_send(self, msg: Any) -> None:
        if msg.get("op") == "call":
            self._to_judge.put(self._child.call(msg))
        elif msg.get("op") == "ranks":
            self._thread = threading.Thread(target=self._child.ranks, args=(msg,), daemon=True)
            self._thread.start()
        else:   # a rank's reply, or the end of a ranks call
            self._to_child.put(msg)

    def _local_recv(self) -> Any:
        try:
            return self._to_judge.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TimeoutError from None
