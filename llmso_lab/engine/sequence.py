"""Sequence: the engine's state for one request (its tokens, its KV blocks, where it is in the queues)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from llmso_lab.batching import is_decode
from llmso_lab.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # in the waiting queue: new, or preempted by recompute (its KV was dropped)
    RUNNING = "running"    # holds KV blocks and is scheduled step by step
    PREEMPTED = "preempted"  # preempted with its KV kept off the device (a preemption strategy's); comes back as is
    FINISHED = "finished"  # hit EOS / a stop id / max_tokens / max_model_len; retired at the next step


@dataclass(slots=True, eq=False)
class Sequence:
    """One request. `token_ids` is prompt + output; `num_computed_tokens` of them have KV in the cache.

    The scheduler gives a sequence `num_tokens - num_computed_tokens` more tokens to compute: the whole
    prompt (or a chunk of it) while prefilling, then exactly one token (the last sampled one) per decode step.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    generator: torch.Generator | None = None
    seed: int = 0                      # of `generator`; sample i of an n > 1 request draws with seed + i
    sample_index: int = 0              # which of the request's n samples (or which member of its group) this is
    num_pending_forks: int = 0         # n > 1: samples still to fork from this one when it samples its first token
    group: object | None = None        # a group forked and pruned together (a search), which takes its logits
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0       # tokens whose K/V are in the cache
    num_cached_tokens: int = 0         # of the prompt, found by prefix caching at the last admission
    block_table: list[int | None] = field(default_factory=list)   # KV block ids (None: kept off the device)
    prefix_ids: list[int | None] = field(default_factory=list)   # prefix cache: id of the prefix each full block ends
    num_dropped_blocks: int = 0        # blocks removed from the table (their KV is gone); the cache holds
                                       # num_computed_tokens - num_dropped_blocks * block_size of its tokens
    finish_reason: str | None = None   # "stop" | "length"
    output_text: str | None = None     # the answer's text where a stop string cut it (`engine.stop_strings`)
    logprobs: list[dict] = field(default_factory=list)   # per output token, when the request asked (`engine.sampler`)
    num_preemptions: int = 0
    predicted_len: float = 0.0         # SJF: predicted output tokens still to generate (set by the policy)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def index(self) -> int:
        """The policies' final tie-breaker (`llmso_lab.policies`): the order of `add_request`."""
        return self.seq_id

    @property
    def name(self) -> str:
        """The request id, with the sample index after a '#' for the second and later ones."""
        return self.request_id if self.sample_index == 0 else f"{self.request_id}#{self.sample_index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while (re)computing a prompt: nothing sampled yet, or the KV was dropped by preemption."""
        return not is_decode(len(self.token_ids), self.num_computed_tokens, self.num_output_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
