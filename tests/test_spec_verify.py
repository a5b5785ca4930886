"""Speculative-decoding verification: the output follows the target distribution whatever the draft, the closed
forms match simulation, greedy is the temperature-0 case, and the Triton kernel equals the torch reference exactly."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere below

import pytest  # noqa: E402
import torch  # noqa: E402

from llmso_lab.engine.sampler import sample_token  # noqa: E402
from llmso_lab.engine.sampling_params import SamplingParams  # noqa: E402
from llmso_lab.spec import (expected_tokens_per_step, greedy_verify, speculative_speedup,  # noqa: E402
                            speculative_verify, target_probs, verify_batch, verify_batch_reference,
                            verify_batch_triton)

torch.set_num_threads(1)
V, K = 6, 3
MIN_PVALUE = 1e-3


# ----------------------------------------------------------------------------------------------------------------
# helpers: a chi-square test, distributions, an engine loop over the batched verifier, wrong verifiers, an oracle
# ----------------------------------------------------------------------------------------------------------------

def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of integer counts to probs (cells with expected < min_expected pooled).

    p-value = P(chi2_df > stat) = Q(df/2, stat/2), the regularized upper incomplete gamma function."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    if counts[expected == 0].sum() > 0:    # an outcome the target gives no mass was observed
        return 0.0
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def random_probs(shape: tuple[int, ...], g: torch.Generator, zeros: int = 0) -> torch.Tensor:
    """Random distributions over the last dim; `zeros` entries per row set to 0 (like top-k filtering)."""
    w = torch.rand(shape, generator=g, dtype=torch.float64) ** 2 + 0.02
    if zeros:
        idx = torch.rand(shape, generator=g).argsort(-1)[..., :zeros]
        w.scatter_(-1, idx, 0.0)
    return (w / w.sum(-1, keepdim=True)).float()


def drafts_for(kind: str, P: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Draft distributions Q [positions, V] of a given kind for target distributions P [positions, V]."""
    if kind == "random":
        return random_probs(P.shape, g)
    if kind == "zeros":                       # q has no mass on some tokens, including p's likely ones
        return random_probs(P.shape, g, zeros=3)
    if kind == "equal":                       # a perfect draft: everything accepted
        return P.clone()
    if kind == "onehot":                      # an n-gram / lookup draft proposes one token with certainty
        return torch.nn.functional.one_hot(torch.randint(V, P.shape[:1], generator=g), V).float()
    raise ValueError(kind)


def generate(verify, P: torch.Tensor, Q: torch.Tensor, k: int, length: int, n: int, seed: int) -> torch.Tensor:
    """The engine loop: n sequences of `length` tokens made by repeated draft + verify steps.

    The target at position t is P[t], the draft Q[t] (context-independent, position-dependent), so the tokens of a
    correct verifier are independent with token t ~ P[t]. Each step starts at the sequence's current length."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.full((n, length), -1)
    pos = torch.zeros(n, dtype=torch.long)
    while (pos < length).any():
        rows = (pos < length).nonzero().squeeze(1)
        m = len(rows)
        t = pos[rows, None] + torch.arange(k + 1)                    # [m, k+1] the step's positions
        p, q = P[t], Q[t[:, :k]]
        d = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(m, k)
        u = torch.rand(m, k, generator=g)
        e = torch.empty(m, V).exponential_(generator=g)
        out, num = verify(p, q, d, torch.full((m,), k), u, e)
        for j in range(k + 1):
            keep = (j < num) & (t[:, j] < length)
            seqs[rows[keep], t[keep, j]] = out[keep, j]
        pos[rows] += num
    return seqs


def wrong_verifier(rule: str):
    """A broken verifier with verify_batch_reference's signature, to show the distribution tests have power.

    rule "resample_from_p": at a rejection draw from p_i instead of the residual max(0, p_i - q_i).
    rule "accept_if_p_gt_q": accept d_i iff p(d_i) > q(d_i) (no coin flip), otherwise the residual as usual."""
    def verify(p, q, d, num_draft, u, noise):
        B, k1, _ = p.shape
        k = k1 - 1
        p_d = p[:, :k].gather(-1, d[..., None]).squeeze(-1)
        q_d = q.gather(-1, d[..., None]).squeeze(-1)
        ok = p_d > q_d if rule == "accept_if_p_gt_q" else u * q_d < p_d
        n_acc = ok.long().cumprod(-1).sum(-1)
        rows = torch.arange(B)
        p_i = p[rows, n_acc]
        dist = (p_i - q[rows, n_acc.clamp(max=k - 1)]).clamp(min=0)
        use_p = (n_acc == k) | (dist.sum(-1) == 0) | (rule == "resample_from_p")
        token = (torch.where(use_p[:, None], p_i, dist) / noise).argmax(-1)
        out = torch.full((B, k1), -1)
        for j in range(k1):
            out[:, j] = torch.where(j < n_acc, d[:, min(j, k - 1)], torch.where(j == n_acc, token, -1))
        return out, n_acc + 1
    return verify


def exact_step_distribution(p: torch.Tensor, q: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Brute force from the definition: the probability of each emitted sequence of one step (drafts d_i ~ q_i,
    accept with min(1, p/q), at the first rejection draw from norm(max(0, p - q)), else the bonus from p_k)."""
    k = q.shape[0]
    p, q = p.double(), q.double()
    out: dict[tuple[int, ...], float] = {}

    def emit(prefix, prob, dist):
        for x in range(dist.numel()):
            if dist[x] > 0:
                key = prefix + (x,)
                out[key] = out.get(key, 0.0) + prob * float(dist[x] / dist.sum())

    def walk(i, prefix, prob):
        if i == k:
            return emit(prefix, prob, p[k])
        reject = 0.0
        for d in range(q.shape[1]):
            if q[i, d] > 0:
                accept = min(1.0, float(p[i, d] / q[i, d]))
                walk(i + 1, prefix + (d,), prob * float(q[i, d]) * accept)
                reject += float(q[i, d]) * (1.0 - accept)
        residual = (p[i] - q[i]).clamp(min=0)
        emit(prefix, prob * reject, residual if residual.sum() > 0 else p[i])

    walk(0, (), 1.0)
    return out


# ----------------------------------------------------------------------------------------------------------------
# distribution: the emitted tokens follow the target, for any draft
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["random", "zeros", "equal", "onehot"])
def test_emitted_tokens_follow_the_target(kind):
    g = torch.Generator().manual_seed(1)
    length = K + 2                                         # so that some tokens come from a second / third step
    P = random_probs((length + K, V), g, zeros=1)          # p has zeros too (top-k style)
    Q = drafts_for(kind, P, g)
    seqs = generate(verify_batch_reference, P, Q, K, length, n=30000, seed=2)
    for t in range(length):                                # each position's marginal: p_t
        counts = torch.bincount(seqs[:, t], minlength=V)
        assert chi2_pvalue(counts, P[t]) > MIN_PVALUE, (kind, t, counts)
    for t in (0, 1):                                       # the next token given the previous one: the target's
        joint = torch.bincount(seqs[:, t] * V + seqs[:, t + 1], minlength=V * V)
        assert chi2_pvalue(joint, torch.outer(P[t], P[t + 1])) > MIN_PVALUE, (kind, t)


@pytest.mark.parametrize("rule", ["resample_from_p", "accept_if_p_gt_q"])
def test_a_wrong_verifier_fails_the_same_test(rule):
    g = torch.Generator().manual_seed(1)
    P = random_probs((2 + K, V), g, zeros=1)
    Q = drafts_for("random", P, g)
    seqs = generate(wrong_verifier(rule), P, Q, K, 1, n=30000, seed=2)
    assert chi2_pvalue(torch.bincount(seqs[:, 0], minlength=V), P[0]) < 1e-9
    seqs = generate(verify_batch_reference, P, Q, K, 1, n=30000, seed=2)   # same inputs, the real verifier passes
    assert chi2_pvalue(torch.bincount(seqs[:, 0], minlength=V), P[0]) > MIN_PVALUE


def test_exact_step_distribution_gives_the_target_marginal():
    g = torch.Generator().manual_seed(3)
    p, q = random_probs((3, 4), g, zeros=1), random_probs((2, 4), g, zeros=1)
    dist = exact_step_distribution(p, q)
    assert abs(sum(dist.values()) - 1) < 1e-6    # fp32 inputs: their rows sum to 1 up to rounding
    first = torch.zeros(4, dtype=torch.float64)
    for seq, prob in dist.items():
        first[seq[0]] += prob
    torch.testing.assert_close(first, p[0].double(), atol=1e-6, rtol=0)


def step_outcome_counts(outcomes: list[tuple[int, ...]], dist: dict) -> tuple[torch.Tensor, torch.Tensor]:
    keys = sorted(set(dist) | set(outcomes))
    index = {key: i for i, key in enumerate(keys)}
    counts = torch.bincount(torch.tensor([index[o] for o in outcomes]), minlength=len(keys))
    return counts, torch.tensor([dist.get(key, 0.0) for key in keys], dtype=torch.float64)


def test_speculative_verify_and_the_batched_reference_follow_the_exact_step_distribution():
    """Both implementations of one step (whole emitted sequence, its length included) against brute force."""
    g = torch.Generator().manual_seed(4)
    k, vocab = 2, 4
    p, q = random_probs((k + 1, vocab), g, zeros=1), random_probs((k, vocab), g, zeros=1)
    dist = exact_step_distribution(p, q)

    gen = torch.Generator().manual_seed(5)
    outcomes = []
    for _ in range(8000):
        d = torch.multinomial(q, 1, generator=gen).squeeze(1)
        outcomes.append(tuple(speculative_verify(p, q, d, gen)))
    assert chi2_pvalue(*step_outcome_counts(outcomes, dist)) > MIN_PVALUE

    n = 40000
    d = torch.multinomial(q.repeat(n, 1), 1, generator=gen).reshape(n, k)
    u, noise = torch.rand(n, k, generator=gen), torch.empty(n, vocab).exponential_(generator=gen)
    out, num = verify_batch_reference(p.expand(n, -1, -1), q.expand(n, -1, -1), d, torch.full((n,), k), u, noise)
    outcomes = [tuple(row[:m]) for row, m in zip(out.tolist(), num.tolist())]
    assert chi2_pvalue(*step_outcome_counts(outcomes, dist)) > MIN_PVALUE


def test_speculative_verify_with_k0_draws_from_p0_and_edge_residual_falls_back_to_p():
    g = torch.Generator().manual_seed(6)
    p = random_probs((1, V), g)
    draws = torch.tensor([speculative_verify(p, torch.empty(0, V), [], g)[0] for _ in range(3000)])
    assert chi2_pvalue(torch.bincount(draws, minlength=V), p[0]) > MIN_PVALUE
    # p <= q everywhere (rows that are not normalised, like p == q up to rounding): the residual is all zeros,
    # yet a rejection can happen; the emitted token then comes from p
    p2 = torch.tensor([[0.0, 0.25, 0.25, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])
    q2 = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0]])
    seen = {tuple(speculative_verify(p2, q2, [2], g)) for _ in range(40)}
    assert seen == {(2, 3), (1,), (2,)}


# ----------------------------------------------------------------------------------------------------------------
# acceptance rate and the closed forms
# ----------------------------------------------------------------------------------------------------------------

def test_acceptance_rate_is_sum_of_min_p_q_and_tokens_per_step_matches_the_formula():
    g = torch.Generator().manual_seed(7)
    p, q = random_probs((V,), g), random_probs((V,), g)
    alpha = float(torch.minimum(p, q).sum())
    n, k = 40000, 4
    d = torch.multinomial(q, n * k, replacement=True, generator=g).reshape(n, k)
    _, num = verify_batch_reference(p.expand(n, k + 1, V), q.expand(n, k, V), d, torch.full((n,), k),
                                    torch.rand(n, k, generator=g), torch.empty(n, V).exponential_(generator=g))
    accepted_first = (num > 1).double()
    assert abs(accepted_first.mean() - alpha) < 5 * (alpha * (1 - alpha) / n) ** 0.5
    mean, std = num.double().mean(), num.double().std()
    assert abs(mean - expected_tokens_per_step(alpha, k)) < 5 * std / n ** 0.5


@pytest.mark.parametrize("alpha,k", [(0.0, 3), (0.3, 1), (0.7, 4), (0.95, 8), (1.0, 5)])
def test_expected_tokens_per_step_matches_simulated_iid_acceptance(alpha, k):
    g = torch.Generator().manual_seed(8)
    n = 50000
    accept = torch.rand(n, k, generator=g) < alpha
    emitted = accept.long().cumprod(-1).sum(-1) + 1          # accepted prefix + one token
    mean, std = emitted.double().mean(), emitted.double().std()
    assert abs(mean - expected_tokens_per_step(alpha, k)) <= 5 * std / n ** 0.5 + 1e-12


def test_speculative_speedup_closed_form():
    assert speculative_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.2)
    assert speculative_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)
    assert speculative_speedup(0.0, 5, 0.0) == pytest.approx(1.0)   # nothing accepted, free draft: no gain
    assert speculative_speedup(0.0, 5, 0.2) == pytest.approx(0.5)   # nothing accepted: the draft's cost is lost
    assert expected_tokens_per_step(0.5, 0) == 1.0
    for bad in [dict(alpha=1.5, k=2, c=0.1), dict(alpha=0.5, k=-1, c=0.1), dict(alpha=0.5, k=2, c=-1.0)]:
        with pytest.raises(ValueError, match="must be"):
            speculative_speedup(**bad)


# ----------------------------------------------------------------------------------------------------------------
# greedy: temperature 0
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target,drafts,want", [
    ([4, 2, 7, 1], [4, 2, 7], [4, 2, 7, 1]),    # all accepted + bonus
    ([4, 2, 7, 1], [5, 2, 7], [4]),             # first rejected: the target's token instead
    ([4, 2, 7, 1], [4, 3, 7], [4, 2]),          # middle rejected
    ([9], [], [9]),                             # no drafts: the target's own token
])
def test_greedy_verify(target, drafts, want):
    assert greedy_verify(target, drafts) == want
    assert greedy_verify(torch.tensor(target), torch.tensor(drafts, dtype=torch.long)) == want


def test_speculative_verify_at_temperature_0_equals_greedy_verify():
    g = torch.Generator().manual_seed(9)
    greedy = SamplingParams(temperature=0.0)
    for trial in range(40):
        k = trial % 4
        logits = torch.randn(k + 1, V, generator=g)
        argmax = logits.argmax(-1)
        q = random_probs((k, V), g)
        d = torch.multinomial(q, 1, generator=g).squeeze(1) if k else torch.empty(0, dtype=torch.long)
        d = torch.where(torch.rand(k, generator=g) < 0.6, argmax[:k], d)   # mostly right, sometimes not
        q[torch.arange(k), d] += 0.1                                         # q(d) > 0 for the forced tokens
        q = q / q.sum(-1, keepdim=True)
        p = target_probs(logits, greedy)
        assert speculative_verify(p, q, d, g) == greedy_verify(argmax, d)


def test_target_probs_is_the_samplers_distribution():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(5, 50, generator=g)
    torch.testing.assert_close(target_probs(logits, SamplingParams()),
                               torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    for params in [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                   SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, top_k=8, top_p=0.8)]:
        probs = target_probs(logits, params)
        torch.testing.assert_close(probs.sum(-1), torch.ones(5))
        if params.top_k > 0:
            assert ((probs > 0).sum(-1) <= params.top_k).all()
        for row in range(5):                     # same seed: the sampler and a draw from target_probs agree
            for seed in range(10):
                want = sample_token(logits[row], params, torch.Generator().manual_seed(seed))
                got = int(torch.multinomial(probs[row], 1, generator=torch.Generator().manual_seed(seed)))
                assert got == want
    plain = target_probs(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(plain, (logits / 2.0).softmax(-1))


# ----------------------------------------------------------------------------------------------------------------
# the Triton kernel equals the torch reference bit for bit
# ----------------------------------------------------------------------------------------------------------------

def batch_inputs(B: int, k: int, vocab: int, seed: int):
    """Random batched inputs with every special row: one-hot drafts, all-accepted, empty residual, ties, padding."""
    g = torch.Generator().manual_seed(seed)
    p = random_probs((B, k + 1, vocab), g, zeros=vocab // 4)
    q = random_probs((B, k, vocab), g, zeros=vocab // 5)
    d = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(B, k) if k else torch.empty(B, 0).long()
    num = torch.randint(0, k + 1, (B,), generator=g)
    u = torch.rand(B, k, generator=g)
    e = torch.empty(B, vocab).exponential_(generator=g)
    if k and B >= 6:
        num[:6] = k
        q[0] = torch.nn.functional.one_hot(d[0], vocab).float()     # n-gram style one-hot drafts
        p[1, :k] = q[1]                                              # p == q: all accepted, bonus token
        p[2, :k] = q[2] * 0.5                                        # p < q everywhere: residual empty -> from p
        u[2] = 0.99
        p[3] = 1.0 / vocab                                           # uniform p, constant noise: argmax ties
        e[3] = 1.0
        num[3] = 0
        e[4, ::3] = 0.0                                              # a zero noise draw: infinite score
    d = torch.where(torch.arange(k) < num[:, None], d, -1)          # padding after each row's drafts
    return p, q, d, num, u, e


# A zero noise draw gives 0 * inf = NaN in the branch tl.where discards; numpy (the interpreter) warns about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("B,k,vocab,block_v", [(12, 4, 37, 16), (12, 4, 37, None), (9, 1, 100, 32),
                                               (5, 0, 20, 8), (16, 3, 6, 4)])
def test_triton_kernel_equals_the_reference_exactly(B, k, vocab, block_v):
    for seed in range(2):
        args = batch_inputs(B, k, vocab, seed)
        ref_out, ref_num = verify_batch_reference(*args)
        out, num = verify_batch_triton(*args, block_v=block_v)
        assert torch.equal(out, ref_out) and torch.equal(num, ref_num), (out, ref_out)
        assert ((ref_num >= 1) & (ref_num <= args[3] + 1)).all()
        if k and B >= 6:
            assert ref_num[1] == k + 1 and torch.equal(ref_out[1, :k], args[2][1])   # everything accepted
            assert ref_num[2] == 1 and args[0][2, 0, ref_out[2, 0]] > 0                  # rejected, drawn from p
            assert ref_num[3] == 1 and ref_out[3, 0] == 0                                # a tie: the lowest index
        out2, num2 = verify_batch(*args)      # CPU tensors: the dispatcher uses the reference
        assert torch.equal(out2, ref_out) and torch.equal(num2, ref_num)


def test_batched_reference_matches_speculative_verify_rule_by_rule():
    """Same algorithm: on each row, the batched emitted drafts are exactly those speculative_verify's rule accepts."""
    p, q, d, num, u, e = batch_inputs(12, 4, 37, seed=3)
    out, n_emit = verify_batch_reference(p, q, d, num, u, e)
    for b in range(12):
        n_acc = 0
        while n_acc < num[b] and u[b, n_acc] * q[b, n_acc, d[b, n_acc]] < p[b, n_acc, d[b, n_acc]]:
            n_acc += 1
        assert n_emit[b] == n_acc + 1 and out[b, :n_acc].tolist() == d[b, :n_acc].tolist()
        residual = (p[b, n_acc] - q[b, n_acc]).clamp(min=0) if n_acc < num[b] else p[b, n_acc]
        dist = residual if (residual > 0).any() else p[b, n_acc]
        assert dist[out[b, n_acc]] > 0                 # the emitted token has mass in the right distribution
        assert (out[b, n_acc + 1:] == -1).all()


# ----------------------------------------------------------------------------------------------------------------
# bad input: clear errors
# ----------------------------------------------------------------------------------------------------------------

def test_bad_input_raises_helpful_value_errors():
    g = torch.Generator().manual_seed(11)
    p, q = random_probs((3, V), g), random_probs((2, V), g)
    with pytest.raises(ValueError, match=r"target_probs must have shape \[3, V\]"):
        speculative_verify(p[:2], q, [0, 1], g)
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[2, 6\]"):
        speculative_verify(p, q[:, :5], [0, 1], g)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        speculative_verify(p, q, [0, V], g)
    with pytest.raises(ValueError, match="not logits"):
        speculative_verify(torch.randn(3, V), q, [0, 1], g)
    q0 = q.clone()
    q0[1, 4] = 0.0
    with pytest.raises(ValueError, match=r"draft_probs\[1, 4\] = 0 .* sampled from q has q > 0"):
        speculative_verify(p, q0, [0, 4], g)
    with pytest.raises(ValueError, match="k\\+1 = 3 entries"):
        greedy_verify([1, 2], [1, 2])
    with pytest.raises(ValueError, match="2-D"):
        target_probs(torch.randn(V), SamplingParams())

    args = list(batch_inputs(4, 2, 10, seed=0))
    bad_shape = list(args)
    bad_shape[1] = args[1][:, :1]
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[4, 2, 10\]"):
        verify_batch_reference(*bad_shape)
    bad_num = list(args)
    bad_num[3] = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"num_draft must lie in \[0, k=2\]"):
        verify_batch_triton(*bad_num)
    bad_tok = list(args)
    bad_tok[2] = torch.full((4, 2), 10)
    bad_tok[3] = torch.full((4,), 2)
    with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, V=10\)"):
        verify_batch_reference(*bad_tok)
    with pytest.raises(ValueError, match="3-D"):
        verify_batch_reference(args[0][0], *args[1:])
