"""DisaggregatedLLM: prefill and decode in separate engine processes, a router in front (lecture 2-3)."""
from __future__ import annotations

import os
import time

from llmso_lab.disagg.router import LOCAL, pd_route
from llmso_lab.disagg.worker import Job, serve
from llmso_lab.engine.inputs import _eos_token_ids, _resolve_model, as_batch, prompt_token_ids
from llmso_lab.engine.outputs import CompletionOutput, RequestOutput
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.parallel.launcher import RankError, Workers
from llmso_lab.workloads import RequestMetrics

__all__ = ["DisaggregatedLLM", "RequestFailedError"]

CONNECTORS = ("GlooConnector",)


class RequestFailedError(RuntimeError):
    """A request could not be served (its KV transfer broke). Its blocks were freed on both sides; the engine
    still serves other requests."""


class DisaggregatedLLM:
    """`LLM`'s `generate()` served by `num_prefill_workers` prefill engines and `num_decode_workers` decode engines,
    each its own process (`llmso_lab.disagg.worker`), with this process as the router.

    A request goes to the decode worker with the fewest requests, which reserves KV blocks for its prompt (blocks
    its prefix cache already holds are shared, not sent). Then the router (`pd_route`) sends it to the prefill
    worker with the fewest queued prompt tokens — or, for a prompt whose uncached part is at most
    `max_local_prefill_tokens`, lets the decode worker prefill it itself. The prefill worker computes the prompt
    and the first token and pushes each layer's KV into the reserved blocks as soon as that layer is done (torch.
    distributed send over gloo); the decode worker then continues generation. Outputs equal one colocated `LLM`'s
    (same seeds; the first token's random state travels with the KV). With `num_prefill_workers=0` the decode
    worker prefills everything: a colocated engine in the same harness, for comparisons.

    `kv_transfer_config` (vLLM's name): {"kv_connector": "GlooConnector", "kv_connector_extra_config":
    {"layerwise": True, "bandwidth_bytes_per_s": None, "latency_s": 0.0}} — layerwise=False sends the whole cache
    after the prefill; a bandwidth makes every layer's send wait latency + bytes / bandwidth first (a slower link
    than loopback, to see pipelining work). Each worker's role is set for it: "kv_producer" (prefill) or
    "kv_consumer" (decode); see `worker_roles`.

    `cpu_affinity`: one list of core ids per worker (prefill workers first), e.g. [[0], [1]], so the pools do not
    share compute, as separate GPUs would not; each worker then uses that many threads. `engine_kwargs` go to
    every worker's `LLM` (continuous batching; no tensor parallelism, speculative decoding, n > 1 or beams).

    `stats()` adds `kv_transfer_bytes`, the TTFT split (queue + prefill + transfer), TPOT, and per pool the queue
    lengths and KV occupancy. Call `shutdown()` (or use `with`).
    """

    def __init__(self, model, num_prefill_workers: int = 1, num_decode_workers: int = 1, *, tokenizer=None,
                 kv_transfer_config: dict | None = None, max_local_prefill_tokens: int = 0,
                 max_prefill_queue_tokens: int | None = None, cpu_affinity: list[list[int]] | None = None,
                 timeout_s: float = 300.0, seed: int = 0, **engine_kwargs) -> None:
        if not isinstance(num_prefill_workers, int) or num_prefill_workers < 0:
            raise ValueError(f"num_prefill_workers must be an int >= 0, got {num_prefill_workers!r}")
        if not isinstance(num_decode_workers, int) or num_decode_workers < 1:
            raise ValueError(f"num_decode_workers must be an int >= 1, got {num_decode_workers!r}")
        for key, bad in (("tensor_parallel_size", 1), ("speculative_config", None)):
            if engine_kwargs.get(key, bad) != bad:
                raise ValueError(f"{key} is not supported by DisaggregatedLLM (each worker is one LLM process)")
        if engine_kwargs.get("kv_cache_dtype", "auto") != "auto":
            raise ValueError("DisaggregatedLLM ships plain KV rows between workers: use kv_cache_dtype='auto' (a "
                             "quantized cache would need its codes and scales sent; not implemented)")
        if engine_kwargs.get("batching", "continuous") != "continuous":
            raise ValueError("DisaggregatedLLM needs batching='continuous' (requests join the decode batch one by one)")
        self.link = _link_config(kv_transfer_config)
        world = num_prefill_workers + num_decode_workers
        if cpu_affinity is not None:
            cores = os.sched_getaffinity(0)
            if len(cpu_affinity) != world or not all(c and set(c) <= cores for c in cpu_affinity):
                raise ValueError(f"cpu_affinity must give each of the {world} workers (prefill first) a non-empty list "
                                 f"of this machine's cores {sorted(cores)}; got {cpu_affinity!r}")
        self.model, self.tokenizer = _resolve_model(model, tokenizer)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.num_prefill, self.num_decode, self.seed = num_prefill_workers, num_decode_workers, seed
        self.max_local_prefill_tokens, self.max_prefill_queue_tokens = max_local_prefill_tokens, max_prefill_queue_tokens
        self.worker_roles = ["kv_producer"] * num_prefill_workers + ["kv_consumer"] * num_decode_workers
        self.engine_kwargs = {**engine_kwargs, "seed": seed}
        self.max_model_len = engine_kwargs.get("max_model_len") or self.model.config.max_position_embeddings
        self.workers = Workers(serve, world, args=(self.model, self.engine_kwargs, num_prefill_workers, self.link,
                                                   cpu_affinity), timeout_s=timeout_s)
        self.worker_info = [self._recv_from(r, timeout_s)[2] for r in range(world)]
        self.num_requests = 0
        self.records: dict[int, dict] = {}   # request index -> what the workers reported, for stats()

    # ---- requests ------------------------------------------------------------------------------
    def _job(self, prompt, params: SamplingParams, arrival: float) -> tuple[Job, str | None]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify()
        if params.n != 1:
            raise ValueError(f"n={params.n}: DisaggregatedLLM serves one completion per request (use n=1)")
        ids, text = prompt_token_ids(prompt, self.tokenizer)
        vocab = self.model.config.vocab_size
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"a prompt needs at least one token id, each an int in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}")
        index = self.num_requests
        self.num_requests += 1
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + index) % (1 << 63)
        job = Job(index, ids, SamplingParams(**{**_fields(params), "seed": seed}), arrival)
        return job, text

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 arrival_times: list[float] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Serve `prompts` (as `LLM.generate`); outputs in prompt order. `arrival_times`: seconds after this call at
        which each request arrives (default: all now), to replay a workload. A request whose KV transfer breaks
        raises RequestFailedError after the other requests of the call were aborted (blocks freed everywhere)."""
        prompts, params = as_batch(prompts, sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params)} sampling_params; give one each")
        offsets = [0.0] * len(prompts) if arrival_times is None else list(arrival_times)
        if len(offsets) != len(prompts) or any(t < 0 for t in offsets):
            raise ValueError("arrival_times needs one offset >= 0 (seconds) per prompt")
        t0 = time.perf_counter()
        jobs = [self._job(p, sp, t0 + dt) for p, sp, dt in zip(prompts, params, offsets)]
        order = sorted(range(len(jobs)), key=lambda i: offsets[i])
        state = _Flight(self.num_prefill, self.num_decode)
        results: dict[int, RequestOutput] = {}
        try:
            while len(results) < len(jobs):
                now = time.perf_counter()
                while order and jobs[order[0]][0].arrival_time <= now:
                    self._dispatch(jobs[order.pop(0)][0], state)
                wait = max(0.0, jobs[order[0]][0].arrival_time - now) if order else 1.0
                got = self.workers.recv_any(min(wait, 1.0))
                if got is not None:
                    self._handle(*got, state, {j.index: (j, text) for j, text in jobs}, results)
        except RequestFailedError:
            for job, _ in jobs:
                if job.index not in {o.metrics.request_id for o in results.values()}:
                    self.workers.send_all(("abort", job.index))
            self._quiesce()
            raise
        except RankError as e:
            raise self._named(e) from None
        return [results[job.index] for job, _ in jobs]

    def _dispatch(self, job: Job, state: "_Flight") -> None:
        """A request arrives: to the decode worker with the fewest requests (colocated: it prefills it)."""
        d = min(range(self.num_decode), key=lambda i: (state.decode_load[i], i))
        state.decode_load[d] += 1
        state.decode_of[job.index] = d
        self.records[job.index] = {"arrival": job.arrival_time, "prompt_len": len(job.prompt_token_ids)}
        rank = self.num_prefill + d
        self.workers.send(rank, ("local" if self.num_prefill == 0 else "reserve", job))

    def _handle(self, rank: int, msg: tuple, state: "_Flight", jobs: dict, results: dict) -> None:
        kind, index, info = msg
        if index not in jobs:   # about a request aborted in an earlier call: nothing to do
            return
        rec = self.records.setdefault(index, {})
        if kind == "reserved":          # decode blocks are ready: choose where to prefill
            job = jobs[index][0]
            p = pd_route(len(job.prompt_token_ids), info, state.prefill_tokens, self.max_local_prefill_tokens,
                         self.max_prefill_queue_tokens)
            rec["num_cached_tokens"] = info
            if p == LOCAL:
                rec["local"] = True
                self.workers.send(rank, ("local", job))
                return
            job.decode_rank, job.num_skip_tokens = rank, info
            state.prefill_tokens[p] += len(job.prompt_token_ids) - info
            state.prefill_of[index] = p
            self.workers.send(p, ("prefill", job))
        elif kind == "first":           # prefill done: the first token (and its random state) goes to the decode
            rec.update(prefill_start=info["prefill_start"], forward_start=info["forward_start"],
                       prefill_end=info["prefill_end"], layer_done=info["layer_done"],
                       forward_thread_cpu=info["forward_thread_cpu"], forward_process_cpu=info["forward_process_cpu"],
                       layer_cpu=info["layer_cpu"])
            p = state.prefill_of[index]
            state.prefill_tokens[p] -= len(jobs[index][0].prompt_token_ids) - rec.get("num_cached_tokens", 0)
            self.workers.send(self.num_prefill + state.decode_of[index], ("first_token", (index, info)))
        elif kind == "sent":
            rec.update(bytes_sent=info["bytes"], send_spans=[span[:2] for span in info["spans"]],
                       send_call_s=[span[2] for span in info["spans"]], send_cpu_s=[span[3] for span in info["spans"]])
        elif kind == "arrived":
            rec.update(bytes_received=info["bytes"], recv_end=info["recv_end"], ready=info["ready"],
                       first_arrival=info["first_arrival"],
                       layer_recv=info["layer_recv"])
        elif kind == "failed":
            raise RequestFailedError(f"request {index} failed: {info}. Its KV blocks were freed on both sides and the "
                                     "other requests of this call were aborted; the engine keeps serving.")
        elif kind == "done":
            state.decode_load[state.decode_of[index]] -= 1
            job, text = jobs[index]
            rec.update(first_token=info["token_times"][0], finish=info["finish"], token_times=info["token_times"])
            if rec.get("local"):
                rec["prefill_start"] = info["first_scheduled"]
            metrics = RequestMetrics(index, job.arrival_time, info["token_times"][0], info["finish"],
                                     len(job.prompt_token_ids), len(info["token_ids"]), 0, rec.get("prefill_start"),
                                     info["token_times"])
            out_text = self.tokenizer.decode(info["token_ids"], skip_special_tokens=True) if self.tokenizer else ""
            results[index] = RequestOutput(str(index), text, list(job.prompt_token_ids),
                                           [CompletionOutput(0, out_text, info["token_ids"], info["finish_reason"])],
                                           True, metrics, rec.get("num_cached_tokens", info["num_cached_tokens"]))
        else:
            raise RuntimeError(f"unexpected message {kind!r} from {self._name(rank)}")

    def _quiesce(self) -> None:
        """After aborts: let the workers process them, then drop late messages about the aborted requests."""
        for r in range(self.num_prefill + self.num_decode):
            self.workers.send(r, ("stats", None))
        pending = set(range(self.num_prefill + self.num_decode))
        while pending:
            got = self.workers.recv_any(self.workers.timeout_s)
            if got is None:
                raise RankError(None, "workers did not answer after aborting a failed request")
            if got[1][0] == "stats":
                pending.discard(got[0])

    def _recv_from(self, rank: int, timeout_s: float | None = None):
        try:
            return self.workers.recv(rank, timeout_s)
        except RankError as e:
            raise self._named(e) from None

    def _named(self, e: RankError) -> RankError:
        """The launcher's error, naming the worker: "decode worker 0 (rank 1): died (exit code -9)"."""
        text = str(e).removeprefix(f"rank {e.rank}: ") if e.rank is not None else str(e)
        err = RankError(None, f"{self._name(e.rank)} (rank {e.rank}): {text}" if e.rank is not None else text)
        err.rank = e.rank
        return err

    def _name(self, rank: int | None) -> str:
        if rank is None:
            return "a worker"
        return f"prefill worker {rank}" if rank < self.num_prefill else f"decode worker {rank - self.num_prefill}"

    # ---- metrics ------------------------------------------------------------------------------
    def worker_stats(self) -> list[dict]:
        """Each worker's engine stats (prefill workers first) with its queue lengths."""
        self.workers.send_all(("stats", None))
        out = {}
        while len(out) < self.num_prefill + self.num_decode:
            got = self.workers.recv_any(self.workers.timeout_s)
            if got is None:
                raise RankError(None, "a worker did not answer the stats request")
            if got[1][0] == "stats":
                out[got[0]] = got[1][2]
        return [out[r] for r in sorted(out)]

    def request_records(self) -> dict[int, dict]:
        """Per request: arrival, prefill start/end, per-layer compute ends and send spans, bytes sent and received,
        KV ready on the decode side, token times (perf_counter seconds, one clock for all processes). For the
        breakdowns: `forward_thread_cpu` / `forward_process_cpu` (CPU seconds of the prefill worker's main thread /
        whole process during the forward), `layer_cpu` (the main thread's CPU seconds since the forward started, at
        each layer's end), `send_call_s` / `send_cpu_s` (per layer: wall and sender-thread CPU
        seconds of its two `dist.send` calls, the link delay excluded), `first_arrival` (the first token reached the
        decode worker through the router)."""
        return self.records

    def stats(self) -> dict:
        """`kv_transfer_bytes` (received by the decode workers), the TTFT split in seconds (means over finished
        requests that were prefilled remotely), TPOT, and per pool: queued / running requests and KV usage."""
        workers = self.worker_stats()
        remote = [r for r in self.records.values() if "ready" in r and "token_times" in r]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        tpots = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
                 for r in self.records.values() if len(r.get("token_times") or []) > 1]
        pre, dec = workers[:self.num_prefill], workers[self.num_prefill:]
        return {
            "num_requests": self.num_requests, "kv_transfer_bytes": sum(w["kv_bytes_received"] for w in dec),
            "ttft_queue_s": mean([r["prefill_start"] - r["arrival"] for r in remote]),
            "ttft_prefill_s": mean([r["prefill_end"] - r["prefill_start"] for r in remote]),
            "ttft_transfer_s": mean([r["ready"] - r["prefill_end"] for r in remote]),
            "ttft_s": mean([r["first_token"] - r["arrival"] for r in self.records.values() if "first_token" in r]),
            "tpot_s": mean(tpots),
            "prefill_pool": [{"num_waiting": w["num_waiting"], "num_running": w["num_running"],
                              "queued_tokens": w["queued_tokens"], "kv_cache_usage": w["kv_cache_usage"],
                              "kv_blocks_used": w["kv_blocks_used"]} for w in pre],
            "decode_pool": [{"num_waiting": w["num_waiting"] + w["num_waiting_reservations"],
                             "num_running": w["num_running"], "num_incoming": w["num_incoming"],
                             "kv_cache_usage": w["kv_cache_usage"], "kv_cache_usage_peak": w["kv_cache_usage_peak"],
                             "kv_blocks_used": w["kv_blocks_used"]} for w in dec],
        }

    # ---- lifetime -----------------------------------------------------------------------------
    def set_link(self, layerwise: bool = True, bandwidth_bytes_per_s: float | None = None, latency_s: float = 0.0) -> None:
        """Change how the prefill workers send KV from the next request on (see `kv_transfer_config`)."""
        self.link = _link_config({"kv_connector_extra_config": {"layerwise": layerwise, "latency_s": latency_s,
                                                                "bandwidth_bytes_per_s": bandwidth_bytes_per_s}})
        for r in range(self.num_prefill):
            self.workers.send(r, ("set_link", self.link))

    def fail_next_transfer(self, after_layers: int, prefill_worker: int = 0) -> None:
        """Fault injection for tests and demos: the next KV transfer of that prefill worker breaks after
        `after_layers` layers (the request fails; the blocks it held are freed on both sides)."""
        self.workers.send(prefill_worker, ("fail_next_transfer", after_layers))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.workers.procs]

    def shutdown(self) -> None:
        self.workers.shutdown()

    def __enter__(self) -> "DisaggregatedLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _Flight:
    """The router's view of the pools during one generate call."""

    def __init__(self, num_prefill: int, num_decode: int) -> None:
        self.prefill_tokens = [0] * num_prefill   # prompt tokens queued per prefill worker
        self.decode_load = [0] * num_decode       # requests per decode worker
        self.prefill_of: dict[int, int] = {}
        self.decode_of: dict[int, int] = {}


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__}


def _link_config(cfg: dict | None) -> dict:
    cfg = dict(cfg or {})
    connector = cfg.pop("kv_connector", "GlooConnector")
    if connector not in CONNECTORS:
        raise ValueError(f"kv_connector {connector!r} is not available; valid: {', '.join(CONNECTORS)}")
    if cfg.pop("kv_role", None) is not None:
        raise ValueError("kv_role is set per worker by DisaggregatedLLM (prefill: kv_producer, decode: kv_consumer); "
                         "leave it out")
    extra = dict(cfg.pop("kv_connector_extra_config", None) or {})
    if cfg:
        raise ValueError(f"unknown kv_transfer_config keys {sorted(cfg)}; valid: kv_connector, kv_connector_extra_config")
    link = {"layerwise": extra.pop("layerwise", True), "bandwidth_bytes_per_s": extra.pop("bandwidth_bytes_per_s", None),
            "latency_s": extra.pop("latency_s", 0.0)}
    if extra:
        raise ValueError(f"unknown kv_connector_extra_config keys {sorted(extra)}; valid: layerwise, "
                         "bandwidth_bytes_per_s, latency_s")
    if link["bandwidth_bytes_per_s"] is not None and link["bandwidth_bytes_per_s"] <= 0:
        raise ValueError("bandwidth_bytes_per_s must be > 0 (or None: loopback speed)")
    if link["latency_s"] < 0:
        raise ValueError("latency_s must be >= 0")
    return link
