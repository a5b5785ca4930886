"""Lab 03 (FlashAttention, FlashDecoding, PagedAttention) exercises and their public checks.

References: `llmso_lab.attention` (torch references, and the Triton `flash_attention` kernel).
Every input is small and built from a seeded generator, so the checks are the same on every machine.
"""
import torch

from llmso_lab.attention.reference import naive_attention
from llmso_lab.grading.compare import close
from llmso_lab.grading.registry import Case, Exercise, register

NEG_INF = float("-inf")
fp32 = close(atol=1e-5, rtol=1e-5)  # torch exercises in fp32: only rounding differences are allowed
kernel = close(atol=1e-4, rtol=1e-4)  # Triton kernels: a different summation order (tiles, tl.dot)
same = close(atol=0.0, rtol=0.0, check_dtype=True)  # index arithmetic: bit-exact, dtype included
TORCH_MATH = ("torch:matmul", "torch:mm", "torch:bmm", "torch:einsum", "torch:softmax", "torch:exp",
              "torch.nn.functional:softmax", "torch:Tensor.__matmul__", "torch:Tensor.matmul", "torch:Tensor.softmax",
              "torch:Tensor.exp")


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def softmax_state(rows: tuple[int, ...], d: int, seed: int, m_value: float | None = None):
    """A plausible running state (m, l, acc) for `rows` query rows after some earlier tiles."""
    m = randn(*rows, seed=seed) if m_value is None else torch.full(rows, m_value)
    l = randn(*rows, seed=seed + 1).abs() + 1.0  # >= 1: the max itself contributes exp(0) = 1
    acc = randn(*rows, d, seed=seed + 2)
    return m, l, acc


def empty_state(rows: tuple[int, ...], d: int):
    """The state before the first tile: m = -inf, l = 0, acc = 0."""
    return torch.full(rows, NEG_INF), torch.zeros(rows), torch.zeros(*rows, d)


def with_masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(mask, NEG_INF)


def split_attention(nq: int, nk: int, cut: int, heads: int, d: int, seed: int):
    """Attention of one query set over keys [0, cut) and [cut, nk) separately: (o1, lse1, o2, lse2)."""
    q, k, v = randn(1, heads, nq, d, seed=seed), randn(1, heads, nk, d, seed=seed + 1), randn(1, heads, nk, d, seed=seed + 2)
    o1, lse1 = naive_attention(q, k[:, :, :cut], v[:, :, :cut], return_lse=True)
    o2, lse2 = naive_attention(q, k[:, :, cut:], v[:, :, cut:], return_lse=True)
    return o1[0], lse1[0], o2[0], lse2[0]  # o [H, Nq, D], lse [H, Nq]


def paged_cache(num_blocks: int, block_size: int, kv_heads: int, d: int, seed: int) -> torch.Tensor:
    return randn(num_blocks, block_size, kv_heads, d, seed=seed)  # [num_blocks, block_size, Hkv, D]


def shuffled_table(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)


def qkv(b: int, h: int, hkv: int, nq: int, nk: int, d: int, seed: int):
    """Dense fp32 inputs: q [B, H, Nq, D], k/v [B, Hkv, Nk, D]."""
    return randn(b, h, nq, d, seed=seed), randn(b, hkv, nk, d, seed=seed + 1), randn(b, hkv, nk, d, seed=seed + 2)


_empty_m, _empty_l, _empty_acc = empty_state((2, 3), 4)
_m, _l, _acc = softmax_state((2, 3), 4, seed=10)
_o1, _lse1, _o2, _lse2 = split_attention(nq=3, nk=20, cut=12, heads=2, d=8, seed=20)

register(
    Exercise("online_softmax_update", "03", 20, "llmso_lab.attention.reference:online_softmax_update", [
        Case("first tile from the empty state (m=-inf, l=0, acc=0)",
             (_empty_m, _empty_l, _empty_acc, randn(2, 3, 5, seed=1), randn(2, 5, 4, seed=2))),
        Case("a later tile that raises the running max (old state must shrink by exp(m_old - m_new))",
             (_m, _l, _acc, randn(2, 3, 6, seed=11, scale=3.0), randn(2, 6, 4, seed=12))),
        Case("a tile with masked (-inf) scores",
             (_m, _l, _acc, with_masked(randn(2, 3, 5, seed=13), randn(2, 3, 5, seed=14) > 0.5),
              randn(2, 5, 4, seed=15))),
    ], compare=fp32, tripwires=("llmso_lab.attention.reference:flash_attention_torch",),
        description="fold one tile of scores into the running (m, l, acc)"),
    Exercise("merge_attention_states", "03", 20, "llmso_lab.attention.reference:merge_attention_states", [
        Case("two halves of the keys of one attention", (_o1, _lse1, _o2, _lse2)),
        Case("an empty split (lse=-inf, o=0) has weight 0",
             (_o1, _lse1, torch.zeros_like(_o2), torch.full_like(_lse2, NEG_INF))),
        Case("decode shapes: o [B, H, D], lse [B, H]",
             (randn(3, 4, 16, seed=30), randn(3, 4, seed=31), randn(3, 4, 16, seed=32), randn(3, 4, seed=33))),
    ], compare=fp32, tripwires=("llmso_lab.attention.reference:flash_decoding_torch",),
        description="combine attention over two disjoint key sets by their lse (FlashDecoding's reduction)"),
    Exercise("gather_paged_kv", "03", 15, "llmso_lab.attention.varlen:gather_paged_kv", [
        Case("10 tokens in blocks of 4 (last block partly used), shuffled block table",
             (paged_cache(6, 4, 2, 3, seed=40), shuffled_table(6, seed=41), 10)),
        Case("exactly 2 full blocks of 16 (the engine's block size)",
             (paged_cache(5, 16, 3, 4, seed=42), torch.tensor([3, 0, 4, 1], dtype=torch.int32), 32)),
    ], compare=same, tripwires=("llmso_lab.attention.varlen:paged_attention_torch",),
        description="read one sequence's K or V out of the paged cache through its block table"),
    Exercise("build_cu_seqlens", "03", 10, "llmso_lab.attention.varlen:build_cu_seqlens", [
        Case("[3, 1, 4] -> [0, 3, 4, 8]", ([3, 1, 4],)),
        Case("an int64 tensor with an empty sequence", (torch.tensor([5, 0, 2]),)),
    ], compare=same, description="cumulative sequence offsets, int32 [B+1], starting at 0"),
    Exercise("flash_attention", "03", 35, "llmso_lab.attention:flash_attention", [
        Case("B=1, H=2, N=96 (two key tiles), D=16, not causal", qkv(1, 2, 2, 96, 96, 16, seed=50),
             {"causal": False}),
        Case("causal, N=130 (three key tiles, the last one partial), D=32", qkv(1, 2, 2, 130, 130, 32, seed=51),
             {"causal": True}),
        Case("GQA (4 query heads, 2 KV heads): 24 queries after 56 cached keys, causal = bottom-right aligned",
             qkv(2, 4, 2, 24, 80, 16, seed=52), {"causal": True}),
    ], compare=kernel, timeout_s=90, env={"TRITON_INTERPRET": "1"},
        # Graded is the student's kernel, launched by the library's launcher (a fixed grid and arguments), so a
        # cell that computes attention in torch and never runs the kernel earns nothing. Expected values come
        # from the torch oracle, so grading needs no kernel (and no GPU) itself. Other implementations that would
        # do the work, and torch's matmul/softmax/exp (the kernel body runs as Python under the interpreter),
        # are disabled meanwhile.
        triton_kernel="_attn_fwd_tile_kernel", launcher="llmso_lab.attention.tile_launcher:launch_attn_fwd_tile",
        oracle="llmso_lab.attention.reference:flash_attention_torch",
        tripwires=("llmso_lab.attention.reference:flash_attention_torch", "llmso_lab.attention.reference:naive_attention",
                   "llmso_lab.attention.varlen:varlen_attention_torch", "llmso_lab.attention.fallback:flash_attention",
                   "torch.nn.functional:scaled_dot_product_attention", *TORCH_MATH),
        description="the inner loop of the FlashAttention forward kernel in Triton (graded under the interpreter)"),
)
