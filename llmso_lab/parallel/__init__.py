"""Parallelism (lecture 2-1 and 1-2): how tensor parallelism splits attention heads and what each rank caches."""
from llmso_lab.parallel.heads import HeadShard, kv_bytes_per_rank, shard_heads, valid_tp_sizes

__all__ = ["HeadShard", "kv_bytes_per_rank", "shard_heads", "valid_tp_sizes"]
