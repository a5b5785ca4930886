"""Low-rank KV by SVD: full rank changes nothing, lower ranks are the best rank-r approximation of [W_k; W_v]."""
import pytest
import torch

from llmso_lab.models import tiny_llama
from llmso_lab.models.low_rank_kv import energy_kept, kv_svd, low_rank_kv


def test_full_rank_keeps_logits_and_low_rank_is_the_svd_truncation():
    model = tiny_llama(num_heads=4, num_kv_heads=2)           # [W_k; W_v]: [64, 64]
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        torch.testing.assert_close(low_rank_kv(model, 64)(ids).logits, base, atol=1e-4, rtol=1e-4)
        low = low_rank_kv(model, 8)
    a, b = model.model.layers[0].self_attn, low.model.layers[0].self_attn
    w = torch.cat([a.k_proj.weight, a.v_proj.weight]).detach()
    w8 = torch.cat([b.k_proj.weight, b.v_proj.weight]).detach()
    assert torch.linalg.matrix_rank(w8) == 8
    S = kv_svd(a)[1]
    assert float(torch.linalg.matrix_norm(w - w8)) ** 2 == pytest.approx(float((S[8:] ** 2).sum()), rel=1e-3)   # Eckart-Young
    assert 0 < energy_kept(model, 8) < energy_kept(model, 32) < energy_kept(model, 64) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rank must be in 1..64"):
        low_rank_kv(model, 65)
