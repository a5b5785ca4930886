"""AWQ and GPTQ: both beat RTN on the layer output error they minimise; AWQ with alpha = 0 and GPTQ with an
identity Hessian are exactly RTN; GPTQ's Cholesky form equals the explicit-inverse (OBQ) form; GPTQ's values lie
on their groups' grids; on SmolLM2, calibrated on text disjoint from the scored text, both beat RTN in perplexity."""
from __future__ import annotations

import time

import pytest
import torch

from llmso_lab.quant import (awq_fake_quantize, awq_quantize_model, awq_scales, awq_search, channel_mean_abs,
                             collect_linear_inputs, fake_quantize, gptq_hessian, gptq_quantize, gptq_quantize_model,
                             gptq_quantize_packed, grid_codes, grid_params, grid_values, input_hessian, linear_names,
                             output_error)


def outlier_layer(seed: int = 0, n: int = 512, d_in: int = 256, d_out: int = 128):
    """Inputs with four outlier channels (30x larger activations), and a random weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    x[:, [3, 50, 77, 200]] *= 30
    return x, torch.randn(d_out, d_in, generator=g) * 0.05


def correlated_layer(seed: int = 0, n: int = 512, d_in: int = 256, d_out: int = 128, rank: int = 64,
                     dtype=torch.float32, n_test: int = 0):
    """Inputs that live near a rank-64 subspace (strongly correlated channels), and a random weight; with
    `n_test`, also fresh inputs from the same distribution (held out)."""
    g = torch.Generator().manual_seed(seed)
    mix, w = torch.randn(rank, d_in, generator=g), torch.randn(d_out, d_in, generator=g) * 0.05
    xs = [torch.randn(k, rank, generator=g) @ mix + 0.1 * torch.randn(k, d_in, generator=g) for k in (n, n_test)]
    return (xs[0].to(dtype), w.to(dtype)) + ((xs[1].to(dtype),) if n_test else ())


# ---------------------------------------------------------------------------------------------------- AWQ

@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_beats_rtn_on_outlier_channels(bits, symmetric):
    x, w = outlier_layer(bits)
    r = awq_search(w, x, bits, group_size=64, symmetric=symmetric)
    rtn = output_error(x, w, fake_quantize(w, bits, group_size=64, symmetric=symmetric))
    assert r.rtn_loss == pytest.approx(rtn, rel=1e-6)
    assert 0 < r.alpha < 1 and r.loss < 0.5 * rtn, (r.alpha, r.loss, rtn)   # strictly (here: over 2x) lower
    assert len(r.losses) == 20 and r.loss == min(r.losses) and r.alphas[r.losses.index(r.loss)] == r.alpha
    # the outlier channels got the largest scales: they are the salient ones
    assert set(r.scales.topk(4).indices.tolist()) == {3, 50, 77, 200}


def test_awq_alpha_zero_is_exactly_rtn():
    x, w = outlier_layer()
    assert torch.equal(awq_scales(channel_mean_abs(x), 0.0), torch.ones(w.shape[1]))
    for kw in ({"group_size": 64, "symmetric": True}, {"group_size": 32, "symmetric": False}, {"group_size": None}):
        assert torch.equal(awq_fake_quantize(w, torch.ones(w.shape[1]), 4, **kw), fake_quantize(w, 4, **kw))
    r = awq_search(w, x, 4, grid=1)   # the grid {0}
    assert r.alpha == 0 and r.loss == r.rtn_loss and torch.equal(r.scales, torch.ones(w.shape[1]))


def test_awq_scales_are_normalised_and_loss_is_recomputable():
    x, w = outlier_layer(1)
    s = awq_scales(channel_mean_abs(x), 0.5)
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)
    r = awq_search(w, x, 4, group_size=32, symmetric=False)
    wq = awq_fake_quantize(w, r.scales, 4, group_size=32, symmetric=False)
    direct = float(((x @ wq.T) - (x @ w.T)).pow(2).mean())   # the paper's ||Q(W s)(s^-1 X) - W X||^2, mean
    assert r.loss == pytest.approx(direct, rel=1e-4)
    # the weight AWQ computes with is the RTN grid of W * s, divided by s: exactly on that grid once scaled back
    torch.testing.assert_close(fake_quantize(wq * r.scales, 4, group_size=32, symmetric=False), wq * r.scales,
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- GPTQ

@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size,symmetric", [(64, True), (32, False), (None, True)])
def test_gptq_beats_rtn_on_correlated_inputs(bits, group_size, symmetric):
    x, w, x_test = correlated_layer(bits, n=1024, n_test=512)   # 4x more calibration tokens than inputs
    wq = gptq_quantize(w, gptq_hessian(x), bits, group_size, symmetric)
    rtn = fake_quantize(w, bits, group_size=group_size, symmetric=symmetric)
    assert output_error(x, w, wq) < 0.5 * output_error(x, w, rtn)
    assert output_error(x_test, w, wq) < 0.5 * output_error(x_test, w, rtn)   # and on inputs it did not see


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size,symmetric", [(64, True), (32, False), (None, False)])
def test_gptq_values_lie_on_their_group_grids(bits, group_size, symmetric):
    x, w = correlated_layer()
    qt = gptq_quantize_packed(w, gptq_hessian(x), bits, group_size, symmetric)
    wq = gptq_quantize(w, gptq_hessian(x), bits, group_size, symmetric)
    assert torch.equal(wq, qt.dequantize())
    q = qt.codes()
    lo, hi = ((-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1))
    assert lo <= int(q.min()) and int(q.max()) <= hi
    g = qt.group_size
    grouped = wq.reshape(w.shape[0], -1, g)
    again = grid_values(grid_codes(grouped, qt.scale, qt.minimum, bits), qt.scale, qt.minimum)
    assert torch.equal(again, grouped)   # re-quantizing on each group's own grid changes nothing


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (None, True)])
def test_gptq_with_identity_hessian_is_exactly_rtn(group_size, symmetric):
    _, w = outlier_layer()
    for bits in (3, 4):
        wq = gptq_quantize(w, torch.eye(w.shape[1]), bits, group_size, symmetric)   # damping keeps H diagonal
        assert torch.equal(wq, fake_quantize(w, bits, group_size=group_size, symmetric=symmetric))


def gptq_explicit_inverse(w, h, bits, group_size, symmetric, percdamp=0.01):
    """OBQ's form of the same algorithm: keep the inverse Hessian of the columns not yet quantized, explicitly;
    after column j, update the rest by -(w_j - q_j) / Hinv[j, j] * Hinv[j, :], then eliminate j from Hinv."""
    W, H = w.clone(), h.clone()
    H.diagonal().add_(percdamp * H.diagonal().mean())
    Hinv = torch.linalg.inv(H)
    out = torch.empty_like(W)
    for j in range(W.shape[1]):
        if j % group_size == 0:
            s, m = grid_params(W[:, j:j + group_size], bits, symmetric)
        q = grid_values(grid_codes(W[:, j, None], s, m, bits), s, m)[:, 0]
        d = Hinv[j, j]
        W[:, j + 1:] -= ((W[:, j] - q) / d)[:, None] * Hinv[j, None, j + 1:]
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / d
        out[:, j] = q
    return out


@pytest.mark.parametrize("blocksize", [128, 16])
def test_gptq_cholesky_equals_explicit_inverse(blocksize):
    x, w = correlated_layer(n=128, d_in=64, d_out=24, rank=16, dtype=torch.float64)
    h = gptq_hessian(x)
    for bits, gs, sym in [(3, 16, True), (4, 32, False)]:
        ref = gptq_explicit_inverse(w, h, bits, gs, sym)
        got = gptq_quantize(w, h, bits, gs, sym, blocksize=blocksize)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
        assert not torch.equal(got, fake_quantize(w, bits, group_size=gs, symmetric=sym))   # not RTN


def test_gptq_model_loss_from_the_hessian_is_the_output_error():
    from llmso_lab.quant.gptq import _output_error

    x, w = correlated_layer()
    wq = fake_quantize(w, 3, group_size=32)
    assert _output_error(gptq_hessian(x), w, wq) == pytest.approx(output_error(x, w, wq), rel=1e-4)


def test_gptq_dead_columns_and_bad_shapes():
    x, w = correlated_layer(n=128, d_in=64, d_out=24)
    x[:, 5] = 0                                                  # an input channel never active
    wq = gptq_quantize(w, gptq_hessian(x), 4, 32, False)
    assert torch.isfinite(wq).all()
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize(w, gptq_hessian(x), 4, 48)
    with pytest.raises(ValueError, match="expected w"):
        gptq_quantize(w, gptq_hessian(x)[:10, :10], 4, 32)


# ------------------------------------------------------------------------------------------- calibration

def recorded_inputs(model, batch: list[list[int]], names) -> dict:
    """Each linear's input in a plain forward of `batch`, recorded with forward hooks: [tokens, in]."""
    seen, mods = {}, dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(
        lambda mod, args, out, n=n: seen.__setitem__(n, args[0].detach().reshape(-1, args[0].shape[-1]).clone()))
        for n in names]
    try:
        with torch.no_grad():
            model(torch.tensor(batch))
    finally:
        for hk in hooks:
            hk.remove()
    return seen


def test_collect_linear_inputs_records_what_each_linear_sees():
    from llmso_lab.models import tiny_llama

    model = tiny_llama()
    ids = list(range(3, 40))
    names = linear_names(model)
    assert "lm_head" not in names and all(n.endswith("_proj") for n in names)
    got = collect_linear_inputs(model, ids, max_tokens=32)
    seen = recorded_inputs(model, [ids[:32]], names)
    assert list(got) == names
    for n in names:
        assert got[n].dtype == torch.float32 and got[n].shape == (32, dict(model.named_modules())[n].in_features)
        assert torch.equal(got[n], seen[n])
    q, k = (n for n in names if n.endswith(("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj")))
    assert got[q] is got[k]                                      # one copy for linears fed the same tensor
    o = next(n for n in names if n.endswith("o_proj"))          # its input (attention output) depends on context
    rows = collect_linear_inputs(model, ids, [o], seq_len=16)[o]   # 37 ids: two rows of 16, one batch
    assert torch.equal(rows, recorded_inputs(model, [ids[:16], ids[16:32]], [o])[o])
    assert rows.shape == (32, 64) and not torch.allclose(rows[16:], got[o][16:])   # row 2 starts afresh
    x = got[names[0]]
    torch.testing.assert_close(input_hessian(x), x.T @ x)
    torch.testing.assert_close(gptq_hessian(x), 2 * x.T @ x / 32)
    torch.testing.assert_close(channel_mean_abs(x), x.abs().mean(0))


def test_model_level_awq_and_gptq_on_a_tiny_model():
    from llmso_lab.models import tiny_llama

    ids = list(range(3, 100))
    for quantize_model in (awq_quantize_model, gptq_quantize_model):
        model = tiny_llama()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        results = quantize_model(model, ids, bits=4, group_size=32, symmetric=True, seq_len=32)   # 3 rows
        assert list(results) == linear_names(model)
        for n, p in model.named_parameters():
            changed = not torch.equal(p, before[n])
            assert changed == (n.removesuffix(".weight") in results), n   # embedding / tied head / norms untouched
        assert all(r.loss <= r.rtn_loss * (1 + 1e-6) for r in results.values())


# ------------------------------------------------------------------------------------------------ SmolLM2

@pytest.mark.slow
def test_smollm2_awq_and_gptq_beat_rtn_in_perplexity():
    """Score the eval text's first 512 tokens (one window); calibrate on tokens 1024.. (disjoint), in rows of
    128. Asymmetric groups of 64: a grid the checkpoint's own Q4_1 blocks (asymmetric, groups of 32) do not align
    with, so RTN loses something (at groups of 32, asymmetric 4-bit RTN gives the fp32 weights back exactly).
    Measured on 1024 tokens (fp32 17.44): 4-bit RTN 24.1, AWQ 19.9; 3-bit RTN 135, AWQ 36, GPTQ 76; here, on 512
    tokens with half the calibration: 3-bit RTN 176, AWQ 49, GPTQ 100; GPTQ on layers 0-14 only (the rest fp32): RTN
    70.8, GPTQ 49.9. 3 bits only; `llmso-lab bench quant` / `bench compress` measure the whole model and 4 bits."""
    from llmso_lab.models import load_model
    from llmso_lab.quality import eval_token_ids, perplexity

    model, tok = load_model("smollm2-135m")
    ids = eval_token_ids(tok)
    scored, calib = ids[:512], ids[1024:]                        # calibration: never scored
    mods = dict(model.named_modules())
    names = linear_names(model)
    orig = {n: mods[n].weight.detach().clone() for n in names}
    kw = {"group_size": 64, "symmetric": False}

    def restore():
        for n in names:
            mods[n].weight.data.copy_(orig[n])

    ppl, seconds = {}, {}
    for bits in (3,):
        for n in names:
            mods[n].weight.data.copy_(fake_quantize(orig[n], bits, **kw))
        ppl["rtn", bits] = perplexity(model, scored, 512)
        restore()
        t0 = time.perf_counter()
        awq = awq_quantize_model(model, calib, bits, **kw, max_tokens=128, seq_len=128)
        seconds["awq", bits] = time.perf_counter() - t0
        ppl["awq", bits] = perplexity(model, scored, 512)
        restore()
        assert all(r.loss <= r.rtn_loss for r in awq.values())   # alpha = 0 is RTN: never worse on calibration
    # GPTQ's column loop is most of the time: quantize layers 0-14 only, against RTN on the same layers
    later = tuple(n for n in names if int(n.split(".")[2]) >= 15)
    half = [n for n in names if n not in later]
    for n in half:
        mods[n].weight.data.copy_(fake_quantize(orig[n], 3, **kw))
    ppl["rtn_half", 3] = perplexity(model, scored, 512)
    restore()
    t0 = time.perf_counter()
    gptq_quantize_model(model, calib, 3, **kw, percdamp=0.1, max_tokens=256, seq_len=128, skip=("lm_head",) + later)
    seconds["gptq_half", 3] = time.perf_counter() - t0
    ppl["gptq_half", 3] = perplexity(model, scored, 512)
    restore()
    print({f"{m}{b}": round(p, 2) for (m, b), p in ppl.items()}, {f"{m}{b}": round(t) for (m, b), t in seconds.items()})
    assert ppl["awq", 3] < 0.5 * ppl["rtn", 3]
    assert ppl["gptq_half", 3] < 0.8 * ppl["rtn_half", 3]
