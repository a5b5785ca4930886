"""KV eviction (llmso_lab.kv.evict): keep-sets against brute-force definitions, PyramidKV budgets, and pruned-cache
generation against independent references (HF generate; a full-sequence forward with the evicted tokens masked)."""
import copy
import math

import pytest
import torch

from llmso_lab.kv.evict import (METHODS, compress_prefill, generate_compressed, greedy_continue, h2o_keep,
                                pyramid_budgets, snapkv_keep, snapkv_scores, streaming_keep)
from llmso_lab.models.tiny import tiny_llama


def test_streaming_keep_is_sinks_plus_recent():
    for T, budget, sink in [(10, 6, 4), (100, 30, 4), (50, 50, 4), (20, 64, 4), (9, 3, 0), (17, 5, 1)]:
        want = sorted(set(range(min(sink, T))) | set(range(max(T - (budget - sink), 0), T)))
        assert streaming_keep(T, budget, sink).tolist() == want
    with pytest.raises(ValueError, match="num_sink"):
        streaming_keep(100, 4, num_sink=4)


def test_h2o_keep_is_recent_plus_heavy_hitters():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 40, generator=g)
    keep = h2o_keep(scores, budget=12, recent=5)
    assert keep.shape == (3, 12)
    for h in range(3):
        earlier = sorted(range(35), key=lambda t: -float(scores[h, t]))[:7]
        assert keep[h].tolist() == sorted(earlier + list(range(35, 40)))
    assert h2o_keep(scores, budget=40, recent=5).tolist() == [list(range(40))] * 3
    with pytest.raises(ValueError, match="recent"):
        h2o_keep(scores, budget=4, recent=5)


def _brute_votes(q_obs, k):
    """Window votes by loops: mean over window queries and over the query heads of a KV head of the causal softmax."""
    H, W, D = q_obs.shape
    Hkv, T, _ = k.shape
    G = H // Hkv
    votes = torch.zeros(Hkv, T, dtype=torch.float64)
    for h in range(H):
        for w in range(W):
            pos = T - W + w
            logits = [float(q_obs[h, w] @ k[h // G, t]) / math.sqrt(D) for t in range(pos + 1)]
            m = max(logits)
            z = sum(math.exp(x - m) for x in logits)
            for t in range(pos + 1):
                votes[h // G, t] += math.exp(logits[t] - m) / z / (W * G)
    return votes


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_keep_matches_definition(pooling):
    g = torch.Generator().manual_seed(1)
    H, Hkv, T, W, D, budget, ks = 6, 2, 30, 4, 8, 12, 5
    q_obs, k = torch.randn(H, W, D, generator=g), torch.randn(Hkv, T, D, generator=g)
    votes = _brute_votes(q_obs, k)
    torch.testing.assert_close(snapkv_scores(q_obs, k).double(), votes, atol=1e-6, rtol=1e-5)
    keep = snapkv_keep(q_obs, k, budget, W, kernel_size=ks, pooling=pooling)
    assert keep.shape == (Hkv, budget)
    for h in range(Hkv):   # pooled score per prefix token; the kept ones must be a top set (ties allowed)
        win = lambda t: [votes[h, s] for s in range(t - ks // 2, t + ks // 2 + 1) if 0 <= s < T]
        pooled = [max(win(t)) if pooling == "max" else sum(win(t)) / ks for t in range(T - W)]
        kept = keep[h].tolist()
        assert kept == sorted(set(kept)) and kept[-W:] == list(range(T - W, T))
        chosen, rest = kept[:-W], [t for t in range(T - W) if t not in kept]
        assert min(pooled[t] for t in chosen) >= max(pooled[t] for t in rest) - 1e-7
    with pytest.raises(ValueError, match="window"):
        snapkv_keep(q_obs, k, budget, window=W + 1)


def test_pyramid_budgets_decrease_and_sum():
    for L, total, beta in [(30, 30 * 51, 20), (30, 30 * 240, 20), (4, 103, 2), (1, 7, 20), (12, 12 * 10, 1)]:
        b = pyramid_budgets(L, total, beta)
        assert sum(b) == total and len(b) == L
        assert all(x >= y for x, y in zip(b, b[1:]))
        avg = total / L
        exact = [2 * avg - avg / beta - l * (2 * avg - 2 * avg / beta) / max(L - 1, 1) for l in range(L)]
        assert all(abs(x - e) < 1 for x, e in zip(b, exact)) if L > 1 else b == [total]
    capped = pyramid_budgets(30, 30 * 400, 20, max_per_layer=496)
    assert max(capped) <= 496 and sum(capped) == 30 * 400 and capped[0] > capped[-1]
    with pytest.raises(ValueError):
        pyramid_budgets(4, 100, 20, max_per_layer=20)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = tiny_llama(num_layers=3)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    return model, ids


def test_budget_equal_to_length_equals_unpruned_generation(tiny):
    model, ids = tiny
    ref = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, 40:].tolist()
    for method in METHODS:
        for aware in (True, False):   # the hooks run and gather every token: the cache must come out unchanged
            out = generate_compressed(model, ids[:, :32], ids[:, 32:], method, 40 if aware else 32,
                                      question_aware=aware, max_new_tokens=10, window=8)
            assert out == ref, (method, aware)


def _masked_reference(model, ids, keep, n_ctx, n_new):
    """Greedy decoding over the full sequence where tokens after the context cannot see evicted context tokens."""
    seq = ids[0].tolist()
    evicted = torch.ones(n_ctx, dtype=torch.bool)
    evicted[keep] = False
    for _ in range(n_new):
        S = len(seq)
        allow = torch.ones(S, S).tril().bool()
        allow[n_ctx:, :n_ctx] &= ~evicted
        mask = torch.zeros(S, S).masked_fill(~allow, float("-inf"))[None, None]
        seq.append(int(model(input_ids=torch.tensor([seq]), attention_mask=mask).logits[0, -1].argmax()))
    return seq[ids.shape[1]:]


def test_streaming_pruned_cache_keeps_original_positions(tiny):
    model, ids = tiny
    want = _masked_reference(model, ids, streaming_keep(32, 12), 32, 6)
    cache, _ = compress_prefill(model, ids[:, :32], "streaming", 12)
    assert [cache.get_seq_length(i) for i in range(3)] == [12] * 3
    hf_cache = copy.deepcopy(cache)
    assert greedy_continue(model, cache, ids[:, 32:], 32, 6) == want
    # HF generate() from the pruned cache: pass only the new ids, their true positions, and a mask as long as
    # cache + new ids (a mask as long as the ids makes generate() drop `cache length` ids from the front).
    out = model.generate(ids[:, 32:], cache=hf_cache, position_ids=torch.arange(32, 40)[None], do_sample=False,
                         attention_mask=torch.ones(1, 12 + 8, dtype=torch.long), max_new_tokens=6, min_new_tokens=6)
    assert out[0, 8:].tolist() == want


def test_snapkv_and_h2o_prune_to_the_keep_set_of_the_true_attention(tiny):
    model, ids = tiny
    full = model(input_ids=ids, output_attentions=True, use_cache=True)
    for method in ("snapkv", "h2o"):
        cache, _ = compress_prefill(model, ids, method, 20, window=8)
        for i, attn in enumerate(full.attentions):                   # eager attention weights [1, H, T, T]
            a = attn[0].view(2, 2, 40, 40).mean(1)                   # GQA: 4 query heads on 2 KV heads
            if method == "snapkv":
                votes = torch.nn.functional.max_pool1d(a[:, -8:].mean(1)[None], 7, 1, 3)[0]
            else:
                votes = a.sum(1)
            keep = torch.cat([votes[:, :32].topk(12, dim=-1).indices, torch.arange(32, 40).expand(2, 8)], 1).sort(-1).values
            want = full.past_key_values.layers[i].keys[0].gather(1, keep[..., None].expand(-1, -1, 16))
            torch.testing.assert_close(cache.layers[i].keys[0], want, atol=1e-5, rtol=1e-5)


def test_pyramidkv_layers_shrink_and_decode(tiny):
    model, ids = tiny
    cache, _ = compress_prefill(model, ids, "pyramidkv", 20, window=8)
    lengths = [cache.get_seq_length(i) for i in range(3)]
    assert sum(lengths) == 60 and lengths[0] > lengths[1] > lengths[2] >= 8
    with pytest.raises(ValueError, match="sdpa"):
        greedy_continue(model, cache, ids[:, -1:], 40, 2)
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    assert len(greedy_continue(sdpa, cache, ids[:, -3:], 40, 4)) == 4


@pytest.mark.slow
def test_smollm2_answers_the_needle_with_full_cache():
    from llmso_lab.kv.needle import make_needle, needle_correct, needle_ids
    from llmso_lab.models.registry import load_model

    model, tok = load_model("smollm2-135m")
    needle = make_needle(tok, 512, depth=0.5, seed=0)
    ctx, q = needle_ids(tok, needle)
    assert 480 <= ctx.shape[1] + q.shape[1] <= 512
    out = generate_compressed(model, ctx, q, "full", 0, question_aware=False, max_new_tokens=6)
    ref = model.generate(torch.cat([ctx, q], 1), max_new_tokens=6, do_sample=False)[0, -6:].tolist()
    assert out == ref
    assert needle_correct(tok.decode(out), needle), tok.decode(out)
