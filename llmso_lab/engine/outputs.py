"""What `LLM.generate` / `LLM.step` return (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass

from llmso_lab.workloads import RequestMetrics


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str                    # decoded output ("" without a tokenizer)
    token_ids: list[int]         # output tokens (an EOS / stop token that ended it included)
    finish_reason: str | None    # "stop" (EOS, a stop id or a stop string) | "length" (max_tokens or max_model_len)
    logprobs: list[dict] | None = None   # SamplingParams.logprobs: per token {"token_id", "logprob", "top"}


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0   # prompt tokens served by the prefix cache at the last admission
