"""KV-cache waste: the share of reserved KV memory that holds no token, by allocation scheme.

A sequence with prompt p and output o stores n = p + o tokens of K/V when it ends. What it reserves:

  contiguous_max_len     max_model_len slots, up front (pre-vLLM engines: one contiguous slab per sequence)
  contiguous_max_tokens  p + max_tokens slots, up front (the output cap is known, the real length is not)
  paged (block size B)   ceil(n / B) blocks of B slots, taken as it grows: only the last block has empty slots

waste = 1 - (tokens stored) / (slots reserved), both summed over sequences (a share of memory, not a mean of
per-sequence ratios). Two moments are measured:

  at_finish   every sequence at its final length: the best moment for the contiguous schemes
  lifetime    every state a sequence passes through, one per forward pass: after the pass that samples output
              token k+1 its cache holds p + k tokens (k = 0 .. o-1; the last token sampled is never written).
              This is what a serving engine holds, summed over its steps (`engine_occupancy` reads it live).

Not modelled: external fragmentation (free slabs too small for the next contiguous reservation), which only
makes the contiguous schemes worse.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence as Seq

import numpy as np

if TYPE_CHECKING:
    from llmso_lab.engine import LLM
    from llmso_lab.engine.sequence import Sequence
    from llmso_lab.kv.block_manager import BlockManager

__all__ = ["SCHEMES", "reserved_slots", "waste", "max_batch", "kv_occupancy", "engine_occupancy"]

SCHEMES = ("contiguous_max_len", "contiguous_max_tokens", "paged")
MOMENTS = ("at_finish", "lifetime")


def _check(lengths: Seq[tuple[int, int]], scheme: str, max_model_len: int | None, max_tokens: int | None,
           block_size: int | None) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    need = {"contiguous_max_len": ("max_model_len", max_model_len), "contiguous_max_tokens": ("max_tokens", max_tokens),
            "paged": ("block_size", block_size)}[scheme]
    if need[1] is None or need[1] < 1:
        raise ValueError(f"scheme {scheme!r} needs {need[0]} >= 1, got {need[1]!r}")
    for p, o in lengths:
        if p < 1 or o < 1:
            raise ValueError(f"lengths are (prompt_len, output_len) pairs of ints >= 1, got {(p, o)}")
        if max_model_len is not None and p + o > max_model_len:
            raise ValueError(f"a request of {p} + {o} tokens does not fit max_model_len={max_model_len}")
        if max_tokens is not None and o > max_tokens:
            raise ValueError(f"output_len {o} exceeds max_tokens={max_tokens}")


def reserved_slots(num_tokens, prompt_len, scheme: str, *, max_model_len: int | None = None,
                   max_tokens: int | None = None, block_size: int | None = None):
    """KV slots a sequence of `prompt_len` prompt tokens reserves while it holds `num_tokens` tokens
    (ints, or numpy arrays of states: elementwise)."""
    if scheme == "contiguous_max_len":
        return max_model_len + 0 * num_tokens
    if scheme == "contiguous_max_tokens":
        return prompt_len + max_tokens
    return -(-num_tokens // block_size) * block_size


def _states(lengths: Seq[tuple[int, int]], moment: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens stored, prompt length) of every state the sequences pass through at `moment`."""
    p, o = (np.asarray([x[i] for x in lengths], dtype=np.int64) for i in (0, 1))
    if moment == "at_finish":
        return p + o, p
    prompt = np.repeat(p, o)                                       # state k of a sequence stores p + k tokens
    k = np.arange(len(prompt)) - np.repeat(np.cumsum(o) - o, o)
    return prompt + k, prompt


def waste(lengths: Seq[tuple[int, int]], scheme: str, *, moment: str = "lifetime", max_model_len: int | None = None,
          max_tokens: int | None = None, block_size: int | None = None) -> float:
    """Share of reserved KV slots that hold no token (0..1) for requests `lengths` = [(prompt_len, output_len)].

    moment="at_finish": each sequence at its final length p + o; "lifetime": summed over the o states it passes
    through in an engine (p, p+1, ..., p+o-1 tokens stored; see the module docstring).
    """
    _check(lengths, scheme, max_model_len, max_tokens, block_size)
    if moment not in MOMENTS:
        raise ValueError(f"unknown moment {moment!r}; use one of {', '.join(MOMENTS)}")
    stored, prompt = _states(lengths, moment)
    reserved = reserved_slots(stored, prompt, scheme, max_model_len=max_model_len, max_tokens=max_tokens,
                              block_size=block_size)
    return 1.0 - int(stored.sum()) / int(reserved.sum()) if len(stored) else 0.0


def max_batch(lengths: Seq[tuple[int, int]], scheme: str, budget_slots: int, *, max_model_len: int | None = None,
              max_tokens: int | None = None, block_size: int | None = None) -> int:
    """How many of the requests, taken in order, fit together in `budget_slots` KV slots, each holding what it
    reserves at its final length (for paging: its peak, so the batch runs without preemption)."""
    _check(lengths, scheme, max_model_len, max_tokens, block_size)
    used = 0
    for k, (p, o) in enumerate(lengths):
        used += reserved_slots(p + o, p, scheme, max_model_len=max_model_len, max_tokens=max_tokens,
                               block_size=block_size)
        if used > budget_slots:
            return k
    return len(lengths)


def kv_occupancy(block_manager: BlockManager, seqs: Iterable[Sequence]) -> tuple[int, int]:
    """(slots holding K/V, slots reserved) in a paged cache now. `seqs`: every sequence that holds blocks.

    Reserved: every block some sequence holds (ref_count > 0), times block_size. A block shared by several
    sequences counts once and holds as many tokens as its fullest holder has computed in it. Freed blocks
    that only keep a cached prefix are free memory, not reserved.
    """
    bs, filled = block_manager.block_size, {}
    for seq in seqs:
        for i, block_id in enumerate(seq.block_table):
            if block_id is not None:   # None: swapped out to the CPU pool
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
    if len(filled) != block_manager.num_used_blocks:
        raise ValueError(f"the sequences given hold {len(filled)} blocks but {block_manager.num_used_blocks} are in "
                         "use: pass every sequence that holds blocks (running and swapped)")
    return sum(filled.values()), block_manager.num_used_blocks * bs


def engine_occupancy(llm: LLM) -> tuple[int, int]:
    """`kv_occupancy` of an engine between two `step()`s: its running and swapped sequences."""
    return kv_occupancy(llm.block_manager, [*llm.scheduler.running, *llm.scheduler.offloaded])
