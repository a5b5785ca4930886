"""Parallelism (lectures 2-1, 2-2 and 1-2): how tensor parallelism splits attention heads and what each rank caches,
pipeline parallelism over stage processes with micro-batches, and data parallelism behind a router."""
import importlib

_EXPORTS = {
    "DataParallelLLM": "data", "HeadShard": "heads", "kv_bytes_per_rank": "heads", "shard_heads": "heads",
    "valid_tp_sizes": "heads", "RankError": "launcher", "Interval": "pipeline", "PipelineJob": "pipeline",
    "bubble_fraction": "pipeline", "measured_bubble": "pipeline", "pipeline_generate": "pipeline",
    "pipeline_prefill": "pipeline", "pipeline_run": "pipeline", "split_batch": "pipeline", "split_layers": "pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import on first use (PEP 562): `parallel.heads` is a leaf the engine's cache sizing imports, and must not pull
    in `parallel.data` (which imports the engine)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
