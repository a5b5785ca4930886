"""Which engine features combine: one table instead of pairwise checks scattered through the code.

`FEATURES` names each feature by the `EngineConfig` setting that turns it on (and "MLA model" for a model with a
latent cache, known once the model is loaded); `INCOMPATIBLE` lists each pair that cannot run together, with why
and what to do instead. `check(config, model_config=None)` raises the first rule that a config breaks;
`matrix()` prints the table as a grid for the labs (x: refused, .: combines).
"""
from __future__ import annotations

from typing import Callable


def _kv(c) -> str:
    return c.kv_cache_dtype


FEATURES: dict[str, Callable] = {   # name -> is it on? (config, model config or None)
    "speculative_config": lambda c, m: c.speculative_config is not None,
    "EAGLE drafting": lambda c, m: c.spec is not None and c.spec.method == "eagle",
    "tensor_parallel_size > 1": lambda c, m: c.tensor_parallel_size > 1,
    "kv_cache_dtype (quantized)": lambda c, m: _kv(c) != "auto",
    "kv_cache_dtype kivi": lambda c, m: _kv(c).startswith("kivi"),
    "kv_eviction": lambda c, m: c.kv_eviction is not None,
    "preemption_mode='swap'": lambda c, m: c.preemption_mode == "swap",
    "enable_prefix_caching": lambda c, m: c.enable_prefix_caching,
    "prefix_caching_algo='radix'": lambda c, m: c.enable_prefix_caching and c.prefix_caching_algo == "radix",
    "static / dynamic batching": lambda c, m: c.batching != "continuous",
    "enable_chunked_prefill=False": lambda c, m: not c.enable_chunked_prefill,
    "quantization": lambda c, m: c.quantization is not None,
    "MLA model": lambda c, m: m is not None and m.model_type == "deepseek_v3",
}

_EVICT = "kv_eviction cannot be combined with {}: {}"
INCOMPATIBLE: list[tuple[str, str, Callable[[object], str]]] = [   # (feature, feature, message for this config)
    ("speculative_config", "static / dynamic batching", lambda c: (
        "speculative_config needs batching='continuous' (a sequence advances by a different number of tokens each "
        "step)")),
    ("speculative_config", "tensor_parallel_size > 1", lambda c: (
        "speculative_config with tensor_parallel_size > 1 is not supported here (the drafters run inside the model "
        "runner); use one or the other")),
    ("kv_cache_dtype (quantized)", "tensor_parallel_size > 1", lambda c: (
        f"kv_cache_dtype={_kv(c)!r} with tensor_parallel_size > 1 is not supported here (the rank processes keep plain "
        "cache tensors); use kv_cache_dtype='auto' or one rank")),
    ("kv_cache_dtype (quantized)", "EAGLE drafting", lambda c: _spec_kv(c)),
    ("kv_cache_dtype kivi", "speculative_config", lambda c: _spec_kv(c)),
    ("kv_cache_dtype kivi", "preemption_mode='swap'", lambda c: (
        f"kv_cache_dtype={_kv(c)!r} with preemption_mode='swap' is not supported (a swapped block would have to carry "
        "its KIVI state: window or sealed); use preemption_mode='recompute'")),
    ("kv_cache_dtype kivi", "prefix_caching_algo='radix'", lambda c: (
        f"kv_cache_dtype={_kv(c)!r} with prefix_caching_algo='radix' is not supported (the radix tree caches partly "
        "filled blocks, which KIVI cannot quantize as a key group); use 'hash'")),
    ("kv_eviction", "enable_prefix_caching", lambda c: _EVICT.format(
        "enable_prefix_caching", "a dropped block leaves a hole in the table, so the blocks after it cannot be shared "
        "as a cached prefix")),
    ("kv_eviction", "speculative_config", lambda c: _EVICT.format(
        "speculative_config", "draft slots and their rollback assume the cache holds the whole sequence")),
    ("kv_eviction", "preemption_mode='swap'", lambda c: _EVICT.format(
        "preemption_mode='swap'", "use preemption_mode='recompute'")),
    ("kv_eviction", "static / dynamic batching", lambda c: _EVICT.format(
        "batching other than 'continuous'", "static batches reserve every row's whole length up front")),
    ("kv_eviction", "tensor_parallel_size > 1", lambda c: _EVICT.format(
        "tensor_parallel_size > 1", "not implemented for the rank processes")),
    ("kv_eviction", "kv_cache_dtype (quantized)", lambda c: _EVICT.format(
        f"kv_cache_dtype={_kv(c)!r}", "the two are not tested together (a KIVI block's window state, scales per "
        "block); use kv_cache_dtype='auto' with kv_eviction")),
    ("kv_eviction", "enable_chunked_prefill=False", lambda c: _EVICT.format(
        "enable_chunked_prefill=False", "a prompt (or a sequence recomputed after preemption) longer than the budget "
        "is prefilled in chunks, evicting between them")),
    ("MLA model", "quantization", lambda c: (
        "quantization is implemented for Llama-family attention, not MLA; use quantization=None")),
    ("MLA model", "kv_cache_dtype (quantized)", lambda c: (
        f"kv_cache_dtype={_kv(c)!r} is implemented for K/V caches, not MLA's latent cache; use kv_cache_dtype='auto' "
        "with MLA models")),
    ("MLA model", "tensor_parallel_size > 1", lambda c: (
        "tensor_parallel_size > 1 is implemented for Llama-family attention, not MLA; use 1")),
    ("MLA model", "kv_eviction", lambda c: (
        "kv_eviction is implemented for Llama-family attention, not MLA; use kv_eviction=None")),
]


def _spec_kv(c) -> str:
    return (f"kv_cache_dtype={_kv(c)!r} with speculative_config method {c.spec.method!r} is not supported (EAGLE's "
            "feature cache and KIVI's window are not rolled back with rejected drafts); use kv_cache_dtype='auto', or "
            "fp8 / int8 with ngram / draft_model drafting")


def check(config, model_config=None) -> None:
    """Raise ValueError for the first pair of features in `config` (and the model) that cannot run together."""
    for a, b, message in INCOMPATIBLE:
        if FEATURES[a](config, model_config) and FEATURES[b](config, model_config):
            raise ValueError(message(config))


def refused_pairs() -> set[frozenset[str]]:
    return {frozenset((a, b)) for a, b, _ in INCOMPATIBLE}


def matrix() -> str:
    """The table as a grid: row i, column j is 'x' where features i and j are refused together."""
    names, refused = list(FEATURES), refused_pairs()
    width = max(map(len, names))
    lines = [" " * (width + 4) + " ".join(f"{j:>2}" for j in range(len(names)))]
    for i, a in enumerate(names):
        cells = [" -" if a == b else (" x" if frozenset((a, b)) in refused else " .") for b in names]
        lines.append(f"{i:>2} {a:<{width}} " + " ".join(cells))
    return "\n".join(lines)
