"""Lab 10's grading inputs: the KIVI oracle is the stated fp32 definition, and no case sits on a tie or a rounding
midpoint (where two correct implementations could disagree). Checked against independent brute force and exact
rational arithmetic; the sandboxed grading of the variants is in test_lab_variants.py."""
from fractions import Fraction

import pytest
import torch

from llmso_lab.grading import exercises, get_exercise
from llmso_lab.grading.grader import expected_values
from llmso_lab.grading.specs.lab10 import MARGIN, kivi_oracle
from llmso_lab.kv.quant import kivi_fake_quantize


def _brute_kivi(k, v, bits, group_size, residual_length):
    """Element by element in Python floats (float64), straight from the exercise's docstring."""
    T, H, D = k.shape
    n_q = max(0, T - residual_length) // group_size * group_size
    top = 2 ** bits - 1

    def rt(xs):
        lo, hi = min(xs), max(xs)
        s = (hi - lo) / top or 1.0
        return [min(max(round((x - lo) / s), 0), top) * s + lo for x in xs]

    kh, vh = k.tolist(), v.tolist()   # nested lists [T][H][D]
    for g in range(0, n_q, group_size):
        for h in range(H):
            for d in range(D):
                col = rt([kh[t][h][d] for t in range(g, g + group_size)])
                for t in range(g, g + group_size):
                    kh[t][h][d] = col[t - g]
    for t in range(n_q):
        for h in range(H):
            vh[t][h] = rt(vh[t][h])
    kh, vh = torch.tensor(kh, dtype=torch.float64), torch.tensor(vh, dtype=torch.float64)
    return kh, vh, n_q


def test_kivi_oracle_matches_brute_force_and_keeps_the_window_exact():
    ex = get_exercise("lab10/kivi_fake_quantize")
    for case in ex.cases:
        k, v, bits, g, r = case.args
        kh, vh, n_q = _brute_kivi(k, v, bits, g, r)
        ok, ov = kivi_oracle(k, v, bits, g, r)
        assert ok.dtype == ov.dtype == torch.float32 and ok.shape == k.shape
        torch.testing.assert_close(ok.double(), kh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ov.double(), vh, atol=1e-5, rtol=1e-5)
        assert torch.equal(ok[n_q:], k[n_q:]) and torch.equal(ov[n_q:], v[n_q:])   # the window comes back exactly
        assert not ok.isnan().any() and not ov.isnan().any()
        if n_q:   # something was quantized: the read-back differs from the input by at least a few levels' worth
            assert (ok[:n_q] - k[:n_q]).abs().max() > 1e-2


def test_kivi_library_stores_fp16_scales_so_it_cannot_be_the_oracle():
    """The library rounds its scales / zero points outward to fp16: one level off on some elements, which the
    comparator must (and does) reject; the exact definition is `kivi_oracle`."""
    ex = get_exercise("lab10/kivi_fake_quantize")
    case = ex.cases[0]
    assert ex.compare(kivi_fake_quantize(*case.args), kivi_oracle(*case.args)) is not None


def test_kivi_cases_stay_clear_of_rounding_midpoints():
    for case in get_exercise("lab10/kivi_fake_quantize").cases:
        k, v, bits, g, r = case.args
        n_q = max(0, k.shape[0] - r) // g * g
        top = 2 ** bits - 1
        sets = [k[s:s + g, h, d].tolist() for s in range(0, n_q, g) for h in range(k.shape[1]) for d in range(k.shape[2])]
        sets += [v[t, h].tolist() for t in range(n_q) for h in range(v.shape[1])]
        for xs in sets:
            lo, hi = min(xs), max(xs)
            s = (hi - lo) / top or 1.0
            assert all(abs((x - lo) / s % 1 - 0.5) > MARGIN for x in xs), case.label


def _cut_gap(scores: list[float], keep: int) -> float:
    top = sorted(scores, reverse=True)
    return top[keep - 1] - top[keep] if 0 < keep < len(top) else float("inf")


def test_keep_set_cases_have_no_tie_at_the_cut():
    """H2O: the scores as given; SnapKV: the pooled votes recomputed here per KV head in float64 with loops."""
    for case in get_exercise("lab10/h2o_keep").cases:
        scores, budget, recent = case.args
        T = scores.shape[1]
        if budget < T:
            for row in scores[:, : T - recent].tolist():
                assert _cut_gap(row, budget - recent) > 0, case.label
    for case in get_exercise("lab10/snapkv_keep").cases:
        q, k, budget, window, ks = case.args
        H, W, D = q.shape
        Hkv, T, _ = k.shape
        if budget >= T:
            continue
        g = H // Hkv
        for j in range(Hkv):
            votes = [0.0] * T
            for h in range(j * g, (j + 1) * g):
                for i in range(W):
                    pos = T - W + i
                    s = (k[j, : pos + 1].double() @ q[h, i].double()) / D ** 0.5
                    p = (s - s.max()).exp()
                    for t, x in enumerate((p / p.sum()).tolist()):
                        votes[t] += x / (g * W)
            pooled = [max(votes[max(0, t - ks // 2): t + ks // 2 + 1]) for t in range(T)]
            assert _cut_gap(pooled[: T - W], budget - window) > 1e-3 * MARGIN, case.label


def _rational_pyramid(L: int, total: int, beta: float = 20):
    """PyramidKV budgets in exact rational arithmetic, and the remainder gap at the largest-remainder cut."""
    if L == 1:
        return [total], None
    avg = Fraction(total, L)
    lo = avg / Fraction(beta)
    hi = 2 * avg - lo
    exact = [hi - l * (hi - lo) / (L - 1) for l in range(L)]
    out = [x.numerator // x.denominator for x in exact]
    order = sorted(range(L), key=lambda l: (-(exact[l] - out[l]), l))
    n = total - sum(out)
    for l in order[:n]:
        out[l] += 1
    frac = [exact[l] - int(exact[l]) for l in order]
    return out, (frac[n - 1] - frac[n] if 0 < n < L else None), hi == lo


def test_pyramid_cases_match_exact_arithmetic_and_ties_are_exact_in_floats():
    ex = get_exercise("lab10/pyramid_budgets")
    for case, want in zip(ex.cases, expected_values(ex)):
        L, total, *rest = case.args
        beta = rest[0] if rest else case.kwargs.get("beta", 20)
        out, gap, *flat = _rational_pyramid(L, total, beta)
        assert out == want and sum(want) == total, case.label
        assert all(a >= b for a, b in zip(want, want[1:])), case.label
        # a tie at the cut is only allowed where every float formula computes it exactly (uniform, or 2 layers)
        assert gap is None or gap > Fraction(1, 10**6) or flat[0] or L == 2, case.label


@pytest.mark.parametrize("name", ["kivi_fake_quantize", "streaming_keep", "h2o_keep", "snapkv_keep", "pyramid_budgets",
                                  "StreamingEvictionPolicy", "cacheblend_select"])
def test_lab10_exercise_is_registered_with_public_and_hidden_cases(name):
    ex = get_exercise(f"lab10/{name}")
    assert any(not c.hidden for c in ex.cases) and any(c.hidden for c in ex.cases)
    assert sum(e.points for e in exercises("10")) == 100
