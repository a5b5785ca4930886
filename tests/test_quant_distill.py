"""Distillation: the loss against a hand-computed case and torch's kl_div, top-k form, deterministic training."""
import math

import pytest
import torch
import torch.nn.functional as F

from llmso_lab.models import tiny_llama
from llmso_lab.quality import eval_token_ids
from llmso_lab.quant.distill import (TopK, distillation_loss, pca_embedding, teacher_topk, topk_distillation_loss,
                                     train_student)


def test_distillation_loss_hand_computed():
    # V = 2, one position. Teacher logits (0, 0): p = (1/2, 1/2) at any T. Student (0, ln 3), label 1.
    s, t, y = torch.tensor([[0.0, math.log(3)]]), torch.zeros(1, 2), torch.tensor([1])
    # T = 1: q = (1/4, 3/4); KL(p || q) = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3); CE = -ln(3/4) = ln(4/3).
    assert distillation_loss(s, t, y, T=1.0, alpha=1.0).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert distillation_loss(s, t, y, T=1.0, alpha=0.0).item() == pytest.approx(math.log(4 / 3), rel=1e-6)
    # T = 2: q = (1, sqrt 3) / (1 + sqrt 3); the KL term is multiplied by T^2 = 4; the CE stays at T = 1.
    r = math.sqrt(3)
    kl = 0.5 * math.log(0.5 * (1 + r)) + 0.5 * math.log(0.5 * (1 + r) / r)
    expected = 0.25 * 4 * kl + 0.75 * math.log(4 / 3)
    assert distillation_loss(s, t, y, T=2.0, alpha=0.25).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("T", [1.0, 2.0, 4.0])
def test_distillation_loss_matches_torch_kl_div_and_cross_entropy(T):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 50, generator=g) * 3, torch.randn(3, 5, 50, generator=g) * 3
    y = torch.randint(0, 50, (3, 5), generator=g)
    kl = F.kl_div(F.log_softmax(s.reshape(15, 50) / T, -1), F.log_softmax(t.reshape(15, 50) / T, -1),
                  log_target=True, reduction="batchmean")
    ce = F.cross_entropy(s.reshape(15, 50), y.reshape(15))
    torch.testing.assert_close(distillation_loss(s, t, y, T=T, alpha=0.7), 0.7 * T * T * kl + 0.3 * ce)


def test_topk_form_equals_full_form_when_the_rest_has_no_mass():
    g = torch.Generator().manual_seed(1)
    s, t, y = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g) * 2, torch.randint(0, 40, (6,), generator=g)
    full = t.topk(40, -1)                                       # k = V: the whole distribution, reordered
    torch.testing.assert_close(distillation_loss(s, TopK(full.values, full.indices, None), y, T=2.0, alpha=0.5),
                               distillation_loss(s, t, y, T=2.0, alpha=0.5))
    top8 = t.topk(8, -1)                                        # k = 8 == a teacher with -inf outside its top 8
    masked = torch.full_like(t, -torch.inf).scatter(-1, top8.indices, top8.values)
    torch.testing.assert_close(distillation_loss(s, TopK(top8.values, top8.indices, None), y, T=3.0, alpha=1.0),
                               distillation_loss(s, masked, y, T=3.0, alpha=1.0))


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_topk_loss_with_rest_equals_the_dense_teacher(T):
    g = torch.Generator().manual_seed(4)
    s, t = torch.randn(2, 7, 30, generator=g) * 2, torch.randn(2, 7, 30, generator=g) * 2
    y = torch.randint(0, 30, (2, 7), generator=g)
    top = t.topk(6, -1)
    teacher = TopK(top.values, top.indices, torch.randn(2, 7, generator=g) - 2)
    dense = teacher.dense(30)
    assert dense.shape == (2, 7, 30) and torch.equal(dense.gather(-1, top.indices), top.values)
    for alpha in (1.0, 0.3, 0.0):
        expected = distillation_loss(s, dense, y, T=T, alpha=alpha)
        torch.testing.assert_close(topk_distillation_loss(s, teacher, y, T=T, alpha=alpha), expected)
        torch.testing.assert_close(distillation_loss(s, teacher, y, T=T, alpha=alpha), expected)
    s1, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()     # and the same gradient for training
    topk_distillation_loss(s1, teacher, y, T=T, alpha=0.5).backward()
    distillation_loss(s2, dense, y, T=T, alpha=0.5).backward()
    torch.testing.assert_close(s1.grad, s2.grad)


def test_distillation_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="T > 0"):
        distillation_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), T=0.0)


def test_teacher_topk_is_the_teachers_top_logits_per_position_and_keeps_the_rest_mass():
    teacher, ids = tiny_llama(), eval_token_ids(None, max_tokens=100)
    top = teacher_topk(teacher, ids, k=5, window=40)
    assert top.values.shape == (100, 5) and top.indices.shape == (100, 5) and top.rest.shape == (100,)
    with torch.no_grad():
        logits = teacher(torch.tensor([ids[40:80]])).logits[0]    # the second window, from scratch
    torch.testing.assert_close(top.values[40:80], logits.topk(5, -1).values)
    assert torch.equal(top.indices[40:80], logits.topk(5, -1).indices)
    # At T = 1 the dense teacher has the true probabilities of the top 5 and the true total of the rest.
    p_dense, p_true = top[40:80].dense(256).softmax(-1), logits.softmax(-1)
    idx = top.indices[40:80]
    torch.testing.assert_close(p_dense.gather(-1, idx), p_true.gather(-1, idx))
    torch.testing.assert_close(p_dense.sum(-1) - p_dense.gather(-1, idx).sum(-1), 1 - p_true.gather(-1, idx).sum(-1))
    torch.testing.assert_close(top[40:80].kept_mass(256), p_true.gather(-1, idx).sum(-1))
    rest = p_dense.scatter(-1, idx, -1.0)
    assert torch.allclose(rest[rest >= 0].reshape(40, -1), rest[rest >= 0].reshape(40, -1)[:, :1])   # spread evenly
    assert teacher_topk(teacher, ids, k=5, keep_rest=False).rest is None


def test_pca_embedding_shape_scale_and_principal_directions():
    w = torch.randn(300, 16, generator=torch.Generator().manual_seed(2)) * torch.tensor([10.0] + [1.0] * 15)
    e = pca_embedding(w, 4, std=0.05)
    assert e.shape == (300, 4) and e.std().item() == pytest.approx(0.05, rel=1e-5)
    var = e.var(0)
    assert bool((var[:-1] >= var[1:]).all())                   # largest variance first
    assert abs(F.cosine_similarity(e[:, 0], w[:, 0] - w[:, 0].mean(), dim=0)) > 0.9   # w's widest axis


def _tiny_run(mode, seed=0, steps=6):
    ids = eval_token_ids(None, max_tokens=600)
    train, held = ids[200:], ids[:200]
    top = teacher_topk(tiny_llama(), train, k=8) if mode == "soft" else None
    return train_student(train, held, mode, top, steps=steps, seed=seed, batch_size=2, seq_len=32, vocab_size=256,
                         hidden_size=32, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_training_is_deterministic(mode):
    a, b = _tiny_run(mode), _tiny_run(mode)
    assert len(a.losses) == 6 and a.losses == b.losses and a.heldout_ppl == b.heldout_ppl
    assert _tiny_run(mode, seed=1).losses != a.losses            # the seed matters (so the check can fail)


def test_training_lowers_the_loss_and_modes_differ():
    soft, hard = _tiny_run("soft", steps=30), _tiny_run("hard", steps=30)
    assert soft.losses[-1] < soft.losses[0] and hard.losses[-1] < hard.losses[0]
    assert soft.losses != hard.losses and math.isfinite(soft.heldout_ppl)
    assert soft.heldout_curve[-1] == (30, soft.heldout_ppl)


def test_soft_mode_needs_the_teacher():
    with pytest.raises(ValueError, match="teacher_topk"):
        train_student(list(range(100)), list(range(50)), "soft", None, vocab_size=256)


@pytest.mark.slow
def test_smollm2_teacher_topk_and_a_short_distillation_run():
    """The real pipeline, briefly: SmolLM2's top-64 holds most of its probability, and a frozen-PCA student
    trained on it for 30 steps lowers its loss and beats a uniform guess on held-out text. (The full soft vs
    hard comparison, `compare_soft_hard`, takes ~80 s: its numbers are in llmso_lab/quant/distill.py.)"""
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = eval_token_ids(tok)
    held, train = ids[:256], ids[1024:1024 + 512]
    top = teacher_topk(model, train, k=64)
    assert 0.5 < float(top.kept_mass(49152).mean()) < 1.0
    emb = pca_embedding(model.get_input_embeddings().weight, 64)
    r = train_student(train, held, "soft", top, steps=30, embedding=emb, freeze_embedding=True)
    assert sum(r.losses[-5:]) < sum(r.losses[:5]) and r.heldout_ppl < 49152 / 4
