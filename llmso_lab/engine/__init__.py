"""Mini serving engine (vLLM's vocabulary): continuous / static / dynamic batching over a paged KV cache.

    from llmso_lab.engine import LLM, SamplingParams
    llm = LLM("smollm2-135m", enable_prefix_caching=True)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""
from llmso_lab.engine.config import EngineConfig
from llmso_lab.engine.llm import LLM
from llmso_lab.engine.metrics import StepTrace
from llmso_lab.workloads import RequestMetrics
from llmso_lab.engine.outputs import CompletionOutput, RequestOutput
from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.sequence import Sequence, SequenceStatus

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "RequestMetrics", "StepTrace",
           "Sequence", "SequenceStatus"]
