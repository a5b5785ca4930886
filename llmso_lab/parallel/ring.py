"""Context parallelism (lecture 2-2): ring attention over a sequence split across ranks.

A long sequence's queries, keys and values are split over `world_size` ranks by position. Each rank keeps its
queries and, for W steps, attends to one KV block while passing that block to rank+1 and receiving the next
one from rank-1; after W steps every rank has seen every block. Partial results are merged exactly with their
log-sum-exp (`merge_attention_states`, FlashDecoding's reduction), so the output equals full causal attention.

Causal masking makes the work uneven: with a contiguous split the last rank's queries see every key and the
first rank's see only their own block (about (2W-1)x less work). The zig-zag split gives rank r chunks r and
2W-1-r of 2W equal chunks, so every rank gets one early and one late chunk and the same number of
(query, key) pairs. A KV block entirely in a rank's future is skipped.

Layout: one sequence, q, k and v all [H, N, D] (no batch, no GQA: expand KV heads first). Positions are global
token indices; query i sees key j iff j <= i.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from llmso_lab.attention.reference import merge_attention_states
from llmso_lab.parallel.launcher import launch

__all__ = ["zigzag_split", "contiguous_split", "ring_attention_step", "ring_case", "ring_rank", "gather_ring",
           "ring_attention"]


def _check_split(seq_len: int, world_size: int, chunks: int, name: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if seq_len < 1 or seq_len % chunks:
        raise ValueError(f"{name} split needs seq_len divisible by {chunks} (= {chunks // world_size} x world_size "
                         f"{world_size}), got seq_len={seq_len}; pad the sequence")


def zigzag_split(seq_len: int, world_size: int) -> list[torch.Tensor]:
    """Positions per rank: 2W equal chunks, rank r gets chunk r then chunk 2W-1-r (ascending positions)."""
    _check_split(seq_len, world_size, 2 * world_size, "zigzag")
    chunks = torch.arange(seq_len).chunk(2 * world_size)
    return [torch.cat([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size)]


def contiguous_split(seq_len: int, world_size: int) -> list[torch.Tensor]:
    """Positions per rank: W equal consecutive chunks, rank r gets chunk r."""
    _check_split(seq_len, world_size, world_size, "contiguous")
    return list(torch.arange(seq_len).chunk(world_size))


def ring_attention_step(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_blk: torch.Tensor,
                        v_blk: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one KV block into the running attention of the local queries (causal by global position).

    o [H, Tq, D] and lse [H, Tq] (fp32): the state so far (start from zeros and -inf); q [H, Tq, D];
    k_blk, v_blk [H, Tk, D]; q_pos [Tq], k_pos [Tk]: global positions; scale: usually 1/sqrt(D).
    Returns the new (o, lse) over the keys seen so far plus this block. A query that sees no key of this
    block gets weight 0 from it (lse -inf, no NaN).
    """
    s = (q.float() @ k_blk.float().transpose(-2, -1)) * scale  # [H, Tq, Tk]
    visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    s = s.masked_fill(~visible, float("-inf"))
    blk_lse = torch.logsumexp(s, dim=-1)  # [H, Tq]; -inf where no key is visible
    p = torch.exp(s - torch.where(blk_lse == float("-inf"), 0.0, blk_lse)[..., None])  # normalised, 0 if masked
    blk_o = p @ v_blk.float()  # [H, Tq, D]
    return merge_attention_states(o, lse, blk_o, blk_lse)


def _positions(seq_len: int, world_size: int, split: str) -> list[torch.Tensor]:
    if split == "zigzag":
        return zigzag_split(seq_len, world_size)
    if split == "contiguous":
        return contiguous_split(seq_len, world_size)
    raise ValueError(f"split must be 'zigzag' or 'contiguous', got {split!r}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k and v must all be [H, N, D] with the same shape (expand KV heads for GQA), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def ring_rank(rank: int, world_size: int, cases: Sequence[tuple]) -> list[tuple[torch.Tensor, dict]]:
    """Rank side of `ring_attention`, for several cases in one launch; each case is (q, k, v, split) with the
    full tensors (each rank slices its own part). Returns per case (o of this rank's positions, fp32,
    stats)."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    results = []
    for q_full, k_full, v_full, split in cases:
        positions = _positions(q_full.shape[1], world_size, split)
        q_pos = positions[rank]
        q = q_full[:, q_pos]
        kv = torch.stack([k_full[:, q_pos], v_full[:, q_pos]])  # the block this rank starts with
        H, T, D = q.shape
        o = torch.zeros(H, T, D)
        lse = torch.full((H, T), float("-inf"))
        stats = {"pairs": 0, "block_pairs": 0, "skipped_blocks": 0, "bytes_sent": 0}
        for step in range(world_size):
            src = (rank - step) % world_size  # the rank whose KV block we hold now
            pending = []
            if step < world_size - 1:  # start passing the block on before computing: transfer overlaps compute
                incoming = torch.empty_like(kv)
                pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt),
                                                  dist.P2POp(dist.irecv, incoming, prv)])
                stats["bytes_sent"] += kv.numel() * kv.element_size()
            k_pos = positions[src]
            visible = int((k_pos[None, :] <= q_pos[:, None]).sum())
            if visible == 0:  # the whole block is in this rank's future
                stats["skipped_blocks"] += 1
            else:
                o, lse = ring_attention_step(o, lse, q, kv[0], kv[1], q_pos, k_pos, 1.0 / math.sqrt(D))
                stats["pairs"] += visible
                stats["block_pairs"] += T * len(k_pos)
            for req in pending:
                req.wait()
            if pending:
                kv = incoming
        results.append((o, stats))
    return results


def gather_ring(per_rank: Sequence[list], cases: Sequence[tuple]) -> list[tuple[torch.Tensor, dict]]:
    """Parent side: put each rank's outputs back at their positions; stats as lists indexed by rank."""
    out = []
    for i, (q, _, _, split) in enumerate(cases):
        world_size = len(per_rank)
        o = torch.empty_like(q)
        for pos, rank_result in zip(_positions(q.shape[1], world_size, split), per_rank):
            o[:, pos] = rank_result[i][0].to(q.dtype)
        stats = {key: [r[i][1][key] for r in per_rank] for key in per_rank[0][i][1]}
        out.append((o, stats))
    return out


def ring_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, split: str = "zigzag") -> tuple:
    """Check the inputs and pack one case for `ring_rank`."""
    _check_qkv(q, k, v)
    _positions(q.shape[1], world_size, split)
    return (q, k, v, split)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, split: str = "zigzag",
                   *, timeout_s: float = 120.0) -> tuple[torch.Tensor, dict]:
    """Causal attention of one sequence by ring attention on `world_size` local ranks.

    q, k, v [H, N, D] -> (o [H, N, D] in sequence order, stats). N must divide into the split's chunks
    (2W for zig-zag, W for contiguous). Stats, lists indexed by rank: "pairs" (query, key) pairs unmasked and
    computed, "block_pairs" Tq x Tk of the blocks computed (what a dense block kernel does), "skipped_blocks"
    fully masked blocks skipped, "bytes_sent" KV bytes sent to the next rank.
    """
    case = ring_case(q, k, v, world_size, split)
    return gather_ring(launch(ring_rank, world_size, args=([case],), timeout_s=timeout_s), [case])[0]
