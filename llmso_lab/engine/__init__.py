"""Mini serving engine (vLLM's vocabulary): continuous / static / dynamic batching over a paged KV cache.

    from llmso_lab.engine import LLM, SamplingParams
    llm = LLM("smollm2-135m", enable_prefix_caching=True)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

The names below are imported on first use (PEP 562), so that importing one of the engine's leaf modules
(`engine.ops`, `engine.cache_sizing`, `engine.sequence`, ...) does not import the whole engine: imports run one
way, from the LLM down to the ops (tests/test_engine_layering.py checks it).
"""
import importlib

_EXPORTS = {
    "LLM": "llmso_lab.engine.llm", "EngineConfig": "llmso_lab.engine.config", "StepTrace": "llmso_lab.engine.metrics",
    "RequestMetrics": "llmso_lab.workloads", "RequestOutput": "llmso_lab.engine.outputs",
    "CompletionOutput": "llmso_lab.engine.outputs", "SamplingParams": "llmso_lab.engine.sampling_params",
    "Sequence": "llmso_lab.engine.sequence", "SequenceStatus": "llmso_lab.engine.sequence",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
