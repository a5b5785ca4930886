"""Expert parallelism (MoE all_to_all) and context parallelism (ring attention), lecture 2-2.

Pure pieces are checked against brute force, exact formulas and Hugging Face's Mixtral router and experts.
The multi-process parts run in two launches (2 and 4 ranks), each doing every EP and ring case at once, and
are checked against the single-process HF model and torch SDPA.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from llmso_lab.models.tiny import tiny_mixtral
from llmso_lab.parallel.launcher import launch
from llmso_lab.parallel.moe import (dispatch_indices, ep_job, ep_rank_forward, expert_capacity, expert_load,
                                    expert_mlp, expert_parallel_forward, gather_ep, route_topk, routing_load_report)
from llmso_lab.parallel.ring import (contiguous_split, gather_ring, ring_attention, ring_attention_step, ring_case,
                                     ring_rank, zigzag_split)


def _ids(batch, seq, seed=0, vocab=256):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _qkv(h, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(h, n, d, generator=g) for _ in range(3))


# ---- pure MoE pieces ---------------------------------------------------------------------------------

def test_route_topk_matches_the_hf_mixtral_router():
    model = tiny_mixtral(num_experts=8, experts_per_token=3)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(1))
    logits, scores, indices = gate(x)
    weights, experts = route_topk(logits, 3)
    assert torch.equal(experts, indices)
    torch.testing.assert_close(weights, scores, atol=0, rtol=0)
    # brute force: a softmax over the k largest logits is the same distribution
    top = logits.topk(3, dim=-1)
    torch.testing.assert_close(weights, torch.softmax(top.values, -1), atol=1e-6, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(50))
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        route_topk(logits, 9)


def test_expert_capacity_formula():
    assert expert_capacity(64, 4, 2, 1.0) == 32
    assert expert_capacity(64, 4, 2, 1.25) == 40
    assert expert_capacity(10, 4, 2, 1.0) == 5       # ceil(20 / 4)
    assert expert_capacity(10, 8, 2, 1.0) == 3       # ceil(2.5)
    assert expert_capacity(7, 3, 1, 1.5) == math.ceil(1.5 * 7 / 3)
    assert expert_capacity(10, 4, 2, None) == expert_capacity(10, 4, 2, float("inf")) == 20
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        expert_capacity(10, 4, 2, 0.0)
    with pytest.raises(ValueError, match="top_k <= num_experts"):
        expert_capacity(10, 4, 5, 1.0)


def _dispatch_brute_force(experts, capacity):
    filled, slot = {}, []
    for row in experts.tolist():
        out = []
        for e in row:
            pos = filled.get(e, 0)
            filled[e] = pos + 1
            out.append(pos if capacity is None or pos < capacity else -1)
        slot.append(out)
    return torch.tensor(slot, dtype=torch.long).view(experts.shape)


def test_dispatch_indices_match_brute_force():
    assert dispatch_indices(torch.tensor([[0, 1], [1, 2], [1, 0], [1, 2]]), 3, 2).tolist() == \
        [[0, 0], [1, 0], [-1, 1], [-1, 1]]   # expert 1 is full after tokens 0 and 1
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        T, E, k = int(torch.randint(1, 40, (1,), generator=g)), 6, 2
        experts = torch.rand(T, E, generator=g).topk(k, -1).indices
        if trial % 2:   # skewed routing: most choices go to expert 0 or 1
            experts = torch.where(torch.rand(T, k, generator=g) < 0.7, experts % 2, experts)
        for cap in (0, 1, 3, expert_capacity(T, E, k, 1.0), None):
            slot = dispatch_indices(experts, E, cap)
            assert torch.equal(slot, _dispatch_brute_force(experts, cap))
            # drops per expert are exactly the load above capacity
            load = expert_load(experts, E)
            assert int((slot < 0).sum()) == (0 if cap is None else int((load - cap).clamp(min=0).sum()))
        assert expert_load(experts, E).tolist() == [int((experts == e).sum()) for e in range(E)]
    with pytest.raises(ValueError, match="expert ids must be in 0..3"):
        dispatch_indices(torch.tensor([[0, 4]]), 4, 2)
    with pytest.raises(ValueError, match=r"\[tokens, top_k\]"):
        dispatch_indices(torch.tensor([0, 1]), 4, 2)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        dispatch_indices(torch.tensor([[0, 1]]), 4, -1)


def test_pure_pieces_rebuild_the_hf_moe_block():
    model = tiny_mixtral(num_experts=4, experts_per_token=2, seed=2)
    block = model.model.layers[1].mlp
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = block(x).view(-1, 64)
        flat = x.view(-1, 64)
        weights, experts = route_topk(F.linear(flat, block.gate.weight), 2)
        y = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for j in range(2):
                e = int(experts[t, j])
                y[t] += weights[t, j] * expert_mlp(flat[t:t + 1], block.experts.gate_up_proj[e],
                                                   block.experts.down_proj[e])[0]
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_routing_load_report_counts_and_drop_fractions():
    model = tiny_mixtral()
    ids = _ids(4, 16)
    rep = routing_load_report(model, ids, groups=2)
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    for layer, logits in enumerate(router_logits):
        top = torch.softmax(logits, -1).topk(2, -1).indices
        load = torch.stack([(top == e).sum() for e in range(4)])
        assert rep["tokens_per_expert"][layer] == load.tolist() and sum(load.tolist()) == 128
        assert rep["imbalance"][layer] == pytest.approx(float(load.max()) / 32)
        for cf in (1.0, 1.25, 1.5, 2.0):   # per group of 2 sequences: drops = load above capacity
            cap = math.ceil(cf * 32 * 2 / 4)
            drops = sum(int((torch.stack([(g == e).sum() for e in range(4)]) - cap).clamp(min=0).sum())
                        for g in top.chunk(2))
            assert rep["dropped_fraction"][cf][layer] == drops / 128
    assert rep["dropped_fraction"][1.0][0] > rep["dropped_fraction"][2.0][0] == 0.0
    with pytest.raises(ValueError, match="groups must divide"):
        routing_load_report(model, ids, groups=3)


# ---- pure ring pieces ----------------------------------------------------------------------------------

def test_splits_partition_the_sequence():
    assert [p.tolist() for p in zigzag_split(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [p.tolist() for p in contiguous_split(6, 3)] == [[0, 1], [2, 3], [4, 5]]
    for n, w in ((12, 3), (32, 4), (2, 1)):
        for parts in (zigzag_split(n, w), contiguous_split(n, w)):
            assert sorted(torch.cat(parts).tolist()) == list(range(n))
            assert len({len(p) for p in parts}) == 1
    with pytest.raises(ValueError, match="divisible by 8"):
        zigzag_split(12, 4)
    with pytest.raises(ValueError, match="divisible by 3"):
        contiguous_split(10, 3)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        zigzag_split(8, 0)


def test_ring_attention_step_over_any_blocks_is_exact():
    q, k, v = _qkv(3, 20, 8, seed=5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.Generator().manual_seed(6)
    q_pos = torch.randperm(20, generator=g)[:7]   # any queries, any key blocks, any order
    blocks = torch.randperm(20, generator=g).chunk(4)
    o, lse = torch.zeros(3, 7, 8), torch.full((3, 7), float("-inf"))
    for k_pos in blocks:
        o, lse = ring_attention_step(o, lse, q[:, q_pos], k[:, k_pos], v[:, k_pos], q_pos, k_pos, 8 ** -0.5)
        assert not o.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(o, ref[:, q_pos], atol=1e-5, rtol=1e-5)
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5 + torch.full((20, 20), float("-inf")).triu(1)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1)[:, q_pos], atol=1e-5, rtol=1e-5)
    # a block entirely in the future: rows see nothing, state unchanged, no NaN
    q_pos = torch.arange(4)
    o0, lse0 = torch.zeros(3, 4, 8), torch.full((3, 4), float("-inf"))
    o1, lse1 = ring_attention_step(o0, lse0, q[:, :4], k[:, 10:14], v[:, 10:14], q_pos, torch.arange(10, 14), 0.3)
    assert torch.equal(o1, o0) and torch.equal(lse1, lse0)
    o2, lse2 = ring_attention_step(o, lse, q[:, :7], k[:, 10:14], v[:, 10:14], torch.arange(7), torch.arange(10, 14), 0.3)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)   # a running state is kept as it is


# ---- multi-process: one launch per world size does every EP and ring case ---------------------------

def _rank_checks(rank, world_size, ep_jobs, ring_cases):
    return ep_rank_forward(rank, world_size, ep_jobs), ring_rank(rank, world_size, ring_cases)


def _run(world_size, ep_jobs, ring_cases):
    per_rank = launch(_rank_checks, world_size, args=(ep_jobs, ring_cases), timeout_s=180)
    return gather_ep([r[0] for r in per_rank]), gather_ring([r[1] for r in per_rank], ring_cases)


def _hf(model, ids):
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return out.logits, [route_topk(logits, k)[1] for logits in out.router_logits]


def _check_no_drop(logits, stats, model, ids, world_size):
    ref, routing = _hf(model, ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    E, H = model.config.num_local_experts, model.config.hidden_size
    tokens_per_rank = ids.numel() // world_size
    for layer, experts in zip(stats, routing):
        assert layer.dropped == 0 and layer.routed == layer.kept == expert_load(experts, E).tolist()
        assert layer.imbalance == max(layer.routed) / (sum(layer.routed) / E)
        # rows crossing a link: choices whose expert lives on another rank than the token
        owner = experts // (E // world_size)
        home = torch.arange(ids.numel())[:, None] // tokens_per_rank
        assert layer.dispatch_bytes == layer.combine_bytes == int((owner != home).sum()) * H * 4


def _check_drops(logits, stats, model, ids, world_size, cf):
    """Layer-0 drops equal dispatch_indices on HF's routing, per rank; a 1-layer model's logits differ
    from HF's exactly at the tokens that lost a choice."""
    ref, routing = _hf(model, ids)
    E, k = model.config.num_local_experts, model.config.num_experts_per_tok
    groups = routing[0].chunk(world_size)
    cap = expert_capacity(groups[0].shape[0], E, k, cf)
    slots = torch.cat([dispatch_indices(g, E, cap) for g in groups])
    assert stats[0].dropped == int((slots < 0).sum()) > 0
    assert stats[0].capacity == [cap] * world_size
    assert stats[0].kept == [int(((routing[0] == e) & (slots >= 0)).sum()) for e in range(E)]
    if model.config.num_hidden_layers == 1:
        lost = (slots < 0).any(-1).view(ids.shape)
        differs = (logits - ref).abs().amax(-1) > 1e-4
        assert torch.equal(differs, lost)
        torch.testing.assert_close(logits[~lost], ref[~lost], atol=1e-5, rtol=1e-5)


def test_two_ranks_expert_parallel_and_ring_attention():
    full = tiny_mixtral()
    one_layer = tiny_mixtral(num_layers=1, seed=3)
    with torch.no_grad():   # skew the router: expert 0 also scores what expert 1 scores
        one_layer.model.layers[0].mlp.gate.weight[0] += one_layer.model.layers[0].mlp.gate.weight[1]
    ids, ids_long = _ids(4, 16), _ids(2, 40, seed=1)
    ep_jobs = [ep_job(full, ids, 2), ep_job(one_layer, ids_long, 2, 1.0), ep_job(full, ids, 2, 1.0)]
    shapes = [(2, 8, 4), (3, 20, 8), (4, 36, 16)]
    ring_cases = [ring_case(*_qkv(*s, seed=i), 2, split) for i, s in enumerate(shapes)
                  for split in ("zigzag", "contiguous")]
    ep, ring = _run(2, ep_jobs, ring_cases)
    _check_no_drop(*ep[0], full, ids, 2)
    for layer in ep[0][1]:   # each rank timed its all-to-alls and its experts in every layer
        assert len(layer.all_to_all_s) == len(layer.expert_s) == 2 and min(layer.all_to_all_s + layer.expert_s) > 0
    _check_drops(*ep[1], one_layer, ids_long, 2, 1.0)
    _check_drops(*ep[2], full, ids, 2, 1.0)
    _check_ring(ring, ring_cases, 2)


def test_four_ranks_expert_parallel_and_ring_attention():
    eight = tiny_mixtral(num_experts=8, experts_per_token=2, seed=1)
    ids = _ids(4, 12, seed=2)
    ep_jobs = [ep_job(eight, ids, 4), ep_job(eight, ids, 4, 1.25)]
    shapes = [(1, 16, 4), (4, 40, 8), (2, 64, 16)]
    ring_cases = [ring_case(*_qkv(*s, seed=10 + i), 4, split) for i, s in enumerate(shapes)
                  for split in ("zigzag", "contiguous")]
    ep, ring = _run(4, ep_jobs, ring_cases)
    _check_no_drop(*ep[0], eight, ids, 4)
    _check_drops(*ep[1], eight, ids, 4, 1.25)
    _check_ring(ring, ring_cases, 4)


def _check_ring(results, cases, world_size):
    for (o, stats), (q, k, v, split) in zip(results, cases):
        torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)
        n = q.shape[1]
        positions = zigzag_split(n, world_size) if split == "zigzag" else contiguous_split(n, world_size)
        # pairs a rank computes = sum over its queries of (position + 1) keys
        assert stats["pairs"] == [int((p + 1).sum()) for p in positions]
        assert sum(stats["pairs"]) == n * (n + 1) // 2
        assert stats["bytes_sent"] == [(world_size - 1) * 2 * q.numel() // world_size * 4] * world_size
        c = n // world_size
        if split == "zigzag":   # balanced, nothing fully masked
            assert len(set(stats["pairs"])) == 1 and stats["skipped_blocks"] == [0] * world_size
        else:                   # rank r skips the W-1-r blocks of later ranks; last rank ~ (2W-1)x the first
            assert stats["skipped_blocks"] == [world_size - 1 - r for r in range(world_size)]
            assert stats["block_pairs"] == [c * c * (r + 1) for r in range(world_size)]
            assert stats["pairs"][-1] / stats["pairs"][0] == pytest.approx((c * c * (world_size - 1) + c * (c + 1) / 2) / (c * (c + 1) / 2))


def test_bad_inputs_fail_before_launching():
    model = tiny_mixtral()   # 4 experts
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3 ranks"):
        expert_parallel_forward(model, _ids(3, 8), 3)
    with pytest.raises(ValueError, match="B divisible by world_size=2"):
        expert_parallel_forward(model, _ids(3, 8), 2)
    q, k, v = _qkv(2, 12, 4, seed=0)
    with pytest.raises(ValueError, match="zigzag split needs seq_len divisible by 8"):
        ring_attention(q, k, v, 4)
    with pytest.raises(ValueError, match="split must be 'zigzag' or 'contiguous'"):
        ring_attention(q, k, v, 2, split="striped")
    with pytest.raises(ValueError, match="same shape"):
        ring_attention(q, k[:1], v, 2)
