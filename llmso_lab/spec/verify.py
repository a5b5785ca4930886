"""Speculative decoding: verify a draft model's k proposed tokens against the target model (rejection sampling).

A cheap draft model proposes k tokens d_0..d_{k-1}, drawing d_i from its distribution q_i. One target forward over
the k+1 positions gives p_0..p_k. Verification (Leviathan et al. 2023; Chen et al. 2023) walks the drafts in order:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection, emit one token drawn from norm(max(0, p_i - q_i)) and stop;
    if all k are accepted, emit a "bonus" token drawn from p_k.

Why this is exact: the token emitted at position i is d with probability
q(d) min(1, p(d)/q(d)) + P(reject) * max(0, p(d) - q(d)) / P(reject) = min(p(d), q(d)) + max(0, p(d) - q(d)) = p(d),
since P(reject) = 1 - sum_x min(p(x), q(x)) = sum_x max(0, p(x) - q(x)). So the output has exactly the target's
distribution, whatever the draft is; a good draft (q close to p) only makes more tokens per step accepted.
The acceptance rate is alpha = sum_x min(p(x), q(x)) = 1 - total variation distance(p, q).

Temperature 0 (greedy) is the special case p = one-hot(argmax): accept while d_i equals the target's argmax
(`greedy_verify`). One step always emits between 1 and k+1 tokens.

Two forms live here:
- `speculative_verify`: one request, on the host, with the request's own torch.Generator (like the engine's sampler).
- `verify_batch_reference`: a whole batch, deterministic given explicit random numbers (acceptance uniforms and
  Exp(1) noise), made of elementwise ops and argmaxes only, so that the Triton kernel `verify_batch_triton`
  (llmso_lab.spec.triton_verify) reproduces it bit for bit. `verify_batch` picks one of the two.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llmso_lab.engine.sampler import filter_logits
from llmso_lab.engine.sampling_params import SamplingParams

__all__ = ["target_probs", "speculative_verify", "verify_with_randoms", "greedy_verify", "verify_batch_reference", "verify_batch",
           "race_scores", "expected_tokens_per_step", "speculative_speedup"]


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [n, V] -> the distributions [n, V] (fp32) that the engine's sampler draws from for these params.

    Temperature, then top-k / top-p (`llmso_lab.engine.sampler.filter_logits`), then softmax: the same steps as
    `sample_token`. Greedy (temperature 0) gives the one-hot vector of each row's argmax. Verification must use
    these *filtered* distributions for the target and, for the draft, the distributions the drafts were really
    sampled from; otherwise the output no longer follows the sampler's distribution.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [n, V] (one row per position), got shape {tuple(logits.shape)}; "
                         "use logits.unsqueeze(0) for a single position")
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits / params.temperature
    filtered = torch.stack([filter_logits(row, params.top_k, params.top_p) for row in scaled]) if len(scaled) \
        else scaled
    return filtered.softmax(-1)


def _check_probs(name: str, probs: Tensor, rows: int, vocab: int | None) -> None:
    """Shape and value checks for one request's probability matrix (rows x V)."""
    if probs.dim() != 2 or probs.shape[0] != rows or (vocab is not None and probs.shape[1] != vocab):
        want = f"[{rows}, {'V' if vocab is None else vocab}]"
        raise ValueError(f"{name} must have shape {want} (k = number of draft tokens), got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must hold probabilities (a floating dtype), got {probs.dtype}")
    if rows and not (torch.isfinite(probs).all() and (probs >= 0).all() and (probs.sum(-1) > 0).all()):
        raise ValueError(f"{name} must hold finite, non-negative rows with positive mass "
                         "(probabilities, e.g. from target_probs), not logits")


def speculative_verify(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor | list[int],
                       generator: torch.Generator | None = None) -> list[int]:
    """Verify k draft tokens of one request; returns the emitted token ids (1 to k+1 of them).

    target_probs [k+1, V]: p_0..p_k from the target's forward over the drafts (p_k gives the bonus token).
    draft_probs [k, V]: q_0..q_{k-1}, the distributions the drafts were sampled from. draft_tokens: k ids.
    The emitted tokens are the accepted drafts followed by one token from the residual max(0, p_i - q_i) at the
    first rejection, or by the bonus token from p_k. k = 0 is allowed: then one token is drawn from p_0.

    Random draws come from `generator` (the request's own, as in the engine's sampler): torch.rand for each
    acceptance test (accept iff u * q(d) < p(d), i.e. u < p/q with u uniform in [0, 1)), torch.multinomial for
    the one non-draft token.

    A draft token with q(d) = 0 raises ValueError: a token sampled from q always has q(d) > 0, so the pair
    (draft_probs, draft_tokens) is inconsistent (e.g. q before top-k/top-p filtering, or drafts from a different
    distribution) and min(1, p/q) is undefined there. Any choice (accept iff p > 0, always reject) would silently
    change the output distribution, so we refuse instead.
    If p_i <= q_i everywhere (p == q, up to rounding), the residual is all zeros; rejection is then (almost)
    impossible, but rounding can still reject, and we fall back to drawing from p_i.
    """
    tokens = [int(t) for t in (draft_tokens.tolist() if isinstance(draft_tokens, Tensor) else draft_tokens)]
    k = len(tokens)
    _check_probs("target_probs", target_probs, k + 1, None)
    vocab = target_probs.shape[1]
    _check_probs("draft_probs", draft_probs, k, vocab)
    for i, d in enumerate(tokens):
        if not 0 <= d < vocab:
            raise ValueError(f"draft_tokens[{i}] = {d} is outside the vocabulary [0, {vocab})")
        if draft_probs[i, d] == 0:
            raise ValueError(f"draft_probs[{i}, {d}] = 0 but token {d} was drafted at position {i}: a token sampled "
                             "from q has q > 0. Pass the distribution the drafts were really sampled from (after "
                             "the same temperature / top-k / top-p)")

    device = generator.device if generator is not None else target_probs.device
    out: list[int] = []
    for i, d in enumerate(tokens):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator, device=device))
        if u * q < p:                              # accepted with probability min(1, p / q)
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        dist = residual if bool((residual > 0).any()) else target_probs[i]
        out.append(int(torch.multinomial(dist.to(device), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k].to(device), 1, generator=generator)))   # the bonus token
    return out


def greedy_verify(target_argmax: list[int] | Tensor, draft_tokens: list[int] | Tensor) -> list[int]:
    """Temperature 0: the longest prefix of drafts equal to the target's argmax, then the target's own token.

    target_argmax [k+1]: the target's argmax at each position (the last one is the bonus token).
    Returns the accepted drafts followed by target_argmax at the first mismatch, or by the bonus token.
    """
    target = [int(t) for t in (target_argmax.tolist() if isinstance(target_argmax, Tensor) else target_argmax)]
    drafts = [int(t) for t in (draft_tokens.tolist() if isinstance(draft_tokens, Tensor) else draft_tokens)]
    if len(target) != len(drafts) + 1:
        raise ValueError(f"target_argmax needs k+1 = {len(drafts) + 1} entries for {len(drafts)} draft tokens "
                         f"(one per draft position plus the bonus position), got {len(target)}")
    out: list[int] = []
    for d, t in zip(drafts, target):
        if d != t:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def _prepare_batch(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, num_draft: Tensor,
                   accept_u: Tensor, exp_noise: Tensor) -> tuple[Tensor, ...]:
    """Check the batched inputs and bring them to the forms both implementations use.

    Returns fp32 contiguous probabilities, int64 drafts (padding replaced by 0), int64 num_draft, fp32 uniforms and
    inv_noise = 1 / exp_noise. Both implementations multiply by inv_noise instead of dividing by exp_noise: an
    fp32 multiply is correctly rounded everywhere, while Triton's fp32 division on a GPU is approximate, so
    the division would break bit-exact agreement.
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be 3-D [B, k+1, V], got shape {tuple(target_probs.shape)}")
    B, k1, V = target_probs.shape
    k = k1 - 1
    if k < 0 or V == 0:
        raise ValueError(f"target_probs [B, k+1, V] needs k+1 >= 1 positions and V >= 1, "
                         f"got {tuple(target_probs.shape)}")
    shapes = {"draft_probs": (draft_probs, (B, k, V)), "draft_tokens": (draft_tokens, (B, k)),
              "num_draft": (num_draft, (B,)), "accept_u": (accept_u, (B, k)), "exp_noise": (exp_noise, (B, V))}
    for name, (t, want) in shapes.items():
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} for target_probs of shape [B={B}, k+1={k1}, "
                             f"V={V}], got {list(t.shape)}")
        if t.device != target_probs.device:
            raise ValueError(f"{name} is on {t.device} but target_probs is on {target_probs.device}: "
                             "put all inputs on one device")
    for name in ("draft_tokens", "num_draft"):
        if shapes[name][0].is_floating_point():
            raise ValueError(f"{name} must be an integer tensor (int64), got {shapes[name][0].dtype}")
    num_draft = num_draft.long().contiguous()
    if B and (num_draft.min() < 0 or num_draft.max() > k):
        raise ValueError(f"num_draft must lie in [0, k={k}] (rows may have fewer drafts, padded), got "
                         f"{num_draft.tolist()}")
    valid = torch.arange(k, device=num_draft.device) < num_draft[:, None]     # [B, k]: the real drafts
    draft_tokens = draft_tokens.long()
    if ((draft_tokens < 0) | (draft_tokens >= V))[valid].any():
        raise ValueError(f"draft_tokens must lie in [0, V={V}) in each row's first num_draft positions "
                         "(padding after them may be anything, e.g. -1)")
    draft_tokens = torch.where(valid, draft_tokens, 0).contiguous()
    f32 = [t.float().contiguous() for t in (target_probs, draft_probs, accept_u)]
    inv_noise = (1.0 / exp_noise.float()).contiguous()
    return f32[0], f32[1], draft_tokens, num_draft, f32[2], inv_noise


def race_scores(dist: Tensor, inv_noise: Tensor) -> Tensor:
    """Exponential race: argmax_j dist[j] / E_j (E_j ~ Exp(1)) is a sample from dist / sum(dist).

    Why: dist[j] / E_j > x  <=>  E_j < dist[j] / x; with independent exponentials the winner is j with probability
    dist[j] / sum(dist) (the first arrival among Poisson clocks of rates dist[j]). Tokens without mass score -1 so
    they never win (0 * inf would be NaN when a noise draw is 0, and NaN wins torch.argmax).
    """
    return torch.where(dist > 0, dist * inv_noise, -1.0)


def verify_batch_reference(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, num_draft: Tensor,
                           accept_u: Tensor, exp_noise: Tensor) -> tuple[Tensor, Tensor]:
    """Batched verification in torch, deterministic given the random numbers: the oracle for the Triton kernel.

    target_probs [B, k+1, V], draft_probs [B, k, V], draft_tokens [B, k] (int64), num_draft [B]: row b has
    num_draft[b] <= k real drafts (positions after them are padding and ignored), accept_u [B, k] uniforms in
    [0, 1), exp_noise [B, V] Exp(1) draws (> 0; e.g. torch.empty(B, V).exponential_()).
    Returns out_tokens [B, k+1] int64 (the emitted tokens, padded with -1) and num_emitted [B] int64 (1..k+1).

    Row b accepts d_i iff accept_u[b, i] * q_i(d_i) < p_i(d_i) (u < p/q without a division). The one non-draft
    token is drawn by the exponential race (`race_scores`) from dist = max(0, p_i - q_i) at the first rejection
    (or p_i if that residual is all zeros), else from p_{num_draft}; argmax ties go to the lowest index.
    Computation is in fp32. Draft tokens with q(d) = 0 are not checked here (that would need a device sync):
    the rule then accepts iff p(d) > 0.
    """
    p, q, d, n, u, inv_noise = _prepare_batch(target_probs, draft_probs, draft_tokens, num_draft, accept_u, exp_noise)
    B, k1, V = p.shape
    k = k1 - 1
    rows = torch.arange(B, device=p.device)
    pos = torch.arange(k, device=p.device)
    p_d = p[:, :k].gather(-1, d[..., None]).squeeze(-1)                     # [B, k] p_i(d_i)
    q_d = q.gather(-1, d[..., None]).squeeze(-1)                            # [B, k] q_i(d_i)
    accepted = (u * q_d < p_d) & (pos < n[:, None])
    n_acc = accepted.long().cumprod(-1).sum(-1)                             # [B] the leading run of acceptances
    rejected = n_acc < n
    p_i = p[rows, n_acc]                                                    # [B, V] the target at the stop position
    q_i = q[rows, n_acc.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_i)
    residual = (p_i - torch.where(rejected[:, None], q_i, 0.0)).clamp(min=0)   # = p_i when all were accepted
    from_residual = race_scores(residual, inv_noise).argmax(-1)
    from_target = race_scores(p_i, inv_noise).argmax(-1)
    token = torch.where((residual > 0).any(-1), from_residual, from_target)
    slots = torch.arange(k1, device=p.device)
    drafts = torch.cat([d, d.new_zeros(B, 1)], dim=1)
    out = torch.where(slots < n_acc[:, None], drafts, torch.where(slots == n_acc[:, None], token[:, None], -1))
    return out, n_acc + 1


def verify_batch(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, num_draft: Tensor,
                 accept_u: Tensor, exp_noise: Tensor) -> tuple[Tensor, Tensor]:
    """Batched verification: the Triton kernel on CUDA tensors, the torch reference otherwise (same results)."""
    if target_probs.is_cuda:
        from llmso_lab.attention.backend import triton_available
        if triton_available():
            from llmso_lab.spec.triton_verify import verify_batch_triton
            return verify_batch_triton(target_probs, draft_probs, draft_tokens, num_draft, accept_u, exp_noise)
    return verify_batch_reference(target_probs, draft_probs, draft_tokens, num_draft, accept_u, exp_noise)


def verify_with_randoms(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor | list[int],
                        accept_u: Tensor, exp_noise: Tensor) -> list[int]:
    """`speculative_verify` for one request with its random numbers given (Lab 07's exercise): accept d_i iff
    accept_u[i] * q_i(d_i) < p_i(d_i); the one non-draft token is argmax_j dist[j] / exp_noise[j] (the exponential
    race, a draw from dist / sum(dist)) with dist the residual max(0, p_i - q_i) at the first rejection (p_i if
    that is all zeros), else p_k. One row of `verify_batch_reference`. Returns the emitted ids (1..k+1)."""
    d = torch.as_tensor(draft_tokens, dtype=torch.int64).reshape(-1)
    out, n = verify_batch_reference(target_probs[None], draft_probs.reshape(len(d), target_probs.shape[-1])[None], d[None],
                                    torch.tensor([len(d)]), accept_u.reshape(1, len(d)), exp_noise[None])
    return out[0, :int(n[0])].tolist()


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens emitted by one verification step: (1 - alpha^(k+1)) / (1 - alpha); k+1 when alpha = 1.

    Assumes each draft is accepted independently with probability alpha (the acceptance rate, sum min(p, q)).
    The step emits i+1 tokens with i accepted drafts, so E = sum_{i=0..k} P(first i accepted) = sum alpha^i.
    """
    _check_alpha_k(alpha, k)
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of speculative decoding over plain decoding (Leviathan et al. 2023, Theorem 3.8).

    c: the cost of one draft forward relative to one target forward. A step runs k draft forwards and one target
    forward over k+1 positions (assumed to cost as much as one decode forward: decode is memory-bound), so it costs
    k*c + 1 target-forward units and emits expected_tokens_per_step(alpha, k) tokens, where plain decoding emits 1.
    """
    if c < 0:
        raise ValueError(f"c (draft cost / target cost) must be >= 0, got {c}")
    return expected_tokens_per_step(alpha, k) / (k * c + 1.0)


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (acceptance rate) must be in [0, 1], got {alpha}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (draft tokens per step) must be an int >= 0, got {k!r}")
