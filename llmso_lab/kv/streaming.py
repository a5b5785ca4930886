"""StreamingLLM in the paged cache: attention sinks + a recent window, evicted a whole block at a time.

StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks") keeps the first
tokens (the attention sinks: softmax parks its unused mass there, so dropping them wrecks the output) and the
most recent ones. `kv.evict.streaming_keep` is that rule over tokens on a Hugging Face cache; here it runs in the
engine's paged cache, where the unit is a block: a sequence keeps its first `num_sink_blocks` blocks and its last
`window_blocks` full blocks plus the block being filled. When it would hold more, the oldest non-sink block is
returned to the block manager and dropped from the block table. So a sequence holds at most
`num_sink_blocks + window_blocks + 1` blocks however long it gets, and a conversation longer than the cache keeps
generating (up to `max_model_len`).

Positions. Keys are stored after RoPE, so a kept key keeps the position it was written at: we keep ORIGINAL
positions (as kvpress and `kv.evict.greedy_continue` do). The paper instead re-assigns positions inside the cache
(sinks 0..s-1, then the window right after), which needs un-rotated keys re-rotated each step. Original
positions are simpler but bounded: a sequence still stops at `max_model_len` (<= the model's
`max_position_embeddings`); what eviction bounds is memory, not length.

Two lengths per sequence. "Tokens in the sequence" (positions, for RoPE) and "tokens in the cache" (what the
attention backends index through the block table). Dropped blocks lie between the sinks and the window, and every
token computed after an eviction lies after them, so one offset per sequence translates: cache index = position -
`num_dropped_blocks * block_size` (`Sequence.num_dropped_blocks`) for every token the engine still reads or writes (`BatchBuilder.prepare_rows`).
The causal mask in cache coordinates is then the causal mask over the kept tokens.

What a token sees. A decode token at position p (in block b = p // block_size) sees the sinks and blocks
b - window_blocks .. b: between window_blocks * block_size + 1 and (window_blocks + 1) * block_size recent
tokens. A prefill chunk is computed in one forward over the cache as it stands for the chunk, so its earlier
tokens see the window of its last block (a little less than their own); a chunk spans at most
`window_blocks + 1` blocks past the sinks (`max_chunk_tokens`), evicting between chunks. Prompts longer than the
budget are therefore prefilled in several chunks (this needs `enable_chunked_prefill=True`).

vLLM has no such option (its paged cache never drops a running sequence's blocks; sliding-window models free the
blocks that fell out of the window, the same mechanism without sinks). The pure functions below are the rule;
`StreamingKVEviction` plugs it into the engine: the scheduler's `growth` seam caps each step's tokens and drops the
blocks before the free-block check (`LLM(kv_eviction={"method": "streaming", "num_sink_blocks": s,
"window_blocks": w})`). The features it refuses are in `engine.compat`; n > 1 and beam search are refused per request
(samples and beams share blocks that one of them would drop). A sequence preempted by recompute is recomputed that
way too, so its later tokens may differ from an uninterrupted run.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StreamingEviction", "streaming_block_keep", "max_chunk_tokens", "num_blocks_to_evict", "StreamingKVEviction"]

EVICTION_METHODS = ("streaming",)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class StreamingEviction:
    """`LLM(kv_eviction={"method": "streaming", "num_sink_blocks": 1, "window_blocks": W})`, checked."""
    num_sink_blocks: int = 1
    window_blocks: int = 15
    method: str = "streaming"

    @classmethod
    def from_dict(cls, spec: dict) -> "StreamingEviction":
        if not isinstance(spec, dict):
            raise ValueError(f"kv_eviction must be a dict like {{'method': 'streaming', 'num_sink_blocks': 1, "
                             f"'window_blocks': 15}} or None, got {spec!r}")
        unknown = set(spec) - {"method", "num_sink_blocks", "window_blocks"}
        if unknown:
            raise ValueError(f"unknown kv_eviction keys {sorted(unknown)}; valid: method, num_sink_blocks, window_blocks")
        method = spec.get("method", "streaming")
        if method not in EVICTION_METHODS:
            raise ValueError(f"kv_eviction method {method!r} is not supported in the engine; valid: "
                             f"{', '.join(EVICTION_METHODS)} (H2O / SnapKV / PyramidKV keep per-head token sets that the "
                             "paged layout cannot hold: see llmso_lab.kv.evict)")
        out = cls(spec.get("num_sink_blocks", 1), spec.get("window_blocks", 15), method)
        if not isinstance(out.num_sink_blocks, int) or out.num_sink_blocks < 0:
            raise ValueError(f"kv_eviction num_sink_blocks must be an int >= 0, got {out.num_sink_blocks!r}")
        if not isinstance(out.window_blocks, int) or out.window_blocks < 1:
            raise ValueError(f"kv_eviction window_blocks must be an int >= 1, got {out.window_blocks!r}")
        return out

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one sequence holds at most: sinks + window + the block being filled."""
        return self.num_sink_blocks + self.window_blocks + 1


def streaming_block_keep(num_blocks: int, num_sink_blocks: int, window_blocks: int) -> list[int]:
    """Logical blocks a decoding sequence spanning `num_blocks` blocks keeps (its last one is being filled): the first
    `num_sink_blocks` and the last `window_blocks + 1`, or all of them when that covers them. Sorted indices."""
    if num_blocks < 0 or num_sink_blocks < 0 or window_blocks < 1:
        raise ValueError(f"need num_blocks >= 0, num_sink_blocks >= 0, window_blocks >= 1; got {num_blocks}, "
                         f"{num_sink_blocks}, {window_blocks}")
    if num_blocks <= num_sink_blocks + window_blocks + 1:
        return list(range(num_blocks))
    return list(range(num_sink_blocks)) + list(range(num_blocks - window_blocks - 1, num_blocks))


def max_chunk_tokens(num_computed: int, block_size: int, ev: StreamingEviction) -> int:
    """The most tokens a sequence with `num_computed` tokens in its KV may compute in one step and still hold at most
    `ev.max_blocks_per_seq` blocks once every evictable block is gone. Evictable: the full non-sink blocks before
    the block holding token `num_computed` (the first one this step writes). With b0 = max(sinks, that block's index)
    the step may reach block b0 + window_blocks: the answer is (b0 + window_blocks + 1) * block_size - num_computed
    (>= window_blocks * block_size + 1, so a decode always fits)."""
    b0 = max(ev.num_sink_blocks, num_computed // block_size)
    return (b0 + ev.window_blocks + 1) * block_size - num_computed


def num_blocks_to_evict(num_computed: int, num_new: int, num_evicted: int, block_size: int, ev: StreamingEviction) -> int:
    """Blocks to drop before a step that computes `num_new` tokens after `num_computed`, when `num_evicted` blocks
    were dropped before: as many as exceed `ev.max_blocks_per_seq` after the step, but only full blocks outside the
    sinks that this step does not write (the oldest of them go first: the caller drops them in table order)."""
    held_after = _cdiv(num_computed + num_new, block_size) - num_evicted
    evictable = max(0, num_computed // block_size - ev.num_sink_blocks - num_evicted)
    return min(evictable, max(0, held_after - ev.max_blocks_per_seq))


class StreamingKVEviction:
    """The engine feature (`kv_eviction=`): the scheduler's `growth` seam and the `kv_evicted_blocks` stat."""
    name = "kv_eviction"

    def __init__(self, engine) -> None:
        self.ev, self.block_size = engine.config.eviction, engine.config.block_size
        self.bm = engine.block_manager
        self.num_evicted_blocks = 0
        engine.scheduler.growth = self

    def cap(self, seq, n: int) -> int:
        """Cap this step's `n` tokens of `seq` so that it holds at most sinks + window + 1 blocks once its evictable
        blocks are gone, drop the oldest non-sink blocks that would exceed that (before the free-block check, so they
        count as free), and return the capped `n`."""
        if n == 0:
            return n
        n = min(n, max_chunk_tokens(seq.num_computed_tokens, self.block_size, self.ev))
        k = num_blocks_to_evict(seq.num_computed_tokens, n, seq.num_dropped_blocks, self.block_size, self.ev)
        if k:
            self.drop_blocks(seq, self.ev.num_sink_blocks, k)
        return n

    def drop_blocks(self, seq, first: int, count: int) -> None:
        """Drop `count` blocks of `seq.block_table` from table index `first` on and return them (the oldest blocks
        after the sinks). Their K/V is gone for good, so they must hold only computed tokens that nothing caches:
        prefix caching is off under eviction (a later sequence could not share a table with a hole)."""
        bm, end = self.bm, first + count
        assert not bm.enable_prefix_caching, "eviction and prefix caching do not mix"
        assert 0 <= first and end * self.block_size <= bm._num_kv_tokens(seq), \
            f"seq {seq.seq_id}: blocks {first}..{end - 1} are not all computed"
        for block_id in seq.block_table[first:end]:
            bm._release(block_id)
        del seq.block_table[first:end]
        seq.num_dropped_blocks += count
        self.num_evicted_blocks += count

    def check_request(self, params) -> None:
        if params.n > 1:
            raise ValueError(f"n={params.n} cannot be combined with kv_eviction (samples share blocks that one of them "
                             "would evict); use n=1")

    def check_search(self) -> None:
        raise ValueError("beam_search cannot be combined with kv_eviction (beams share blocks that one of them would "
                         "evict); make an LLM without kv_eviction")

    def stats(self) -> dict:
        return {"kv_evicted_blocks": self.num_evicted_blocks}
