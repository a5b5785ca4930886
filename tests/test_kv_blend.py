"""Cache blending (llmso_lab.kv.blend): RoPE re-rotation against keys computed in place, ratio 1 against a full
prefill, ratio 0 against plain concatenation run through Hugging Face's own forward, where deviations are zero,
that selection picks the top deviations, and the FLOP count against the cost model."""
import pytest
import torch

from llmso_lab.hardware import ACCELERATORS
from llmso_lab.kv.blend import (blend, deviation_by_layer, full_prefill, greedy_answer, kv_deviation, prefill_kv,
                                rag_prompt, rerotate_keys, select_tokens)
from llmso_lab.kv.evict import cache_kwarg
from llmso_lab.models.shapes import ModelShape
from llmso_lab.models.tiny import tiny_llama
from llmso_lab.sim.cost import StepCost

MODEL = tiny_llama(num_layers=3, seed=0)
INV_FREQ = MODEL.model.rotary_emb.inv_freq


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


PREFIX, CHUNKS, QUESTION = _ids(4, 1), [_ids(7, 2), _ids(9, 3), _ids(5, 4)], _ids(3, 5)
IDS = torch.cat([PREFIX, *CHUNKS, QUESTION], dim=1)
T, P, Q = IDS.shape[1], PREFIX.shape[1], QUESTION.shape[1]


def test_rerotation_moves_layer0_keys_exactly():
    chunk = CHUNKS[1]
    at0 = prefill_kv(MODEL, chunk, start=0)
    for p in (1, 11, 300):
        at_p = prefill_kv(MODEL, chunk, start=p)
        # layer 0: K depends only on the token and its position, V only on the token
        torch.testing.assert_close(rerotate_keys(at0[0][0], p, INV_FREQ), at_p[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(at0[0][1], at_p[0][1])
        # deeper layers too: RoPE scores depend only on relative positions, so a chunk shifted as a whole computes
        # the same hidden states; what re-rotation cannot fix is the context a chunk never saw
        for l in (1, 2):
            torch.testing.assert_close(rerotate_keys(at0[l][0], p, INV_FREQ), at_p[l][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(at0[l][1], at_p[l][1], atol=1e-4, rtol=1e-4)
    k = at0[0][0]
    torch.testing.assert_close(rerotate_keys(k, 0, INV_FREQ), k)
    torch.testing.assert_close(rerotate_keys(rerotate_keys(k, 5, INV_FREQ), 7, INV_FREQ), rerotate_keys(k, 12, INV_FREQ),
                               atol=1e-5, rtol=1e-5)
    per_token = torch.arange(k.shape[2])     # a per-token delta: token t moves t places
    manual = torch.stack([rerotate_keys(k[:, :, t:t + 1], t, INV_FREQ)[:, :, 0] for t in range(k.shape[2])], dim=2)
    torch.testing.assert_close(rerotate_keys(k, per_token, INV_FREQ), manual)
    with pytest.raises(ValueError, match="head_dim / 2"):
        rerotate_keys(k, 1, INV_FREQ[:-1])


def test_ratio_one_is_full_prefill_and_ratio_zero_is_plain_concatenation():
    full_cache, full_logits = full_prefill(MODEL, IDS)
    b1 = blend(MODEL, PREFIX, CHUNKS, QUESTION, 1.0)
    torch.testing.assert_close(b1.logits, full_logits, atol=1e-5, rtol=1e-5)
    assert deviation_by_layer(full_cache, b1.cache, 0, T).max() < 1e-5
    assert b1.recompute_fraction == 1.0 and b1.flops == pytest.approx(b1.full_flops)
    # the same greedy continuation from both caches
    assert greedy_answer(MODEL, b1.cache, b1.logits, T, 4) == greedy_answer(MODEL, full_cache, full_logits, T, 4)

    # ratio 0: stored chunk KVs re-rotated behind the prefix, then HF's own forward runs the question over them
    from transformers import DynamicCache
    plain = DynamicCache(config=MODEL.config)
    pre = prefill_kv(MODEL, PREFIX)
    stored = [prefill_kv(MODEL, c) for c in CHUNKS]
    starts = [P, P + 7, P + 16]
    for l in range(3):
        plain.update(torch.cat([pre[l][0]] + [rerotate_keys(s[l][0], o, INV_FREQ) for s, o in zip(stored, starts)], 2),
                     torch.cat([pre[l][1]] + [s[l][1] for s in stored], 2), l)
    ref = MODEL(input_ids=QUESTION, position_ids=torch.arange(T - Q, T)[None], use_cache=True,
                **{cache_kwarg(MODEL): plain}).logits[0, -1]
    b0 = blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.0, chunk_kv=stored)
    torch.testing.assert_close(b0.logits, ref, atol=1e-5, rtol=1e-5)
    assert b0.selected.numel() == 0 and b0.flops < b1.flops
    assert not torch.allclose(b0.logits, full_logits, atol=1e-3)   # concatenation alone is not exact here


def test_where_the_deviation_is_zero():
    # no prefix: the first chunk is computed at its own place with nothing before it -> exact in every layer
    full_cache, _ = full_prefill(MODEL, torch.cat([*CHUNKS, QUESTION], dim=1))
    b0 = blend(MODEL, PREFIX[:, :0], CHUNKS, QUESTION, 0.0)
    dev = deviation_by_layer(full_cache, b0.cache, 0, 21)          # [L, chunk tokens]
    assert dev[:, :7].max() < 1e-5     # first chunk: fp32 rounding only (matmuls of another length; 1.05e-6 seen)
    assert dev[0].max() < 1e-5                                      # layer 0: re-rotation is exact
    assert dev[1:, 7:].min(dim=1).values.gt(0).all() and dev[1:, 7:].max() > 0.05   # later chunks deviate
    # behind a prefix the first chunk misses the prefix from layer 1 on
    full_cache, _ = full_prefill(MODEL, IDS)
    dev = deviation_by_layer(full_cache, blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.0).cache, P, T - Q)
    assert dev[0].max() < 1e-5 and dev[1, :7].max() > 0.05


def test_selection_picks_the_top_deviations():
    g = torch.Generator().manual_seed(0)
    dev = torch.rand(50, generator=g)
    for ratio in (0.0, 0.05, 0.1, 0.37, 1.0):
        k = int(ratio * 50 + 0.5)
        want = sorted(sorted(range(50), key=lambda t: -float(dev[t]))[:k])
        assert select_tokens(dev, ratio).tolist() == want
    assert select_tokens(torch.zeros(4), 0.5).tolist() == [0, 1]        # ties: the earlier tokens
    # in blend: layer 0 is recomputed in full, so layer 1's fresh V is the full prefill's; the selection is the
    # top ratio of the layer-1 deviation between the full prefill and the stored (plain) cache
    full_cache, _ = full_prefill(MODEL, IDS)
    plain = blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.0).cache
    for on, layer_dev in (("v", deviation_by_layer(full_cache, plain, P, T - Q, "v")[1]),
                          ("k", deviation_by_layer(full_cache, plain, P, T - Q, "k")[1])):
        for ratio in (0.2, 0.5):
            b = blend(MODEL, PREFIX, CHUNKS, QUESTION, ratio, on=on)
            assert (b.selected - P).tolist() == select_tokens(layer_dev, ratio).tolist()
            assert b.recompute_fraction == pytest.approx(int(ratio * 21 + 0.5) / 21)
    # the random control selects as many tokens, others than the top deviations (for a seed), all of them at 1
    b, r = blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.2), blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.2, select="random")
    assert r.selected.numel() == b.selected.numel() and r.selected.tolist() != b.selected.tolist()
    torch.testing.assert_close(blend(MODEL, PREFIX, CHUNKS, QUESTION, 1.0, select="random").logits,
                               full_prefill(MODEL, IDS)[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="select"):
        blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.2, select="top")
    # a direct check of kv_deviation: relative L2 over heads and dims, per token
    new, old = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    want = [float((new[0, :, t] - old[0, :, t]).norm() / new[0, :, t].norm()) for t in range(5)]
    assert kv_deviation(new, old).tolist() == pytest.approx(want, rel=1e-5)


def test_flop_count_matches_the_cost_model():
    b = blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.5)
    cost = StepCost(ACCELERATORS["H100-SXM"], ModelShape.from_hf_config(MODEL.config))
    # chunks + question prefilled behind the cached prefix, without the logits head
    assert b.full_flops == pytest.approx(cost.work([(T - P, P)])[0] - 2 * cost.model.head_params, rel=1e-9)
    flops = [blend(MODEL, PREFIX, CHUNKS, QUESTION, r).flops for r in (0.0, 0.2, 0.5, 1.0)]
    assert flops == sorted(flops) and flops[0] < 0.5 * flops[-1]


def test_bad_inputs():
    with pytest.raises(ValueError, match="ratio must be in"):
        blend(MODEL, PREFIX, CHUNKS, QUESTION, 1.5)
    with pytest.raises(ValueError, match="select_layer"):
        blend(MODEL, PREFIX, CHUNKS, QUESTION, 0.1, select_layer=3)
    with pytest.raises(ValueError, match="question_ids"):
        blend(MODEL, PREFIX, CHUNKS, QUESTION[:, :0], 0.1)
    with pytest.raises(ValueError, match="one shape"):
        kv_deviation(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4, 4))


@pytest.mark.slow
def test_smollm2_rag_prompt_and_full_recompute():
    from llmso_lab.models.registry import load_model

    model, tok = load_model("smollm2-135m")
    prefix, chunks, question, needle = rag_prompt(tok, 256, 0.5, num_chunks=3, seed=0)
    assert len(chunks) == 3 and sum(needle.answer in tok.decode(c[0]) for c in chunks) == 1
    ids = torch.cat([prefix, *chunks, question], dim=1)
    _, logits = full_prefill(model, ids)
    b = blend(model, prefix, chunks, question, 1.0)
    torch.testing.assert_close(b.logits, logits, atol=1e-3, rtol=1e-4)   # 30 layers of fp32 sums in another order
    assert int(b.logits.argmax()) == int(logits.argmax())


def test_selector_seam_and_harness():
    """`blend(selector=...)` uses the given selection; the library's (`select_high_deviation`) is `kv_deviation` +
    `select_tokens`; Lab 10's harness (`run_selector`) recomputes exactly the selected positions, and ratio 1 gives
    the full prefill's answer while picking the least deviating tokens recovers less of the full-prefill KV."""
    from llmso_lab.kv.blend import kv_deviation, run_selector, select_high_deviation, select_tokens

    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)
    assert torch.equal(select_high_deviation(new, old, 0.2), select_tokens(kv_deviation(new, old), 0.2))

    def least(new, old, ratio):
        dev = kv_deviation(new, old)
        return torch.sort(torch.topk(-dev, int(ratio * dev.numel() + 0.5)).indices).values

    best, worst = run_selector(select_high_deviation, 0.3, seed=1), run_selector(least, 0.3, seed=1)
    assert len(best["selected"]) == len(worst["selected"]) == 15 and best["selected"] != worst["selected"]
    assert best["deviation_x1000"] < worst["deviation_x1000"]
    full = run_selector(select_high_deviation, 1.0, seed=1)
    assert full["same_answer_as_full"] and full["deviation_x1000"] == 0 and len(full["selected"]) == 51
