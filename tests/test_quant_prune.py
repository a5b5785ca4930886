"""Pruning: exact mask sparsity, largest weights kept, 2:4 validity, structured pruning shapes and equivalences."""
import copy

import pytest
import torch

from llmso_lab.models import tiny_llama
from llmso_lab.quality import eval_token_ids, perplexity
from llmso_lab.quant.prune import (head_importance, is_2_4, linear_sparsity, magnitude_mask, mask_2_4,
                                   mlp_activations, mlp_channel_importance, perplexity_sweep, prune_2_4, prune_heads,
                                   prune_heads_by_importance, prune_mlp_channels, prune_unstructured)


def _ids(n=48, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.333, 0.5, 0.9, 1.0])
def test_magnitude_mask_exact_count_and_keeps_the_largest(sparsity):
    w = torch.randn(37, 53, generator=torch.Generator().manual_seed(0))
    keep = magnitude_mask(w, sparsity)
    assert keep.dtype == torch.bool and keep.shape == w.shape
    assert int((~keep).sum()) == round(sparsity * w.numel())
    if 0 < sparsity < 1:   # every kept |w| >= every pruned |w|
        assert float(w.abs()[keep].min()) >= float(w.abs()[~keep].max())


def test_magnitude_mask_ties_are_deterministic_and_nested():
    w = torch.tensor([[1.0, -1.0, 1.0, 2.0], [1.0, -2.0, 0.5, 1.0]])
    # |w| ascending, equal values in row-major order: 0.5(6), then the 1.0s at 0, 1, 2, 4, 7
    assert magnitude_mask(w, 3 / 8).flatten().tolist() == [False, False, True, True, True, True, False, True]
    masks = [magnitude_mask(w, s / 8) for s in range(9)]
    assert all(bool((b <= a).all()) for a, b in zip(masks, masks[1:]))   # more sparsity prunes a superset


def test_magnitude_mask_equals_the_stable_sort_definition_with_many_ties():
    """The mask prunes what a stable ascending sort of |w| puts first (the definition), found without sorting."""
    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        shape = tuple(int(x) for x in torch.randint(1, 30, (2,), generator=g))
        w = torch.randint(-3, 4, shape, generator=g).float() if trial % 2 else torch.randn(shape, generator=g)
        for sparsity in (0.0, 0.13, 0.5, 0.77, 1.0):
            n = round(sparsity * w.numel())
            ref = torch.ones(w.numel(), dtype=torch.bool)
            ref[torch.sort(w.abs().flatten(), stable=True).indices[:n]] = False
            assert torch.equal(magnitude_mask(w, sparsity), ref.reshape(shape)), (trial, sparsity)


def test_magnitude_mask_rejects_bad_sparsity():
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\]"):
        magnitude_mask(torch.ones(4, 4), 1.5)


def test_prune_unstructured_masks_every_linear_but_the_head():
    model = tiny_llama()
    head = model.lm_head.weight.clone()
    masks = prune_unstructured(model, 0.5)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(masks) == sorted(n for n in linears if n != "lm_head") and len(masks) == 2 * 7
    for name, mask in masks.items():
        w = model.get_submodule(name).weight
        assert torch.equal(w != 0, mask) and int((~mask).sum()) == round(0.5 * w.numel())
    assert linear_sparsity(model) == pytest.approx(0.5)
    assert torch.equal(model.lm_head.weight, head)   # the tied head (= embedding) is skipped


def test_pruning_in_steps_equals_pruning_at_once():
    a, b = tiny_llama(), tiny_llama()
    prune_unstructured(a, 0.5)
    prune_unstructured(a, 0.8)
    prune_unstructured(b, 0.8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_zero_sparsity_changes_nothing():
    model, ids = tiny_llama(), _ids()
    before = model(ids).logits
    prune_unstructured(model, 0.0)
    prune_mlp_channels(model, 0.0)
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)


def test_mask_2_4_keeps_the_two_largest_of_every_group():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, 1.0, -1.0]])
    assert mask_2_4(w).tolist() == [[False, True, True, False, True, True, False, False]]   # ties: earlier wins
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    keep = mask_2_4(w)
    assert is_2_4(keep) and is_2_4(w * keep) and int(keep.sum()) == w.numel() // 2
    g, k = w.abs().reshape(64, 24, 4), keep.reshape(64, 24, 4)
    kept_min = torch.where(k, g, torch.inf).amin(-1)
    dropped_max = torch.where(k, -torch.inf, g).amax(-1)
    assert bool((kept_min >= dropped_max).all())


def test_is_2_4_catches_a_wrong_mask_and_bad_shapes():
    ok = torch.tensor([[1, 1, 0, 0, 0, 1, 0, 1]], dtype=torch.bool)
    assert is_2_4(ok)
    assert not is_2_4(torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool))    # 3 in the first group
    assert not is_2_4(magnitude_mask(torch.arange(8.0).reshape(1, 8), 0.5))           # 50% but 0+4 per group
    with pytest.raises(ValueError, match="divisible by 4"):
        is_2_4(torch.ones(2, 6))
    with pytest.raises(ValueError, match="divisible by 4"):
        mask_2_4(torch.ones(6))


def test_prune_2_4_model_every_linear_valid_and_model_runs():
    model, ids = tiny_llama(), _ids()
    masks = prune_2_4(model)
    assert len(masks) == 14 and all(is_2_4(model.get_submodule(n).weight) for n in masks)
    assert linear_sparsity(model) == pytest.approx(0.5)
    assert torch.isfinite(model(ids).logits).all()


def test_prune_heads_shrinks_uniform_gqa_and_equals_zeroing():
    # 6 query heads, 2 KV heads: groups {0,1,2} -> KV 0, {3,4,5} -> KV 1.
    model, ids = tiny_llama(hidden_size=96, num_heads=6, num_kv_heads=2), _ids()
    zeroed = copy.deepcopy(model)
    assert prune_heads(model, 1, [1, 5]) == "shrunk"          # one per group: groups of 2
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.shape == (4 * 16, 96) and attn.o_proj.weight.shape == (96, 4 * 16)
    assert attn.k_proj.weight.shape == (2 * 16, 96) and attn.num_key_value_groups == 2
    # Reference: the same heads switched off by zeroing their o_proj columns in the full layout.
    with torch.no_grad():
        for h in (1, 5):
            zeroed.model.layers[1].self_attn.o_proj.weight[:, h * 16:(h + 1) * 16] = 0
    torch.testing.assert_close(model(ids).logits, zeroed(ids).logits, atol=1e-5, rtol=1e-5)


def test_prune_heads_removes_a_whole_kv_group_and_falls_back_to_zeroing():
    model, ids = tiny_llama(hidden_size=96, num_heads=6, num_kv_heads=2), _ids()
    ref = copy.deepcopy(model)
    assert prune_heads(model, 0, [3, 4, 5]) == "shrunk"       # all of KV group 1: its KV head goes too
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == 48 and attn.k_proj.out_features == 16 and attn.v_proj.out_features == 16
    assert attn.num_key_value_groups == 3 and torch.isfinite(model(ids).logits).all()
    assert prune_heads(ref, 0, [0]) == "zeroed"               # groups would keep 2 and 3 heads: not a GQA layout
    a = ref.model.layers[0].self_attn
    assert a.q_proj.out_features == 96 and a.o_proj.weight[:, :16].count_nonzero() == 0
    assert a.o_proj.weight[:, 16:].count_nonzero() == a.o_proj.weight[:, 16:].numel()
    with pytest.raises(ValueError, match="out of range"):
        prune_heads(ref, 0, [6])
    with pytest.raises(ValueError, match="cannot remove all"):
        prune_heads(ref, 0, range(6))


def test_head_importance_is_o_proj_norm_and_by_importance_drops_the_smallest():
    model = tiny_llama(hidden_size=96, num_heads=6, num_kv_heads=2)
    imp = head_importance(model, 0)
    o = model.model.layers[0].self_attn.o_proj.weight
    torch.testing.assert_close(imp, torch.stack([o[:, h * 16:(h + 1) * 16].norm() for h in range(6)]))
    expected = sorted([int(imp[:3].argmin()), 3 + int(imp[3:].argmin())])
    removed = prune_heads_by_importance(model, 1)
    assert removed[0] == expected and all(len(r) == 2 for r in removed.values())
    assert all(l.self_attn.q_proj.out_features == 64 for l in model.model.layers)


def test_prune_mlp_channels_shrinks_and_keeps_the_most_important():
    model, ids = tiny_llama(hidden_size=64, intermediate_size=128), _ids()
    ref = copy.deepcopy(model)
    imp = mlp_channel_importance(ref.model.layers[0].mlp)
    assert prune_mlp_channels(model, 0.25) == 96 and model.config.intermediate_size == 96
    for layer in model.model.layers:
        m = layer.mlp
        assert m.gate_proj.weight.shape == (96, 64) == m.up_proj.weight.shape and m.down_proj.weight.shape == (64, 96)
    kept = torch.sort(torch.topk(imp, 96).indices).values
    torch.testing.assert_close(model.model.layers[0].mlp.gate_proj.weight, ref.model.layers[0].mlp.gate_proj.weight[kept])
    # Same function as zeroing those channels' down_proj columns in the full model.
    with torch.no_grad():
        for layer in ref.model.layers:
            drop = torch.topk(mlp_channel_importance(layer.mlp), 32, largest=False).indices
            layer.mlp.down_proj.weight[:, drop] = 0
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_mlp_channel_importance_formulas():
    model = tiny_llama()
    m = model.model.layers[1].mlp
    j = 7
    expected = m.gate_proj.weight[j].norm() * m.up_proj.weight[j].norm() * m.down_proj.weight[:, j].norm()
    torch.testing.assert_close(mlp_channel_importance(m)[j], expected)
    acts = torch.randn(10, 256, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(mlp_channel_importance(m, acts)[j],
                               acts[:, j].abs().mean() * m.down_proj.weight[:, j].norm())


def test_mlp_activations_are_the_input_of_down_proj():
    model, ids = tiny_llama(), eval_token_ids(None, max_tokens=70)
    outs = []
    hook = model.model.layers[1].mlp.register_forward_hook(lambda _m, _a, out: outs.append(out[0]))
    acts = mlp_activations(model, ids, window=32)               # 3 windows: 32 + 32 + 6 tokens
    hook.remove()
    assert len(acts) == 2 and acts[1].shape == (70, 256)
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj(acts[1]), torch.cat(outs))


def test_activation_aware_mlp_pruning_keeps_the_most_active_channels():
    model, ids = tiny_llama(), eval_token_ids(None, max_tokens=64)
    ref = copy.deepcopy(model)
    imp = mlp_channel_importance(ref.model.layers[0].mlp, mlp_activations(ref, ids)[0])
    assert prune_mlp_channels(model, 0.5, calibration_ids=ids) == 128
    kept = torch.sort(torch.topk(imp, 128).indices).values
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight,
                               ref.model.layers[0].mlp.down_proj.weight[:, kept])


def test_perplexity_sweep_leaves_the_model_alone():
    model = tiny_llama()
    ids = eval_token_ids(None, max_tokens=200)
    before = perplexity(model, ids, window=64)
    rows = perplexity_sweep(model, ids, prune_unstructured, [0.0, 0.5], window=64)
    assert rows[0] == (0.0, pytest.approx(before, rel=1e-6)) and rows[1][1] != rows[0][1]
    assert perplexity(model, ids, window=64) == pytest.approx(before, rel=1e-6)


@pytest.mark.slow
def test_smollm2_perplexity_rises_with_sparsity_and_2_4_is_worse_than_unstructured():
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = eval_token_ids(tok, max_tokens=256)
    ppl = {0.0: perplexity(model, ids, window=256)}
    m24 = copy.deepcopy(model)
    for s in (0.5, 0.8):            # in place: magnitude masks are nested, so 0.5 then 0.8 == 0.8 directly
        prune_unstructured(model, s)
        ppl[s] = perplexity(model, ids, window=256)
    prune_2_4(m24)
    p24 = perplexity(m24, ids, window=256)
    assert ppl[0.0] < ppl[0.5] < ppl[0.8]
    assert ppl[0.5] < p24           # same 50% sparsity, but 2:4 may not pick the globally smallest weights
