"""The engine's layering (issue: a core a student reads in an hour, features beside it): leaf modules import
downward only, and the core files name no feature."""
import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Leaf modules: each may import other leaves, never the engine's upper layers (LLM, scheduler, runner, features).
LEAVES = ["llmso_lab.engine.ops", "llmso_lab.engine.cache_sizing", "llmso_lab.hardware", "llmso_lab.engine.kv_cache",
          "llmso_lab.engine.inputs", "llmso_lab.engine.logits_processors", "llmso_lab.engine.detokenizer",
          "llmso_lab.engine.sequence", "llmso_lab.engine.attention", "llmso_lab.engine.config",
          "llmso_lab.kv.block_manager", "llmso_lab.parallel.heads"]
UPPER = ("llmso_lab.engine.llm", "llmso_lab.engine.core", "llmso_lab.engine.scheduler", "llmso_lab.engine.model_runner",
         "llmso_lab.engine.features", "llmso_lab.engine.mla", "llmso_lab.engine.beam_search", "llmso_lab.spec.engine",
         "llmso_lab.engine.lockstep", "llmso_lab.engine.swap", "llmso_lab.kv.radix_cache",
         "llmso_lab.spec.drafters", "llmso_lab.parallel.tensor", "llmso_lab.parallel.data", "llmso_lab.disagg")


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_module_imports_no_upper_engine_module(leaf):
    code = (f"import sys, {leaf}\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.startswith({UPPER!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pulled = out.stdout.split()
    assert not pulled, f"importing {leaf} alone pulls in {pulled}: a leaf must import downward only"


# The core files, read top to bottom in class, name no feature: each feature plugs into a seam from its own module
# (`engine.features` registers them). ("evict" alone is allowed: the prefix cache's LRU eviction is the core's.)
CORE_FILES = ["llmso_lab/engine/core.py", "llmso_lab/engine/scheduler.py", "llmso_lab/engine/model_runner.py",
              "llmso_lab/engine/sequence.py", "llmso_lab/engine/sampler.py", "llmso_lab/kv/block_manager.py"]
FEATURE_WORDS = re.compile(r"speculative|\bspec_|draft|tensor.parallel|\btp_|\bmla\b|latent|kivi|quantiz|beam|"
                           r"kv_eviction|evicted_blocks|streaming|swap|static|dynamic|lockstep|radix|eagle|medusa|ngram",
                           re.IGNORECASE)


@pytest.mark.parametrize("path", CORE_FILES)
def test_core_file_names_no_feature(path):
    hits = [f"{path}:{i}: {line.strip()}" for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
            if FEATURE_WORDS.search(line.replace("@staticmethod", ""))]
    assert not hits, "feature names in a core file (move the feature behind a seam):\n" + "\n".join(hits)


def test_the_feature_check_catches_a_feature_branch():
    assert FEATURE_WORDS.search("        if self.config.spec_decode is not None:")
    assert FEATURE_WORDS.search("if seq.beam is not None:") and FEATURE_WORDS.search("k_swap = ...")
    assert FEATURE_WORDS.search("stats['kv_evicted_blocks']") and FEATURE_WORDS.search("batching='static'")
    assert not FEATURE_WORDS.search("h = h + all_reduce(w.attn.output(o))")
    assert not FEATURE_WORDS.search("self.num_evictions += 1   # LRU: the prefix cache lets an old block go")


def test_core_is_about_nano_vllm_size():
    """The core a student reads in an hour: about nano-vllm's size (its five engine files are ~1.2k lines)."""
    lines = {p: len((ROOT / p).read_text().splitlines()) for p in CORE_FILES}
    assert sum(lines.values()) <= 1500, lines


# ---- the compatibility table (`engine.compat`) -------------------------------------------------------------------
ON = {   # engine arguments that turn each feature of the table on (MLA: a model, checked at LLM construction)
    "speculative_config": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    "EAGLE drafting": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 2, "model": "x"}},
    "tensor_parallel_size > 1": {"tensor_parallel_size": 2},
    "kv_cache_dtype (quantized)": {"kv_cache_dtype": "int8"},
    "kv_cache_dtype kivi": {"kv_cache_dtype": "kivi4"},
    "kv_eviction": {"kv_eviction": {"method": "streaming", "num_sink_blocks": 1, "window_blocks": 2}},
    "preemption_mode='swap'": {"preemption_mode": "swap"},
    "enable_prefix_caching": {"enable_prefix_caching": True},
    "prefix_caching_algo='radix'": {"enable_prefix_caching": True, "prefix_caching_algo": "radix"},
    "static / dynamic batching": {"batching": "static"},
    "enable_chunked_prefill=False": {"enable_chunked_prefill": False},
    "quantization": {"quantization": "int8"},
}


def test_every_refused_pair_is_refused_and_every_feature_alone_is_accepted():
    from llmso_lab.engine import EngineConfig, compat
    assert set(ON) | {"MLA model"} == set(compat.FEATURES)
    for name, kwargs in ON.items():
        if name != "EAGLE drafting":   # (an EAGLE config needs a head model; its pair is checked below)
            EngineConfig(**kwargs)
    for a, b, message in compat.INCOMPATIBLE:
        if "MLA model" in (a, b):
            continue
        kwargs = {**ON[a], **ON[b]}
        config = EngineConfig.__new__(EngineConfig)   # the pair's settings without __post_init__'s other checks
        for f in dataclasses.fields(EngineConfig):
            setattr(config, f.name, kwargs.get(f.name, None if f.default is dataclasses.MISSING else f.default))
        spec = kwargs.get("speculative_config")
        config.spec = type("Spec", (), {"method": spec["method"]})() if spec else None
        with pytest.raises(ValueError) as err:
            compat.check(config)
        assert str(err.value) == message(config), (a, b)
    grid = compat.matrix().splitlines()
    names = list(compat.FEATURES)
    i, j = names.index("kv_eviction"), names.index("enable_prefix_caching")
    assert grid[1 + i].split()[-len(names):][j] == "x" and grid[1 + i].split()[-len(names):][i] == "-"
    assert grid[1 + names.index("quantization")].split()[-len(names):][names.index("enable_prefix_caching")] == "."
