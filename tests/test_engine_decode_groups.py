"""The torch backend's decode in groups of similar context length: same attention as one padded batch,
and `length_groups` picks the cheapest split."""
import itertools

import pytest
import torch

from llmso_lab.engine.attention import AttentionMetadata, TorchAttentionBackend
from llmso_lab.engine.decode_groups import length_groups


def _decode_batch(ctx, H=6, Hkv=2, D=16, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, nblocks = len(ctx), sum(-(-c // bs) for c in ctx) + 5
    kc, vc = torch.randn(nblocks + 1, bs, Hkv, D, generator=g), torch.randn(nblocks + 1, bs, Hkv, D, generator=g)
    perm, tables = torch.randperm(nblocks, generator=g).tolist(), []
    for c in ctx:   # scattered blocks, as after some allocations and frees
        tables.append(perm[:-(-c // bs)])
        perm = perm[-(-c // bs):]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(B, dtype=torch.long),
        block_tables=torch.tensor([t + [nblocks] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0] + ctx).cumsum(0).int(), num_decodes=B, max_seqlen_q=1, max_seqlen_k=max(ctx),
        start_positions=[c - 1 for c in ctx], query_lens=[1] * B, context_lens_host=list(ctx))
    q = torch.randn(B, H, D, generator=g)
    ref = []
    for i, c in enumerate(ctx):   # independent reference: each sequence alone, K/V repeated per query head
        k = kc[tables[i]].reshape(-1, Hkv, D)[:c].repeat_interleave(H // Hkv, 1)
        v = vc[tables[i]].reshape(-1, Hkv, D)[:c].repeat_interleave(H // Hkv, 1)
        p = (torch.einsum("hd,khd->hk", q[i], k) * D ** -0.5).softmax(-1)
        ref.append(torch.einsum("hk,khd->hd", p, v))
    return q, kc, vc, meta, torch.stack(ref), (H, Hkv, D, bs)


@pytest.mark.parametrize("ctx", [[3, 40, 41, 9, 17, 64, 5, 33], [7], [12, 12, 12], [1, 2, 100, 101, 3]])
@pytest.mark.parametrize("group_cost", [0, 2, 10**6, None])
def test_grouped_decode_matches_per_sequence_attention(ctx, group_cost):
    q, kc, vc, meta, ref, (H, Hkv, D, bs) = _decode_batch(ctx)
    backend = TorchAttentionBackend(H, Hkv, D, bs)
    backend.decode_group_cost = group_cost
    backend.plan(meta)
    out = backend.forward(q, None, None, kc, vc, meta)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    groups = backend._memo["decode_groups"]
    assert sorted(r for g in groups for r in g.rows.tolist()) == list(range(len(ctx)))
    if group_cost == 0:   # free groups: every distinct block count gets its own, nothing padded beyond a block
        assert len(groups) == len({-(-c // bs) for c in ctx})
    if group_cost is None:   # the reference: one group, every row padded to the longest
        assert len(groups) == 1 and groups[0].rows.tolist() == list(range(len(ctx)))


def _cost(lengths, groups, group_cost):
    return sum(len(g) * max(lengths[r] for r in g) + group_cost for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_length_groups_is_the_cheapest_split(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(1, 50, (n,), generator=g).tolist()
    group_cost = int(torch.randint(0, 60, (1,), generator=g))
    groups = length_groups(lengths, group_cost)
    assert sorted(r for grp in groups for r in grp) == list(range(n))
    order = sorted(range(n), key=lengths.__getitem__)
    best = min(   # brute force over every way to cut the sorted order
        _cost(lengths, [order[a:b] for a, b in zip((0,) + cuts, cuts + (n,))], group_cost)
        for k in range(n) for cuts in itertools.combinations(range(1, n), k))
    assert _cost(lengths, groups, group_cost) == best


def test_length_groups_keeps_close_lengths_together():
    assert length_groups([10, 11, 10, 12], group_cost=8) == [[0, 2, 1, 3]]
    assert length_groups([2, 40, 3, 41], group_cost=8) == [[0, 2], [1, 3]]
