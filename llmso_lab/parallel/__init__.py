"""Parallelism (lectures 2-1, 2-2 and 1-2): how tensor parallelism splits attention heads and what each rank caches,
pipeline parallelism over stage processes with micro-batches, and data parallelism behind a router."""
from llmso_lab.parallel.data import DataParallelLLM
from llmso_lab.parallel.heads import HeadShard, kv_bytes_per_rank, shard_heads, valid_tp_sizes
from llmso_lab.parallel.launcher import RankError
from llmso_lab.parallel.pipeline import (Interval, PipelineJob, bubble_fraction, measured_bubble, pipeline_generate,
                                         pipeline_prefill, pipeline_run, split_batch, split_layers)

__all__ = ["DataParallelLLM", "HeadShard", "Interval", "PipelineJob", "RankError", "bubble_fraction",
           "kv_bytes_per_rank", "measured_bubble", "pipeline_generate", "pipeline_prefill", "pipeline_run",
           "shard_heads", "split_batch", "split_layers", "valid_tp_sizes"]
