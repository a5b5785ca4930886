"""Cross-layer KV sharing and sliding-window layers on HF models, without training."""
import pytest
import torch

from llmso_lab.models import tiny_llama
from llmso_lab.models.kv_sharing import kv_bytes, layer_plan, share_kv


def ids(n=20, seed=0):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=4)


def logits(m, x):
    with torch.no_grad():
        return m(x).logits


def test_no_sharing_and_a_wide_window_change_nothing(model):
    x = ids()
    torch.testing.assert_close(logits(share_kv(model), x), logits(model, x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(share_kv(model, window=20), x), logits(model, x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(share_kv(model, window=4), x), logits(model, x), atol=1e-3)


def test_cross_layer_sharing_ignores_the_upper_layers_own_kv(model):
    x = ids()
    cla = share_kv(model, share_every=2)
    base = logits(cla, x)
    with torch.no_grad():   # layers 1 and 3 use layers 0 and 2's K/V: their own k/v projections are dead weights
        for i in (1, 3):
            cla.model.layers[i].self_attn.k_proj.weight.mul_(3.0)
            cla.model.layers[i].self_attn.v_proj.weight.zero_()
    torch.testing.assert_close(logits(cla, x), base)
    assert not torch.allclose(base, logits(model, x), atol=1e-3)


def test_window_matches_a_hand_built_mask(model):
    """A 1-layer model with window 3: each position sees itself and the 2 before, via an explicit 4-D mask."""
    x = ids(10, 1)
    one = tiny_llama(num_layers=1)
    n = x.shape[1]
    pos = torch.arange(n)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
    want = logits(share_kv(one, window=3), x)
    with torch.no_grad():
        ref = one(x, attention_mask=torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf"))).logits
    torch.testing.assert_close(want, ref, atol=1e-5, rtol=1e-5)


def test_generate_with_a_window_runs_with_the_cache(model):
    out = share_kv(model, window=4, global_every=2).generate(ids(6), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11)


def test_plan_and_bytes():
    assert layer_plan(4, share_every=2) == [(None, None), (0, None), (None, None), (2, None)]
    assert layer_plan(4, window=8, global_every=2) == [(None, 8), (None, None), (None, 8), (None, None)]
    full = kv_bytes(30, 3, 64, 8192, 4)
    assert full == 30 * 2 * 3 * 64 * 4 * 8192                                   # SmolLM2 fp32, 8K tokens
    assert kv_bytes(30, 3, 64, 8192, 4, share_every=2) == full // 2
    assert kv_bytes(30, 3, 64, 8192, 4, window=1024, global_every=3) == (10 * 8192 + 20 * 1024) * 2 * 3 * 64 * 4
    with pytest.raises(ValueError):
        layer_plan(4, share_every=0)
