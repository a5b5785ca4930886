"""LLM: the engine's front door (vLLM's offline API) and the four-step `step()` loop."""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from llmso_lab.engine.beam_search import BeamSearchGroup, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from llmso_lab.engine.config import EngineConfig
from llmso_lab.engine.metrics import StepTrace
from llmso_lab.engine.kv_cache import KiviBlockEvents
from llmso_lab.engine.model_runner import ModelRunner
from llmso_lab.engine.outputs import CompletionOutput, RequestOutput
from llmso_lab.engine.sampler import Sampler, sample_token
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.scheduler import Scheduler, SchedulerOutput
from llmso_lab.engine.sequence import Sequence
from llmso_lab.workloads import RequestMetrics

Prompt = str | dict | list[int]


class LLM:
    """A small serving engine: continuous batching over a paged KV cache, run on a HF Llama-family model.

    `model` is a registry name ("smollm2-135m", "tiny-llama") or a Hugging Face PreTrainedModel.
    `num_kv_blocks=None` sizes the cache from `kv_cache_memory_bytes` (capped at what `max_num_seqs`
    sequences of `max_model_len` tokens can use). See `Scheduler` for what the batching modes mean.

    `dtype` (vLLM's `--dtype`): "float32", "bfloat16", "float16" or "auto" — the weights, activations and KV
    cache in that dtype (norm statistics and logits in fp32, as Hugging Face does). "auto" picks bf16 where the
    hardware multiplies it natively (a CUDA GPU with bf16, a CPU with AMX-BF16 / AVX512-BF16, checked by a
    quick measurement) and fp32 elsewhere; `llm.dtype_reason` says why. On such CPUs bf16 makes prefill and
    batched decode several times faster; batch-1 decode gains little (plain bf16 matrix-vector products are slower
    than fp32 there, so the engine prepacks bf16 weights for oneDNN: `model_runner.OneDNNLinear`, as it does fp32
    weights where that measured faster on this CPU, vLLM's CPU backend's `onednn_mm`; `llmso-lab bench precision`
    measures all three). The default stays "float32" (vLLM's is "auto")
    because the labs compare the engine with Hugging Face fp32 token for token.

    Sharing (lecture 1-2): `SamplingParams(n=N)` computes the prompt once and forks N samples that share its KV
    blocks; `beam_search` forks and prunes beams the same way. A write into a shared block copies it first
    (copy-on-write). `share_kv_blocks=False` copies every block at the fork instead (the baseline without
    reference counts: same tokens, more memory). `prefix_caching_algo="radix"` caches prefixes in a radix tree
    over tokens (SGLang) instead of a hash chain over full blocks (vLLM).

    Quantization (lecture 1-3): `quantization="int8"` (per output channel) or `"int4"` / `"int4-g64"` (group 32 /
    64, asymmetric) quantizes every matmul's weight at load time and multiplies from the packed bytes
    (`llmso_lab.quant.weight_only`; W8A16 / W4A16, activations cast to bf16 for the kernel only). Decode reads
    4x / 8x fewer weight bytes than fp32; the embedding, norms and KV cache keep `dtype`.

    Quantized KV cache (lecture 2-4): `kv_cache_dtype="fp8_e4m3" | "fp8_e5m2" | "int8" | "kivi4" | "kivi2"` (vLLM's
    `--kv-cache-dtype`; "auto" = `dtype`) stores K/V compressed for real, codes with their scales
    (`llmso_lab.kv.quant.QuantizedPagedKV`), and dequantizes on read (`engine.kv_cache`). `kv_cache_memory_bytes` is
    divided by the compressed bytes per block, so the same budget holds more blocks. FP8 uses static scales, 1.0
    unless `calculate_kv_scales=True` (then the first forward's absmax; `kv_fp8_scales="tensor" | "head"`); KIVI
    keeps the last `kivi_residual_length` tokens in a full-precision window (a fixed cost, taken from the budget)
    and quantizes a block once it leaves that window. Prefill attention over the prompt's own tokens uses their
    exact K/V; what is read back from the cache is the dequantized form.

    Speculative decoding (lecture 2-1): `speculative_config={"method": "ngram" | "draft_model" | "medusa" | "eagle",
    "num_speculative_tokens": k, ...}` (vLLM's names; `llmso_lab.spec.config`). Each decoding sequence reserves k
    lookahead KV slots, a drafter fills them (`llmso_lab.spec.drafters`), the target computes its last token and the
    k drafts in the same forward as the rest of the batch, and rejection sampling (`llmso_lab.spec.verify`; greedy:
    argmax matching) decides what is emitted: greedy outputs equal plain decoding, sampled ones follow the target's
    distribution. Rejected drafts' slots are rolled back and the blocks only they used freed. `llm.stats()` adds
    `spec_num_draft_tokens`, `spec_num_accepted_tokens`, the acceptance rate and the mean accepted length.

    Tensor parallelism (lecture 2-2): `tensor_parallel_size=N` (vLLM's name) runs N rank processes on this machine
    (gloo over loopback), each holding 1/N of every layer's heads and MLP and its own KV heads' cache; two
    all-reduces per layer (`llmso_lab.parallel.tensor`). `kv_cache_memory_bytes` is then per rank. Greedy tokens
    equal tensor_parallel_size=1 except at near-ties (the all-reduce sums partials in another order). Call
    `shutdown()` (or use `with LLM(...) as llm:`) to stop the ranks; they also stop when this process exits.

    KV eviction (lecture 2-4): `kv_eviction={"method": "streaming", "num_sink_blocks": s, "window_blocks": w}` runs
    StreamingLLM (Xiao et al., 2023) in the paged cache, a block at a time (`llmso_lab.kv.streaming`): each
    sequence keeps its first s blocks (the attention sinks) and its last w full blocks plus the one being filled,
    and returns the blocks in between to the block manager as it grows. So one sequence holds at most s + w + 1
    blocks and may generate far more tokens than the cache holds (max_tokens up to max_model_len). Kept keys keep
    their original positions (like kvpress; the paper re-assigns positions inside the cache), so a sequence still
    stops at max_model_len <= max_position_embeddings. Lossy: tokens attend only to the kept blocks. vLLM has no
    such option. Refused with it: prefix caching, speculative decoding, n > 1 and beam search, swap preemption,
    static / dynamic batching, tensor parallelism, MLA and sliding-window models, chunked prefill off (a prompt
    longer than the budget is prefilled in chunks of at most w + 1 blocks, evicting between them). A sequence
    preempted by recompute is recomputed that way too, so its later tokens may differ from an uninterrupted run.

    Determinism: every request samples from its own generator (seeded by `SamplingParams.seed`, else by
    `seed` and its order of arrival), so its random draws do not depend on the rest of the batch; its logits
    can, at near-ties, because the batch's shape changes the order of floating-point sums (`sampler`).
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 batching: str = "continuous", batch_window_s: float = 0.05,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False,
                 scheduling_policy: str = "fcfs", preemption_mode: str = "recompute",
                 swap_space_blocks: int | None = None, attention_backend: str = "torch", seed: int = 0,
                 kv_cache_memory_bytes: int = 1 << 30, sjf_predictor="oracle", sjf_aging: float = 0.0,
                 dtype: str | torch.dtype = "float32", share_kv_blocks: bool = True, prefix_caching_algo: str = "hash",
                 quantization: str | None = None, speculative_config: dict | None = None,
                 tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto", kv_fp8_scales: str = "tensor",
                 calculate_kv_scales: bool = False, kivi_residual_length: int = 32,
                 kv_eviction: dict | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = c = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, batching=batching,
            batch_window_s=batch_window_s, enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
            preemption_mode=preemption_mode, swap_space_blocks=swap_space_blocks, attention_backend=attention_backend,
            seed=seed, kv_cache_memory_bytes=kv_cache_memory_bytes, sjf_predictor=sjf_predictor, sjf_aging=sjf_aging,
            dtype=dtype, share_kv_blocks=share_kv_blocks, prefix_caching_algo=prefix_caching_algo,
            quantization=quantization, speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype, kv_fp8_scales=kv_fp8_scales, calculate_kv_scales=calculate_kv_scales,
            kivi_residual_length=kivi_residual_length, kv_eviction=kv_eviction)
        if kv_cache_dtype != "auto" and type(self) is not LLM:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is supported by LLM itself, not by {type(self).__name__} "
                             "(disaggregation ships the plain K/V tensors between workers); use kv_cache_dtype='auto'")
        self.model, self.tokenizer = _resolve_model(model, tokenizer)
        c.resolve(self.model.config, self.model.get_input_embeddings().weight.device)
        self.max_model_len, self.seed, self.clock = c.max_model_len, seed, clock
        self.dtype, self.dtype_reason = c.torch_dtype, c.dtype_reason
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.scheduler = Scheduler(c, self.eos_token_ids, clock)
        self.block_manager = self.scheduler.block_manager
        if c.tensor_parallel_size > 1:   # N rank processes hold the shards; this process schedules and samples
            from llmso_lab.parallel.tensor import TensorParallelExecutor
            self.model_runner = TensorParallelExecutor(self.model, c)
        else:
            self.model_runner = ModelRunner(self.model, c)
            if c.kv_cache_dtype.startswith("kivi"):   # KIVI blocks follow the block manager (window / sealed state)
                self.block_manager.events = KiviBlockEvents(self.model_runner.kv_store)
        self.sampler = Sampler()
        self.drafter = None
        if c.spec is not None:
            from llmso_lab.spec.drafters import make_drafter
            self.drafter = make_drafter(c.spec, c, self.model, self.model_runner)
        self.num_spec_steps = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.draft_probs: dict[int, Tensor] = {}   # this step's draft distributions (sampled drafts only)
        self.num_requests = self.num_seqs = self.num_steps = self.num_finished = 0
        self.num_prompt_tokens = self.num_generated_tokens = self.num_computed_tokens = self.num_padded_tokens = 0
        self.busy_time_s, self.peak_blocks_used = 0.0, 0
        self.undelivered: list[RequestOutput] = []   # finished inside generate() but not its own: for the next step()
        self.samples: dict[str, list[Sequence]] = {}   # request id -> its sequences (n > 1: one per sample)
        self.beam_groups: dict[str, BeamSearchGroup] = {}   # beam searches in progress

    # ---- requests ----------------------------------------------------------------------------
    def _validate(self, prompt: Prompt, params: SamplingParams, priority: int) -> tuple[list[int], str | None]:
        """Check one request; return its prompt token ids and text. Raises ValueError, changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify()
        if params.n > 1 and self.config.batching != "continuous":
            raise ValueError(f"n={params.n} needs batching='continuous' (a static batch cannot grow by forking)")
        if params.n > 1 and self.config.eviction is not None:
            raise ValueError(f"n={params.n} cannot be combined with kv_eviction (samples share blocks that one of them "
                             "would evict); use n=1")
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
        return ids, text

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue one request; returns its request id. `arrival_time` (engine clock) may lie in the future:
        the request stays invisible to the scheduler until then (replaying a workload)."""
        params = sampling_params or SamplingParams()
        ids, text = self._validate(prompt, params, priority)
        return self._add(ids, text, params, priority, arrival_time)

    def _add(self, ids: list[int], text: str | None, params: SamplingParams, priority: int, arrival_time: float | None,
             beam: BeamSearchGroup | None = None) -> str:
        index = self.num_requests
        self.num_requests += 1
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + index) % (1 << 63)
        now = self.clock()
        seq = Sequence(self._new_seq_id(), str(index), ids, params, now if arrival_time is None else arrival_time,
                       priority, prompt=text, generator=torch.Generator().manual_seed(seed), seed=seed,
                       num_pending_forks=params.n - 1, beam=beam)
        self.scheduler.add(seq)
        self.samples[seq.request_id] = [seq]
        self.num_prompt_tokens += len(ids)
        return seq.request_id

    def _new_seq_id(self) -> int:
        self.num_seqs += 1
        return self.num_seqs - 1

    def _fork(self, parent: Sequence, sample_index: int, seed: int) -> Sequence:
        """A new sequence continuing `parent` (same request), sharing its KV blocks copy-on-write."""
        child = Sequence(self._new_seq_id(), parent.request_id, parent.prompt_token_ids, parent.sampling_params,
                         parent.arrival_time, parent.priority, prompt=parent.prompt,
                         generator=torch.Generator().manual_seed(seed % (1 << 63)), seed=seed,
                         sample_index=sample_index, beam=parent.beam)
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
        if self.drafter is not None:
            for seq in retired:
                self.drafter.forget(seq.seq_id)
        # 2. count free KV blocks
        trace.num_free_blocks_before = self.block_manager.num_free_blocks
        # 3. admit under the token budget (decodes first, then prefill chunks), preempting if blocks run out
        out = self.scheduler.schedule()
        if self.drafter is not None:
            self._propose(out)
        self._trace_schedule(trace, out)
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

    def _execute(self, out: SchedulerOutput) -> None:
        """Step 4: the swap copies, one forward over all scheduled tokens, sampling, appending."""
        self.model_runner.swap_out(out.blocks_to_swap_out)   # before the forward overwrites those blocks
        self.model_runner.swap_in(out.blocks_to_swap_in)
        self.model_runner.copy_blocks(out.blocks_to_copy)    # copy-on-write, after the swaps freed and filled blocks
        if self.drafter is not None:
            self.drafter.copy_blocks(out.blocks_to_copy)
        if not out.scheduled:
            return
        logits = self.model_runner.execute(out)              # [rows, V]: sampling sequences (+ idle static rows)
        sampling, spec, row = [], [], 0   # (logits row, seq); (first row, item): a speculative decode's s + 1 rows
        for item in out.scheduled:
            if item.spec_token_ids:
                spec.append((row, item))
                row += 1 + len(item.spec_token_ids)
            elif item.sample or item.idle:
                if item.sample:
                    sampling.append((row, item.seq))
                row += 1
        beams = [seq for r, seq in sampling if seq.beam is not None]
        for r, seq in sampling:   # a beam's next-token log-probs wait for the rest of its group (`_beam_step`)
            if seq.beam is not None:
                seq.beam.pending[seq.seq_id] = logits[r].float().cpu().log_softmax(-1)
        sampling = [(r, seq) for r, seq in sampling if seq.beam is None]
        spec_emitted = self._verify_all(spec, logits)
        if hasattr(self.drafter, "observe"):   # Medusa: the hidden state behind each sequence's newest token
            hidden = self.model_runner.last_hidden
            for r, seq in sampling:
                self.drafter.observe(seq, hidden[r])
            for r, item in spec:
                self.drafter.observe(item.seq, hidden[r + len(spec_emitted[item.seq.seq_id]) - 1])
        if spec or len(sampling) < row:
            logits = logits.index_select(0, torch.tensor([r for r, _ in sampling], dtype=torch.int64, device=logits.device))
        seqs = [seq for _, seq in sampling]
        tokens = self.sampler(logits, [s.sampling_params for s in seqs], [s.generator for s in seqs]) if seqs else []
        sampled: dict[int, int | list[int]] = {s.seq_id: t for s, t in zip(seqs, tokens)}
        for item in out.scheduled:   # a decode that reserved draft slots but got no draft: one token, as a list
            if item.num_lookahead and not item.spec_token_ids:
                sampled[item.seq.seq_id] = [sampled[item.seq.seq_id]]
        sampled.update(spec_emitted)
        now = self.clock()
        before = {item.seq.seq_id: item.seq.num_tokens for _, item in spec}
        self.scheduler.update(out, sampled, now)
        self.model_runner.commit_kv(out)                     # KIVI: quantize the blocks that left the window
        self.num_generated_tokens += len(tokens) + sum(item.seq.num_tokens - before[item.seq.seq_id] for _, item in spec)
        for r, seq in enumerate(seqs):   # n > 1: the request's first token is sampled; fork the other samples
            for i in range(1, seq.num_pending_forks + 1):
                child = self._fork(seq, i, seq.seed + i)
                child.token_ids.pop()   # the parent's first token: the child draws its own from the same logits
                self.scheduler.append_token(child, sample_token(logits[r].cpu(), seq.sampling_params, child.generator), now)
                self.num_generated_tokens += 1
            seq.num_pending_forks = 0
        for group in {seq.beam.request_id: seq.beam for seq in beams}.values():
            if group.ready():
                self._beam_step(group, now)

    # ---- speculative decoding ------------------------------------------------------------------
    def _propose(self, out: SchedulerOutput) -> None:
        """Ask the drafter for tokens to fill each decode's reserved slots; the target verifies them in this step's
        forward. Decodes with drafts become multi-token rows, so the one-token rows are put first again."""
        items = [item for item in out.scheduled if item.num_lookahead]
        self.draft_probs = {}
        for item, (tokens, q) in zip(items, self.drafter.propose(items) if items else []):
            item.spec_token_ids = list(tokens[:item.num_lookahead])
            item.num_new_tokens = 1 + len(item.spec_token_ids)
            if q is not None:
                self.draft_probs[item.seq.seq_id] = q
        out.scheduled.sort(key=lambda item: item.num_query_tokens > 1)
        out.num_decodes = sum(item.num_query_tokens == 1 for item in out.scheduled)

    batched_verification: bool | None = None   # None: on a GPU (one Triton kernel for the batch); else per request

    def _verify_all(self, spec: list, logits: Tensor) -> dict[int, list[int]]:
        """The tokens each speculative decode emits: its accepted drafts, then one from the target (a correction at
        the first rejection, or the bonus token after all). An item's rows of `logits` (from its first row r):
        the target at its last token and at each of its s drafts. Greedy: the longest run of drafts equal to the
        target's argmax; sampling: rejection sampling, so the emitted tokens are distributed exactly as the
        target's own samples (`llmso_lab.spec.verify`)."""
        from llmso_lab.spec.verify import greedy_verify, speculative_verify, target_probs
        emitted, batch = {}, []
        batched = logits.is_cuda if self.batched_verification is None else self.batched_verification
        for r, item in spec:
            seq, drafts = item.seq, item.spec_token_ids
            rows = logits[r:r + 1 + len(drafts)]
            if seq.sampling_params.greedy:
                emitted[seq.seq_id] = greedy_verify(rows.argmax(-1).tolist(), drafts)
                continue
            p = target_probs(rows if batched else rows.cpu(), seq.sampling_params)
            q = self.draft_probs.get(seq.seq_id)
            if q is None:   # one-hot drafts (n-gram lookup, greedy drafting)
                q = torch.zeros(len(drafts), p.shape[-1]).scatter_(1, torch.tensor(drafts)[:, None], 1.0)
            if batched:
                batch.append((seq, p, q.to(p.device), drafts))
            else:
                emitted[seq.seq_id] = speculative_verify(p, q, drafts, seq.generator)
        if batch:
            emitted.update(self._verify_batch(batch))
        for r, item in spec:
            self.num_spec_steps += 1
            self.num_draft_tokens += len(item.spec_token_ids)
            self.num_accepted_tokens += len(emitted[item.seq.seq_id]) - 1
        return emitted

    @staticmethod
    def _verify_batch(batch: list) -> dict[int, list[int]]:
        """Every sampled speculative decode of the step in one call (`verify_batch`: the Triton kernel on a GPU),
        padded to the most drafts; each request's random numbers come from its own generator."""
        from llmso_lab.spec.verify import verify_batch
        k, V, dev = max(len(d) for *_, d in batch), batch[0][1].shape[-1], batch[0][1].device
        B = len(batch)
        p, q = torch.zeros(B, k + 1, V, device=dev), torch.zeros(B, k, V, device=dev)
        tokens, u, noise = torch.zeros(B, k, dtype=torch.int64), torch.zeros(B, k), torch.empty(B, V)
        for b, (seq, pb, qb, drafts) in enumerate(batch):
            s = len(drafts)
            p[b, :s + 1], q[b, :s] = pb, qb
            tokens[b, :s] = torch.tensor(drafts, dtype=torch.int64)
            u[b, :s] = torch.rand(s, generator=seq.generator)
            noise[b].exponential_(generator=seq.generator)
        num = torch.tensor([len(d) for *_, d in batch])
        out, n = verify_batch(p, q, tokens.to(dev), num.to(dev), u.to(dev), noise.to(dev))
        out, n = out.cpu(), n.cpu()
        return {seq.seq_id: out[b, :int(n[b])].tolist() for b, (seq, *_) in enumerate(batch)}

    def _trace_schedule(self, trace: StepTrace, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            rid = item.seq.name
            trace.num_tokens[rid] = item.num_query_tokens
            if item.idle:
                trace.idle.append(rid)
            elif item.seq.is_prefill:
                trace.prefill[rid] = item.num_new_tokens
            else:
                trace.decode.append(rid)
            trace.num_padded_tokens += item.num_query_tokens - (0 if item.idle else item.num_new_tokens)
            self.num_computed_tokens += 0 if item.idle else item.num_new_tokens
        trace.num_batched_tokens = out.num_batched_tokens
        self.num_padded_tokens += trace.num_padded_tokens
        trace.preempted = [s.name for s in out.preempted]
        trace.swapped_in = [s.name for s in out.swapped_in]
        trace.num_blocks_used, trace.num_blocks_free = self.block_manager.num_used_blocks, self.block_manager.num_free_blocks
        sch = self.scheduler
        trace.num_running, trace.num_waiting, trace.num_swapped = len(sch.running), len(sch.waiting), len(sch.swapped)

    def _finished_requests(self, retired: list[Sequence]) -> list[RequestOutput]:
        """The requests whose every sample has now been retired (n > 1: all n of them)."""
        done = []
        for seq in retired:
            samples = self.samples.get(seq.request_id)
            if samples is not None and all(s.finish_time is not None and not s.num_pending_forks for s in samples):
                del self.samples[seq.request_id]
                done.append(self._output(sorted(samples, key=lambda s: s.sample_index)))
        return done

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, samples: list[Sequence]) -> RequestOutput:
        first = samples[0]
        times = sorted(t for s in samples for t in s.token_times)
        metrics = RequestMetrics(first.request_id, first.arrival_time, times[0] if times else None,
                                 max(s.finish_time for s in samples), first.num_prompt_tokens,
                                 sum(s.num_output_tokens for s in samples), sum(s.num_preemptions for s in samples),
                                 first.first_scheduled_time, times)
        outputs = [CompletionOutput(s.sample_index, self._decode(s.output_token_ids), s.output_token_ids, s.finish_reason)
                   for s in samples]
        return RequestOutput(first.request_id, first.prompt, list(first.prompt_token_ids), outputs, True, metrics,
                             first.num_cached_tokens)

    # ---- beam search ---------------------------------------------------------------------------
    def _beam_step(self, group: BeamSearchGroup, now: float) -> None:
        """Every live beam of `group` has its next-token log-probs: choose the next beams, then fork the beams
        chosen more than once (blocks shared), extend the others and prune the beams nobody chose."""
        chosen = group.step()
        kept = {cand.parent for cand in chosen}
        for p, parent in enumerate(group.beams):
            if p not in kept:
                self.scheduler.abort(parent)   # pruned: its blocks go back (those it shared stay with the others)
        # A parent chosen k times is forked k - 1 times before any beam grows, so each child starts from its tokens.
        beams, seen = [], set()
        for cand in chosen:
            parent = group.beams[cand.parent]
            beams.append(parent if cand.parent not in seen else
                         self._fork(parent, len(self.samples[group.request_id]), parent.seed))
            seen.add(cand.parent)
        for beam, cand in zip(beams, chosen):
            beam.append_token(cand.token, now)
        scores = [cand.cum_logprob for cand in chosen]
        group.beams, group.scores = beams, scores
        self.num_generated_tokens += len(chosen)
        if group.done:
            for beam in group.beams:
                self.scheduler.abort(beam)
            group.beams = []

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's `LLM.beam_search`), all prompts batched together. Beams fork by
        copy-on-write and free their blocks when pruned; the scores follow Hugging Face (see `beam_search`).
        Returns, per prompt, its `beam_width` best sequences, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if self.config.batching != "continuous":
            raise ValueError("beam_search needs batching='continuous' (beams fork and are pruned step by step)")
        if self.config.eviction is not None:
            raise ValueError("beam_search cannot be combined with kv_eviction (beams share blocks that one of them would "
                             "evict); make an LLM without kv_eviction")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sp = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True)
        checked = [self._validate(p, sp, 0) for p in prompts]
        for ids, _ in checked:
            need = params.beam_width * -(-(len(ids) + params.max_tokens) // self.config.block_size)
            if len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} exceeds "
                                 f"max_model_len={self.max_model_len}")
            if need > self.block_manager.num_blocks:
                raise ValueError(f"beam_width={params.beam_width} beams of {len(ids)} + {params.max_tokens} tokens may "
                                 f"need {need} KV blocks but the cache has {self.block_manager.num_blocks}; raise "
                                 "num_kv_blocks or lower beam_width / max_tokens")
        groups = []
        for ids, text in checked:
            group = BeamSearchGroup("", len(ids), params, self.eos_token_ids)
            group.request_id = self._add(ids, text, sp, 0, None, beam=group)
            group.beams, group.scores = list(self.samples[group.request_id]), [0.0]
            self.beam_groups[group.request_id] = group
            groups.append(group)
        from tqdm.auto import tqdm
        with tqdm(total=len(groups), desc="beam_search", disable=not use_tqdm) as bar:
            last_progress = self.clock()
            while not all(g.done for g in groups):
                before = sum(g.done for g in groups)
                finished, trace = self._step()
                self.undelivered += finished
                bar.update(sum(g.done for g in groups) - before)
                if trace.num_batched_tokens or finished:
                    last_progress = self.clock()
                elif self.clock() - last_progress > 30:
                    raise RuntimeError("beam search made no progress for 30 s (its beams cannot get KV blocks?); "
                                       "this is a bug, please report it")
        results = []
        for group in groups:
            del self.beam_groups[group.request_id]
            self.samples.pop(group.request_id, None)
            for h in group.finished:
                h.text = self._decode(h.tokens[group.prompt_len:])
            results.append(BeamSearchOutput(group.finished))
        return results

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
        checked = [self._validate(p, sp, pr) for p, sp, pr in zip(prompts, params, priority)]
        ids = [self._add(tok, text, sp, pr, None) for (tok, text), sp, pr in zip(checked, params, priority)]
        pending, results = set(ids), {}
        from tqdm.auto import tqdm
        with tqdm(total=n, desc="generate", disable=not use_tqdm) as bar:
            last_progress = self.clock()
            while pending:
                finished, trace = self._step()
                for o in finished:
                    if o.request_id in pending:
                        pending.discard(o.request_id)
                        results[o.request_id] = o
                        bar.update(1)
                    else:
                        self.undelivered.append(o)
                if trace.num_batched_tokens or finished:
                    last_progress = self.clock()
                elif self.clock() - last_progress > 30 + self.config.batch_window_s:
                    raise RuntimeError("the scheduler made no progress for 30 s; this is a bug, please report it")
                else:   # dynamic batching: waiting for the batch window to close
                    before = self.clock()
                    time.sleep(0.001)
                    if self.clock() == before:
                        raise RuntimeError(
                            f"generate is waiting for the dynamic batch window (batch_window_s="
                            f"{self.config.batch_window_s}) to close, but the engine clock did not advance during a "
                            "1 ms sleep: pass a clock that advances, or call step() yourself and move the clock")
        return [results[i] for i in ids]

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        busy = self.busy_time_s
        return {
            "num_requests": self.num_requests, "num_requests_finished": self.num_finished, "num_steps": self.num_steps,
            "num_preemptions_total": sch.num_preemptions_total, "num_preemptions_recompute": sch.num_recomputes,
            "num_preemptions_swap": sch.num_swaps, "num_cow_copies": bm.num_cow_copies,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate, "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens, "prefix_cache_evictions": bm.num_evictions,
            "kv_evicted_blocks": bm.num_evicted_blocks,
            "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks, "kv_blocks_free": bm.num_free_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks, "kv_cache_usage_peak": self.peak_blocks_used / bm.num_blocks,
            "num_prompt_tokens": self.num_prompt_tokens, "num_generated_tokens": self.num_generated_tokens,
            "num_computed_tokens": self.num_computed_tokens, "num_padded_tokens": self.num_padded_tokens,
            "busy_time_s": busy, "throughput_tokens_per_s": self.num_generated_tokens / busy if busy else 0.0,
            **self._spec_stats(), **self._tp_stats(),
        }

    def _tp_stats(self) -> dict:
        """Tensor parallelism: all-reduces per rank (2 per layer per forward) and the seconds spent in them."""
        if self.config.tensor_parallel_size == 1:
            return {}
        ranks = self.model_runner.rank_stats()
        return {"tp_size": len(ranks), "tp_num_forwards": ranks[0]["forwards"],
                "tp_all_reduces_per_rank": ranks[0]["all_reduces"],
                "tp_all_reduce_s_per_rank": [r["all_reduce_s"] for r in ranks],
                "tp_forward_s_per_rank": [r["forward_s"] for r in ranks]}

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes (no-op for one process). Also runs when the LLM is garbage
        collected or at interpreter exit, and on leaving `with LLM(...) as llm:`."""
        if hasattr(self.model_runner, "shutdown"):
            self.model_runner.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _spec_stats(self) -> dict:
        """vLLM's speculative-decoding metrics: drafts proposed and accepted, the acceptance rate, and the mean
        accepted length = tokens emitted per verification step (accepted drafts + the target's own token)."""
        if self.drafter is None:
            return {}
        steps, drafted, accepted = self.num_spec_steps, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_num_steps": steps, "spec_num_draft_tokens": drafted, "spec_num_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0}


def prompt_token_ids(prompt, tokenizer) -> tuple[list[int], str | None]:
    """(token ids, text or None) of one prompt: a string (needs `tokenizer`), a list of token ids, or
    {'prompt_token_ids': [...], 'prompt': optional text}. Raises ValueError for anything else."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass tokenizer=... or {'prompt_token_ids': [...]}")
        return list(tokenizer.encode(prompt)), prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"]), prompt.get("prompt")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt), None
    raise ValueError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}")


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """`generate`'s inputs as two lists: one prompt (text, token ids or a dict) becomes a list of one, and one
    SamplingParams (or None: the defaults) is repeated for every prompt. Raises ValueError for what is neither."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
    return prompts, params


def _resolve_model(model, tokenizer):
    if isinstance(model, str):
        from llmso_lab.models import load_model

        loaded, tok = load_model(model)
        return loaded, tokenizer if tokenizer is not None else tok
    if not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"model must be a registry name or a Hugging Face PreTrainedModel, got {type(model).__name__}")
    return model.eval(), tokenizer


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids as Hugging Face `generate` uses them: generation_config, else config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()
