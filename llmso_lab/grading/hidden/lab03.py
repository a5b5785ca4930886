"""Hidden checks for Lab 03 (instructor only; not in the student bundle): odd lengths, GQA, edge cases."""
import torch

from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab03 import (
    NEG_INF, empty_state, paged_cache, qkv, randn, shuffled_table, softmax_state, split_attention, with_masked,
)

_m, _l, _acc = softmax_state((2, 4, 3), 8, seed=100)
_em, _el, _eacc = empty_state((3, 2), 5)
_m_big, _l_big, _acc_big = softmax_state((2, 3), 4, seed=110, m_value=400.0)
_o1, _lse1, _o2, _lse2 = split_attention(nq=5, nk=33, cut=7, heads=3, d=16, seed=120)
_both_empty = (torch.zeros(2, 3, 8), torch.full((2, 3), NEG_INF), torch.zeros(2, 3, 8), torch.full((2, 3), NEG_INF))
_cache = paged_cache(9, 16, 3, 8, seed=130)
# Query rows that have seen no visible key yet (state empty, every score -inf) must stay m=-inf, l=0, acc=0.
_partly_masked = randn(3, 2, 7, seed=104)
_partly_masked[0] = NEG_INF

hidden("03", {
    "online_softmax_update": [
        ((_m, _l, _acc, randn(2, 4, 3, 9, seed=101), randn(2, 4, 9, 8, seed=102)), {}),  # [B, H, M] batch dims
        ((_m, _l, _acc, randn(2, 4, 3, 1, seed=103) - 10.0, randn(2, 4, 1, 8, seed=105)), {}),  # 1 key, max unchanged
        ((_em, _el, _eacc, _partly_masked, randn(3, 7, 5, seed=106)), {}),  # rows that saw only masked keys: no NaN
        ((_m, _l, _acc, torch.full((2, 4, 3, 4), NEG_INF), randn(2, 4, 4, 8, seed=107)), {}),  # fully masked tile
        ((_m_big, _l_big, _acc_big, randn(2, 3, 6, seed=111) + 450.0, randn(2, 6, 4, seed=112)), {}),  # exp overflow
        ((_em, _el, _eacc, with_masked(randn(3, 2, 17, seed=108), randn(3, 2, 17, seed=109) > 0), randn(3, 17, 5, seed=113)),
         {}),
    ],
    "merge_attention_states": [
        ((_o1, _lse1, _o2, _lse2), {}),  # an uneven split of 33 keys
        (_both_empty, {}),  # both empty: o = 0, lse = -inf, no NaN
        ((torch.zeros(4, 8), torch.full((4,), NEG_INF), randn(4, 8, seed=121), randn(4, seed=122)), {}),  # first empty
        ((randn(2, 3, 8, seed=123), randn(2, 3, seed=124) + 200.0, randn(2, 3, 8, seed=125),
          randn(2, 3, seed=126) + 190.0), {}),  # exp(lse) would overflow fp32
        ((randn(2, 3, 8, seed=127), randn(2, 3, seed=128) * 30.0, randn(2, 3, 8, seed=129),
          randn(2, 3, seed=131) * 30.0), {}),  # one side dominates
    ],
    "gather_paged_kv": [
        ((_cache, shuffled_table(9, seed=132), 1), {}),  # one token
        ((_cache, shuffled_table(9, seed=133), 0), {}),  # empty sequence -> [0, Hkv, D]
        ((_cache, torch.tensor([7, 7, 2, 5, -1, -1], dtype=torch.int32), 37), {}),  # a repeated block id, table padded with -1
        ((_cache, torch.tensor([4, 0, 8, 10**6, 10**6], dtype=torch.int32), 40), {}),  # padding is not a valid block id
        ((_cache, torch.tensor([8, 1, 0, 2, 6, 3, 5, 4, 7], dtype=torch.int32), 144), {}),  # every block, full
        ((paged_cache(4, 1, 1, 2, seed=134), torch.tensor([2, 0, 3], dtype=torch.int32), 3), {}),  # block_size 1
    ],
    "build_cu_seqlens": [
        (([],), {}),
        (([1],), {}),
        (((2048, 2048, 2048, 1, 0, 7),), {}),
        ((torch.tensor([4, 4, 4], dtype=torch.int32),), {}),
        (([0, 0, 0],), {}),
    ],
    "flash_attention": [
        (qkv(1, 2, 2, 1, 1, 16, seed=140), {"causal": True}),  # a single token
        (qkv(2, 2, 2, 17, 17, 64, seed=141), {"causal": True}),  # odd length, D=64
        (qkv(1, 6, 2, 100, 100, 32, seed=142), {"causal": False}),  # GQA group of 3, two query tiles
        (qkv(1, 4, 1, 5, 37, 16, seed=143), {"causal": True}),  # MQA, fewer queries than keys: bottom-right causal
        (qkv(1, 2, 1, 20, 8, 16, seed=144), {"causal": True}),  # more queries than keys: first rows see no key
        (qkv(1, 2, 2, 33, 70, 16, seed=145), {"causal": False}),  # Nq != Nk, not causal
    ],
})
