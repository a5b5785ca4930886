"""Parallelism (lecture 2-1 and 1-2): how tensor parallelism splits attention heads and what each rank caches."""
from llmso_lab.parallel.heads import HeadShard, shard_heads, valid_tp_sizes

__all__ = ["HeadShard", "shard_heads", "valid_tp_sizes"]
