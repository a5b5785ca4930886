"""The two kinds of worker process behind `DisaggregatedLLM`, each a full engine (`LLM`) with a role.

prefill worker (kv_role "kv_producer")  runs each prompt with max_tokens=1: the forward computes the prompt's KV
    and samples the first token. Layer by layer, as soon as a layer's KV is in its paged cache, the rows of the
    prompt tokens the decode worker lacks are copied out and queued to a sender thread, which ships them
    (torch.distributed send over gloo, optionally slowed to a given link) while the next layers compute.
decode worker (kv_role "kv_consumer")   reserves KV blocks for an incoming prompt (its prefix cache may already
    hold the start: those tokens are not sent), receives the layers straight into those blocks (one receiver
    thread per prefill worker), and when every layer and the first token are there, the sequence joins its
    running batch as a decode. It can also prefill a request itself ("local": the router decided that moving
    the KV would not pay) — with no prefill worker at all it is a colocated engine.

Messages with the driver go through the launcher's pipes; KV goes worker to worker. On the KV stream each
message is a header [request index, layer, tokens, kind] and, for kind DATA, a payload [caches, tokens, Hkv, D].
"""
from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from llmso_lab.engine.llm import LLM
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.scheduler import SchedulerOutput
from llmso_lab.engine.sequence import Sequence, SequenceStatus

DATA, ABORT, BYE = 0, 1, 2   # header kinds on the KV stream


@dataclass(slots=True)
class Job:
    """What the driver sends about one request (token ids only: the driver tokenizes)."""
    index: int                      # the request's number in the driver (its id on the KV stream)
    prompt_token_ids: list[int]
    params: SamplingParams          # seed filled in by the driver, so every worker draws the same numbers
    arrival_time: float
    decode_rank: int = -1           # where the KV goes (prefill side)
    num_skip_tokens: int = 0        # prompt tokens the decode worker has cached: not sent


def slots_of(block_table: list[int], block_size: int, start: int, stop: int) -> Tensor:
    """Cache slots (block * block_size + offset) of token positions start..stop-1."""
    return torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)],
                        dtype=torch.int64)


def write_received_kv(caches: list[Tensor], layer: int, payload: Tensor, block_table: list[int], block_size: int,
                      start: int) -> None:
    """The receiving side of a layer-wise KV transfer: write one layer's rows into the blocks reserved for them.

    caches: the decode engine's cache tensors (K and V), each [num_layers, num_blocks, block_size, Hkv, D];
    payload [len(caches), n, Hkv, D]: layer `layer`'s K and V rows of token positions start .. start + n - 1
    (positions before `start` are the decode side's cached prefix: not sent, not touched); block_table: the
    sequence's physical block ids (position p lives in block block_table[p // block_size], row p % block_size)."""
    slots = slots_of(block_table, block_size, start, start + payload.shape[1])
    for c, rows in zip(caches, payload):
        c[layer].view(-1, *c.shape[-2:]).index_copy_(0, slots, rows)


def _caches(runner) -> list[Tensor]:
    """The per-layer cache tensors a transfer carries: K and V, or MLA's one latent cache."""
    return runner.kv_store.transfer_tensors()


class Link:
    """Makes a loopback send behave like a slower link: each message first waits latency + bytes / bandwidth."""

    def __init__(self, bandwidth_bytes_per_s: float | None = None, latency_s: float = 0.0) -> None:
        self.bandwidth, self.latency = bandwidth_bytes_per_s, latency_s

    def delay(self, nbytes: int) -> float:
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


class Pipe:
    """The worker's pipe to the driver, safe to use from the main loop and the sender thread."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


class Hooks:
    """A feature made of callbacks: how a worker plugs into its engine's loop (`engine.features`) without
    overriding the engine's methods."""

    def __init__(self, name: str, **hooks) -> None:
        self.name = name
        for hook, fn in hooks.items():
            setattr(self, hook, fn)

    def stats(self) -> dict:
        return {}


class ShippingEngine(LLM):
    """An engine whose KV rows travel between workers as plain tensors (`transfer_tensors`)."""

    def __init__(self, model, tokenizer=None, **engine_args) -> None:
        kv = engine_args.get("kv_cache_dtype", "auto")
        if kv != "auto":
            raise ValueError(f"kv_cache_dtype={kv!r} is supported by LLM itself, not by {type(self).__name__} "
                             "(disaggregation ships the plain K/V tensors between workers); use kv_cache_dtype='auto'")
        super().__init__(model, tokenizer, **engine_args)


# ---- prefill side ------------------------------------------------------------------------------------
class PrefillEngine(ShippingEngine):
    """An engine whose forwards export KV: in a step where a prompt's last chunk is computed, a hook after each
    layer copies that layer's rows for the prompt's unsent tokens and hands them to the sender."""

    def setup(self, rank: int, pipe: Pipe, link: Link, layerwise: bool) -> None:
        self.rank, self.pipe, self.link, self.layerwise = rank, pipe, link, layerwise
        self.jobs: dict[str, Job] = {}            # engine request id -> job
        self.outbox: queue.Queue = queue.Queue()  # (job, layer, payload | None, kind) for the sender thread
        self.exporting: list[tuple[Sequence, Job, Tensor]] = []
        self.held: list[tuple[Job, int, Tensor]] = []   # layerwise=False: payloads kept until the forward ends
        self.layer_times: list[float] = []
        self.layer_cpu: list[float] = []                # the main thread's CPU clock at each layer's end
        self.fail_after_layers: int | None = None       # fault injection (tests): the next transfer breaks after k layers
        self.spans: dict[int, list] = {}                # request index -> (start, end) of each layer's send
        self.sent: dict[int, int] = {}                  # request index -> bytes sent
        self.failed: set[int] = set()                   # requests whose transfer broke: their other layers are dropped
        self.features.append(Hooks("kv_export", after_schedule=self._plan_export, after_update=self._send_firsts))
        threading.Thread(target=self._send_loop, daemon=True, name="kv-sender").start()

    def submit(self, job: Job) -> None:
        params = replace(job.params, max_tokens=1)
        rid = self.add_checked(job.prompt_token_ids, None, params, 0, job.arrival_time)
        self.jobs[rid] = job

    def queued_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self.scheduler.waiting + self.scheduler.running)

    # ---- this engine's hooks in the loop (`Hooks`, one of its `features`) ------------------------------------
    t0 = 0.0
    cpu0 = (0.0, 0.0)

    def _plan_export(self, out: SchedulerOutput) -> None:
        """The prompts whose last chunk is computed this step export their KV: a hook after each layer."""
        done = [item.seq for item in out.scheduled if item.sample and item.seq.is_prefill]
        self.exporting = [(s, job, slots_of(s.block_table, self.config.block_size, job.num_skip_tokens, s.num_prompt_tokens))
                          for s in done for job in [self.jobs[s.request_id]]]
        self.layer_times, self.layer_cpu = [], []
        self.model_runner.kv_hook = self._on_layer if self.exporting else None
        self.t0 = time.perf_counter()
        self.cpu0 = (time.thread_time(), time.process_time())   # CPU seconds: this (main) thread, the whole process

    def _send_firsts(self, now: float) -> None:
        """After the step: retire the finished prompts at once and tell the driver their first tokens."""
        self.model_runner.kv_hook = None
        t1 = time.perf_counter()
        thread_cpu, process_cpu = time.thread_time() - self.cpu0[0], time.process_time() - self.cpu0[1]
        self.retire_finished()   # prompts done: their blocks go back now, not next step
        for job, layer, payload in self.held:   # whole-cache mode: everything is sent now
            self.outbox.put((job, layer, payload, DATA))
        self.held = []
        for seq, job, _ in self.exporting:
            self.pipe.send(("first", job.index, {
                "token": seq.token_ids[-1], "generator_state": seq.generator.get_state(),
                "prefill_start": seq.first_scheduled_time, "forward_start": self.t0, "prefill_end": t1,
                "layer_done": list(self.layer_times), "num_prompt_tokens": seq.num_prompt_tokens,
                # where the forward's wall time went: the main thread's CPU, the other threads' (sender, gloo)
                "forward_thread_cpu": thread_cpu, "forward_process_cpu": process_cpu,
                "layer_cpu": [c - self.cpu0[0] for c in self.layer_cpu]}))
            del self.jobs[seq.request_id]
        self.exporting = []

    def _on_layer(self, layer: int) -> None:
        self.layer_times.append(time.perf_counter())
        self.layer_cpu.append(time.thread_time())
        for seq, job, slots in self.exporting:
            payload = torch.stack([c[layer].view(-1, *c.shape[-2:]).index_select(0, slots) for c in _caches(self.model_runner)])
            if self.layerwise:
                self.outbox.put((job, layer, payload, DATA))
            else:
                self.held.append((job, layer, payload))

    def _send_loop(self) -> None:
        try:
            while True:
                self._send_one(*self.outbox.get())
                self.outbox.task_done()
        except BaseException:  # noqa: BLE001 - the driver fails the run with this traceback
            self.pipe.send(("error", traceback.format_exc()))

    def _send_one(self, job, layer: int, payload: Tensor | None, kind: int) -> None:
        if kind == BYE:
            dist.send(torch.tensor([-1, -1, 0, BYE]), job)   # `job` is the decode rank here
            return
        if job.index in self.failed:
            return
        L = self.model_runner.num_layers
        if self.fail_after_layers is not None and layer >= self.fail_after_layers:   # a broken link fails this
            self.fail_after_layers = None                                            # request, not the worker
            self.failed.add(job.index)
            dist.send(torch.tensor([job.index, layer, 0, ABORT]), job.decode_rank)
            self.pipe.send(("failed", job.index, f"prefill worker (rank {self.rank}): the KV transfer to decode rank "
                            f"{job.decode_rank} broke after {layer} of {L} layers (injected fault)"))
            self.spans.pop(job.index, None), self.sent.pop(job.index, None)
            return
        nbytes = payload.numel() * payload.element_size()
        start = time.perf_counter()
        time.sleep(self.link.delay(nbytes))
        sent, cpu = time.perf_counter(), time.thread_time()
        dist.send(torch.tensor([job.index, layer, payload.shape[1], DATA]), job.decode_rank)
        dist.send(payload.contiguous(), job.decode_rank)
        end = time.perf_counter()
        # (start, end, the two dist.send calls' wall time, the sender thread's CPU seconds in them)
        self.spans.setdefault(job.index, []).append((start, end, end - sent, time.thread_time() - cpu))
        self.sent[job.index] = self.sent.get(job.index, 0) + nbytes
        if layer == L - 1:
            self.pipe.send(("sent", job.index, {"bytes": self.sent.pop(job.index), "spans": self.spans.pop(job.index)}))

    def abort_job(self, index: int) -> None:
        for rid, job in list(self.jobs.items()):
            if job.index == index:
                self.abort_request(rid)
                del self.jobs[rid]


# ---- decode side -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Incoming:
    seq: Sequence
    start: int                  # the first position that will arrive (before it: the decode side's cached prefix)
    layers: int = 0             # layers received
    first: dict | None = None   # the first token and the prefill's timings
    first_arrival: float = 0.0  # when the first token reached this worker (through the driver)
    bytes: int = 0
    recv_end: float = 0.0
    aborted: bool = False
    layer_recv: list[float] = field(default_factory=list)


class DecodeEngine(ShippingEngine):
    """An engine that continues requests prefilled elsewhere: blocks reserved, KV written in by receiver threads."""

    def setup(self, rank: int, pipe: Pipe, prefill_ranks: list[int]) -> None:
        self.rank, self.pipe, self.lock = rank, pipe, threading.Lock()
        self.incoming: dict[int, Incoming] = {}
        self.ready: queue.Queue = queue.Queue()           # indices whose KV is complete (or aborted)
        self.waiting_reservations: list[Job] = []
        self.index_of: dict[str, int] = {}                # engine request id -> driver index
        self.kv_bytes_received = 0
        self.receivers = [threading.Thread(target=self._recv_loop, args=(src,), daemon=True, name=f"kv-recv-{src}")
                          for src in prefill_ranks]
        for t in self.receivers:
            t.start()

    def reserve(self, job: Job) -> int | None:
        """Blocks for the prompt (its cached prefix shared); returns the cached tokens, or None if no room yet."""
        seed = job.params.seed
        seq = Sequence(self.new_seq_id(), str(self.num_requests), job.prompt_token_ids, job.params, job.arrival_time,
                       generator=torch.Generator().manual_seed(seed), seed=seed)
        bm, n = self.block_manager, len(job.prompt_token_ids)
        cached = bm.match_prefix(seq)
        if not bm.can_allocate(seq, n + 1 - cached.num_tokens, cached):   # + 1: room for the first decode
            return None
        self.num_requests += 1
        self.model_runner.copy_blocks(bm.allocate(seq, n - cached.num_tokens, cached))
        with self.lock:
            self.incoming[job.index] = Incoming(seq, cached.num_tokens)
        self.index_of[seq.request_id] = job.index
        return cached.num_tokens

    def prefill_locally(self, job: Job) -> None:
        """The router chose no transfer: this engine computes the prompt itself (a colocated request)."""
        self.cancel(job.index)
        rid = self.add_checked(job.prompt_token_ids, None, job.params, 0, job.arrival_time)
        self.index_of[rid] = job.index

    def cancel(self, index: int) -> None:
        """Forget a reservation (or a running / queued request): its blocks go back."""
        with self.lock:
            inc = self.incoming.pop(index, None)
        if inc is not None:
            self.block_manager.free(inc.seq)
            self.index_of.pop(inc.seq.request_id, None)
        for rid, i in list(self.index_of.items()):
            if i == index:
                self.abort_request(rid)
                del self.index_of[rid]
        self.waiting_reservations = [j for j in self.waiting_reservations if j.index != index]

    def first_token(self, index: int, info: dict) -> None:
        with self.lock:
            inc = self.incoming.get(index)
            if inc is None:
                return
            inc.first, inc.first_arrival = info, time.perf_counter()
            if inc.layers == self.model_runner.num_layers:
                self.ready.put(index)

    def _recv_loop(self, src: int) -> None:
        try:
            self._receive(src)
        except BaseException:  # noqa: BLE001 - the driver fails the run with this traceback
            self.pipe.send(("error", traceback.format_exc()))

    def _receive(self, src: int) -> None:
        runner = self.model_runner
        caches = _caches(runner)
        shape = (len(caches), runner.num_kv_heads, runner.head_dim)
        while True:
            header = torch.empty(4, dtype=torch.int64)
            dist.recv(header, src)
            index, layer, tokens, kind = header.tolist()
            if kind == BYE:
                return
            with self.lock:
                inc = self.incoming.get(index)
            if kind == ABORT:
                if inc is not None:
                    inc.aborted = True
                    self.ready.put(index)
                continue
            payload = torch.empty(shape[0], tokens, *shape[1:], dtype=runner.dtype)
            dist.recv(payload, src)
            self.accept_layer(index, layer, payload)

    def accept_layer(self, index: int, layer: int, payload: Tensor, write=None) -> None:
        """Layer `layer`'s KV rows of request `index` have arrived: write them into its reserved blocks
        (`write_received_kv`, or `write` with its signature: Lab 09's exercise) and count the layer; with every
        layer and the first token here, the request is ready to join the batch."""
        with self.lock:
            inc = self.incoming.get(index)
        if inc is None:   # cancelled meanwhile: drop it
            return
        (write or write_received_kv)(_caches(self.model_runner), layer, payload, inc.seq.block_table,
                                     self.config.block_size, inc.start)
        with self.lock:
            inc.layers += 1
            inc.bytes += payload.numel() * payload.element_size()
            self.kv_bytes_received += payload.numel() * payload.element_size()
            inc.recv_end = time.perf_counter()
            inc.layer_recv.append(inc.recv_end)
            if inc.layers == self.model_runner.num_layers and inc.first is not None:
                self.ready.put(index)

    def activate_ready(self, pipe: Pipe) -> None:
        """Sequences whose KV and first token are all here join the running batch as decodes."""
        while True:
            try:
                index = self.ready.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                inc = self.incoming.pop(index, None)
            if inc is None:
                continue
            seq = inc.seq
            if inc.aborted:   # the prefill side gave up: give the blocks back (the driver was told by the prefill)
                self.block_manager.free(seq)
                self.index_of.pop(seq.request_id, None)
                continue
            now = time.perf_counter()
            seq.generator.set_state(inc.first["generator_state"])
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.first_scheduled_time = inc.first["prefill_start"]
            self.block_manager.cache_full_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            self.scheduler.running.append(seq)
            self.samples[seq.request_id] = [seq]
            self.num_prompt_tokens += seq.num_prompt_tokens
            self.scheduler.append_token(seq, inc.first["token"], now)
            self.num_generated_tokens += 1
            pipe.send(("arrived", index, {"bytes": inc.bytes, "recv_end": inc.recv_end, "ready": now,
                                          "first_arrival": inc.first_arrival,
                                          "layer_recv": inc.layer_recv, "num_cached_tokens": seq.num_cached_tokens}))

    def retry_reservations(self, pipe: Pipe) -> None:
        while self.waiting_reservations:
            cached = self.reserve(self.waiting_reservations[0])
            if cached is None:
                return
            job = self.waiting_reservations.pop(0)
            pipe.send(("reserved", job.index, cached))

    def pool_stats(self) -> dict:
        sch = self.scheduler
        return {**self.stats(), "num_running": len(sch.running), "num_waiting": len(sch.waiting),
                "num_incoming": len(self.incoming), "num_waiting_reservations": len(self.waiting_reservations),
                "kv_bytes_received": self.kv_bytes_received}


# ---- the process ---------------------------------------------------------------------------------------
def serve(rank: int, world_size: int, conn, model, engine_kwargs: dict, num_prefill: int, link: dict,
          cpu_affinity: list | None) -> None:
    """One worker: ranks 0..num_prefill-1 prefill, the rest decode. Runs the driver's commands until "stop"."""
    if cpu_affinity is not None:
        cores = cpu_affinity[rank]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    pipe = Pipe(conn)
    decode_ranks = list(range(num_prefill, world_size))
    if rank < num_prefill:
        engine = PrefillEngine(model, **engine_kwargs)
        engine.setup(rank, pipe, Link(link.get("bandwidth_bytes_per_s"), link.get("latency_s", 0.0)),
                     link.get("layerwise", True))
    else:
        engine = DecodeEngine(model, **engine_kwargs)
        engine.setup(rank, pipe, list(range(num_prefill)))
    del model
    pipe.send(("ready", rank, {"kv_blocks": engine.block_manager.num_blocks, "cores": sorted(os.sched_getaffinity(0)),
                               "threads": torch.get_num_threads()}))
    while True:
        while conn.poll(0 if engine.has_unfinished_requests() else 0.002):
            cmd, arg = conn.recv()
            if cmd == "stop":
                if rank < num_prefill:
                    for d in decode_ranks:
                        engine.outbox.put((d, None, None, BYE))
                    engine.outbox.join()
                else:
                    for t in engine.receivers:
                        t.join(5.0)
                return
            _command(engine, rank, num_prefill, pipe, cmd, arg)
        if rank >= num_prefill:
            engine.activate_ready(pipe)
        if engine.has_unfinished_requests():
            finished, _ = engine.step()
            for out in finished:
                index = engine.index_of.pop(out.request_id, None) if rank >= num_prefill else None
                if index is not None:
                    c = out.outputs[0]
                    pipe.send(("done", index, {"token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                               "token_times": out.metrics.token_times, "finish": out.metrics.finish_time,
                                               "first_scheduled": out.metrics.first_scheduled_time,
                                               "num_cached_tokens": out.num_cached_tokens}))
            if rank >= num_prefill:
                engine.retry_reservations(pipe)


def _command(engine, rank: int, num_prefill: int, pipe: Pipe, cmd: str, arg) -> None:
    if cmd == "prefill":            # prefill worker: compute the prompt, ship its KV
        engine.submit(arg)
    elif cmd == "reserve":          # decode worker: blocks for a prompt that will arrive
        cached = engine.reserve(arg)
        if cached is None:
            engine.waiting_reservations.append(arg)
        else:
            pipe.send(("reserved", arg.index, cached))
    elif cmd == "local":
        engine.prefill_locally(arg)
    elif cmd == "first_token":
        engine.first_token(*arg)
    elif cmd == "abort":
        (engine.abort_job if rank < num_prefill else engine.cancel)(arg)
    elif cmd == "set_link":
        engine.link, engine.layerwise = Link(arg["bandwidth_bytes_per_s"], arg["latency_s"]), arg["layerwise"]
    elif cmd == "fail_next_transfer":
        engine.fail_after_layers = arg
    elif cmd == "stats":
        stats = engine.pool_stats() if rank >= num_prefill else {
            **engine.stats(), "num_waiting": len(engine.scheduler.waiting), "num_running": len(engine.scheduler.running),
            "queued_tokens": engine.queued_tokens()}
        pipe.send(("stats", rank, stats))
    else:
        raise ValueError(f"unknown command {cmd!r}")
