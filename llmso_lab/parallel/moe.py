"""Expert parallelism (lecture 2-2): a Mixtral MoE layer whose experts live on different ranks.

A sparse MoE layer sends each token to `top_k` of `E` experts. Under expert parallelism (EP) the experts are
split contiguously over `world_size` ranks (rank r owns experts [r*E/W, (r+1)*E/W)) and every rank holds its own
tokens (a shard of the batch, as with data parallelism). One MoE layer is then:

    route     each rank scores its tokens with the (replicated) router: top-k experts and weights per token
    drop      each expert takes at most `capacity` choices from each rank (capacity factor); extra ones drop
    dispatch  all_to_all #1 (counts), all_to_all #2 (token activations) to the ranks that own the experts
    compute   each rank runs its experts on the tokens it received
    combine   all_to_all #3 sends the results back the same way; each rank sums them with the routing weights

Capacity is per (rank, expert), computed from the rank's own token count, as GShard's "groups": a rank drops
choices before sending, so no round trip is needed to agree on a global order. A dropped choice adds 0 to its
token (the token keeps its residual and its other experts), as in Switch Transformer and GShard.

The pure functions (`route_topk`, `expert_capacity`, `dispatch_indices`, `expert_load`, `expert_mlp`) are the
single-process reference; `expert_parallel_moe` (inside a process group) is built from them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmso_lab.parallel.launcher import launch

__all__ = [
    "route_topk", "expert_capacity", "dispatch_indices", "expert_load", "expert_mlp", "MoELayerStats",
    "expert_parallel_moe", "ExpertParallelMoE", "expert_parallel_forward", "ep_job", "ep_rank_forward",
    "gather_ep",
    "routing_load_report",
]


# ---- pure single-process pieces ----------------------------------------------------------------------

def route_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: softmax over all E experts (fp32), keep the top_k, renormalise them to sum to 1.

    router_logits [T, E] -> (weights [T, k] fp32, experts [T, k] int64), experts in decreasing probability.
    (Softmax before top-k; renormalising gives the same weights as a softmax over the k kept logits.)
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in 1..{router_logits.shape[1]} (the number of experts), got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k]
    return weights / weights.sum(dim=-1, keepdim=True), experts


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Buffer size per expert: ceil(capacity_factor * T * k / E), the mean load times the capacity factor.

    capacity_factor None or inf means no limit: returns T * k (every choice fits, nothing can drop).
    """
    if num_tokens < 0 or num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need num_tokens >= 0, num_experts >= 1 and 1 <= top_k <= num_experts, got "
                         f"{num_tokens}, {num_experts}, {top_k}")
    if capacity_factor is None or math.isinf(capacity_factor):
        return num_tokens * top_k
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for no limit), got {capacity_factor}")
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def dispatch_indices(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Each choice's slot in its expert's buffer, or -1 when the buffer is already full (the choice drops).

    experts [T, k] int (expert of token t's j-th choice) -> slot [T, k] int64. Choices fill the buffers in
    token order, and within a token in choice order (t=0 j=0, t=0 j=1, t=1 j=0, ...): slot = how many earlier
    choices went to the same expert. capacity None: no limit. Pure: no communication, no randomness.
    """
    if experts.dim() != 2:
        raise ValueError(f"experts must be [tokens, top_k], got shape {tuple(experts.shape)}")
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError(f"expert ids must be in 0..{num_experts - 1}, got {int(experts.min())}..{int(experts.max())}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 (or None for no limit), got {capacity}")
    flat = experts.reshape(-1).long()  # [T*k] in token-then-choice order
    one_hot = F.one_hot(flat, num_experts)  # [T*k, E]
    position = (one_hot.cumsum(dim=0) - 1).gather(1, flat[:, None])[:, 0]  # earlier choices of the same expert
    if capacity is not None:
        position = torch.where(position < capacity, position, torch.full_like(position, -1))
    return position.view(experts.shape)


def expert_load(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Choices routed to each expert: experts [T, k] -> counts [E] int64 (sums to T * k)."""
    return torch.bincount(experts.reshape(-1).long(), minlength=num_experts)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """One Mixtral expert (SwiGLU): x [N, H], gate_up [2I, H] (gate rows then up rows), down [H, I] -> [N, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


# ---- expert parallelism inside a process group ---------------------------------------------------------

@dataclass
class MoELayerStats:
    """What one MoE layer did, summed over ranks by `merge`.

    routed [E]: choices sent to each expert (the load); kept [E]: choices it processed (routed minus drops);
    dropped: choices dropped by capacity; dispatch_bytes / combine_bytes: activation bytes that left a rank for
    another rank in the two all_to_alls (rows a rank keeps for its own experts cross no link; the small count
    exchange is not included)."""
    routed: list[int]
    kept: list[int]
    dropped: int
    dispatch_bytes: int
    combine_bytes: int
    capacity: list[int] = field(default_factory=list)   # per rank (one entry before merging)
    all_to_all_s: list[float] = field(default_factory=list)   # per rank: seconds inside the three all_to_alls
    expert_s: list[float] = field(default_factory=list)       # per rank: seconds computing its experts

    @property
    def imbalance(self) -> float:
        """Max load / mean load over experts (1.0 = perfectly balanced)."""
        mean = sum(self.routed) / len(self.routed)
        return max(self.routed) / mean if mean else 1.0

    @staticmethod
    def merge(parts: Sequence["MoELayerStats"]) -> "MoELayerStats":
        return MoELayerStats([sum(v) for v in zip(*(p.routed for p in parts))],
                             [sum(v) for v in zip(*(p.kept for p in parts))],
                             sum(p.dropped for p in parts), sum(p.dispatch_bytes for p in parts),
                             sum(p.combine_bytes for p in parts), [c for p in parts for c in p.capacity],
                             [t for p in parts for t in p.all_to_all_s], [t for p in parts for t in p.expert_s])


def expert_parallel_moe(x: torch.Tensor, gate_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        top_k: int, capacity_factor: float | None = None,
                        act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> tuple[torch.Tensor, MoELayerStats]:
    """One MoE layer under expert parallelism; call it in every rank of the default process group.

    x [T, H]: this rank's tokens (T may differ between ranks); gate_weight [E, H]: the router (same on every
    rank); gate_up [E/W, 2I, H] and down [E/W, H, I]: the weights of this rank's experts only. Returns
    (y [T, H], this rank's stats). Without drops y equals the single-process Mixtral block.
    """
    W, rank = dist.get_world_size(), dist.get_rank()
    E, H = gate_weight.shape
    n = gate_up.shape[0]  # experts per rank
    if n * W != E:
        raise ValueError(f"this rank holds {n} experts but {E} experts over {W} ranks means {E // W} per rank")
    weights, experts = route_topk(F.linear(x, gate_weight), top_k)  # [T, k] each
    capacity = expert_capacity(x.shape[0], E, top_k, capacity_factor)
    slot = dispatch_indices(experts, E, capacity)
    routed = expert_load(experts, E)

    # Kept choices grouped by expert; experts are owned contiguously, so this also groups them by rank.
    tok, choice = (slot >= 0).nonzero(as_tuple=True)  # token order
    order = torch.argsort(experts[tok, choice], stable=True)
    tok, choice = tok[order], choice[order]
    send_counts = expert_load(experts[tok, choice][:, None], E)  # [E] rows for each expert
    recv_counts = torch.empty_like(send_counts)  # [W * n]: from rank s, rows for my expert e at s*n + e
    t0 = time.perf_counter()
    dist.all_to_all_single(recv_counts, send_counts)  # counts first: receivers size their buffers
    send_split = send_counts.view(W, n).sum(1).tolist()  # rows to each rank
    recv_split = recv_counts.view(W, n).sum(1).tolist()  # rows from each rank

    # Dispatch: token activations go to the ranks owning their experts.
    received = x.new_empty(sum(recv_split), H)
    dist.all_to_all_single(received, x[tok].contiguous(), recv_split, send_split)
    t1 = time.perf_counter()

    # Compute: rows arrive grouped by source rank, then by my local expert.
    local_expert = torch.arange(n).repeat(W).repeat_interleave(recv_counts)  # [rows]
    out = torch.empty_like(received)
    for e in range(n):
        rows = local_expert == e
        if rows.any():
            out[rows] = expert_mlp(received[rows], gate_up[e], down[e], act).to(out.dtype)
    t2 = time.perf_counter()

    # Combine: results travel back along the reverse splits, in the order the rows were sent.
    back = x.new_empty(len(tok), H)
    dist.all_to_all_single(back, out, send_split, recv_split)
    t3 = time.perf_counter()
    y = torch.zeros_like(x)
    y.index_add_(0, tok, (back * weights[tok, choice, None]).to(y.dtype))

    row_bytes = H * x.element_size()
    stats = MoELayerStats(routed.tolist(), send_counts.tolist(), int((slot < 0).sum()),
                          (sum(send_split) - send_split[rank]) * row_bytes,
                          (sum(recv_split) - recv_split[rank]) * row_bytes, [capacity],
                          [(t1 - t0) + (t3 - t2)], [t2 - t1])
    return y, stats


class ExpertParallelMoE(nn.Module):
    """Drop-in replacement for a `MixtralSparseMoeBlock` inside a rank: keeps the router and this rank's experts
    only, runs `expert_parallel_moe`, and appends each call's stats to `self.stats`."""

    def __init__(self, block: nn.Module, rank: int, world_size: int, capacity_factor: float | None = None) -> None:
        super().__init__()
        num_experts = block.gate.weight.shape[0]
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {world_size} ranks; "
                             f"use a world size that divides {num_experts}")
        n = num_experts // world_size
        self.top_k, self.capacity_factor, self.act = block.gate.top_k, capacity_factor, block.experts.act_fn
        self.gate_weight = nn.Parameter(block.gate.weight.detach().clone(), requires_grad=False)
        self.gate_up = nn.Parameter(block.experts.gate_up_proj[rank * n:(rank + 1) * n].detach().clone(),
                                    requires_grad=False)
        self.down = nn.Parameter(block.experts.down_proj[rank * n:(rank + 1) * n].detach().clone(), requires_grad=False)
        self.stats: list[MoELayerStats] = []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        y, stats = expert_parallel_moe(hidden_states.reshape(-1, shape[-1]), self.gate_weight, self.gate_up,
                                       self.down, self.top_k, self.capacity_factor, self.act)
        self.stats.append(stats)
        return y.view(shape)


# ---- whole model ------------------------------------------------------------------------------------

def _check_ep(model: nn.Module, input_ids: torch.Tensor, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] % world_size:
        raise ValueError(f"input_ids must be [B, S] with B divisible by world_size={world_size} (each rank takes "
                         f"B / world_size sequences), got shape {tuple(input_ids.shape)}")
    num_experts = model.config.num_local_experts
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world_size} ranks; "
                         f"use a world size that divides {num_experts}")


def ep_rank_forward(rank: int, world_size: int, jobs: Sequence[tuple]) -> list[tuple[tuple, list]]:
    """Rank side of `expert_parallel_forward`, for several jobs in one launch. Each job is
    (model class, config, state_dict, input_ids [B, S], capacity_factor); this rank rebuilds the model, swaps
    every layer's MoE block for an `ExpertParallelMoE`, and runs its B / world_size sequences.
    Returns per job (local logits, [MoELayerStats per layer])."""
    results = []
    for cls, config, state, input_ids, capacity_factor in jobs:
        model = cls(config)
        model.load_state_dict(state)
        model = model.to(next(iter(state.values())).dtype).eval()
        for layer in model.model.layers:
            layer.mlp = ExpertParallelMoE(layer.mlp, rank, world_size, capacity_factor)
        b = input_ids.shape[0] // world_size
        with torch.no_grad():
            logits = model(input_ids[rank * b:(rank + 1) * b]).logits
        stats = [layer.mlp.stats[-1] for layer in model.model.layers]
        results.append((logits, stats))   # the launcher pickles results by value
    return results


def gather_ep(per_rank: Sequence[list]) -> list[tuple[torch.Tensor, list[MoELayerStats]]]:
    """Parent side: concatenate the ranks' logits in rank order and merge their stats, per job."""
    out = []
    for job in zip(*per_rank):
        logits = torch.cat([r[0] for r in job])
        stats = [MoELayerStats.merge(layer) for layer in zip(*(r[1] for r in job))]
        out.append((logits, stats))
    return out


def ep_job(model: nn.Module, input_ids: torch.Tensor, world_size: int, capacity_factor: float | None = None) -> tuple:
    """Check the inputs and pack one job for `ep_rank_forward` (the model travels as config + weights)."""
    _check_ep(model, input_ids, world_size)
    return (type(model), model.config, {k: v.detach() for k, v in model.state_dict().items()}, input_ids,
            capacity_factor)


def expert_parallel_forward(model: nn.Module, input_ids: torch.Tensor, world_size: int,
                            capacity_factor: float | None = None, *, timeout_s: float = 120.0
                            ) -> tuple[torch.Tensor, list[MoELayerStats]]:
    """Forward a Mixtral-style model (`tiny_mixtral`) with expert parallelism on `world_size` local ranks.

    Rank r takes sequences [r*B/W, (r+1)*B/W) of input_ids [B, S]; attention, norms and embeddings run
    locally with replicated weights; every MoE block is an `ExpertParallelMoE` holding E/W experts.
    Returns (logits [B, S, V] in batch order, per-layer `MoELayerStats` summed over ranks). With
    capacity_factor None nothing drops and the logits equal the single-process model's.
    """
    job = ep_job(model, input_ids, world_size, capacity_factor)
    return gather_ep(launch(ep_rank_forward, world_size, args=([job],), timeout_s=timeout_s))[0]


def routing_load_report(model: nn.Module, input_ids: torch.Tensor,
                        capacity_factors: Sequence[float] = (1.0, 1.25, 1.5, 2.0), groups: int = 1) -> dict:
    """Load-imbalance data for a plot, single-process, from the routing of the unmodified model.

    Runs the model once on input_ids [B, S] and routes each layer's tokens as Mixtral does. `groups`: capacity is
    applied per group of B / groups sequences (= per rank under EP), 1 = the whole batch. Drops are counted per
    layer as if earlier layers had dropped nothing. Returns {"tokens_per_expert": [L][E] choices per expert,
    "imbalance": [L] max/mean load, "capacity_factors": [...], "dropped_fraction": {cf: [L] dropped choices /
    all choices}, "tokens": B * S, "top_k": k}.
    """
    B = input_ids.shape[0]
    if groups < 1 or B % groups:
        raise ValueError(f"groups must divide the batch size {B}, got {groups}")
    E, k = model.config.num_local_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        router_logits = model(input_ids, output_router_logits=True).router_logits  # L x [B*S, E]
    experts = [route_topk(logits, k)[1] for logits in router_logits]
    loads = [expert_load(e, E) for e in experts]
    dropped: dict[float, list[float]] = {}
    for cf in capacity_factors:
        dropped[cf] = []
        for e in experts:
            parts = e.chunk(groups)
            cap = expert_capacity(parts[0].shape[0], E, k, cf)
            drops = sum(int((dispatch_indices(p, E, cap) < 0).sum()) for p in parts)
            dropped[cf].append(drops / e.numel())
    return {"tokens_per_expert": [l.tolist() for l in loads],
            "imbalance": [float(l.max() / l.float().mean()) for l in loads],
            "capacity_factors": list(capacity_factors), "dropped_fraction": dropped,
            "tokens": input_ids.numel(), "top_k": k}
