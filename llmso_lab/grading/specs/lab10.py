"""Lab 10 (KV-cache compression) exercises and their public checks.

References: `llmso_lab.kv.quant:kivi_fake_quantize` (KIVI), `llmso_lab.kv.evict` (`streaming_keep`, `h2o_keep`,
`snapkv_keep` with max pooling, `pyramid_budgets`). Inputs are small and seeded, so the checks are the same
everywhere. Two mechanism exercises are graded by running them: the StreamingLLM eviction policy in the engine's
growth seam (`kv.streaming.run_policy_in_engine`: greedy tokens, every cap decision, blocks held and freed, against
the library policy) and CacheBlend's token selection inside `kv.blend.blend` (`kv.blend.run_selector`: the
recomputed positions and the answer, against the library selection).

KIVI's expected values come from `kivi_oracle` below, the exact fp32 min-max definition the exercise states: the
library stores its scales and zero points in fp16, rounded outward, so its codes differ from the fp32 grid by
one level on a few elements. The library function is still the exercise's reference, disabled while it is graded.

Keep-sets are index sets chosen by top-k, so a case whose boundary falls on a tie (or a near-tie that summation
order could flip) would have more than one right answer. The case generators below draw inputs from a seed and
move to the next seed until the boundary is clear (`MARGIN`); for the same reason KIVI's inputs keep every
quantized element away from a rounding midpoint.
"""
from __future__ import annotations

import itertools

import torch

from llmso_lab.grading.compare import close, exact
from llmso_lab.grading.registry import Case, Exercise, register
from llmso_lab.grading.specs.lab06 import RTN_CODE

# fp32 rounding only: one quantization step (1e-3 and up on these inputs, 8-bit included) on any element fails
fp32 = close(atol=1e-5, rtol=1e-5)
same = exact()   # index tensors (value, shape and dtype int64) and lists of ints
MARGIN = 1e-4    # KIVI: |frac((x - zero) / scale) - 0.5| > MARGIN; keep-sets: the kept and the dropped differ by more

KIVI_CODE = ("llmso_lab.kv.quant:quantize_asym", "llmso_lab.kv.quant:kivi_quantize_keys",
             "llmso_lab.kv.quant:kivi_quantize_values", "llmso_lab.kv.quant:AsymQuantized",
             "llmso_lab.quant.rtn:fake_quantize", *RTN_CODE)
EVICT = "llmso_lab.kv.evict"
STREAMING = "llmso_lab.kv.streaming"
BLEND = "llmso_lab.kv.blend"
P10, P7 = list(range(3, 13)), list(range(40, 47))          # prompts (token ids) for the eviction harness
P30 = [(7 * i + 3) % 250 + 3 for i in range(30)]
SELECT_CODE = (f"{EVICT}:_top_plus_recent", f"{EVICT}:h2o_keep")   # "recent window + top-k of the rest"


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _fake(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max fake quantization of x over `dim` (fp32, scale 0 -> 1), the exercise's definition."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return ((x - lo) / scale).round().clamp(0, 2 ** bits - 1) * scale + lo


def _num_quantized(T: int, group_size: int, residual_length: int) -> int:
    return max(0, T - residual_length) // group_size * group_size


def kivi_oracle(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int,
                residual_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI read-back, exact fp32: the oldest n_q tokens quantized (keys per channel in groups of `group_size`
    tokens, values per token over D), the recent ones returned unchanged. k, v [T, H, D] -> (k_hat, v_hat)."""
    n_q = _num_quantized(k.shape[0], group_size, residual_length)
    k_hat, v_hat = k.float().clone(), v.float().clone()
    for s in range(0, n_q, group_size):
        k_hat[s:s + group_size] = _fake(k[s:s + group_size].float(), bits, dim=0)
    if n_q:
        v_hat[:n_q] = _fake(v[:n_q].float(), bits, dim=-1)
    return k_hat, v_hat


def _rounding_margin(x: torch.Tensor, bits: int, dim: int) -> float:
    """How close (x - min) / scale comes to a rounding midpoint k + 0.5, in float64 (inf for empty x)."""
    if x.numel() == 0:
        return float("inf")
    x = x.double()
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    z = (x - lo) / torch.where(scale == 0, torch.ones_like(scale), scale)
    return float(((z - z.floor()) - 0.5).abs().min())


def kivi_inputs(T: int, H: int, D: int, bits: int, group_size: int, residual_length: int, seed: int,
                outliers: tuple[int, ...] = (3,), constant: bool = False) -> tuple:
    """Case args (k, v, bits, group_size, residual_length): keys [T, H, D] whose `outliers` channels are ~10x larger
    and offset (as real keys have), values [T, H, D] randn. `constant`: key channel (head 0, channel 0) constant
    over the first group and one value token (token 1, head 0) constant, so scale 0 must become 1.
    Seeds from `seed` on are tried until no quantized element sits within MARGIN of a rounding midpoint."""
    n_q = _num_quantized(T, group_size, residual_length)
    for s in itertools.count(seed):
        k, v = randn(T, H, D, seed=s), randn(T, H, D, seed=s + 50_000)
        k[:, :, list(outliers)] = k[:, :, list(outliers)] * 10.0 + 4.0
        if constant:
            k[:group_size, 0, 0] = 0.75
            v[1, 0, :] = -1.25
        groups = [k[g:g + group_size] for g in range(0, n_q, group_size)]
        margin = min([_rounding_margin(g, bits, 0) for g in groups] + [_rounding_margin(v[:n_q], bits, -1)])
        if margin > MARGIN:
            return k, v, bits, group_size, residual_length
    raise AssertionError("unreachable")


def _clear_cut(scores: torch.Tensor, keep: int) -> bool:
    """Do the `keep` largest of each row of scores [H, n] beat the rest by more than MARGIN (no tie at the cut)?"""
    if keep <= 0 or keep >= scores.shape[1]:
        return True
    top = scores.sort(dim=-1, descending=True).values
    return bool(((top[:, keep - 1] - top[:, keep]) > MARGIN * top[:, 0]).all())


def h2o_scores(H: int, T: int, seed: int, budget: int, recent: int, causal: bool = True) -> torch.Tensor:
    """Accumulated attention [H, T]: the column sums of a causal softmax attention of random logits (causal=True:
    early tokens collect more, as in a real prompt), or uniform random scores (causal=False: recent tokens can
    score highest too). Seeds from `seed` on until the heavy-hitter cut is clear."""
    for s in itertools.count(seed):
        if causal:
            logits = randn(H, T, T, seed=s, scale=2.0)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            scores = logits.masked_fill(mask, float("-inf")).softmax(-1).sum(1)
        else:
            scores = torch.rand(H, T, generator=torch.Generator().manual_seed(s))
        if budget >= T or _clear_cut(scores[:, :T - recent], budget - recent):
            return scores
    raise AssertionError("unreachable")


def _pooled_votes(q_obs: torch.Tensor, k: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """SnapKV's max-pooled votes [Hkv, T] (only for choosing seeds; no library call, so importing this module
    never runs code that grading disables)."""
    H, W, D = q_obs.shape
    Hkv, T, _ = k.shape
    logits = q_obs @ k.repeat_interleave(H // Hkv, dim=0).transpose(1, 2) / D ** 0.5            # [H, W, T]
    future = torch.arange(T)[None, :] > torch.arange(T - W, T)[:, None]
    votes = logits.masked_fill(future, float("-inf")).softmax(-1).mean(1).view(Hkv, H // Hkv, T).mean(1)
    return torch.nn.functional.max_pool1d(votes[None], kernel_size, stride=1, padding=kernel_size // 2)[0]


def snapkv_inputs(H: int, Hkv: int, T: int, D: int, budget: int, window: int, kernel_size: int, seed: int,
                  scale: float = 2.0) -> tuple:
    """Case args (q_obs [H, window, D], k [Hkv, T, D], budget, window, kernel_size), seeded. Seeds from `seed` on
    are tried until the pooled votes of the kept and the dropped earlier tokens differ by more than MARGIN (max
    pooling makes plateaus of equal votes: a cut inside one would have several right answers)."""
    for s in itertools.count(seed):
        q, k = randn(H, window, D, seed=s, scale=scale), randn(Hkv, T, D, seed=s + 50_000)
        if budget >= T or _clear_cut(_pooled_votes(q, k, kernel_size)[:, :T - window], budget - window):
            return q, k, budget, window, kernel_size
    raise AssertionError("unreachable")


# a recent token with the largest score: heavy hitters taken from all tokens would pick it twice
_h2o_recent_hot = h2o_scores(3, 24, seed=20, budget=10, recent=4, causal=False)
_h2o_recent_hot[:, -2] = 5.0

register(
    Exercise("kivi_fake_quantize", "10", 20, "llmso_lab.kv.quant:kivi_fake_quantize", [
        Case("4-bit, T=40, groups of 8, window 8: the oldest 32 tokens (4 key groups) quantized, 8 exact; "
             "key channel 3 is an outlier", kivi_inputs(40, 2, 16, 4, 8, 8, seed=1)),
        Case("2-bit, T=45, groups of 8, window 8: floor(37 / 8) * 8 = 32 quantized, the last 13 exact",
             kivi_inputs(45, 2, 16, 2, 8, 8, seed=2, outliers=(0, 9))),
        Case("window (16) longer than the sequence (12): nothing quantized, k and v come back unchanged",
             kivi_inputs(12, 2, 8, 4, 4, 16, seed=3)),
        Case("window 0, T=32, groups of 16: every token quantized", kivi_inputs(32, 3, 8, 4, 16, 0, seed=4)),
        Case("a constant key channel and a constant value token: scale 0 becomes 1 (no NaN, values exact)",
             kivi_inputs(24, 2, 8, 2, 8, 4, seed=5, constant=True)),
    ], compare=fp32, oracle="llmso_lab.grading.specs.lab10:kivi_oracle", tripwires=KIVI_CODE,
        description="KIVI read-back: oldest whole groups quantized (keys per channel per group, values per token), "
                    "the recent window exact; fp32 asymmetric min-max"),
    Exercise("streaming_keep", "10", 5, f"{EVICT}:streaming_keep", [
        Case("T=100, budget 20, 4 sinks: tokens 0-3 and 84-99", (100, 20)),
        Case("T=50, budget 10, 2 sinks", (50, 10, 2)),
        Case("no sinks (num_sink=0): only the 12 most recent of 30", (30, 12, 0)),
        Case("budget = num_sink + 1: the sinks and the last token", (40, 5, 4)),
        Case("budget one short of T: only token 4 is dropped", (25, 24)),
        Case("budget = T: every token", (16, 16)),
        Case("budget > T: every token (16 of them, not 40)", (16, 40)),
        Case("budget = num_sink (4 of 4): no room for a recent token, ValueError", (100, 4), raises="ValueError"),
        Case("budget 2 < 3 sinks: ValueError, even with a short sequence", (2, 2, 3), raises="ValueError"),
    ], compare=same, tripwires=("llmso_lab.kv.streaming:streaming_block_keep",),   # the same rule, in blocks
        description="StreamingLLM keep-set: the first num_sink tokens and the most recent "
                                 "budget - num_sink, sorted (int64)"),
    Exercise("h2o_keep", "10", 15, f"{EVICT}:h2o_keep", [
        Case("4 heads, T=32, budget 12 = 4 recent + 8 heavy hitters (column sums of causal attention)",
             (h2o_scores(4, 32, seed=10, budget=12, recent=4), 12, 4)),
        Case("3 heads, T=24, budget 10, recent 4; token 22 (in the recent window) has the largest score: it is "
             "kept once, as a recent token, and 6 heavy hitters come from tokens 0-19",
             (_h2o_recent_hot, 10, 4)),
        Case("recent 0: the 6 largest scores of each of 2 heads",
             (h2o_scores(2, 20, seed=30, budget=6, recent=0, causal=False), 6, 0)),
        Case("1 head, budget = recent + 1: one heavy hitter", (h2o_scores(1, 16, seed=40, budget=5, recent=4), 5, 4)),
        Case("budget = T: every token for each head, [H, T]", (h2o_scores(3, 12, seed=50, budget=12, recent=4), 12, 4)),
        Case("budget > T: still [H, T]", (h2o_scores(2, 8, seed=60, budget=20, recent=2), 20, 2)),
    ], compare=same, tripwires=(f"{EVICT}:_top_plus_recent",),
        description="H2O keep-set per head: the recent window plus the budget - recent largest accumulated "
                    "scores among the earlier tokens, sorted [H, budget]"),
    Exercise("snapkv_keep", "10", 20, f"{EVICT}:snapkv_keep", [
        Case("MHA (2 heads), T=48, D=16, window 8, budget 20, max-pool kernel 7",
             snapkv_inputs(2, 2, 48, 16, 20, 8, 7, seed=100)),
        Case("GQA: 6 query heads on 2 KV heads (query heads 0-2 -> KV head 0, 3-5 -> 1), T=64, window 8, "
             "budget 24, kernel 3", snapkv_inputs(6, 2, 64, 16, 24, 8, 3, seed=200)),
        Case("kernel 1 (no pooling), GQA 6/2, T=40, window 4, budget 12",
             snapkv_inputs(6, 2, 40, 8, 12, 4, 1, seed=300)),
        Case("GQA 4/1 (one KV head), T=32, window 6, budget 14, kernel 5",
             snapkv_inputs(4, 1, 32, 8, 14, 6, 5, seed=400)),
        Case("budget >= T: every token for each KV head", snapkv_inputs(6, 2, 16, 8, 16, 4, 7, seed=500)),
    ], compare=same, tripwires=(f"{EVICT}:snapkv_scores", *SELECT_CODE),
        description="SnapKV keep-set per KV head: causal window votes averaged over the window and the query "
                    "heads of a group, max-pooled, top budget - window earlier tokens plus the window"),
    Exercise("pyramid_budgets", "10", 5, f"{EVICT}:pyramid_budgets", [
        Case("SmolLM2-135M: 30 layers, 64 tokens per layer on average (1920), beta 20", (30, 1920)),
        Case("30 layers, 2000 tokens (not a multiple of 30), beta 20: largest remainders fill the sum",
             (30, 2000, 20)),
        Case("one layer gets the whole budget", (1, 77)),
        Case("beta 1: uniform; 10 over 4 layers -> [3, 3, 2, 2] (ties: lower layer first)", (4, 10, 1)),
        Case("8 layers, 100 tokens, beta 4", (8, 100, 4)),
        Case("2 layers, 9 tokens, beta 2: 4.5 * (1.5, 0.5) = (6.75, 2.25) -> [7, 2]", (2, 9, 2)),
    ], compare=same, description="PyramidKV per-layer budgets: arithmetic, decreasing with depth, from 2k - k/beta "
                                 "to k/beta, rounded by largest remainder to sum exactly to the total"),
    Exercise("StreamingEvictionPolicy", "10", 20, f"{STREAMING}:StreamingEvictionPolicy", [
        Case("one 10-token prompt, 40 new tokens; 1 sink + 3 window blocks of 4 tokens: at most 5 blocks held",
             ([P10], 40, 1, 3, 8)),
        Case("a 30-token prompt longer than the 20-token budget: prefilled in capped chunks, evicting between them",
             ([P30], 12, 1, 3, 6)),
        Case("the same with a 12-token step budget: smaller chunks, the cap still holds", ([P30], 12, 1, 3, 6, 12)),
        Case("two sequences at once, 2 sink blocks and a window of 2", ([P10, P7], 30, 2, 2, 16)),
        Case("no sink blocks (num_sink_blocks=0): a pure sliding window", ([P10], 30, 0, 3, 8)),
        Case("a window that covers the whole sequence: nothing is evicted, the plain engine's tokens",
             ([P10, P7], 20, 1, 20, 64)),
    ], compare=same, harness=f"{STREAMING}:run_policy_in_engine", timeout_s=90,
        tripwires=(f"{STREAMING}:max_chunk_tokens", f"{STREAMING}:num_blocks_to_evict",
                   f"{STREAMING}:streaming_block_keep"),
        description="StreamingLLM in the paged cache, run in the engine's growth seam: cap each step's tokens, drop "
                    "and release the oldest non-sink blocks, keep num_dropped_blocks; graded on the engine's tokens, "
                    "every cap decision and the blocks held and freed"),
    Exercise("cacheblend_select", "10", 15, f"{BLEND}:select_high_deviation", [
        Case("recompute 10 %: the 5 of 51 chunk tokens whose layer-1 V deviates most", (0.1,)),
        Case("recompute 30 % (15 of 51 tokens), another prompt", (0.3, 1)),
        Case("select by K instead of V (on='k'), 20 %", (0.2, 2), {"on": "k"}),
        Case("ratio 0: plain concatenation, nothing recomputed", (0.0, 3)),
        Case("ratio 1: every chunk token recomputed, the full prefill's answer", (1.0, 4)),
        Case("two chunks of 40 and 9 tokens, 25 % (12 of 49)", (0.25, 5), {"chunk_lens": (40, 9)}),
    ], compare=same, harness=f"{BLEND}:run_selector", timeout_s=60,
        tripwires=(f"{BLEND}:kv_deviation", f"{BLEND}:select_tokens"),
        description="CacheBlend's selection, run inside kv.blend.blend: the round(ratio x n) chunk tokens with the "
                    "largest relative K/V deviation, sorted; graded on the recomputed positions and the answer"),
)
