"""Knowledge distillation (lecture 6): train a small student on a big teacher's output distribution.

A hard label says "the next token is X"; the teacher's soft label says "X with 0.6, Y with 0.2, Z with 0.1, ...":
far more information per token (which mistakes are close), so a student learns more from the same text.
Hinton et al. (2015):

    loss = alpha * T^2 * KL( softmax(teacher / T) || softmax(student / T) ) + (1 - alpha) * CE(student, labels)

A temperature T > 1 flattens both distributions so the small probabilities (the "dark knowledge") weigh more;
the gradient of the KL term scales like 1 / T^2, hence the T^2 that keeps it comparable to the CE term.

Here: the teacher is SmolLM2-135M, the student a tiny Llama (2 layers, width 64) with SmolLM2's tokenizer. Its
tied embedding (49152 x 64, ~95% of its parameters) is the PCA of SmolLM2's, frozen: a 1.7K-token training slice
contains only ~700 distinct tokens, and a trained embedding would learn those alone. Storing the teacher's full
distribution would take positions x 49152 x 4 bytes (~330 MB for 1,700 positions), so `teacher_topk` runs the
teacher once and keeps its top-k logits, their token ids and one logit standing for the rest per position;
`topk_distillation_loss` trains on that at the cost of plain cross-entropy.

Measured on the 2,687-token eval text (held-out: the first 1,024 tokens; train: the other 1,663), 200 steps of
4 x 64 tokens, seed 0, k = 64 (89.9% of the teacher's probability), windows of 64: held-out perplexity
1116 (soft, T = 1, alpha = 1) vs 1553 (hard); the teacher 30.7, a unigram model of the training slice ~2500.
The hard-label student overfits (in a 300-step run: 1337 after 100 steps, then worse), the soft one keeps
improving. T = 2 is much worse here (~4400 after 300 steps): with a top-k teacher the dropped tokens are one
flat tail, which at T = 2 holds most of the mass, so the student learns the tail instead of the top tokens.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TopK", "distillation_loss", "topk_distillation_loss", "teacher_topk", "tiny_student", "pca_embedding",
           "DistillResult", "train_student", "compare_soft_hard"]


@dataclass(slots=True)
class TopK:
    """A teacher's k largest logits per position, their token ids, and one logit standing for all the others."""
    values: Tensor          # fp32 [N, k] logits, descending
    indices: Tensor         # int64 [N, k] vocabulary ids
    rest: Tensor | None     # fp32 [N]: log-mean-exp of the V - k dropped logits (None: they had no mass)

    def __getitem__(self, idx) -> "TopK":
        return TopK(self.values[idx], self.indices[idx], None if self.rest is None else self.rest[idx])

    def kept_mass(self, vocab_size: int) -> Tensor:
        """[N]: the teacher's probability (T = 1) on its k kept tokens (1 when `rest` is None)."""
        if self.rest is None:
            return torch.ones(self.values.shape[:-1])
        lse_kept = self.values.logsumexp(-1)
        return torch.exp(lse_kept - torch.logaddexp(lse_kept, self.rest + math.log(vocab_size - self.values.shape[-1])))

    def dense(self, vocab_size: int) -> Tensor:
        """Logits [N, vocab_size]: the k kept ones in place, `rest` (or -inf) everywhere else. At T = 1 this
        teacher gives the k tokens exactly their probabilities and the others, together, exactly theirs, spread
        evenly; at other T it is an approximation (the dropped logits were not all equal)."""
        fill = torch.full((*self.values.shape[:-1], vocab_size), -torch.inf, dtype=self.values.dtype)
        if self.rest is not None:
            fill = fill.copy_(self.rest[..., None].expand_as(fill))
        return fill.scatter(-1, self.indices, self.values)


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor | TopK, labels: Tensor, T: float = 2.0,
                      alpha: float = 0.5) -> Tensor:
    """alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, labels), averaged over positions.

    student_logits, teacher_logits: [..., V]; labels: [...] token ids, the hard targets (the CE is at
    temperature 1). alpha = 1: soft labels only; alpha = 0: plain next-token cross-entropy. A teacher logit of
    -inf (probability 0) contributes 0 to the KL (0 log 0 = 0). A `TopK` teacher goes to `topk_distillation_loss`
    (the same value as with `teacher.dense(V)`, without building it).
    """
    if T <= 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"need T > 0 and 0 <= alpha <= 1, got T={T}, alpha={alpha}")
    if isinstance(teacher_logits, TopK):
        return topk_distillation_loss(student_logits, teacher_logits, labels, T, alpha)
    s = student_logits.float().flatten(0, -2)                                # [N, V]
    log_q = F.log_softmax(s / T, dim=-1)                                     # student, at temperature T
    log_p = F.log_softmax(teacher_logits.float().flatten(0, -2) / T, dim=-1)  # teacher, at temperature T
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1).mean()        # KL(p || q), mean over positions
    ce = F.cross_entropy(s, labels.flatten())
    return alpha * T * T * kl + (1.0 - alpha) * ce


def topk_distillation_loss(student_logits: Tensor, teacher: TopK, labels: Tensor, T: float = 2.0,
                           alpha: float = 0.5) -> Tensor:
    """`distillation_loss` against `teacher.dense(V)`, computed from the k logits and the `rest` logit alone.

    With m = V - k dropped tokens all at logit c (= teacher.rest), the teacher at temperature T is
    log p_i = v_i / T - log Z for the k kept tokens and log p_r = c / T - log Z for each dropped one, where
    log Z = logsumexp(v_1 / T, ..., v_k / T, c / T + log m). The dropped tokens' part of the KL is
    sum_j p_r (log p_r - log q_j) = m p_r log p_r - p_r (sum_all log q - sum_kept log q): one sum over the
    vocabulary instead of a second [N, V] distribution (the training step's cost stays that of plain CE).
    """
    if T <= 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"need T > 0 and 0 <= alpha <= 1, got T={T}, alpha={alpha}")
    s = student_logits.float().flatten(0, -2)                                # [N, V]
    v, idx = teacher.values.float().flatten(0, -2) / T, teacher.indices.flatten(0, -2)   # [N, k]
    log_q = F.log_softmax(s if T == 1 else s / T, dim=-1)                    # (no [N, V] copy at T = 1)
    log_q_kept = log_q.gather(-1, idx)                                       # [N, k]
    m = s.shape[-1] - idx.shape[-1]
    if teacher.rest is None or m == 0:
        log_p = v - v.logsumexp(-1, keepdim=True)
        kl = (log_p.exp() * (log_p - log_q_kept)).sum(-1)
    else:
        c = teacher.rest.float().flatten() / T                               # [N]
        log_z = torch.logaddexp(v.logsumexp(-1), c + math.log(m))
        log_p, log_p_r = v - log_z[:, None], c - log_z
        kl_kept = (log_p.exp() * (log_p - log_q_kept)).sum(-1)
        kl_rest = log_p_r.exp() * (m * log_p_r - (log_q.sum(-1) - log_q_kept.sum(-1)))
        kl = kl_kept + kl_rest
    if alpha == 1:                         # skip the terms with weight 0: each is a pass over [N, V] both ways
        return T * T * kl.mean()
    ce = F.nll_loss(log_q, labels.flatten()) if T == 1 else F.cross_entropy(s, labels.flatten())
    return ce if alpha == 0 else alpha * T * T * kl.mean() + (1.0 - alpha) * ce


@torch.no_grad()
def teacher_topk(teacher: nn.Module, token_ids: Sequence[int], k: int = 64, window: int = 512,
                 keep_rest: bool = True) -> TopK:
    """The teacher's top-k next-token logits at every position of `token_ids` ([len, k]) and (`keep_rest`) the
    log-mean-exp of the other V - k logits, from forwards over consecutive windows of `window` tokens (each from
    scratch, like `quality.perplexity`). Without `rest` the student is taught that every token outside the
    top k is impossible, and pushes them all down: on new text, where the right token is sometimes outside the
    teacher's top k, that costs a lot."""
    vals, idx, rest = [], [], []
    for start in range(0, len(token_ids), window):
        chunk = torch.tensor([list(token_ids[start:start + window])])
        logits = teacher(chunk).logits[0].float()                         # [n, V]
        top = logits.topk(k, dim=-1)                                      # [n, k]
        vals.append(top.values)
        idx.append(top.indices)
        # log sum over the dropped logits = log(sum(all) - sum(top)), computed relative to sum(all)
        lse_all, lse_top = logits.logsumexp(-1), top.values.logsumexp(-1)
        tail = lse_all + torch.log1p(-torch.exp(lse_top - lse_all).clamp(max=1 - 1e-7))
        rest.append(tail - math.log(max(logits.shape[-1] - k, 1)))
    return TopK(torch.cat(vals), torch.cat(idx), torch.cat(rest) if keep_rest else None)


def pca_embedding(weight: Tensor, dim: int, std: float = 0.2) -> Tensor:
    """[V, dim]: the rows of an embedding [V, H] projected on its `dim` leading principal directions (eigenvectors
    of the H x H covariance; deterministic), rescaled so that the entries have standard deviation `std`.
    Tokens that the teacher embeds close together start close together in the student. Used frozen as a tied
    embedding, `std` also sets the logit scale: 0.02 (the usual random init) gives logits too small to train
    (the loss hardly moves), 1.0 too large ones at the start (initial loss ~80); 0.2 works."""
    x = weight.detach().float()
    x = x - x.mean(0)
    _, vecs = torch.linalg.eigh(x.T @ x)                                     # ascending eigenvalues
    proj = x @ vecs[:, -dim:].flip(-1)                                       # [V, dim], largest variance first
    return proj * (std / proj.std())


def tiny_student(vocab_size: int = 49152, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, max_position_embeddings: int = 512, seed: int = 0,
                 embedding: Tensor | None = None) -> nn.Module:
    """A small random Llama with a tied embedding (seeded; the caller's RNG is untouched). `embedding`
    [vocab_size, hidden_size], if given, initialises the (tied) embedding, e.g. `pca_embedding(teacher_emb, 64)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      intermediate_size=4 * hidden_size,
                      max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      rope_theta=10000.0, initializer_range=0.02, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    if embedding is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embedding)
    return model


@dataclass(slots=True)
class DistillResult:
    mode: str                        # "soft" or "hard"
    steps: int
    losses: list[float]              # training objective per step
    heldout_ppl: float               # perplexity on the held-out tokens after training
    heldout_curve: list[tuple[int, float]] = field(default_factory=list)   # (step, held-out perplexity)
    seconds: float = 0.0


def train_student(train_ids: Sequence[int], heldout_ids: Sequence[int], mode: Literal["soft", "hard"] = "soft",
                  teacher: TopK | None = None, steps: int = 200, seed: int = 0, batch_size: int = 4,
                  seq_len: int = 64, lr: float = 1e-2, T: float = 1.0, alpha: float = 1.0,
                  embedding: Tensor | None = None, freeze_embedding: bool = False, eval_every: int | None = None,
                  **student_kw) -> DistillResult:
    """Train `tiny_student(seed=seed, embedding=embedding, **student_kw)` with AdamW for `steps` steps, each on
    `batch_size` windows of `seq_len` tokens at random offsets of `train_ids`, and return its losses and its
    perplexity on `heldout_ids` (windows of `seq_len`: the longest context it was trained on).

    mode="hard": next-token cross-entropy on the text (the labels). mode="soft": `distillation_loss` with the
    teacher's top-k at the same positions (`teacher` = `teacher_topk(model, train_ids)`), temperature T, weight
    alpha. Seeded and deterministic: the same arguments give the same numbers (on the same machine and thread
    count: float sums in another order round differently).
    """
    from llmso_lab.quality import perplexity

    if mode not in ("soft", "hard"):
        raise ValueError(f"mode must be 'soft' or 'hard', got {mode!r}")
    if mode == "soft" and (teacher is None or teacher.values.shape[0] < len(train_ids)):
        raise ValueError("mode='soft' needs the teacher's top-k for every training position: "
                         "teacher=teacher_topk(teacher_model, train_ids)")
    if len(train_ids) < seq_len + 1:
        raise ValueError(f"need more than seq_len={seq_len} training tokens, got {len(train_ids)}")
    ids = torch.tensor(list(train_ids))
    gen = torch.Generator().manual_seed(seed)           # batch offsets: independent of the global RNG
    model = tiny_student(seed=seed, embedding=embedding, max_position_embeddings=max(seq_len, 64), **student_kw)
    model.get_input_embeddings().weight.requires_grad_(not freeze_embedding)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses, curve = [], []
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)            # refuse any op whose result depends on thread timing
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            model.train()
            starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=gen)
            pos = starts[:, None] + torch.arange(seq_len)                      # [B, L] positions of the inputs
            logits = model(ids[pos]).logits                                    # [B, L, V]
            labels = ids[pos + 1]
            if mode == "hard":
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            else:
                loss = distillation_loss(logits, teacher[pos], labels, T=T, alpha=alpha)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                curve.append((step + 1, perplexity(model.eval(), heldout_ids, window=seq_len)))
        ppl = perplexity(model.eval(), heldout_ids, window=seq_len)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    curve.append((steps, ppl))
    return DistillResult(mode, steps, losses, ppl, curve, time.perf_counter() - t0)


def compare_soft_hard(teacher: nn.Module, tokenizer, heldout_tokens: int = 1024, max_train_tokens: int | None = None,
                      k: int = 64, steps: int = 200, seed: int = 0, embedding: Literal["pca", "random"] = "pca",
                      **train_kw) -> dict:
    """Soft- vs hard-label students on the eval text: held-out = its first `heldout_tokens` tokens, train = the
    tokens after them (at most `max_train_tokens`). Both students start from the same weights and see the same
    batches (same seed); only the targets differ. embedding="pca": the student's tied embedding is
    `pca_embedding` of the teacher's, frozen (it is ~95% of the student's parameters, and ~40% of the held-out
    tokens never occur in a 1.7K-token training slice: a trained embedding learns only the seen ones);
    "random": the usual random init, trained.

    Returns {"soft": DistillResult, "hard": DistillResult, "teacher_ppl": the teacher's held-out perplexity at
    the students' window, "topk_mass": mean teacher probability in its top k, "teacher_seconds": time to
    compute the top-k, "train_tokens": int}.
    """
    from llmso_lab.quality import eval_token_ids, perplexity

    ids = eval_token_ids(tokenizer)
    heldout, train = ids[:heldout_tokens], ids[heldout_tokens:]
    train = train[:max_train_tokens] if max_train_tokens else train
    t0 = time.perf_counter()
    top = teacher_topk(teacher, train, k=k)
    teacher_seconds = time.perf_counter() - t0
    if embedding == "pca":
        train_kw = {"embedding": pca_embedding(teacher.get_input_embeddings().weight, train_kw.get("hidden_size", 64)),
                    "freeze_embedding": True, **train_kw}
    out: dict = {"train_tokens": len(train), "teacher_seconds": teacher_seconds}
    for mode in ("soft", "hard"):
        out[mode] = train_student(train, heldout, mode, top if mode == "soft" else None, steps=steps, seed=seed,
                                  vocab_size=teacher.config.vocab_size, **train_kw)
    out["teacher_ppl"] = perplexity(teacher, heldout, window=train_kw.get("seq_len", 64))
    out["topk_mass"] = float(top.kept_mass(teacher.config.vocab_size).mean())
    return out
