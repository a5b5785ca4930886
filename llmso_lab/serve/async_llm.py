"""`AsyncLLM`: the engine stepping in a thread of its own while an asyncio server talks to clients (vLLM's
`AsyncLLM`, without its separate engine process).

Only the engine thread touches the engine. The server's coroutines hand it requests and aborts through an inbox;
after every step the thread hands each request's new text to that request's `RequestStream` (an asyncio queue read
by the HTTP handler). Text comes from `IncrementalDetokenizer` (the streamed text holds back what could still become
a stop string; the engine ends the sample at the stop string itself). A client that goes away is aborted: its
request leaves the engine and its KV blocks go back. The engine's public API is all this uses: `validate`, `add_checked`, `step`,
`retire_finished`, `abort_request`, `stats`."""
from __future__ import annotations

import asyncio
import copy
import threading
import time
import traceback
from dataclasses import dataclass, field

from llmso_lab.engine.core import LLMEngine
from llmso_lab.engine.inputs import prompt_token_ids
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.kv.block_manager import cdiv
from llmso_lab.engine.detokenizer import IncrementalDetokenizer
from llmso_lab.serve.metrics import ServerMetrics
from llmso_lab.workloads import RequestMetrics


class Overloaded(Exception):
    """The queue is full: the server answers 503 instead of letting it grow without bound."""


class EngineDead(Exception):
    """The engine thread failed; the server answers 503 from then on."""


class RequestFailed(Exception):
    """Serving this request raised (in the engine's step or while queueing it): it alone fails, with a 500; the
    engine frees its blocks and keeps stepping the others."""


MAX_FAILED_STEPS = 3   # steps failing one after another: the engine itself is broken, not one request


@dataclass(slots=True)
class Delta:
    """New output of one sample: text (and the token ids behind it); `finish_reason` on its last delta."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict] | None = None   # per token of `token_ids`, when the request asked (`engine.sampler`)


@dataclass(slots=True)
class Usage:
    """The request's end: token counts and its metrics (engine clock: `time.perf_counter`)."""
    prompt_tokens: int
    completion_tokens: int
    metrics: RequestMetrics
    num_cached_tokens: int = 0


@dataclass(eq=False)
class RequestStream:
    """What a handler iterates: `Delta`s, then one `Usage`; raises `EngineDead` if the engine failed meanwhile."""
    params: SamplingParams
    token_ids: list[int]               # the prompt's
    arrival_time: float
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: str | None = None      # the engine's id, set by the engine thread
    finished: bool = False

    def put(self, item) -> None:   # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if isinstance(item, Usage):
            self.finished = True
        return item


class _Tracked:
    """The engine thread's view of one stream: per sample, tokens handed out and its detokenizer."""

    def __init__(self, stream: RequestStream, decode) -> None:
        self.stream = stream
        n = stream.params.n
        self.sent = [0] * n
        self.detok = [IncrementalDetokenizer(decode, stream.stop, stream.params.min_tokens) for _ in range(n)]
        self.done: list[str | None] = [None] * n    # finish reason per sample
        self.ids: list[list[int]] = [[] for _ in range(n)]


class _LockedTokenizer:
    """A tokenizer, one call at a time: a Rust-backed Hugging Face tokenizer used from two threads at once fails
    ("Already borrowed"). The engine thread has one (it decodes every step), the HTTP side another (`AsyncLLM`
    copies it), so that tokenizing a long prompt never holds up the engine's detokenizing."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self._lock = tokenizer, threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._tokenizer, name)
        if not callable(attr):
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)
        return locked


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, max_queue: int = 64, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.tokenizer = None   # the HTTP side's own copy: prompts and chat templates are tokenized with it
        if engine.tokenizer is not None:
            if isinstance(engine.tokenizer, _LockedTokenizer):   # a second AsyncLLM over the same engine
                engine.tokenizer = engine.tokenizer._tokenizer
            self.tokenizer = _LockedTokenizer(copy.deepcopy(engine.tokenizer))
            engine.tokenizer = _LockedTokenizer(engine.tokenizer)
        self.metrics = metrics
        self.max_in_flight = engine.config.max_num_seqs + max_queue
        self.dead: BaseException | None = None
        self._inbox: list[tuple[str, RequestStream]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._in_flight = 0
        self._tracked: dict[str, _Tracked] = {}
        self._failed_steps = 0
        self._thread = threading.Thread(target=self._run, name="llmso-engine", daemon=True)

    # ---- the server's side (event loop thread) -----------------------------------------------
    def start(self) -> "AsyncLLM":
        self._thread.start()
        return self

    def check(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError with what to change (nothing is queued). Tokenizes a text prompt with
        the HTTP side's tokenizer: call it off the event loop (`asyncio.to_thread`), it can take seconds."""
        ids, _ = self.engine.validate(prompt_token_ids(prompt, self.tokenizer)[0], params, 0)
        limit = self.engine.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, {params.max_tokens} "
                             "in the completion). Please reduce the length of the messages or completion.")
        bm = self.engine.block_manager
        need = cdiv(len(ids) + params.max_tokens, bm.block_size)
        if need > bm.num_blocks:
            raise ValueError(f"this request needs {need} KV blocks at its longest but the whole cache has {bm.num_blocks}: "
                             "lower max_tokens, or start the server with a larger KV cache (--num-kv-blocks)")
        return ids

    def render_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages` (with the assistant's turn opened), as token ids; off the event
        loop, like `check`. ValueError when the template refuses them."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:   # noqa: BLE001 - the template refused these messages
            raise ValueError(f"the chat template could not render these messages: {exc}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prompt_text(self, ids: list[int]) -> str:
        """A token-id prompt as text (for `echo`), with the HTTP side's tokenizer; off the event loop."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def submit(self, ids: list[int], params: SamplingParams, stop: list[str] | None = None) -> RequestStream:
        """Queue a checked request; returns its stream. Raises Overloaded / EngineDead."""
        if self.dead is not None:
            raise EngineDead(f"the engine failed: {self.dead!r}; restart the server")
        stream = RequestStream(params, ids, time.perf_counter(), list(stop or []), asyncio.get_running_loop())
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                raise Overloaded(f"{self._in_flight} requests are in flight (max_num_seqs + --max-queue = "
                                 f"{self.max_in_flight}); retry later")
            self._in_flight += 1
            self._inbox.append(("add", stream))
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client went away: drop the request, free its blocks (a finished one is left alone)."""
        with self._lock:
            self._inbox.append(("abort", stream))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                if self._drain():
                    self._observe()   # an abort freed blocks: the gauges say so now
            except Exception as exc:   # an abort that raised: the engine's state is unknown
                traceback.print_exc()
                self._die(exc)
                return
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                continue
            try:
                finished, _ = self.engine.step()
                finished += self.engine.retire_finished()
                self._publish(finished)
                self._observe()
                self._failed_steps = 0
            except Exception as exc:   # fail the requests of this step; the engine goes on with the others
                traceback.print_exc()
                self._failed_steps += 1
                if self._failed_steps >= MAX_FAILED_STEPS or not self._fail_step(exc):
                    self._die(exc)
                    return
        for t in list(self._tracked.values()):
            self._close(t, EngineDead("the server is shutting down"))

    def _die(self, exc: BaseException) -> None:
        """The engine cannot go on: fail what is in flight, refuse the rest (`/health` says 503 from now on)."""
        self.dead = exc
        for t in list(self._tracked.values()):
            self._close(t, EngineDead(f"the engine failed while serving this request: {exc!r}"))

    def _fail_step(self, exc: BaseException) -> bool:
        """A step raised: abort the requests it was running (their blocks go back) and fail them with a 500; the
        rest stay queued. False when the engine's state cannot be trusted afterwards."""
        running = {seq.request_id for seq in self.engine.scheduler.running}
        victims = [t for rid, t in self._tracked.items() if rid in running] or list(self._tracked.values())
        try:
            for t in victims:
                self.engine.abort_request(t.stream.request_id)
                self._close(t, RequestFailed(f"the engine failed while serving this request: {exc!r}"))
            self.engine.scheduler.check_invariants()
        except Exception:   # noqa: BLE001 - aborting failed too: the engine is broken
            traceback.print_exc()
            return False
        return True

    def _drain(self) -> bool:
        """Take the inbox's requests and aborts; True if there were any. A request the engine refuses fails alone."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for op, stream in inbox:
            if op == "add":
                try:
                    rid = self.engine.add_checked(stream.token_ids, None, stream.params, 0, stream.arrival_time)
                except Exception as exc:   # noqa: BLE001 - this request only; nothing of it was queued
                    traceback.print_exc()
                    with self._lock:
                        self._in_flight -= 1
                    stream.put(RequestFailed(f"the request could not be queued: {exc!r}"))
                    continue
                stream.request_id = rid
                self._tracked[rid] = _Tracked(stream, self.engine.decode)
            elif stream.request_id in self._tracked:   # abort: the request may have finished meanwhile
                self.engine.abort_request(stream.request_id)
                self._close(self._tracked[stream.request_id], None)
                if self.metrics is not None:   # vLLM counts it: request_success_total{finished_reason="abort"}
                    self.metrics.aborted()
        return bool(inbox)

    def _publish(self, finished) -> None:
        """Hand out every request's new text; end the finished ones (and those a stop string ended)."""
        ended = {o.request_id: o for o in finished}
        for rid, t in list(self._tracked.items()):
            out = ended.get(rid)
            if out is not None:
                seqs = [(c.index, c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs]
            else:   # (the engine ends a sample at a stop string itself: `engine.stop_strings`)
                seqs = [(s.sample_index, s.output_token_ids, None, s.logprobs) for s in self.engine.samples.get(rid, [])]
            for index, ids, reason, logprobs in seqs:
                self._advance(t, index, ids, reason, logprobs)
            if out is not None:
                self._close(t, Usage(len(t.stream.token_ids), sum(len(i) for i in t.ids), out.metrics, out.num_cached_tokens))

    def _advance(self, t: _Tracked, index: int, ids: list[int], reason: str | None, logprobs: list | None) -> None:
        if t.done[index] is not None:
            return
        start = t.sent[index]
        new = list(ids[start:])
        t.sent[index] = len(ids)
        t.ids[index] += new
        detok = t.detok[index]
        text = detok.add(new, final=reason is not None)
        if detok.stopped_at is not None:
            reason = "stop"
        if text or new or reason:
            asked = t.stream.params.logprobs is not None
            t.stream.put(Delta(index, text, new, reason, list(logprobs[start:len(ids)]) if asked and logprobs else None))
        t.done[index] = reason

    def _close(self, t: _Tracked, last) -> None:
        del self._tracked[t.stream.request_id]
        with self._lock:
            self._in_flight -= 1
        if last is not None:
            if isinstance(last, Usage) and self.metrics is not None:
                reasons = [r for r in t.done if r]
                self.metrics.finished(last.metrics, reasons[0] if reasons else "abort")
            t.stream.put(last)

    def _observe(self) -> None:
        if self.metrics is not None:
            sch = self.engine.scheduler
            self.metrics.after_step(self.engine.stats(), len(sch.running), len(sch.waiting))

