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
`StreamingEvictionPolicy` applies it to one sequence in the scheduler's `growth` seam (`cap(seq, n)`: cap this step's
tokens, drop the oldest non-sink blocks before the free-block check) and `StreamingKVEviction` plugs it into the engine
(`LLM(kv_eviction={"method": "streaming", "num_sink_blocks": s, "window_blocks": w})`; `"policy": cls` swaps in
another class with the same constructor and `cap`, as Lab 10's exercise does). The features it refuses are in `engine.compat`; n > 1 and beam search are refused per request
(samples and beams share blocks that one of them would drop). A sequence preempted by recompute is recomputed that
way too, so its later tokens may differ from an uninterrupted run.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StreamingEviction", "streaming_block_keep", "max_chunk_tokens", "num_blocks_to_evict",
           "StreamingEvictionPolicy", "StreamingKVEviction"]

EVICTION_METHODS = ("streaming",)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class StreamingEviction:
    """`LLM(kv_eviction={"method": "streaming", "num_sink_blocks": 1, "window_blocks": W})`, checked."""
    num_sink_blocks: int = 1
    window_blocks: int = 15
    method: str = "streaming"
    policy: type | None = None   # the class applying the rule in the growth seam (None: StreamingEvictionPolicy)

    @classmethod
    def from_dict(cls, spec: dict) -> "StreamingEviction":
        if not isinstance(spec, dict):
            raise ValueError(f"kv_eviction must be a dict like {{'method': 'streaming', 'num_sink_blocks': 1, "
                             f"'window_blocks': 15}} or None, got {spec!r}")
        unknown = set(spec) - {"method", "num_sink_blocks", "window_blocks", "policy"}
        if unknown:
            raise ValueError(f"unknown kv_eviction keys {sorted(unknown)}; valid: method, num_sink_blocks, window_blocks, "
                             "policy")
        method = spec.get("method", "streaming")
        if method not in EVICTION_METHODS:
            raise ValueError(f"kv_eviction method {method!r} is not supported in the engine; valid: "
                             f"{', '.join(EVICTION_METHODS)} (H2O / SnapKV / PyramidKV keep per-head token sets that the "
                             "paged layout cannot hold: see llmso_lab.kv.evict)")
        policy = spec.get("policy")
        if policy is not None and not callable(getattr(policy, "cap", None)):
            raise ValueError(f"kv_eviction policy must be a class with a cap(seq, n) method (like "
                             f"StreamingEvictionPolicy), got {policy!r}")
        out = cls(spec.get("num_sink_blocks", 1), spec.get("window_blocks", 15), method, policy)
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


class StreamingEvictionPolicy:
    """The rule applied to one sequence at a time, in the scheduler's `growth` seam.

    `release(block_id)` returns a block to the block manager. `cap(seq, n)` is called before the free-block check of
    each step that would compute `n` tokens of `seq` (positions c .. c + n - 1, c = `seq.num_computed_tokens`):
    it caps n so that the sequence holds at most sinks + window + 1 blocks once its evictable blocks are gone
    (`max_chunk_tokens`), drops the oldest non-sink blocks that would exceed that (`num_blocks_to_evict`: full
    blocks the step does not write) from `seq.block_table` (table index `num_sink_blocks` on: the sinks stay first),
    releases them, adds their count to `seq.num_dropped_blocks` (the engine's cache index = position -
    num_dropped_blocks * block_size), and returns the capped n."""

    def __init__(self, num_sink_blocks: int, window_blocks: int, block_size: int, release) -> None:
        self.ev = StreamingEviction(num_sink_blocks, window_blocks)
        self.block_size, self.release = block_size, release

    def cap(self, seq, n: int) -> int:
        if n == 0:
            return n
        n = min(n, max_chunk_tokens(seq.num_computed_tokens, self.block_size, self.ev))
        k = num_blocks_to_evict(seq.num_computed_tokens, n, seq.num_dropped_blocks, self.block_size, self.ev)
        first, end = self.ev.num_sink_blocks, self.ev.num_sink_blocks + k
        # only computed tokens may go: their K/V is gone for good
        assert k == 0 or (end + seq.num_dropped_blocks) * self.block_size <= seq.num_computed_tokens
        for block_id in seq.block_table[first:end]:
            self.release(block_id)
        del seq.block_table[first:end]
        seq.num_dropped_blocks += k
        return n


class StreamingKVEviction:
    """The engine feature (`kv_eviction=`): installs the policy in the scheduler's `growth` seam, hands it the block
    manager's release, and counts the `kv_evicted_blocks` stat."""
    name = "kv_eviction"

    def __init__(self, engine) -> None:
        self.ev, self.block_size = engine.config.eviction, engine.config.block_size
        self.bm = engine.block_manager
        # evicted K/V is gone for good, so nothing may share it: prefix caching is off under eviction (engine.compat)
        assert not self.bm.enable_prefix_caching, "eviction and prefix caching do not mix"
        self.num_evicted_blocks = 0
        policy = self.ev.policy or StreamingEvictionPolicy
        self.policy = policy(self.ev.num_sink_blocks, self.ev.window_blocks, self.block_size, self._release)
        engine.scheduler.growth = self.policy

    def _release(self, block_id: int) -> None:
        self.bm._release(block_id)
        self.num_evicted_blocks += 1

    def check_request(self, params) -> None:
        if params.n > 1:
            raise ValueError(f"n={params.n} cannot be combined with kv_eviction (samples share blocks that one of them "
                             "would evict); use n=1")

    def check_search(self) -> None:
        raise ValueError("beam_search cannot be combined with kv_eviction (beams share blocks that one of them would "
                         "evict); make an LLM without kv_eviction")

    def stats(self) -> dict:
        return {"kv_evicted_blocks": self.num_evicted_blocks}


def run_policy_in_engine(policy_cls, prompts: list[list[int]], max_tokens: int, num_sink_blocks: int = 1,
                         window_blocks: int = 3, num_kv_blocks: int = 16, max_num_batched_tokens: int = 64,
                         block_size: int = 4, max_steps: int = 2000) -> dict:
    """Lab 10's harness for the StreamingLLM eviction exercise: the engine runs with `policy_cls` in its growth seam.

    `policy_cls(num_sink_blocks, window_blocks, block_size, release)` must behave like `StreamingEvictionPolicy`
    (its `cap(seq, n)` caps a step's tokens and drops the oldest non-sink blocks, releasing them). The engine is a
    tiny seeded Llama (`models.tiny.tiny_llama`, 2 layers, fp32) with `kv_eviction={..., "policy": policy_cls}`,
    chunked prefill on, greedy decoding of `max_tokens` tokens per prompt (token id lists). Every step the block
    manager's invariants are checked (a block released but still in a table, or leaked, fails here).

    Returns plain data: "tokens" (greedy tokens per prompt), "caps" (one [request, computed, asked, granted,
    dropped blocks, blocks held] per `cap` call: what the policy let the step compute and which positions it
    kept), "most_blocks_held" (by one sequence after any step), "kv_evicted_blocks", "blocks_free_after" (every
    block back in the free list at the end)."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.models.tiny import tiny_llama

    caps = []

    class Recorded:   # the student's policy, each call recorded
        def __init__(self, *args) -> None:
            self.inner = policy_cls(*args)

        def cap(self, seq, n: int) -> int:
            got = self.inner.cap(seq, n)
            caps.append([int(seq.request_id), seq.num_computed_tokens, n, int(got), seq.num_dropped_blocks,
                         len(seq.block_table)])
            return got

    llm = LLM(tiny_llama(num_layers=2, max_position_embeddings=512), block_size=block_size, max_model_len=512,
              num_kv_blocks=num_kv_blocks, max_num_batched_tokens=max_num_batched_tokens,
              kv_eviction={"method": "streaming", "num_sink_blocks": num_sink_blocks, "window_blocks": window_blocks,
                           "policy": Recorded})
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.add_request({"prompt_token_ids": list(p)}, params) for p in prompts]
    outs, most_held = {}, 0
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            break
        done, _ = llm.step()
        llm.scheduler.check_invariants()
        most_held = max([most_held] + [len(s.block_table) for s in llm.scheduler.running])
        for o in done:
            outs[o.request_id] = list(o.outputs[0].token_ids)
    else:
        raise RuntimeError(f"the engine did not finish in {max_steps} steps: does cap() return 0 for a sequence "
                           "that still has tokens to compute?")
    return {"tokens": [outs[i] for i in ids], "caps": caps, "most_blocks_held": most_held,
            "kv_evicted_blocks": llm.stats()["kv_evicted_blocks"],
            "blocks_free_after": llm.block_manager.num_free_blocks == llm.block_manager.num_blocks}
