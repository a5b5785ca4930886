"""Tensor parallelism (lecture 2-2): Megatron-style sharding of a Llama layer, and the engine's TP executor.

A linear layer y = x W^T (Hugging Face weight W [out, in]) splits two ways over `tp` ranks:
- column-parallel: each rank keeps out/tp ROWS of W (a slice of the output features) and computes its slice
  of y from the whole x; no communication, the outputs stay split;
- row-parallel: each rank keeps in/tp COLUMNS of W, multiplies its slice of x (exactly what a column-parallel
  layer left on it) and produces a partial y; the full y is the SUM over ranks: one all-reduce.
A Llama layer chains them so that one all-reduce per block suffices: QKV column-parallel by heads ->
attention on the rank's own heads -> O row-parallel -> all-reduce; gate/up column-parallel -> SwiGLU ->
down row-parallel -> all-reduce. Two all-reduces per layer per forward: 2 x 30 = 60 per step for SmolLM2,
2 x 80 = 160 for a 80-layer model (`llmso_lab.sim.comm`). Heads split by `heads.shard_heads` (KV heads replicate
once tp > num_kv_heads). The embedding and the LM head are replicated here (vLLM splits them over the vocabulary
and gathers the logits; one fewer concept for a 135M model), and only rank 0 computes logits.

`LLM(model, tensor_parallel_size=N)` runs N rank processes (`launcher.Workers`), each a `ModelRunner` over its
shard with its own KV cache (its KV heads only); the driver keeps the scheduler, block manager and sampler,
builds each batch once (`TensorParallelExecutor`) and sends it to every rank; rank 0 returns the logits.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from llmso_lab.engine.model_runner import BatchBuilder
from llmso_lab.parallel.heads import shard_heads
from llmso_lab.parallel.launcher import RankError, Workers

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig

__all__ = ["shard_linear", "column_parallel_linear", "row_parallel_linear", "head_slices", "shard_llama_layer",
           "TensorParallelExecutor", "tp_mlp_forward", "run_tp_mlp", "mlp_weights"]


def shard_linear(weight: Tensor, rank: int, tp: int, style: str) -> Tensor:
    """Rank `rank`'s shard of a Hugging Face linear weight [out, in]: "column" keeps rows
    [rank * out/tp, (rank + 1) * out/tp) (output features), "row" keeps those columns (input features)."""
    if style not in ("column", "row"):
        raise ValueError(f"style must be 'column' or 'row', got {style!r}")
    if not (isinstance(tp, int) and tp >= 1 and isinstance(rank, int) and 0 <= rank < tp):
        raise ValueError(f"need 0 <= rank < tp, got rank={rank!r}, tp={tp!r}")
    dim = 0 if style == "column" else 1
    size = weight.shape[dim]
    if size % tp:
        raise ValueError(f"{style}-parallel split of {size} {'output' if dim == 0 else 'input'} features over tp={tp} "
                         f"is uneven; choose tp dividing {size}")
    return weight.narrow(dim, rank * (size // tp), size // tp)


def column_parallel_linear(x: Tensor, weight: Tensor, rank: int, tp: int) -> Tensor:
    """This rank's slice of x W^T [.., out/tp]: concatenating all ranks' slices gives the full output."""
    return x @ shard_linear(weight, rank, tp, "column").t()


def row_parallel_linear(x_shard: Tensor, weight: Tensor, rank: int, tp: int) -> Tensor:
    """This rank's partial x W^T [.., out] from its slice of x [.., in/tp]: the full output is the sum over ranks
    (the all-reduce)."""
    return x_shard @ shard_linear(weight, rank, tp, "row").t()


def head_slices(num_heads: int, num_kv_heads: int, rank: int, tp: int) -> tuple[range, range]:
    """(query heads, KV heads) that rank `rank` holds. While tp <= num_kv_heads each rank has its own KV heads;
    beyond, rank r's query heads all belong to one KV group and it keeps (a replica of) that KV head."""
    shard = shard_heads(num_heads, num_kv_heads, tp)
    q = range(rank * shard.q_heads_per_rank, (rank + 1) * shard.q_heads_per_rank)
    if shard.kv_replication == 1:
        kv = range(rank * shard.kv_heads_per_rank, (rank + 1) * shard.kv_heads_per_rank)
    else:
        group = q.start // (num_heads // num_kv_heads)
        kv = range(group, group + 1)
    return q, kv


def _rows(w: Tensor | None, heads: range, head_dim: int) -> Tensor | None:
    return None if w is None else w[heads.start * head_dim:heads.stop * head_dim]


def shard_llama_layer(layer, rank: int, tp: int, head_dim: int) -> dict[str, Tensor | None]:
    """Rank `rank`'s weights of one HF Llama-family decoder layer, in HF orientation ([out, in]): q/k/v rows of its
    heads (column-parallel), o_proj columns of its query heads (row-parallel), gate/up rows and down columns of
    its 1/tp of the MLP. Row-parallel biases (o, down) stay on rank 0 only: they must be added once, not tp times."""
    a, m = layer.self_attn, layer.mlp
    H = a.q_proj.weight.shape[0] // head_dim
    Hkv = a.k_proj.weight.shape[0] // head_dim
    q_heads, kv_heads = head_slices(H, Hkv, rank, tp)
    bias = lambda lin: getattr(lin, "bias", None)  # noqa: E731
    inter = m.gate_proj.weight.shape[0]
    if inter % tp:
        raise ValueError(f"intermediate_size={inter} does not split over tensor_parallel_size={tp}")
    mlp = lambda w, style: None if w is None else shard_linear(w, rank, tp, style)  # noqa: E731
    return {
        "q": _rows(a.q_proj.weight, q_heads, head_dim), "k": _rows(a.k_proj.weight, kv_heads, head_dim),
        "v": _rows(a.v_proj.weight, kv_heads, head_dim), "q_bias": _rows(bias(a.q_proj), q_heads, head_dim),
        "k_bias": _rows(bias(a.k_proj), kv_heads, head_dim), "v_bias": _rows(bias(a.v_proj), kv_heads, head_dim),
        "o": a.o_proj.weight[:, q_heads.start * head_dim:q_heads.stop * head_dim],
        "o_bias": bias(a.o_proj) if rank == 0 else None,
        "gate": mlp(m.gate_proj.weight, "column"), "up": mlp(m.up_proj.weight, "column"),
        "gate_bias": mlp(bias(m.gate_proj), "column"), "up_bias": mlp(bias(m.up_proj), "column"),
        "down": mlp(m.down_proj.weight, "row"), "down_bias": bias(m.down_proj) if rank == 0 else None,
    }


# ---- the engine's executor -------------------------------------------------------------------------
class TensorParallelGroup:
    """The model runner's `group` seam for one TP rank: the rank's heads and layer shard (`head_slices`,
    `shard_llama_layer`), and the all-reduce that sums the row-parallel outputs (o_proj, down_proj): two per layer,
    gloo over loopback, counted and timed."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.num_all_reduces, self.all_reduce_s = 0, 0.0

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        return head_slices(num_heads, num_kv_heads, self.rank, self.size)

    def layer_weights(self, layer, head_dim: int) -> dict[str, Tensor | None]:
        return shard_llama_layer(layer, self.rank, self.size, head_dim)

    def all_reduce(self, partial: Tensor) -> Tensor:
        """Sum a row-parallel output over the ranks, in place."""
        import torch.distributed as dist
        t0 = time.perf_counter()
        dist.all_reduce(partial)
        self.all_reduce_s += time.perf_counter() - t0
        self.num_all_reduces += 1
        return partial


def _serve_rank(rank: int, world_size: int, conn, model, config: EngineConfig) -> None:
    """One TP rank: build the shard's ModelRunner, then run the driver's commands until ("stop", None)."""
    from llmso_lab.engine.model_runner import ModelRunner

    group = TensorParallelGroup(rank, world_size)
    runner = ModelRunner(model, config, group=group)
    del model
    conn.send(("ready", {"kv_heads": runner.num_kv_heads, "q_heads": runner.num_heads}))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            return
        if cmd == "forward":
            logits = runner.forward(*arg)
            if rank == 0:
                conn.send(("logits", logits))
        elif cmd in ("swap_out", "swap_in", "copy_blocks"):
            getattr(runner.kv_store, cmd)(arg)
        elif cmd == "stats":
            conn.send(("stats", {"all_reduces": group.num_all_reduces, "all_reduce_s": group.all_reduce_s,
                                 "forwards": runner.num_forwards, "forward_s": runner.forward_s}))
        else:
            raise ValueError(f"unknown command {cmd!r}")


class TensorParallelExecutor(BatchBuilder):
    """Stands where the `ModelRunner` stands in `LLM` when tensor_parallel_size > 1: same `execute`, swap and copy
    calls, carried out by every rank. Rank failures raise `launcher.RankError` with the rank's traceback."""

    def __init__(self, model, config: EngineConfig) -> None:
        tp = config.tensor_parallel_size
        self.block_size, self.null_block, self.device = config.block_size, config.num_kv_blocks, torch.device("cpu")
        self.vocab_size, self.tp_size, self.last_hidden = model.config.vocab_size, tp, None
        self.workers = Workers(_serve_rank, tp, args=(model, config), timeout_s=config.tp_timeout_s)
        self.rank_info = [self.workers.recv(r, timeout_s=config.tp_timeout_s) for r in range(tp)]
        self.comm_wait_s = 0.0   # driver time waiting for rank 0's logits

    def forward(self, input_ids: Tensor, positions: Tensor, meta, logits_indices: Tensor,
                inputs_embeds: Tensor | None = None) -> Tensor:
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported with tensor_parallel_size > 1")
        self.workers.send_all(("forward", (input_ids, positions, meta, logits_indices)))
        t0 = time.perf_counter()
        _, logits = self.workers.recv(0)
        self.comm_wait_s += time.perf_counter() - t0
        return logits

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            self.workers.send_all(("swap_out", mapping))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            self.workers.send_all(("swap_in", mapping))

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            self.workers.send_all(("copy_blocks", mapping))

    def move_blocks(self, out) -> None:
        for op, mapping in out.block_moves():
            getattr(self, op)(mapping)

    def rank_stats(self) -> list[dict]:
        """Per rank: all-reduces done, seconds inside all_reduce, forwards, seconds in forward."""
        self.workers.send_all(("stats", None))
        return [self.workers.recv(r)[1] for r in range(self.tp_size)]

    def stats(self) -> dict:
        """For `LLM.stats()`: all-reduces per rank (2 per layer per forward) and the seconds spent in them."""
        ranks = self.rank_stats()
        return {"tp_size": len(ranks), "tp_num_forwards": ranks[0]["forwards"],
                "tp_all_reduces_per_rank": ranks[0]["all_reduces"],
                "tp_all_reduce_s_per_rank": [r["all_reduce_s"] for r in ranks],
                "tp_forward_s_per_rank": [r["forward_s"] for r in ranks]}

    def shutdown(self) -> None:
        self.workers.shutdown()


# ---- the MLP under TP, run for real across ranks (Lab 08's exercise and its harness) ---------------------------
def tp_mlp_forward(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, group) -> Tensor:
    """One rank's share of a Llama MLP, down(silu(gate(x)) * up(x)), under tensor parallelism. x [T, H] (every rank
    has all of it); gate, up [I, H] and down [H, I]: the FULL Hugging Face weights; `group` has .rank, .size and
    .all_reduce(t) (sums t over the ranks in place and returns it). gate/up column-parallel (this rank's I/tp rows),
    SwiGLU on the rank's slice (elementwise: no communication), down row-parallel (the same I/tp columns) ->
    a partial [T, H]; ONE all-reduce makes it the full output on every rank."""
    r, tp = group.rank, group.size
    g = x @ shard_linear(gate, r, tp, "column").t()          # [T, I/tp]
    u = x @ shard_linear(up, r, tp, "column").t()            # [T, I/tp]
    partial = (torch.nn.functional.silu(g) * u) @ shard_linear(down, r, tp, "row").t()   # [T, H], a partial sum
    return group.all_reduce(partial)


class RecordingGroup(TensorParallelGroup):
    """A TP group that also keeps a copy of every tensor handed to all_reduce (before the sum): the harness checks
    that a rank contributes its own share, not the whole MLP divided by tp."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.sent: list[Tensor] = []

    def all_reduce(self, partial: Tensor) -> Tensor:
        if not isinstance(partial, Tensor):
            raise TypeError(f"all_reduce takes a tensor, got {type(partial).__name__}")
        self.sent.append(partial.detach().clone())
        return super().all_reduce(partial)


def _tp_mlp_rank(rank: int, world_size: int, fn, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> dict:
    import torch.distributed as dist

    group = RecordingGroup(rank, world_size)
    dist.barrier()   # every pair connected before the student's code runs
    with torch.no_grad():
        y = fn(x.clone(), gate.clone(), up.clone(), down.clone(), group)
    dist.barrier()   # no rank tears the group down while a peer still uses it (e.g. when fn never communicates)
    if not isinstance(y, Tensor):
        raise TypeError(f"tp_mlp_forward must return a tensor [T, H], got {type(y).__name__}")
    return {"y": y.detach().clone(), "sent": group.sent, "seconds": group.all_reduce_s}


def mlp_weights(hidden: int, intermediate: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded (gate [I, H], up [I, H], down [H, I]) of a Llama MLP, scaled like a trained layer (std 1/sqrt(fan-in))."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(intermediate, hidden, generator=gen) / hidden ** 0.5
    up = torch.randn(intermediate, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(hidden, intermediate, generator=gen) / intermediate ** 0.5
    return gate, up, down


def tp_mlp_case(tp: int, num_tokens: int = 5, hidden: int = 16, intermediate: int = 24, seed: int = 0,
                weights: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inputs of one `tp_mlp_forward` run: (x [T, H], gate [I, H], up [I, H], down [H, I]), seeded (or `weights`)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    gate, up, down = weights if weights is not None else mlp_weights(hidden, intermediate, seed)
    gate, up, down = (w.detach().float() for w in (gate, up, down))
    if gate.shape[0] % tp:
        raise ValueError(f"intermediate size {gate.shape[0]} does not split over tp={tp}")
    x = torch.randn(num_tokens, gate.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    return x, gate, up, down


def share_features(act: Tensor, down: Tensor, partial: Tensor, tol: float) -> list[int] | None:
    """Which intermediate features a rank's partial sum is made of, or None when it is not such a sum.

    Feature i contributes the rank-1 term act[:, i] (x) down[:, i] to the MLP's output; a rank's share is the sum of
    the terms of ITS features (any I/tp of them: contiguous, strided or permuted are all Megatron-correct). With
    T x H >= I the terms are linearly independent, so a least-squares fit of the partial on them recovers one weight
    per feature: a share has weights 0 or 1 (the whole MLP / tp, or a wrong slice, does not) and reproduces the
    partial to rounding (`tol`). Returns the features with weight 1."""
    T, I = act.shape
    if not isinstance(partial, Tensor) or tuple(partial.shape) != (T, down.shape[0]):
        return None
    terms = (act.double()[:, None, :] * down.double()[None, :, :]).reshape(-1, I)   # [T*H, I]
    if terms.shape[0] < I or int(torch.linalg.matrix_rank(terms)) < I:
        raise ValueError(f"{T} tokens x {down.shape[0]} hidden < {I} features: a share cannot be told apart")
    target = partial.detach().double().reshape(-1, 1)
    w = torch.linalg.lstsq(terms, target).solution[:, 0]
    pick = w.round()
    if not bool(((w - pick).abs() <= 1e-3).all()) or not bool(((pick == 0) | (pick == 1)).all()):
        return None
    if float((terms @ pick - target[:, 0]).abs().max()) > tol:
        return None
    return [int(i) for i in torch.nonzero(pick)[:, 0]]


def tp_mlp_report(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, outputs: list, sent: list[list]) -> dict:
    """Judge one TP run of `tp_mlp_forward` from what each rank returned (`outputs`) and what each handed to
    all_reduce (`sent`, recorded by the group, not by the rank's code). Plain data:
    {"output_equals_tp1": every rank's output matches down(silu(gate x) * up x) (fp32; up to 1e-5 of the largest sum
     of |terms|, i.e. rounding from summing in another order),
     "ranks_agree": all ranks return the same tensor, "all_reduces_per_rank": [count per rank] (1 each),
     "partial_is_rank_share": what each rank first all-reduced is the sum of I/tp features' terms, the ranks' features
     disjoint (so each rank needs only 1/tp of every weight: contiguous or strided, `share_features`),
     "max_abs_diff": the largest |TP - TP1| (for the reader; not graded)}."""
    tp = len(outputs)
    with torch.no_grad():
        act = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())          # [T, I]
        full = act @ down.t()                                                # [T, H]
    # fp32 sums in another order differ by rounding only: allow 1e-5 of the largest sum of |terms| (|act| @ |down|^T)
    tol = 1e-5 * float((act.abs() @ down.abs().t()).max())
    for y in outputs:
        if not isinstance(y, Tensor):
            raise TypeError(f"tp_mlp_forward must return a tensor [T, H], got {type(y).__name__}")
    ok = lambda a, b: a.shape == b.shape and bool(((a.float() - b).abs() <= tol).all())  # noqa: E731
    features = [share_features(act, down, s[0], tol) if s else None for s in sent]
    owned = [i for f in features if f is not None for i in f]
    share = (all(f is not None and len(f) == act.shape[1] // tp for f in features)
             and sorted(owned) == list(range(act.shape[1])))
    return {"output_equals_tp1": all(ok(y, full) for y in outputs),
            "ranks_agree": all(y.shape == outputs[0].shape and torch.equal(y, outputs[0]) for y in outputs),
            "all_reduces_per_rank": [len(s) for s in sent],
            "partial_is_rank_share": share,
            "max_abs_diff": max(float((y.float() - full).abs().max()) if y.shape == full.shape else float("inf")
                                for y in outputs)}


def run_tp_mlp(fn, tp: int, num_tokens: int = 5, hidden: int = 16, intermediate: int = 24, seed: int = 0,
               weights: tuple[Tensor, Tensor, Tensor] | None = None, timeout_s: float = 20.0) -> dict:
    """Harness of the `tp_mlp_forward` exercise: run `fn(x, gate, up, down, group)` in `tp` real gloo ranks (forked
    processes, so `fn` may come from a notebook cell) on a seeded MLP (or `weights` = (gate, up, down)), and judge the
    run with `tp_mlp_report` (its docstring lists what it returns). The grader runs the same ranks in its sandbox with
    the all-reduce carried out by the grading process (`grading.judge.tp_mlp`), and judges them the same way.
    Raises launcher.RankError ('rank r: the exception') when `fn` fails in a rank."""
    from llmso_lab.parallel.launcher import launch

    x, gate, up, down = tp_mlp_case(tp, num_tokens, hidden, intermediate, seed, weights)
    try:
        ranks = launch(_tp_mlp_rank, tp, args=(fn, x, gate, up, down), timeout_s=timeout_s, start_method="fork")
    except RankError as err:
        raise err.brief() from None
    return tp_mlp_report(x, gate, up, down, [r["y"] for r in ranks], [r["sent"] for r in ranks])
