"""The engine's core: `LLMEngine`, the four-step `step()` loop over the scheduler and the model runner, and the
request API (`add_request`, `step`, `abort_request`, `generate`, `stats`). It names no feature: each one plugs in through
the seams of the scheduler and the model runner, or as an object whose hooks the loop calls (`engine.features`).
`LLM` (`engine.llm`) is the offline front door built on it."""
from __future__ import annotations

import time
from typing import Callable

import torch

from llmso_lab.engine import features
from llmso_lab.engine.config import EngineConfig
from llmso_lab.engine.inputs import Prompt, _eos_token_ids, _resolve_model, as_batch, prompt_token_ids
from llmso_lab.engine.metrics import StepTrace, trace_schedule
from llmso_lab.engine.outputs import CompletionOutput, RequestOutput
from llmso_lab.engine.sampler import Sampler
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.scheduler import SchedulerOutput
from llmso_lab.engine.sequence import Sequence
from llmso_lab.workloads import RequestMetrics


class LLMEngine:
    """A small serving engine: continuous batching over a paged KV cache, run on a HF Llama-family model.
    `LLMEngine(model, tokenizer=None, clock=..., **engine_args)`; see `LLM` for the arguments."""

    def __init__(self, model, tokenizer=None, *, clock: Callable[[], float] = time.perf_counter, **engine_args) -> None:
        self.config = c = EngineConfig.from_engine_args(engine_args)
        self.model, self.tokenizer = _resolve_model(model, tokenizer)
        c.resolve(self.model.config, self.model.get_input_embeddings().weight.device)
        self.max_model_len, self.seed, self.clock = c.max_model_len, c.seed, clock
        self.dtype, self.dtype_reason = c.torch_dtype, c.dtype_reason
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.scheduler = features.make_scheduler(c, self.eos_token_ids, clock)
        self.block_manager = self.scheduler.block_manager
        self.model_runner = features.model_runner(self.model, c)
        self.block_manager.listener = self.model_runner.block_listener()
        self.sampler = Sampler(self.eos_token_ids)
        self.num_requests = self.num_seqs = self.num_steps = self.num_finished = 0
        self.num_prompt_tokens = self.num_generated_tokens = self.num_computed_tokens = self.num_padded_tokens = 0
        self.busy_time_s, self.peak_blocks_used = 0.0, 0
        self.undelivered: list[RequestOutput] = []   # finished inside generate() but not its own: for the next step()
        self.samples: dict[str, list[Sequence]] = {}   # request id -> its sequences (n > 1: one per sample)
        self.features = features.engine_features(self)   # the loop's hooks: each feature's module

    def feature(self, name: str):
        """The active feature registered as `name` (its `EngineConfig` field or API, `engine.features`), or None."""
        return next((f for f in self.features if f.name == name), None)

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, prompt: Prompt, params: SamplingParams, priority: int) -> tuple[list[int], str | None]:
        """Check one request; return its prompt token ids and text. Raises ValueError, changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify()
        self._hook("check_request", params)   # what a feature cannot serve (e.g. n > 1 where samples cannot fork)
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        ids, text = prompt_token_ids(prompt, self.tokenizer)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}")
        vocab = self.model_runner.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if params.stop_token_ids and not all(t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids of this model, in [0, {vocab}); got "
                             f"{[t for t in params.stop_token_ids if t >= vocab][:5]}")
        return ids, text

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue one request; returns its request id. `arrival_time` (engine clock) may lie in the future:
        the request stays invisible to the scheduler until then (replaying a workload)."""
        params = sampling_params or SamplingParams()
        ids, text = self.validate(prompt, params, priority)
        return self.add_checked(ids, text, params, priority, arrival_time)

    def add_checked(self, ids: list[int], text: str | None, params: SamplingParams, priority: int,
                    arrival_time: float | None, group: object | None = None) -> str:
        """Queue a request `validate` accepted (ids, text); returns its request id. `group`: `Sequence.group`."""
        index = self.num_requests
        self.num_requests += 1
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + index) % (1 << 63)
        now = self.clock()
        seq = Sequence(self.new_seq_id(), str(index), ids, params, now if arrival_time is None else arrival_time,
                       priority, prompt=text, generator=torch.Generator().manual_seed(seed), seed=seed,
                       num_pending_forks=params.n - 1, group=group)
        self.scheduler.add(seq)
        self.samples[seq.request_id] = [seq]
        self.num_prompt_tokens += len(ids)
        return seq.request_id

    def new_seq_id(self) -> int:
        self.num_seqs += 1
        return self.num_seqs - 1

    def fork(self, parent: Sequence, sample_index: int, seed: int) -> Sequence:
        """A new sequence continuing `parent` (same request), sharing its KV blocks copy-on-write."""
        child = Sequence(self.new_seq_id(), parent.request_id, parent.prompt_token_ids, parent.sampling_params,
                         parent.arrival_time, parent.priority, prompt=parent.prompt,
                         generator=torch.Generator().manual_seed(seed % (1 << 63)), seed=seed,
                         sample_index=sample_index, group=parent.group)
        self.model_runner.copy_blocks(self.scheduler.fork(parent, child))
        self.samples[parent.request_id].append(child)
        return child

    def has_unfinished_requests(self) -> bool:
        """Is a request still queued or running, or finished but its output not yet returned by `step()`?"""
        return self.scheduler.has_unfinished() or bool(self.undelivered)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepTrace]:
        """One scheduler iteration: the lecture's four steps. Returns the requests retired in step 1
        (after any that finished inside an earlier `generate` call; see there) and the step's trace."""
        earlier, self.undelivered = self.undelivered, []
        finished, trace = self._step()
        return earlier + finished, trace

    def _step(self) -> tuple[list[RequestOutput], StepTrace]:
        trace = StepTrace(step=self.num_steps, start_time=self.clock())
        # 1. retire sequences that hit EOS / a stop id / max_tokens last step; their KV blocks go back
        retired = self.scheduler.retire()
        self._hook("on_retire", retired)
        # 2. count free KV blocks
        trace.num_free_blocks_before = self.block_manager.num_free_blocks
        # 3. admit under the token budget (decodes first, then prefill chunks), preempting if blocks run out
        out = self.scheduler.schedule()
        self._hook("after_schedule", out)
        computed, padded = trace_schedule(trace, out, self.scheduler)
        self.num_computed_tokens += computed
        self.num_padded_tokens += padded
        # 4. one forward over the flattened batch; sample; append
        self._execute(out)
        self.num_steps += 1
        done = self._finished_requests(retired)
        self.num_finished += len(done)
        self.peak_blocks_used = max(self.peak_blocks_used, trace.num_blocks_used)
        trace.retired = [s.name for s in retired]
        trace.wall_time_s = self.clock() - trace.start_time
        self.busy_time_s += trace.wall_time_s
        return done, trace

    def _hook(self, name: str, *args) -> None:
        for feature in self.features:
            hook = getattr(feature, name, None)
            if hook is not None:
                hook(*args)

    def _execute(self, out: SchedulerOutput) -> None:
        """Step 4: the block moves, one forward over all scheduled tokens, sampling, appending."""
        self.model_runner.move_blocks(out)   # before the forward overwrites any block
        self._hook("on_block_copies", out.blocks_to_copy)
        if not out.scheduled:
            return
        logits = self.model_runner.execute(out)              # [rows, V]: sampling sequences (+ idle rows)
        rows, r = [], 0   # (item, its first logits row, its number of rows) for every item with logits
        for item in out.scheduled:
            n = (1 + len(item.lookahead_token_ids)) if item.sample else int(item.idle)
            if n:
                rows.append((item, r, n))
                r += n
        # A feature may take an item's logits: return the tokens it emits (a list), or None for "handled, nothing
        # to append now" (e.g. a sequence whose next token is chosen with others later).
        taken: dict[int, list[int] | None] = {}
        for feature in self.features:
            if hasattr(feature, "take_logits"):
                taken.update(feature.take_logits(rows, logits, self.model_runner.last_hidden))
        sampling = [(r, item.seq) for item, r, n in rows if item.sample and item.seq.seq_id not in taken]
        if len(sampling) < len(logits):
            logits = logits.index_select(0, torch.tensor([r for r, _ in sampling], dtype=torch.int64, device=logits.device))
        seqs = [seq for _, seq in sampling]
        tokens = self.sampler(logits, seqs) if seqs else []
        sampled: dict[int, int | list[int]] = {s.seq_id: t for s, t in zip(seqs, tokens)}
        sampled.update({seq_id: t for seq_id, t in taken.items() if t is not None})
        self._hook("after_sample", out, sampled)
        now = self.clock()
        before = {item.seq.seq_id: item.seq.num_tokens for item in out.scheduled}
        self.scheduler.update(out, sampled, now)
        self.model_runner.after_step(out)                     # the KV store settles (e.g. compresses what aged)
        self.num_generated_tokens += sum(item.seq.num_tokens - before[item.seq.seq_id] for item in out.scheduled)
        for r, seq in enumerate(seqs):   # n > 1: the request's first token is sampled; fork the other samples
            for i in range(1, seq.num_pending_forks + 1):
                child = self.fork(seq, i, seq.seed + i)
                child.token_ids.pop()   # the parent's first token: the child draws its own from the same logits
                self.scheduler.append_token(child, self.sampler.sample(logits[r], child), now)
                self.num_generated_tokens += 1
            seq.num_pending_forks = 0
        self._hook("after_update", now)

    def _finished_requests(self, retired: list[Sequence]) -> list[RequestOutput]:
        """The requests whose every sample has now been retired (n > 1: all n of them)."""
        done = []
        for seq in retired:
            samples = self.samples.get(seq.request_id)
            if samples is not None and all(s.finish_time is not None and not s.num_pending_forks for s in samples):
                del self.samples[seq.request_id]
                done.append(self._output(sorted(samples, key=lambda s: s.sample_index)))
        return done

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, samples: list[Sequence]) -> RequestOutput:
        first = samples[0]
        times = sorted(t for s in samples for t in s.token_times)
        metrics = RequestMetrics(first.request_id, first.arrival_time, times[0] if times else None,
                                 max(s.finish_time for s in samples), first.num_prompt_tokens,
                                 sum(s.num_output_tokens for s in samples), sum(s.num_preemptions for s in samples),
                                 first.first_scheduled_time, times,
                                 [list(s.token_times) for s in samples] if len(samples) > 1 else None)
        outputs = [CompletionOutput(s.sample_index, self.decode(s.output_token_ids) if s.output_text is None else s.output_text,
                                    s.output_token_ids, s.finish_reason, s.logprobs if s.sampling_params.logprobs is not None else None)
                   for s in samples]
        return RequestOutput(first.request_id, first.prompt, list(first.prompt_token_ids), outputs, True, metrics,
                             first.num_cached_tokens)

    # ---- offline API -------------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run `prompts` to completion; returns their outputs, in prompt order. All inputs are checked before any
        is queued. Requests queued earlier with `add_request` are served alongside; those that finish here are
        not in the result (vLLM's `generate` would mix them in) but kept: the next `step()` returns them."""
        prompts, params = as_batch(prompts, sampling_params)
        n = len(prompts)
        priority = [0] * n if priority is None else list(priority)
        if len(params) != n or len(priority) != n:
            raise ValueError(f"got {n} prompts, {len(params)} sampling_params and {len(priority)} priorities; give one each")
        checked = [self.validate(p, sp, pr) for p, sp, pr in zip(prompts, params, priority)]
        ids = [self.add_checked(tok, text, sp, pr, None) for (tok, text), sp, pr in zip(checked, params, priority)]
        pending, results = set(ids), {}
        from tqdm.auto import tqdm
        with tqdm(total=n, desc="generate", disable=not use_tqdm) as bar:
            def collect(finished: list[RequestOutput]) -> None:
                for o in finished:
                    if o.request_id in pending:
                        pending.discard(o.request_id)
                        results[o.request_id] = o
                        bar.update(1)
                    else:
                        self.undelivered.append(o)
            self.run_until(lambda: not pending, collect)
        return [results[i] for i in ids]

    def run_until(self, done: Callable[[], bool], collect: Callable[[list[RequestOutput]], None],
                  what: str = "the scheduler") -> None:
        """Step until `done()`, handing each step's finished requests to `collect`. A watchdog raises if no token is
        computed and nothing finishes for 30 s (plus the batch window a waiting batch may be held for)."""
        last_progress = self.clock()
        while not done():
            finished, trace = self._step()
            collect(finished)
            if trace.num_batched_tokens or finished:
                last_progress = self.clock()
            elif self.clock() - last_progress > 30 + self.config.batch_window_s:
                raise RuntimeError(f"{what} made no progress for 30 s; this is a bug, please report it")
            else:   # a batch is being held open (its window has not closed yet)
                before = self.clock()
                time.sleep(0.001)
                if self.clock() == before:
                    raise RuntimeError(
                        f"generate is waiting for the batch window (batch_window_s="
                        f"{self.config.batch_window_s}) to close, but the engine clock did not advance during a "
                        "1 ms sleep: pass a clock that advances, or call step() yourself and move the clock")

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        busy = self.busy_time_s
        return {
            **features.ALWAYS_REPORTED,   # (a feature that is on reports its own value below)
            "num_requests": self.num_requests, "num_requests_finished": self.num_finished, "num_steps": self.num_steps,
            **sch.stats(), "num_cow_copies": bm.num_cow_copies,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate, "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens, "prefix_cache_evictions": bm.num_evictions,
            "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks, "kv_blocks_free": bm.num_free_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks, "kv_cache_usage_peak": self.peak_blocks_used / bm.num_blocks,
            "num_prompt_tokens": self.num_prompt_tokens, "num_generated_tokens": self.num_generated_tokens,
            "num_computed_tokens": self.num_computed_tokens, "num_padded_tokens": self.num_padded_tokens,
            "busy_time_s": busy, "throughput_tokens_per_s": self.num_generated_tokens / busy if busy else 0.0,
            **self.model_runner.stats(), **{k: v for f in self.features for k, v in f.stats().items()},
        }

    def retire_finished(self) -> list[RequestOutput]:
        """Retire the sequences that finished in this step now instead of at the next step's start (their blocks go
        back at once); returns the requests that completed (not delivered by `step()`)."""
        return self._finished_requests(self.scheduler.retire())

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request (vLLM's `abort_request`, e.g. its client went away): its sequences leave
        the queues and their KV blocks go back now. Returns False if no such request is in progress."""
        seqs = self.samples.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if seq.finish_time is None:
                self.scheduler.abort(seq)
        self._hook("on_retire", seqs)
        return True

    def shutdown(self) -> None:
        """Stop any processes the model runner started (none for one process). Also runs on leaving
        `with LLM(...) as llm:`; the processes also stop when this one exits."""
        self.model_runner.shutdown()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
