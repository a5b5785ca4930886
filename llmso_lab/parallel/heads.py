"""Attention heads under tensor parallelism (vLLM's rule), and the KV each rank keeps.

TP splits the query heads evenly: `num_heads % tp == 0`. KV heads split too while there are enough of them
(`num_kv_heads % tp == 0`); once tp > num_kv_heads each rank still needs one whole KV head for its query
heads, so KV heads are REPLICATED tp / num_kv_heads times (tp must then be a multiple of num_kv_heads). The
KV cache per rank stops shrinking at that point: an 8-KV-head model at TP 16 keeps the same KV per rank as at
TP 8, and the cluster holds every KV head twice.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadShard:
    tp: int
    q_heads_per_rank: int
    kv_heads_per_rank: int
    kv_replication: int     # copies of each KV head across the ranks (1 = no replication)

    def kv_fraction_per_rank(self, num_kv_heads: int) -> float:
        """KV cache per rank as a fraction of the unsharded model's KV cache."""
        return self.kv_heads_per_rank / num_kv_heads


def valid_tp_sizes(num_heads: int, num_kv_heads: int, largest: int = 64) -> list[int]:
    """The TP sizes up to `largest` that `shard_heads` accepts."""
    ok = []
    for tp in range(1, largest + 1):
        try:
            shard_heads(num_heads, num_kv_heads, tp)
            ok.append(tp)
        except ValueError:
            pass
    return ok


def shard_heads(num_heads: int, num_kv_heads: int, tp: int) -> HeadShard:
    """Query and KV heads per rank at tensor-parallel size `tp`. Raises ValueError saying which sizes work."""
    if not all(isinstance(x, int) and x >= 1 for x in (num_heads, num_kv_heads, tp)):
        raise ValueError(f"num_heads, num_kv_heads and tp must be ints >= 1, got {num_heads}, {num_kv_heads}, {tp}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into groups over {num_kv_heads} KV heads")
    problem = None
    if num_heads % tp:
        problem = f"{num_heads} query heads cannot be split evenly over tensor_parallel_size={tp}"
    elif tp > num_kv_heads and tp % num_kv_heads:
        problem = (f"tensor_parallel_size={tp} > {num_kv_heads} KV heads must be a multiple of {num_kv_heads} "
                   "so that each KV head is replicated the same number of times")
    elif tp <= num_kv_heads and num_kv_heads % tp:
        problem = f"{num_kv_heads} KV heads cannot be split evenly over tensor_parallel_size={tp}"
    if problem:
        sizes = [t for t in range(1, num_heads + 1) if num_heads % t == 0 and
                 (t % num_kv_heads == 0 if t > num_kv_heads else num_kv_heads % t == 0)]
        raise ValueError(f"{problem}; valid sizes for {num_heads} query / {num_kv_heads} KV heads: "
                         f"{', '.join(map(str, sizes))}")
    if tp <= num_kv_heads:
        return HeadShard(tp, num_heads // tp, num_kv_heads // tp, 1)
    return HeadShard(tp, num_heads // tp, 1, tp // num_kv_heads)


def kv_bytes_per_rank(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, tp: int,
                      dtype_bytes: float = 2) -> int:
    """KV-cache bytes one token adds on EACH tensor-parallel rank: K and V of the rank's KV heads in every layer
    (`shard_heads`: num_kv_heads / tp while tp <= num_kv_heads, then one replicated head). Raises ValueError for
    a tp the heads do not allow. Llama-3-70B (80 layers, 64 / 8 heads, 128) in fp16: 81,920 B at TP 4,
    40,960 B at TP 8 and still 40,960 B at TP 16."""
    shard = shard_heads(num_heads, num_kv_heads, tp)
    return int(2 * num_layers * shard.kv_heads_per_rank * head_dim * dtype_bytes)
