"""Torch references for attention: the naive N x N version and FlashAttention's tiled online softmax.

These are the oracles every kernel is tested against, and the code the lecture (section 1-2) explains.
Layout (as torch SDPA): q [B, H, Nq, D], k and v [B, Hkv, Nk, D], with Hkv dividing H (GQA: query head h
reads KV head h // (H // Hkv)). `lse` is the natural-log sum of exp of the *scaled* scores, [B, H, Nq].
Causal with Nq < Nk is bottom-right aligned: query i sees keys j <= i + (Nk - Nq) (FlashAttention >= 2.1).
Math is done in fp32; outputs come back in the input dtype, lse stays fp32.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "naive_attention", "online_softmax_update", "flash_attention_torch", "merge_attention_states",
    "flash_decoding_torch", "repeat_kv", "causal_mask",
]


def repeat_kv(x: torch.Tensor, num_heads: int, head_dim: int = -3) -> torch.Tensor:
    """Expand KV heads to query heads for GQA: [B, Hkv, N, D] -> [B, H, N, D] (head axis `head_dim`)."""
    hkv = x.shape[head_dim]
    assert num_heads % hkv == 0, f"{num_heads} query heads are not a multiple of {hkv} KV heads"
    return x if hkv == num_heads else x.repeat_interleave(num_heads // hkv, dim=head_dim)


def causal_mask(nq: int, nk: int, q_start: int = 0, k_start: int = 0, *, q_len: int | None = None,
                k_len: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Bottom-right causal mask for the tile rows [q_start, q_start+nq) x cols [k_start, k_start+nk).

    True = the query may attend to the key. `q_len`/`k_len` are the full sequence lengths (default: the
    tile is the whole matrix). Query i sees key j iff j <= i + (k_len - q_len).
    """
    q_len = nq if q_len is None else q_len
    k_len = nk if k_len is None else k_len
    rows = torch.arange(q_start, q_start + nq, device=device)[:, None]  # [nq, 1]
    cols = torch.arange(k_start, k_start + nk, device=device)[None, :]  # [1, nk]
    return cols <= rows + (k_len - q_len)  # [nq, nk]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False):
    """Textbook attention: materialise S = Q K^T (N x N per head), softmax, then P V.

    q [B, H, Nq, D], k/v [B, Hkv, Nk, D] -> o [B, H, Nq, D] (and lse [B, H, Nq] if `return_lse`).
    On a GPU, S and P each make a round trip through HBM: that traffic is what FlashAttention removes.
    Rows that see no key (Nq > Nk with causal, or Nk = 0) give o = 0 and lse = -inf.
    """
    H, D = q.shape[-3], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k, v = repeat_kv(k, H).float(), repeat_kv(v, H).float()
    s = q.float() @ k.transpose(-2, -1)  # [B, H, Nq, Nk]  <- S, the N x N matrix (written to HBM)
    s.mul_(scale)  # in place, so that S and P are the only N x N tensors
    if causal:
        s.masked_fill_(~causal_mask(s.shape[-2], s.shape[-1], device=s.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # [B, H, Nq, Nk] <- P; all -inf rows -> 0, not NaN
    o = (p @ v).to(q.dtype)  # [B, H, Nq, D]
    return (o, torch.logsumexp(s, dim=-1)) if return_lse else o


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                          v_tile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the online softmax: fold a new tile of keys into the running state.

    m [..., M] running max of scores, l [..., M] running sum of exp(score - m), acc [..., M, D] running
    sum of exp(score - m) * v; scores [..., M, N] (already scaled, masked entries = -inf); v_tile [..., N, D].
    Returns the new (m, l, acc). After the last tile, o = acc / l and lse = m + log(l).
    """
    m_new = torch.maximum(m, scores.amax(dim=-1))  # [..., M]
    # A row that has seen only masked keys still has m = -inf; subtract 0 instead so exp() gives 0, not NaN.
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)  # [..., M] rescale of the old state: exp(m_old - m_new) <= 1
    p = torch.exp(scores - m_safe[..., None])  # [..., M, N]
    l = alpha * l + p.sum(dim=-1)
    acc = alpha[..., None] * acc + p @ v_tile  # [..., M, D]
    return m_new, l, acc


def flash_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          block_q: int = 64, block_k: int = 64, scale: float | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's algorithm in plain torch: never holds more than a [block_q, block_k] score tile.

    q [B, H, Nq, D], k/v [B, Hkv, Nk, D] -> (o [B, H, Nq, D], lse [B, H, Nq] fp32).
    Exact (to fp32 rounding) because the online softmax rescales old partial sums by exp(m_old - m_new).
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[-2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf, kf, vf = q.float(), repeat_kv(k, H).float(), repeat_kv(v, H).float()
    o = torch.empty(B, H, Nq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    for qs in range(0, Nq, block_q):
        qe = min(qs + block_q, Nq)
        q_tile = qf[:, :, qs:qe]  # [B, H, bq, D]  (on a GPU: loaded once into SRAM)
        m = torch.full((B, H, qe - qs), float("-inf"), device=q.device)  # running max
        l = torch.zeros(B, H, qe - qs, device=q.device)  # running denominator
        acc = torch.zeros(B, H, qe - qs, D, device=q.device)  # running numerator
        # Causal: the last row of this tile sees keys up to (qe - 1) + (Nk - Nq); skip tiles beyond it.
        k_end = max(0, min(Nk, qe + Nk - Nq)) if causal else Nk
        for ks in range(0, k_end, block_k):
            ke = min(ks + block_k, k_end)
            s = (q_tile @ kf[:, :, ks:ke].transpose(-2, -1)) * scale  # [B, H, bq, bk]: one tile only
            if causal:
                mask = causal_mask(qe - qs, ke - ks, qs, ks, q_len=Nq, k_len=Nk, device=q.device)
                s = s.masked_fill(~mask, float("-inf"))
            m, l, acc = online_softmax_update(m, l, acc, s, vf[:, :, ks:ke])
        o[:, :, qs:qe] = acc / torch.where(l == 0, 1.0, l)[..., None]  # rows that saw no key -> 0
        lse[:, :, qs:qe] = m + torch.log(l)  # -inf where l == 0
    return o.to(q.dtype), lse


def merge_attention_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets (FlashDecoding's reduction).

    o1, o2 [..., D] each normalised over its own keys; lse1, lse2 [...]. Returns (o, lse) over the union:
    lse = log(e^lse1 + e^lse2), o = e^(lse1 - lse) o1 + e^(lse2 - lse) o2. An empty part has lse = -inf
    and weight 0; if both are empty, o = 0 and lse = -inf (no NaN).
    """
    lse1, lse2 = lse1.float(), lse2.float()
    m = torch.maximum(lse1, lse2)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: avoid -inf - -inf
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # [...]
    total = w1 + w2
    o = (w1[..., None] * o1.float() + w2[..., None] * o2.float()) / torch.where(total == 0, 1.0, total)[..., None]
    return o.to(o1.dtype), m + torch.log(total)


def flash_decoding_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int = 4,
                         scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode in torch: attend to each chunk of keys separately, then merge by lse.

    q [B, H, D] (one new token per sequence), k/v [B, Hkv, Nk, D] -> (o [B, H, D], lse [B, H]).
    Chunks have ceil(Nk / num_splits) keys; trailing chunks may be empty (lse = -inf, weight 0).
    """
    B, H, D = q.shape
    Nk = k.shape[-2]
    split = -(-Nk // num_splits) if Nk else 0
    o = torch.zeros(B, H, D, dtype=q.dtype, device=q.device)
    lse = torch.full((B, H), float("-inf"), device=q.device)
    for i in range(num_splits):
        lo, hi = min(i * split, Nk), min((i + 1) * split, Nk)
        o_i, lse_i = naive_attention(q[:, :, None], k[:, :, lo:hi], v[:, :, lo:hi], scale=scale, return_lse=True)
        o, lse = merge_attention_states(o, lse, o_i[:, :, 0], lse_i[:, :, 0])
    return o, lse
