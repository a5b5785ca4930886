"""Pipeline parallelism (lecture 2-2): each rank holds a contiguous slice of the decoder layers, activations flow
from rank to rank, and micro-batches keep the stages busy at the same time.

    logits, timeline = pipeline_prefill(model, prompt_ids, num_stages=2, num_microbatches=4)
    tokens, timeline = pipeline_generate(model, prompt_ids, num_stages=2, num_microbatches=4, max_new_tokens=16)
    measured_bubble(timeline, 2), bubble_fraction(2, 4)      # measured idle share vs GPipe's (p - 1) / (m + p - 1)

Stage s runs the layers `split_layers(L, p)[s]`; stage 0 also embeds the tokens, the last stage also applies the
final norm and the LM head. Each stage is a process (`launcher.launch`); hidden states go to the next stage with
`dist.isend` / `dist.recv` over gloo. Every stage computes the rotary position embeddings itself from the positions
(cheap, and nothing extra to send).

Prefill (GPipe, forward only): the batch is split into m micro-batches; stage s works on micro-batch j while stage
s + 1 works on j - 1. With equal work per micro-batch a stage idles (p - 1) of the (m + p - 1) slots: the bubble.

Decode: the last stage picks each micro-batch's next token (greedy) and sends it back to stage 0 (a ring), which
starts that micro-batch's next step. One micro-batch in flight leaves p - 1 stages idle at every step; with m >= p
micro-batches in flight every stage has work in the steady state, the way continuous batching keeps a GPU busy.
Each stage keeps the KV cache of its own layers, one `StageKVCache` per micro-batch.

How the model reaches the ranks: it is pickled into each process; torch.multiprocessing moves its tensors into
shared memory once, so the ranks map the same weights (no copy) and each uses only its slice. A registry name
("smollm2-135m", "tiny-llama") is loaded in this process first. Sends are non-blocking (`isend`) so that the ring
cannot deadlock however many micro-batches are in flight; receives block, which is the waiting a bubble is made of.

Every stage records its compute intervals, `Interval(stage, microbatch, kind, t_start, t_end, step)`, in seconds
from a common t0 (after a barrier, rank 0 reads `time.perf_counter` and broadcasts it: the ranks share one machine
and so one monotonic clock). Receiving and waiting are not busy time.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

__all__ = ["Interval", "PipelineJob", "PipelineStage", "StageKVCache", "bubble_fraction", "gpipe_stage",
           "measured_bubble", "pipeline_generate", "pipeline_prefill", "pipeline_run", "pipeline_stage_ideal",
           "run_pipeline_stage", "split_batch", "split_layers"]


# ---- pure reference functions (student exercises) --------------------------------------------------------

def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """The layers of each pipeline stage: contiguous ranges covering 0..num_layers-1 in order, sizes differing by
    at most one (the first num_layers % num_stages stages get the extra layer). split_layers(30, 4) ->
    [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]. Raises ValueError unless 1 <= num_stages <= num_layers."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    if not isinstance(num_stages, int) or not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be an int between 1 and the number of layers ({num_layers}), "
                         f"got {num_stages!r}: every stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """GPipe's bubble: the share of stage-time slots left idle when m equal micro-batches pass p stages,
    (p - 1) / (m + p - 1). The pipeline takes m + p - 1 slots, each stage works in m of them."""
    p, m = num_stages, num_microbatches
    if not isinstance(p, int) or p < 1 or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_stages and num_microbatches must be ints >= 1, got {p!r} and {m!r}")
    return (p - 1) / (m + p - 1)


def split_batch(batch_size: int, num_microbatches: int) -> list[range]:
    """The rows of each micro-batch: contiguous, sizes differing by at most one (`split_layers`' rule)."""
    if not isinstance(num_microbatches, int) or not 1 <= num_microbatches <= batch_size:
        raise ValueError(f"num_microbatches must be an int between 1 and the batch size ({batch_size}), "
                         f"got {num_microbatches!r}: every micro-batch needs at least one sequence")
    return split_layers(batch_size, num_microbatches)


class Interval(NamedTuple):
    """One stage computing one micro-batch: `kind` "prefill" (step 0) or "decode" (step >= 1), seconds from t0."""
    stage: int
    microbatch: int
    kind: str
    t_start: float
    t_end: float
    step: int = 0


def measured_bubble(timeline: Sequence[Interval], num_stages: int) -> float:
    """The idle share of the run: 1 - sum(busy time) / (num_stages * makespan), where the makespan runs from the
    first interval's start to the last one's end. Compare with `bubble_fraction` for a prefill."""
    if not timeline:
        raise ValueError("the timeline is empty: run pipeline_prefill / pipeline_generate first")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    busy = sum(iv.t_end - iv.t_start for iv in timeline)
    makespan = max(iv.t_end for iv in timeline) - min(iv.t_start for iv in timeline)
    if makespan <= 0:
        raise ValueError("the timeline has zero length; its intervals must have t_end > t_start")
    return 1.0 - busy / (num_stages * makespan)


# ---- one stage ----------------------------------------------------------------------------------------

class StageKVCache:
    """K and V of one micro-batch in this stage's layers: {layer index: tensor [batch, kv_heads, tokens, head_dim]}.

    Hugging Face attention calls `update(key, value, layer_idx)` with the new tokens' K and V and attends over what
    it returns (everything cached so far), which is all a cache has to do."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if layer_idx in self.keys:
            key = torch.cat([self.keys[layer_idx], key], dim=2)
            value = torch.cat([self.values[layer_idx], value], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value

    def num_tokens(self) -> int:
        return next(iter(self.keys.values())).shape[2] if self.keys else 0


def _cache_kwarg() -> str:
    """The name under which this transformers version's decoder layer takes its KV cache."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"


class PipelineStage:
    """The part of a Hugging Face Llama-family model (`model.model.layers`, `embed_tokens`, `norm`, `rotary_emb`,
    `model.lm_head`) that stage `stage` of `num_stages` runs. Holds references, copies nothing."""

    def __init__(self, model, stage: int, num_stages: int) -> None:
        _check_model(model)
        inner = model.model
        self.stage, self.num_stages = stage, num_stages
        self.layer_ids = split_layers(len(inner.layers), num_stages)[stage]
        self.layers = [inner.layers[i] for i in self.layer_ids]
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.embed = inner.embed_tokens if self.first else None
        self.norm, self.head = (inner.norm, model.lm_head) if self.last else (None, None)
        self.rotary = inner.rotary_emb
        self.hidden_size = model.config.hidden_size
        self.dtype = inner.embed_tokens.weight.dtype
        self.cache_kwarg = _cache_kwarg()

    def forward(self, x: Tensor, start: int, cache: StageKVCache) -> Tensor:
        """This stage's layers over `x` (token ids [b, t] on stage 0, hidden states [b, t, H] after it) at positions
        start..start+t-1, appending their K and V to `cache`. Returns hidden states [b, t, H]."""
        h = self.embed(x) if self.first else x
        t = h.shape[1]
        positions = torch.arange(start, start + t, device=h.device)[None]
        cos_sin = self.rotary(h, positions)
        mask = None
        if t > 1:   # additive causal mask: query i sees keys 0..start+i (eager and SDPA both take it)
            mask = torch.full((t, start + t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device)
            mask = mask.triu(start + 1)[None, None]
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin, use_cache=True,
                      **{self.cache_kwarg: cache})
            h = h[0] if isinstance(h, tuple) else h
        return h

    def logits(self, h: Tensor) -> Tensor:
        """Last stage only: final norm and LM head."""
        return self.head(self.norm(h))


def _check_model(model) -> None:
    inner = getattr(model, "model", None)
    needed = ("layers", "embed_tokens", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
        raise ValueError(f"the pipeline splits a Hugging Face Llama-family causal LM (model.model.layers, embed_tokens, "
                         f"norm, rotary_emb and model.lm_head); got {type(model).__name__}")


# ---- the schedule, run by every rank ----------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineJob:
    """One run over the pipeline. kind "prefill": logits of every prompt position come back; kind "generate": the
    greedy continuation of `max_new_tokens` tokens (no stop at EOS, like `ignore_eos`)."""
    kind: str
    prompt_ids: Tensor             # [batch, prompt_len] int64, one length for all
    num_microbatches: int
    max_new_tokens: int = 0


def _run_stage(stage: PipelineStage, job: PipelineJob, t0: float) -> tuple[Tensor | None, list[Interval]]:
    """This rank's part of `job`: for step 0 (prefill) then each decode step, every micro-batch in order: receive
    its input, compute, send the output on. The last stage returns the logits (prefill) or tokens (generate)."""
    import torch.distributed as dist

    rank, p = stage.stage, stage.num_stages
    prompts, m = job.prompt_ids, job.num_microbatches
    T = prompts.shape[1]
    microbatches = split_batch(prompts.shape[0], m)
    caches = [StageKVCache() for _ in microbatches]
    steps = 1 if job.kind == "prefill" else job.max_new_tokens
    timeline: list[Interval] = []
    pending = []                                   # isend handles; their tensors must live until they complete
    tokens: list[list[Tensor]] = [[] for _ in microbatches]   # last stage: each micro-batch's chosen tokens
    logits_out: list[Tensor] = []
    for step in range(steps):
        start, t = (0, T) if step == 0 else (T + step - 1, 1)
        for j, rows in enumerate(microbatches):
            tag = step * m + j
            if stage.first and step == 0:
                x = prompts[rows.start:rows.stop]
            elif stage.first:
                if p == 1:
                    x = tokens[j][-1][:, None]
                else:
                    x = torch.empty(len(rows), 1, dtype=torch.int64)
                    dist.recv(x, src=p - 1, tag=tag)
            else:
                x = torch.empty(len(rows), t, stage.hidden_size, dtype=stage.dtype)
                dist.recv(x, src=rank - 1, tag=tag)
            t_start = time.perf_counter() - t0
            h = stage.forward(x, start, caches[j])
            if stage.last:
                if job.kind == "prefill":
                    logits_out.append(stage.logits(h))
                else:
                    tokens[j].append(stage.logits(h[:, -1:])[:, -1].float().argmax(-1)[:, None])
            t_end = time.perf_counter() - t0
            timeline.append(Interval(rank, j, "prefill" if step == 0 else "decode", t_start, t_end, step))
            if not stage.last:
                pending.append(dist.isend(h.contiguous(), dst=rank + 1, tag=tag))
            elif p > 1 and step + 1 < steps:      # the ring: stage 0 needs the token for the next step
                pending.append(dist.isend(tokens[j][-1], dst=0, tag=tag + m))
    for work in pending:
        work.wait()
    if not stage.last:
        return None, timeline
    if job.kind == "prefill":
        return torch.cat(logits_out), timeline
    return torch.cat([torch.cat(tok, dim=1) for tok in tokens]), timeline


def _pipeline_rank(rank: int, world_size: int, model, jobs: list[PipelineJob]) -> list[tuple[Tensor | None, list[Interval]]]:
    """Runs in each rank (`launch`): build this rank's stage, then run the jobs one after the other, each from a
    fresh common t0."""
    import torch.distributed as dist

    stage = PipelineStage(model, rank, world_size)
    results = []
    with torch.inference_mode():
        for job in jobs:
            dist.barrier()
            t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
            dist.broadcast(t0, src=0)
            results.append(_run_stage(stage, job, float(t0)))
    return results


# ---- the public entry points ---------------------------------------------------------------------------

def _resolve(model):
    if isinstance(model, str):
        from llmso_lab.models import load_model
        model = load_model(model)[0]
    _check_model(model)
    return model.eval()


def _as_prompt_ids(prompt_ids, vocab_size: int) -> Tensor:
    if isinstance(prompt_ids, Tensor):
        ids = prompt_ids
    else:
        rows = [list(r) for r in prompt_ids]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("prompt_ids must be a non-empty batch of prompts of ONE length (group or pad prompts "
                             f"by length first); got lengths {sorted({len(r) for r in rows})}")
        ids = torch.tensor(rows, dtype=torch.int64)
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prompt_ids must be an integer tensor [batch, prompt_len] with both >= 1, got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    return ids.to(torch.int64).contiguous()


def pipeline_run(model, jobs: Sequence[PipelineJob], num_stages: int, *,
                 timeout_s: float = 300.0) -> list[tuple[Tensor, list[Interval]]]:
    """Run several jobs on ONE set of `num_stages` stage processes (processes cost seconds to start): for each job,
    (its logits [batch, prompt_len, vocab] or tokens [batch, max_new_tokens], the timeline of every stage sorted by
    start time). Raises ValueError for bad input, `RankError` if a stage fails."""
    from llmso_lab.parallel.launcher import launch

    model = _resolve(model)
    split_layers(len(model.model.layers), num_stages)        # checks num_stages
    checked = []
    for job in jobs:
        if job.kind not in ("prefill", "generate"):
            raise ValueError(f"job kind must be 'prefill' or 'generate', got {job.kind!r}")
        ids = _as_prompt_ids(job.prompt_ids, model.config.vocab_size)
        split_batch(ids.shape[0], job.num_microbatches)        # checks num_microbatches
        if job.kind == "generate" and (not isinstance(job.max_new_tokens, int) or job.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {job.max_new_tokens!r}")
        checked.append(PipelineJob(job.kind, ids, job.num_microbatches, job.max_new_tokens))
    if not checked:
        raise ValueError("no jobs given")
    per_rank = launch(_pipeline_rank, num_stages, args=(model, checked), timeout_s=timeout_s)
    results = []
    for i in range(len(checked)):
        timeline = sorted((iv for rank in per_rank for iv in rank[i][1]), key=lambda iv: (iv.t_start, iv.stage))
        results.append((per_rank[-1][i][0], timeline))
    return results


def pipeline_prefill(model, prompt_ids, num_stages: int, num_microbatches: int, *,
                     timeout_s: float = 300.0) -> tuple[Tensor, list[Interval]]:
    """Prefill `prompt_ids` [batch, prompt_len] through `num_stages` stage processes in `num_microbatches`
    micro-batches (GPipe). Returns (logits [batch, prompt_len, vocab], timeline); the logits equal the model's
    own forward."""
    return pipeline_run(model, [PipelineJob("prefill", prompt_ids, num_microbatches)], num_stages,
                        timeout_s=timeout_s)[0]


def pipeline_generate(model, prompt_ids, num_stages: int, num_microbatches: int, max_new_tokens: int, *,
                      timeout_s: float = 300.0) -> tuple[Tensor, list[Interval]]:
    """Greedy decoding with `num_microbatches` micro-batches in flight: prefill, then `max_new_tokens - 1` decode
    steps, tokens going from the last stage back to stage 0. Returns (tokens [batch, max_new_tokens], timeline);
    the tokens equal Hugging Face `generate(do_sample=False)` without an EOS stop."""
    return pipeline_run(model, [PipelineJob("generate", prompt_ids, num_microbatches, max_new_tokens)], num_stages,
                        timeout_s=timeout_s)[0]


# ---- a stage's loop, run for real across ranks (Lab 08's exercise and its harness) -----------------------------

def gpipe_stage(stage: int, num_stages: int, num_microbatches: int, inputs, compute, send, recv):
    """One stage of a GPipe forward pass, as every rank runs it: for each micro-batch in order, take its input (stage
    0: `inputs[j]`; later stages: `recv(stage - 1)`), `compute` it, and hand the result on (`send(y, stage + 1)`);
    the last stage keeps the outputs and returns them in micro-batch order (the other stages return None). Stage s
    works on micro-batch j while stage s + 1 works on j - 1: that overlap is the whole point of micro-batches."""
    outputs = []
    for j in range(num_microbatches):
        x = inputs[j] if stage == 0 else recv(stage - 1)
        y = compute(x)
        if stage + 1 < num_stages:
            send(y, stage + 1)
        else:
            outputs.append(y)
    return outputs if stage + 1 == num_stages else None


def _stage_weight(stage: int, hidden: int, seed: int) -> Tensor:
    return torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed + 100 + stage)) / hidden ** 0.5


def _schedule_rank(rank: int, world_size: int, fn, num_microbatches: int, rows: int, hidden: int, seed: int,
                   slot_s: float) -> dict:
    """One stage for `run_pipeline_stage`: gives `fn` its compute / send / recv and records each compute twice: its
    wall-clock interval (seconds after a common t0 broadcast by rank 0) and its interval on a logical clock in slots.
    The logical clock replays the run as an ideal machine would: every compute takes one slot, a stage's clock moves
    to a message's stamp when it receives it (it cannot start before the data exists), and a message carries the
    sender's clock. It depends on the order of the stage's calls only, not on how busy the machine is."""
    import torch.distributed as dist

    inputs = pipeline_stage_inputs(world_size, num_microbatches, rows, hidden, seed) if rank == 0 else None
    pending, intervals, logical = [], [], []
    clock = [0.0]   # this stage's logical time, in slots
    dist.barrier()
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(t0, src=0)
    t0 = float(t0)

    def compute(x: Tensor) -> Tensor:
        """This stage's layers on one micro-batch; takes `slot_s` of wall time (a sleep stands in for the GPU kernel,
        so that ranks sharing 2 cores do not slow each other and the timing shows the schedule alone)."""
        start = time.perf_counter()
        y = stage_compute(rank, x, hidden, seed)
        time.sleep(max(0.0, slot_s - (time.perf_counter() - start)))
        intervals.append((start - t0, time.perf_counter() - t0))
        logical.append((clock[0], clock[0] + 1.0))
        clock[0] += 1.0
        return y

    def check_peer(peer, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < world_size or peer == rank:
            raise ValueError(f"stage {rank}: {what} stage {peer!r}; the stages are 0..{world_size - 1}")

    def send(t: Tensor, dst: int) -> None:
        """Send activations [rows, hidden] to stage `dst` (non-blocking: returns at once)."""
        check_peer(dst, "send to")
        if not isinstance(t, Tensor) or tuple(t.shape) != (rows, hidden):
            raise ValueError(f"stage {rank}: send takes one micro-batch's activations [{rows}, {hidden}], got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        t = t.detach().float().contiguous()
        stamp = torch.tensor([clock[0]], dtype=torch.float64)
        pending.append((dist.isend(t, dst=dst), t))
        pending.append((dist.isend(stamp, dst=dst), stamp))

    def recv(src: int) -> Tensor:
        """The next micro-batch's activations from stage `src` (blocks until they arrive)."""
        check_peer(src, "recv from")
        x, stamp = torch.empty(rows, hidden), torch.empty(1, dtype=torch.float64)
        dist.recv(x, src=src)
        dist.recv(stamp, src=src)
        clock[0] = max(clock[0], float(stamp))
        return x

    with torch.no_grad():
        out = fn(rank, world_size, num_microbatches, inputs, compute, send, recv)
    for work, _ in pending:
        work.wait()
    dist.barrier()   # no rank tears the group down while a peer still receives
    if rank == world_size - 1 and isinstance(out, (list, tuple)):
        out = [y.detach().clone() if isinstance(y, Tensor) else y for y in out]
    return {"intervals": intervals, "logical": logical, "outputs": out if rank == world_size - 1 else None}


def run_pipeline_stage(fn, num_stages: int, num_microbatches: int, rows: int = 2, hidden: int = 8, seed: int = 0,
                       slot_ms: float = 20.0, timeout_s: float = 20.0) -> dict:
    """Harness of the `pipeline_stage` exercise: run `fn(stage, num_stages, num_microbatches, inputs, compute, send,
    recv)` in `num_stages` real gloo ranks (forked processes, so `fn` may come from a notebook cell). Stage s's
    `compute(x)` is tanh(x @ W_s) and lasts `slot_ms`; `send(y, dst)` / `recv(src)` move activations [rows, hidden].
    Returns plain data:
    {"outputs_equal_single_process": the last stage's outputs equal the m micro-batches passed through all stages
     in one process, "computes_per_stage": [compute calls of each stage] (m each),
     "bubble": the idle share 1 - busy / (p x makespan) on the logical clock (one slot per compute, a stage waits
     for its input: see `_schedule_rank`), which does not depend on the machine's load (GPipe: (p - 1) / (m + p - 1)),
     "makespan_slots": the logical makespan (GPipe: m + p - 1),
     "bubble_wall": the same measured with the wall clock (`measured_bubble`; a little above on a busy machine),
     "timeline": [(stage, j, t_start, t_end)] wall-clock seconds}.
    Raises launcher.RankError ('rank r: the exception') when `fn` fails in a rank."""
    from llmso_lab.parallel.launcher import RankError, launch

    pipeline_stage_inputs(num_stages, num_microbatches, rows, hidden, seed)   # checks the arguments
    try:
        ranks = launch(_schedule_rank, num_stages, args=(fn, num_microbatches, rows, hidden, seed, slot_ms / 1e3),
                       timeout_s=timeout_s, start_method="fork")
    except RankError as err:
        raise err.brief() from None
    return pipeline_stage_report(ranks[-1]["outputs"], [r["logical"] for r in ranks], [r["intervals"] for r in ranks],
                                 num_microbatches, rows, hidden, seed)


def pipeline_stage_inputs(num_stages: int, num_microbatches: int, rows: int, hidden: int, seed: int) -> list[Tensor]:
    """Stage 0's micro-batches [rows, hidden] of a `run_pipeline_stage` run (seeded); checks the arguments."""
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    split_batch(num_microbatches, num_microbatches)     # checks num_microbatches
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, hidden, generator=gen) for _ in range(num_microbatches)]


def stage_compute(stage: int, x: Tensor, hidden: int, seed: int) -> Tensor:
    """What stage `stage` computes on one micro-batch in the exercise's pipeline: tanh(x @ W_stage)."""
    return torch.tanh(x @ _stage_weight(stage, hidden, seed))


def pipeline_stage_report(outputs, logical: list[list[tuple[float, float]]], wall: list[list[tuple[float, float]]] | None,
                          num_microbatches: int, rows: int, hidden: int, seed: int) -> dict:
    """Judge a pipeline run from the last stage's outputs and every stage's compute intervals on the logical clock
    (`logical[s]`, one per compute call, kept by the harness, never by the stage's code) and, where measured, the
    wall clock (`wall[s]`; None: not measured). See `run_pipeline_stage` for the keys."""
    if not isinstance(outputs, (list, tuple)) or not all(isinstance(y, Tensor) for y in outputs):
        raise TypeError("the last stage must return the list of its micro-batch outputs (tensors)")
    expected = pipeline_stage_inputs(len(logical), num_microbatches, rows, hidden, seed)
    with torch.no_grad():
        for s in range(len(logical)):
            expected = [stage_compute(s, x, hidden, seed) for x in expected]
    equal = len(outputs) == len(expected) and all(
        g.shape == e.shape and torch.allclose(g.float(), e, atol=1e-6) for g, e in zip(outputs, expected))
    ideal = [Interval(s, j, "prefill", a, b) for s, r in enumerate(logical) for j, (a, b) in enumerate(r)]
    if not ideal:
        raise ValueError("no stage called compute(): nothing ran")
    timed = None if wall is None else [Interval(s, j, "prefill", a, b) for s, r in enumerate(wall) for j, (a, b) in enumerate(r)]
    return {"outputs_equal_single_process": bool(equal),
            "computes_per_stage": [len(r) for r in logical],
            "bubble": round(measured_bubble(ideal, len(logical)), 3),
            "makespan_slots": max(iv.t_end for iv in ideal) - min(iv.t_start for iv in ideal),
            "bubble_wall": None if timed is None else round(measured_bubble(timed, len(logical)), 3),
            "timeline": None if timed is None else [(iv.stage, iv.microbatch, round(iv.t_start, 4), round(iv.t_end, 4))
                                                    for iv in timed]}


def pipeline_stage_ideal(num_stages: int, num_microbatches: int, *args, **kwargs) -> dict:
    """What `run_pipeline_stage` reports for a correct GPipe stage (the grader's expected value): equal outputs,
    m computes per stage, bubble (p - 1) / (m + p - 1) in m + p - 1 slots on the logical clock (the wall-clock
    bubble and timeline are for the reader: None here, not graded)."""
    p, m = num_stages, num_microbatches
    return {"outputs_equal_single_process": True, "computes_per_stage": [m] * p,
            "bubble": round(bubble_fraction(p, m), 3), "makespan_slots": float(m + p - 1), "bubble_wall": None,
            "timeline": None}
