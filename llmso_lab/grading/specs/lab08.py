"""Lab 08 (parallelism: TP, PP, EP, context parallelism) exercises and their public checks.

References: `llmso_lab.parallel.tensor:shard_linear`, `llmso_lab.parallel.tensor:tp_mlp_forward`,
`llmso_lab.sim.comm:tp_allreduces_per_token`, `llmso_lab.sim.comm:allreduce_time`,
`llmso_lab.parallel.pipeline:bubble_fraction`, `llmso_lab.parallel.pipeline:gpipe_stage`,
`llmso_lab.parallel.moe:dispatch_indices`, `llmso_lab.parallel.ring:ring_attention_step`.

Two are mechanisms run for real as concurrent ranks (harness exercises; in the notebook gloo ranks, in the grader ranks
of the sandboxed job whose collectives the grader carries out, `grading.judge`): `tp_mlp_forward` must equal the
unsharded MLP with one all-reduce of the rank's own share (any I/tp of the features: `tensor.share_features`);
`pipeline_stage` runs as every stage of a 2-4 stage pipeline (`pipeline.run_pipeline_stage`), whose outputs must
equal one process's and whose bubble, measured on the harness's logical clock (one slot per compute, a stage
waits for its input's stamp: independent of the machine's load), must be GPipe's (p - 1) / (m + p - 1) in
m + p - 1 slots (expected values from `pipeline_stage_ideal`; the wall-clock bubble is reported, not graded). The others are single-process and pure; tensor inputs are
small and built from seeded generators, so the checks are the same on every machine. `allreduce_time` takes a
`hardware.Link` (case arguments may hold one: `protocol.ARGUMENT_CLASSES`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from llmso_lab.grading.compare import Comparator, close, exact
from llmso_lab.grading.registry import Case, Exercise, register
from llmso_lab.hardware import LINKS

rel = close(atol=0.0, rtol=1e-9)   # closed-form arithmetic: only float rounding is allowed
# Other implementations of a ring collective's cost: an all-gather is half an all-reduce on the same ring.
COLLECTIVE_CODE = ("llmso_lab.sim.comm:allgather_time", "llmso_lab.sim.comm:all_to_all_time")
# Code that computes attention with its log-sum-exp, or merges two partial results by it: the two halves of a ring
# step. (Library functions that call ring_attention_step itself trip on the disabled reference.)
ATTENTION_MERGE_CODE = (
    "llmso_lab.attention.reference:merge_attention_states", "llmso_lab.attention.reference:online_softmax_update",
    "llmso_lab.attention.reference:naive_attention", "llmso_lab.attention.reference:flash_attention_torch",
    "llmso_lab.attention.reference:flash_decoding_torch", "llmso_lab.attention.varlen:varlen_attention_torch",
    "llmso_lab.attention.fallback:flash_attention", "llmso_lab.attention.fallback:flash_decoding",
    "torch.nn.functional:scaled_dot_product_attention")


def run_report(hints: dict[str, str] | None = None, ignore: tuple[str, ...] = ()) -> Comparator:
    """Compare a harness's report (a dict) key by key, exactly, except the `ignore`d keys (for the reader: a
    wall-clock timing, a float error). A mismatch names the key and adds its hint."""
    hints = hints or {}

    def cmp(got: Any, exp: Any) -> str | None:
        if not isinstance(got, dict):
            return f"expected the harness's report (a dict), got {type(got).__name__}"
        for key, e in exp.items():
            if key in ignore:
                continue
            if key not in got:
                return f"the report has no {key!r}"
            if got[key] != e:
                return f"{key}: got {got[key]!r}, expected {e!r}. {hints.get(key, '')}".strip()
        return None

    return cmp


TP_HINTS = {
    "output_equals_tp1": "Each rank must end with the FULL MLP output: gate/up column-parallel (rows of the weight), "
                         "SwiGLU on the rank's slice, down row-parallel (the same columns), then the all-reduce.",
    "all_reduces_per_rank": "One all-reduce per MLP, after down_proj (group.all_reduce): activations before down are "
                            "slices of different features, not partial sums.",
    "partial_is_rank_share": "What a rank all-reduces must be its own share: silu(x G_r^T) * (x U_r^T) @ D_r^T with "
                             "G_r, U_r I/tp rows (features) of gate and up and D_r the same I/tp columns of down, "
                             "each feature on one rank (not the whole MLP / tp).",
    "ranks_agree": "After the all-reduce every rank holds the same sum.",
}
PP_HINTS = {
    "outputs_equal_single_process": "The last stage must return its m outputs in micro-batch order, each the "
                                    "micro-batch passed through every stage once.",
    "computes_per_stage": "Each stage computes each micro-batch once (not the whole batch at once).",
    "bubble": "Hand each micro-batch on as soon as it is computed (send), and receive the next one only when you "
              "need it: a stage that first collects all m micro-batches leaves the pipeline idle, (p - 1) / p. "
              "run_pipeline_stage(pipeline_stage, 3, 4) shows the measured timeline.",
    "makespan_slots": "GPipe finishes in m + p - 1 slots: stage s computes micro-batch j in slot s + j.",
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


def counting_weight(out_features: int, in_features: int) -> torch.Tensor:
    """W[i, j] = 100 i + j (fp32): a wrong slice shows which rows and columns it took."""
    return (100 * torch.arange(out_features)[:, None] + torch.arange(in_features)[None, :]).float()


def routed(num_tokens: int, top_k: int, num_experts: int, seed: int, skew: float = 0.0) -> torch.Tensor:
    """experts [T, k] int64: each token's top_k of random router logits (distinct experts, best first); `skew`
    is added to expert 0's logit, so that it is popular and its buffer overflows."""
    logits = randn(num_tokens, num_experts, seed=seed)
    logits[:, 0] += skew
    return logits.topk(top_k, dim=-1).indices


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q over one block, with its lse ((0, -inf) for a query that sees none of it)."""
    s = (q @ k.transpose(-2, -1) * scale).masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v, torch.logsumexp(s, dim=-1)


def ring_inputs(heads: int, dim: int, q_pos: Sequence[int], k_pos: Sequence[int], seed: int,
                before: Sequence[int] | None = None, scale: float | None = None, q_scale: float = 1.0) -> tuple:
    """(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale) for one ring step. The state (o, lse) is the attention over an
    earlier block at positions `before` (None: the first step, zeros and -inf). scale defaults to 1/sqrt(dim)."""
    qp, kp = torch.tensor(list(q_pos)), torch.tensor(list(k_pos))
    q = randn(heads, len(qp), dim, seed=seed, scale=q_scale)
    k, v = randn(heads, len(kp), dim, seed=seed + 1), randn(heads, len(kp), dim, seed=seed + 2)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if before is None:
        o, lse = torch.zeros(heads, len(qp), dim), torch.full((heads, len(qp)), float("-inf"))
    else:
        bp = torch.tensor(list(before))
        o, lse = _attend(q, randn(heads, len(bp), dim, seed=seed + 3), randn(heads, len(bp), dim, seed=seed + 4),
                         qp, bp, scale)
    return o, lse, q, k, v, qp, kp, scale


def attention_state(atol: float = 1e-5, rtol: float = 1e-5) -> Comparator:
    """`close` on (o, lse), naming which of the two is off, and with messages for the -inf rows: lse = -inf marks a
    query that has seen no key yet (weight 0 in later merges); the reference has -inf exactly there, and no NaN."""
    base = close(atol=atol, rtol=rtol)

    def first(mask: torch.Tensor) -> list[int]:
        return [int(i) for i in torch.nonzero(mask)[0]]

    def cmp(got: Any, exp: Any) -> str | None:
        pair = isinstance(got, (tuple, list)) and len(got) == 2
        if pair and all(isinstance(g, torch.Tensor) and not g.is_complex() for g in got):
            for name, g, e in zip(("o", "lse"), got, exp):
                if tuple(g.shape) == tuple(e.shape) and bool((nan := torch.isnan(g.double()) & ~torch.isnan(e)).any()):
                    return (f"{name} is NaN at index {first(nan)}: a query that sees no key of a block must keep "
                            "its (o, lse) (exp(-inf - (-inf)) is NaN: subtract 0 instead of an lse that is -inf)")
            g, e = got[1].double(), exp[1].double()
            if g.shape == e.shape and bool((off := torch.isneginf(g) != torch.isneginf(e)).any()):
                i = first(off)
                if bool(torch.isneginf(e[tuple(i)])):
                    return (f"lse at index {i}: got {g[tuple(i)].item():.6g}, expected -inf: this query has seen no "
                            "key so far (every key masked: position k_pos > q_pos), so its lse stays -inf")
                return (f"lse at index {i}: got -inf, expected {e[tuple(i)].item():.6g}: this query sees at least "
                        "one key (k_pos <= q_pos), so its lse is finite")
        msg = base(got, exp)
        if msg is None:
            return None
        return msg.replace("result[0]", "o (result[0])", 1).replace("result[1]", "lse (result[1])", 1)

    return cmp


register(
    Exercise("shard_linear", "08", 5, "llmso_lab.parallel.tensor:shard_linear", [
        Case("column-parallel, tp 2, rank 0: the first half of the rows (output features) of a [4, 6] weight",
             (counting_weight(4, 6), 0, 2, "column")),
        Case("column-parallel, tp 4, rank 3: the last 2 of 8 rows", (counting_weight(8, 6), 3, 4, "column")),
        Case("row-parallel, tp 2, rank 1: the second half of the columns (input features)",
             (counting_weight(4, 6), 1, 2, "row")),
        Case("row-parallel, tp 3, rank 1: the middle 2 of 6 columns", (counting_weight(4, 6), 1, 3, "row")),
        Case("a square [6, 6] weight, column-parallel, tp 3, rank 2: rows, not columns",
             (counting_weight(6, 6), 2, 3, "column")),
        Case("tp 1: the whole weight", (counting_weight(3, 5), 0, 1, "row")),
        Case("a random fp16 weight [6, 8], row-parallel, tp 4, rank 2: values and dtype unchanged",
             (randn(6, 8, seed=1).half(), 2, 4, "row")),
        Case("an unknown style ('rows'): ValueError, as the docstring says", (counting_weight(4, 6), 0, 2, "rows"),
             raises="ValueError"),
        Case("9 output features over tp 2 (column): ValueError, not uneven shards", (counting_weight(9, 4), 0, 2,
                                                                                      "column"), raises="ValueError"),
        Case("6 input features over tp 4 (row): ValueError", (counting_weight(4, 6), 1, 4, "row"), raises="ValueError"),
    ], compare=exact(),
        description="rank r's slice of a Hugging Face weight [out, in]: rows (column-parallel) or columns "
                    "(row-parallel)"),
    Exercise("tp_mlp_forward", "08", 30, "llmso_lab.parallel.tensor:tp_mlp_forward", [
        Case("2 gloo ranks: an MLP with hidden 16, intermediate 24", (2,)),
        Case("3 gloo ranks (8 of the 24 intermediate features each), 7 tokens", (3,), {"num_tokens": 7, "seed": 3}),
        Case("4 ranks, hidden 12, intermediate 32", (4,), {"hidden": 12, "intermediate": 32, "seed": 5}),
    ], compare=run_report(hints=TP_HINTS, ignore=("max_abs_diff",)), harness="llmso_lab.parallel.tensor:run_tp_mlp",
        tripwires=("llmso_lab.parallel.tensor:column_parallel_linear", "llmso_lab.parallel.tensor:row_parallel_linear",
                   # the engine's TP rank: its layer shards and its MLP op (the engine is not what this job runs)
                   "llmso_lab.parallel.tensor:shard_llama_layer", "llmso_lab.engine.ops:swiglu_mlp",
                   "llmso_lab.parallel.tensor:shard_linear"),   # the sharding is the exercise
        timeout_s=60.0,
        description="one rank's Megatron MLP (column gate/up, SwiGLU, row down, one all-reduce), run in real gloo "
                    "ranks; the gathered result must equal TP = 1"),
    Exercise("tp_allreduces_per_token", "08", 5, "llmso_lab.sim.comm:tp_allreduces_per_token", [
        Case("SmolLM2-135M: 30 layers", (30,)),
        Case("Llama-3-70B: 80 layers (the lecture's count)", (80,)),
        Case("a single layer", (1,)),
    ], compare=exact(),
        description="two all-reduces per layer (after o_proj and after down_proj), whatever the number of tokens"),
    Exercise("allreduce_time", "08", 5, "llmso_lab.sim.comm:allreduce_time", [
        Case("one decode token of a 8192-wide model in bf16 (16 KB), 8 GPUs on NVLink4: latency-bound",
             (16384, 8, LINKS["NVLink4"])),
        Case("1 GB over 8 GPUs on NVLink4: bandwidth-bound, each rank sends 2 (n - 1) / n of the bytes",
             (1e9, 8, LINKS["NVLink4"])),
        Case("16 MB between 2 servers on 100 Gb Ethernet", (16 * 2**20, 2, LINKS["100GbE"])),
        Case("64 MB over 16 GPUs on InfiniBand NDR", (64 * 2**20, 16, LINKS["IB-NDR"])),
        Case("n = 1: nothing to exchange, 0 seconds", (1e9, 1, LINKS["IB-NDR"])),
    ], compare=rel, tripwires=COLLECTIVE_CODE,
        description="ring all-reduce: 2 (n - 1) steps, each sending one 1/n chunk: "
                    "2 (n - 1) / n * nbytes / bandwidth + 2 (n - 1) * latency"),
    Exercise("bubble_fraction", "08", 5, "llmso_lab.parallel.pipeline:bubble_fraction", [
        Case("4 stages, 8 micro-batches", (4, 8)),
        Case("2 stages, 4 micro-batches", (2, 4)),
        Case("8 stages, 1 micro-batch: one stage works at a time", (8, 1)),
        Case("1 stage: no pipeline, no bubble", (1, 6)),
    ], compare=rel, tripwires=("llmso_lab.parallel.pipeline:measured_bubble", "llmso_lab.sim.comm:pipeline_bubble",
                               "llmso_lab.parallel.pipeline:pipeline_stage_ideal"),   # the same share, measured or ideal
        description="GPipe's idle share (p - 1) / (m + p - 1): m + p - 1 slots, each stage busy in m of them"),
    Exercise("pipeline_stage", "08", 20, "llmso_lab.parallel.pipeline:gpipe_stage", [
        Case("2 stages, 4 micro-batches: bubble 1/5", (2, 4)),
        Case("3 stages, 4 micro-batches: bubble 2/6", (3, 4), {"seed": 1}),
        Case("4 stages, 3 micro-batches, wider activations: bubble 3/6", (4, 3), {"rows": 3, "hidden": 6, "seed": 2}),
    ], compare=run_report(hints=PP_HINTS, ignore=("bubble_wall", "timeline")),
        harness="llmso_lab.parallel.pipeline:run_pipeline_stage", oracle="llmso_lab.parallel.pipeline:pipeline_stage_ideal",
        timeout_s=60.0,
        description="one stage's GPipe loop (recv, compute, send per micro-batch), run as every stage of a real "
                    "pipeline; outputs equal one process's, measured bubble (p - 1) / (m + p - 1)"),
    Exercise("dispatch_indices", "08", 15, "llmso_lab.parallel.moe:dispatch_indices", [
        Case("no capacity limit: slot = how many earlier choices went to the same expert",
             (torch.tensor([[0, 1], [1, 2], [0, 1], [2, 0]]), 3, None)),
        Case("token order first: token 0's second choice comes before token 1's first",
             (torch.tensor([[0, 1], [1, 0]]), 2, None)),
        Case("capacity 1: a choice whose expert is already full drops (-1)",
             (torch.tensor([[0, 1], [1, 0], [0, 2]]), 3, 1)),
        Case("top-1 routing, capacity 2", (torch.tensor([[2], [2], [0], [2], [2], [1]]), 3, 2)),
        Case("capacity 0: every choice drops", (torch.tensor([[1, 0], [0, 1]]), 2, 0)),
        Case("16 tokens, top-2 of 4 experts, expert 0 popular, capacity ceil(1.0 x 16 x 2 / 4) = 8",
             (routed(16, 2, 4, seed=2, skew=1.5), 4, 8)),
    ], compare=exact(),
        description="each routing choice's slot in its expert's buffer (token order, then choice order), "
                    "-1 once the expert holds `capacity` choices"),
    Exercise("ring_attention_step", "08", 15, "llmso_lab.parallel.ring:ring_attention_step", [
        Case("first step (o = 0, lse = -inf), a block entirely in the past: every key visible",
             ring_inputs(2, 8, range(8, 12), range(0, 4), seed=3)),
        Case("the diagonal block after an earlier one: query i sees the block's keys up to its own position",
             ring_inputs(2, 8, range(4, 8), range(4, 8), seed=4, before=range(0, 4))),
        Case("a block entirely in the future: (o, lse) come back unchanged",
             ring_inputs(2, 8, range(4, 8), range(8, 12), seed=5, before=range(0, 4))),
        Case("first step, zig-zag positions: queries 0 and 1 see no key of the block (lse stays -inf, o stays 0)",
             ring_inputs(2, 8, [0, 1, 14, 15], [4, 5, 10, 11], seed=6)),
        Case("folding a 6-key block into a real state (scale 0.5): both parts reweighted by their lse",
             ring_inputs(3, 8, range(10, 14), range(4, 10), seed=7, before=range(0, 4), scale=0.5)),
        Case("large scores (up to ~117, lse ~100): exp(s) and exp(lse) overflow fp32, so subtract a max (or use "
             "torch.logsumexp / logaddexp)",
             ring_inputs(2, 16, range(6, 10), range(2, 8), seed=8, before=range(0, 2), scale=1.0, q_scale=16.0)),
        Case("large scores on the diagonal block after a large-score state", ring_inputs(
            3, 8, range(6, 12), range(6, 12), seed=9, before=range(0, 6), scale=1.0, q_scale=20.0), hidden=True),
    ], compare=attention_state(), tripwires=ATTENTION_MERGE_CODE,
        description="fold one KV block into a query block's running (o, lse), causal by global position"),
)
