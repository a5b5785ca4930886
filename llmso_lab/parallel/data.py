"""Data parallelism (lecture 2-2): N independent engine replicas behind a router.

    with DataParallelLLM("smollm2-135m", num_replicas=2, router="prefix_aware", enable_prefix_caching=True) as dp:
        outs = dp.generate(prompts, SamplingParams(max_tokens=32))
        dp.stats()["requests_per_replica"]

Each replica is a process (`launcher.Workers`) running its own `llmso_lab.engine.LLM` with its own KV cache
and prefix cache; replicas never talk to each other (the launcher still joins them in a process group, unused).
This process routes every request (`llmso_lab.routing.make_router`), sends each replica its share, and puts the
`RequestOutput`s back in prompt order, so the result looks like one engine's.

Routing: a token-id prompt's key is `prefix_key(ids, block_size)`; a text prompt's key hashes its UTF-8 bytes the
same way (this process does not tokenize; SGLang's router also matches prefixes on text), so prompts with one
system prompt share a key either way. A request's load counts as outstanding until its `generate` call returns:
within one call `least_loaded` spreads requests evenly, like `round_robin`.

Sampling does not depend on where a request lands: a request without `SamplingParams.seed` gets the seed one `LLM`
would give it (from `seed` and its order of arrival over all calls), so sampled outputs equal a single engine's
(up to near-ties in the logits, which batch composition can flip; `llmso_lab.engine.sampler`).

The model reaches the replicas by pickling (torch.multiprocessing shares the weights, no copy) or, given a registry
name, each replica loads it from the cache itself, as each GPU of a real deployment loads its own copy.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from llmso_lab.engine.inputs import as_batch
from llmso_lab.engine.outputs import RequestOutput
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.parallel.launcher import RankError, Workers
from llmso_lab.routing import Router, make_router, prefix_key

__all__ = ["DataParallelLLM", "RankError"]


def _replica_main(rank: int, world_size: int, conn, model, engine_kwargs: dict) -> None:
    """One replica: build the engine, report ready, then serve ("generate", (prompts, params)) and ("stats", None)
    until ("stop", None). Bad input comes back as ("invalid", message) and the replica keeps serving; any other
    exception ends the replica (the launcher reports it as a RankError)."""
    from llmso_lab.engine import LLM

    llm = LLM(model, **engine_kwargs)
    conn.send(("ready", {"max_model_len": llm.max_model_len, "dtype": str(llm.dtype)}))
    while True:
        command, payload = conn.recv()
        if command == "stop":
            return
        if command == "generate":
            prompts, params = payload
            try:
                outputs = llm.generate(prompts, params, use_tqdm=False)
            except ValueError as exc:   # generate checks every input before queueing any: nothing to undo
                conn.send(("invalid", str(exc)))
                continue
            conn.send(("outputs", outputs))
        elif command == "stats":
            conn.send(("stats", llm.stats()))
        else:
            raise ValueError(f"replica {rank} got an unknown command {command!r}")


class DataParallelLLM:
    """`num_replicas` engine processes, each `LLM(model, **engine_kwargs)`, behind a router (`routing.ROUTERS`).

    `generate(prompts, sampling_params)` returns the `RequestOutput`s in prompt order with request ids "0", "1", ...
    over the life of this object (as one `LLM` numbers them). A replica that fails raises `RankError` with its
    traceback, and every replica is stopped. Use it as a context manager, or call `shutdown()`."""

    def __init__(self, model, num_replicas: int, router: str = "round_robin", *, router_kwargs: dict | None = None,
                 threads_per_replica: int | None = None, timeout_s: float = 300.0, **engine_kwargs: Any) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas
        self.set_router(router, **(router_kwargs or {}))
        self.block_size = engine_kwargs.get("block_size", 16)
        self.seed = engine_kwargs.get("seed", 0)
        self.num_requests = 0
        self.last_replicas: list[int] = []   # the replica each prompt of the last generate call went to
        self.requests_per_replica = [0] * num_replicas
        self.prompt_tokens_per_replica = [0] * num_replicas
        self.generated_tokens_per_replica = [0] * num_replicas
        self.workers = Workers(_replica_main, num_replicas, args=(model, engine_kwargs), timeout_s=timeout_s,
                               threads_per_rank=threads_per_replica)
        self.replica_info = [self._expect(r, "ready") for r in range(num_replicas)]

    def set_router(self, name: str, **kwargs: Any) -> None:
        """Route the next requests with router `name` (`routing.make_router`); replicas and caches stay as they are."""
        self.router: Router = make_router(name, self.num_replicas, **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def routing_key(self, prompt) -> int:
        """The router's key for one prompt: `prefix_key` of its token ids, or of its UTF-8 bytes for text."""
        if isinstance(prompt, str):
            units = list(prompt.encode("utf-8"))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            units = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            units = list(prompt)
        else:
            raise ValueError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}")
        if not units:
            raise ValueError("prompt is empty: give at least one token")
        return prefix_key(units, block_size=self.block_size)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Route each prompt, run every replica's share at the same time, return the outputs in prompt order.
        Raises ValueError for bad input (the replicas keep running), RankError if a replica fails."""
        prompts, params = as_batch(prompts, sampling_params)
        n = len(prompts)
        if len(params) != n:
            raise ValueError(f"got {n} prompts and {len(params)} sampling_params; give one each")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them")
        keys = [self.routing_key(p) for p in prompts]
        self._check_open()
        # the seed one LLM would give request number num_requests + i (see LLM._add), so routing cannot change samples
        params = [p if p.seed is not None else
                  dataclasses.replace(p, seed=(self.seed * 1_000_003 + self.num_requests + i) % (1 << 63))
                  for i, p in enumerate(params)]
        loads, where = [0] * self.num_replicas, []
        for key in keys:
            r = self.router.route(key, loads)
            loads[r] += 1
            where.append(r)
        self.last_replicas = where
        shares = {r: [i for i in range(n) if where[i] == r] for r in range(self.num_replicas) if loads[r]}
        for r, idx in shares.items():
            self.workers.send(r, ("generate", ([prompts[i] for i in idx], [params[i] for i in idx])))
        results: list[RequestOutput | None] = [None] * n
        rejected = []
        for r, idx in shares.items():   # collect every reply first, so no answer is left in a pipe
            kind, payload = self.workers.recv(r)
            if kind == "invalid":
                rejected.append(f"replica {r}: {payload}")
                continue
            for i, out in zip(idx, payload):
                results[i] = out
        if rejected:
            raise ValueError("invalid request(s), nothing was generated for them: " + "; ".join(rejected))
        for i, out in enumerate(results):
            out.request_id = str(self.num_requests + i)
            r = where[i]
            self.requests_per_replica[r] += 1
            self.prompt_tokens_per_replica[r] += len(out.prompt_token_ids)
            self.generated_tokens_per_replica[r] += sum(len(c.token_ids) for c in out.outputs)
        self.num_requests += n
        return results

    def stats(self) -> dict:
        """Requests and tokens each replica served (counted here), and each replica engine's own `LLM.stats()`."""
        self._check_open()
        for r in range(self.num_replicas):
            self.workers.send(r, ("stats", None))
        return {"num_replicas": self.num_replicas, "router": self.router.name, "num_requests": self.num_requests,
                "requests_per_replica": list(self.requests_per_replica),
                "prompt_tokens_per_replica": list(self.prompt_tokens_per_replica),
                "generated_tokens_per_replica": list(self.generated_tokens_per_replica),
                "engines": [self._expect(r, "stats") for r in range(self.num_replicas)]}

    # ---- lifetime ------------------------------------------------------------------------------
    def _expect(self, rank: int, kind: str) -> Any:
        got, payload = self.workers.recv(rank)
        if got != kind:
            self.shutdown()
            raise RankError(rank, f"expected a {kind!r} reply, got {got!r}; all replicas were stopped")
        return payload

    def _check_open(self) -> None:
        if not self.workers.alive:
            raise RuntimeError("this DataParallelLLM is shut down (shutdown() was called or a replica failed); "
                               "create a new one")

    def shutdown(self) -> None:
        """Stop every replica (safe to call twice)."""
        self.workers.shutdown()

    def __enter__(self) -> "DataParallelLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
