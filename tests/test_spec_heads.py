"""Draft heads and their training (scripts/train_spec_drafts.py), on tiny models only (never SmolLM2):
save/load round trips and their errors, EagleHead.forward against a hand-written fc + Llama layer, the
autoregressive EAGLE rollout against a start-by-start reference, the evaluation metrics against brute force,
and each training function lowering its loss on a fixed batch in 2 steps."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from llmso_lab.models import tiny_llama
from llmso_lab.spec.heads import EagleHead, MedusaHeads, load_draft_model, load_head, save_draft_model, save_head

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_spec_drafts", ROOT / "scripts" / "train_spec_drafts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


T = _load_script()
TARGET = tiny_llama(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=256, seed=0)


def eagle_head(seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(TARGET.config, intermediate_size=96).attach(TARGET)
    with torch.no_grad():                   # larger random weights than the init: every term matters
        for name, p in head.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return head.eval()


def generations(n: int = 3, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 256, (5 + i,), generator=g).tolist(),
             torch.randint(3, 256, (9 + 2 * i,), generator=g).tolist()) for i in range(n)]


def features(gens, hidden: int = 64, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(p) + len(o), hidden, generator=g).half() for p, o in gens]


# ------------------------------------------------------------------------------------- save / load
def test_medusa_round_trip_fp16(tmp_path):
    heads = MedusaHeads(64, 3)
    for lin in heads.res:
        torch.nn.init.normal_(lin.weight, std=0.1)
        torch.nn.init.normal_(lin.bias, std=0.1)
    path = tmp_path / "m.pt"
    save_head(heads, path, target="tiny")
    saved = torch.load(path, weights_only=True)
    assert saved["config"] == {"kind": "medusa", "hidden_size": 64, "num_heads": 3, "target": "tiny"}
    assert all(v.dtype == torch.float16 for v in saved["state_dict"].values())
    loaded = load_head("medusa", path, TARGET)
    assert loaded.num_heads == 3 and not loaded.training
    for (k, a), (k2, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a.half().float(), b)
    h = torch.randn(5, 64)
    torch.testing.assert_close(loaded(h), heads(h), atol=2e-3, rtol=2e-3)


def test_eagle_round_trip_fp16_leaves_out_the_targets_tables(tmp_path):
    head = eagle_head()
    path = tmp_path / "e.pt"
    save_head(head, path)
    saved = torch.load(path, weights_only=True)
    assert not any("embed_tokens" in k or "lm_head" in k for k in saved["state_dict"])
    assert saved["config"]["intermediate_size"] == 96
    loaded = load_head("eagle", path, TARGET)
    assert loaded.model.model.embed_tokens.weight is TARGET.get_input_embeddings().weight
    assert loaded.model.lm_head.weight is TARGET.get_output_embeddings().weight
    for k, v in head.trainable_state_dict().items():
        assert torch.equal(v.half().float(), loaded.trainable_state_dict()[k]), k
    ids, prev = torch.randint(0, 256, (1, 7)), torch.randn(1, 7, 64)
    torch.testing.assert_close(loaded(ids, prev)[1], head(ids, prev)[1], atol=0.05, rtol=0.02)


def test_load_head_errors(tmp_path):
    path = tmp_path / "m.pt"
    save_head(MedusaHeads(64, 2), path)
    with pytest.raises(ValueError, match="holds a medusa head, not a eagle head"):
        load_head("eagle", path, TARGET)
    other = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=256)
    with pytest.raises(ValueError, match="hidden size 64, the target has 32"):
        load_head("medusa", path, other)
    with pytest.raises(ValueError, match="no medusa head at"):
        load_head("medusa", tmp_path / "missing.pt", TARGET)
    with pytest.raises(ValueError, match="hidden size 64, the target 32"):
        load_head("medusa", MedusaHeads(64, 2), other)


def test_draft_model_round_trip_and_missing_file(tmp_path):
    model = T.make_draft_model(T.draft_config(vocab_size=256, hidden_size=64, num_layers=2, intermediate_size=96), seed=3)
    path = tmp_path / "d.pt"
    save_draft_model(model, path, target="tiny")
    saved = torch.load(path, weights_only=True)
    assert "lm_head.weight" not in saved["state_dict"]            # tied: stored once
    loaded = load_draft_model(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and not loaded.training
    assert loaded.config.num_hidden_layers == 2 and loaded.config.max_position_embeddings == 8192
    for k, v in model.state_dict().items():
        assert torch.equal(v.half().float(), loaded.state_dict()[k]), k
    with pytest.raises(ValueError, match="no draft model at .*train_spec_drafts.py draft"):
        load_draft_model(tmp_path / "missing.pt")
    torch.save({"weights": {}}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a draft model file"):
        load_draft_model(tmp_path / "bad.pt")


# ------------------------------------------------------------------------------------- EAGLE forward
def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    d = x.shape[-1]
    ang = pos[:, None].double() * (1.0 / theta ** (torch.arange(0, d, 2).double() / d))[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def manual_eagle(head: EagleHead, ids: torch.Tensor, prev: torch.Tensor, allowed: torch.Tensor | None = None,
                 pos: torch.Tensor | None = None) -> torch.Tensor:
    """fc([embed(x); f_prev]) through one Llama decoder layer and a final RMSNorm, written out by hand for one
    sequence (ids [T], prev [T, H]); `allowed` [T, T] replaces the causal mask."""
    cfg, layer = head.model.config, head.model.model.layers[0]
    eps, n_h, n_kv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = ids.shape[0]
    pos = torch.arange(n) if pos is None else pos
    x = torch.cat([TARGET.get_input_embeddings().weight[ids], prev], -1) @ head.fc.weight.T + head.fc.bias
    a = layer.self_attn
    h = _rms(x, layer.input_layernorm.weight, eps)
    q = _rope((h @ a.q_proj.weight.T).view(n, n_h, d), pos, 10000.0)
    k = _rope((h @ a.k_proj.weight.T).view(n, n_kv, d), pos, 10000.0).repeat_interleave(n_h // n_kv, dim=1)
    v = (h @ a.v_proj.weight.T).view(n, n_kv, d).repeat_interleave(n_h // n_kv, dim=1)
    allowed = torch.ones(n, n).tril().bool() if allowed is None else allowed
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    att = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), v).reshape(n, n_h * d)
    x = x + att @ a.o_proj.weight.T
    m = layer.mlp
    h = _rms(x, layer.post_attention_layernorm.weight, eps)
    x = x + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(x, head.model.model.norm.weight, eps)


def test_eagle_forward_equals_manual_layer():
    head = eagle_head()
    ids, prev = torch.randint(0, 256, (2, 9)), torch.randn(2, 9, 64)
    f, logits = head(ids, prev)
    for b in range(2):
        ref = manual_eagle(head, ids[b], prev[b])
        torch.testing.assert_close(f[b], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[b], ref @ TARGET.get_output_embeddings().weight.T, atol=1e-4, rtol=1e-4)


def test_eagle_rollout_equals_drafting_start_by_start():
    """Reference: from each start s, run the head on [teacher inputs 0..s, own-feature inputs s+1..] one
    step at a time (a fresh causal forward each step), as drafting with a KV cache computes it."""
    head = eagle_head(seed=1)
    (p, o), = generations(1)
    ids = torch.tensor(p + o)
    feats = torch.randn(len(ids), 64)
    steps = 3
    out = T.eagle_rollout(head, ids, feats, steps)                              # [steps, L, H]
    prev = torch.cat([torch.zeros(1, 64), feats[:-1]])
    for s in range(0, len(ids) - steps):
        ctx_prev = prev[:s + 1].clone()
        for j in range(steps):
            f = manual_eagle(head, ids[:s + 1 + j], ctx_prev)[-1]
            torch.testing.assert_close(out[j, s + j], f, atol=1e-4, rtol=1e-4)
            ctx_prev = torch.cat([ctx_prev, f[None]])                           # its own feature feeds the next step


def test_rollout_mask_small_case():
    m = T.rollout_mask(3, 2).int()
    # rows/cols: pass 1 positions 0..2, then pass 2 positions 0..2
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],      # pass 2 at q=0: start -1 (unused), itself only
                             [1, 0, 0, 0, 1, 0],      # start 0: teacher key 0, own key at 1
                             [1, 1, 0, 0, 0, 1]])
    assert torch.equal(m, expected)


# ------------------------------------------------------------------------------------- data and metrics
def test_chain_metrics_brute_force():
    correct = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    m = T.chain_metrics(correct)
    assert m["acc"] == [0.8, 0.8, 0.8, 0.8]
    lead = [next((j for j in range(4) if not row[j]), 4) for row in correct.tolist()]    # accepted drafts per row
    assert m["chain"] == [round(sum(a >= j for a in lead) / 5, 4) for j in range(1, 5)]
    assert m["tokens_per_step"] == pytest.approx(1 + sum(lead) / 5)


def test_pad_generations_targets_outputs_only():
    gens = [([5, 6, 7], [8, 9]), ([1, 2], [3, 4, 10, 11])]
    ids, targets = T.pad_generations(gens, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 10, 11]]
    assert targets.tolist() == [[-100, -100, 8, 9, -100, -100], [-100, 3, 4, 10, 11, -100]]


def test_medusa_examples_brute_force():
    gens = generations(2)
    feats = features(gens)
    for outputs_only in (True, False):
        h, targets = T.medusa_examples(gens, feats, k=3, outputs_only=outputs_only)
        rows = []
        for (p, o), f in zip(gens, feats):
            seq = p + o
            for t in range(len(p) - 1 if outputs_only else 0, len(seq) - 2):
                rows.append((f[t], [seq[t + 2 + i] if t + 2 + i < len(seq) else -100 for i in range(3)]))
        assert h.shape[0] == len(rows)
        assert torch.equal(h, torch.stack([r[0] for r in rows]))
        assert targets.tolist() == [r[1] for r in rows]


def test_eval_draft_chain_matches_greedy_drafting():
    """Teacher-forced agreement = what greedy drafting accepts: compare with drafting token by token."""
    model = T.make_draft_model(T.draft_config(vocab_size=256, hidden_size=64, num_layers=1, intermediate_size=64), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    (p, _), = generations(1)
    # an output the model partly agrees with: its own greedy continuation with every third token changed
    seq = list(p)
    for i in range(12):
        nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(nxt if i % 3 else (nxt + 1) % 256)
    gen = (p, seq[len(p):])
    m = T.eval_draft(model, [gen], k=3)
    accepted = []
    for s in T.draft_starts(len(p), len(seq), 3):
        ctx, n = seq[:s + 1], 0
        for j in range(3):
            guess = int(model(torch.tensor([ctx])).logits[0, -1].argmax())
            if guess != seq[s + 1 + j]:
                break
            ctx, n = ctx + [guess], n + 1
        accepted.append(n)
    assert m["tokens_per_step"] == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-4)


def test_prompts_deterministic_and_never_from_the_eval_text():
    calib = (ROOT / "data" / "eval" / "calib_text.txt").read_text()
    prompts = T.build_prompts(calib)
    assert prompts == T.build_prompts(calib) and 250 <= len(prompts) <= 350
    kinds = {p["kind"] for p in prompts}
    assert {"summarise", "quote", "rewrite", "json_edit", "context_qa", "question", "story"} <= kinds
    held = {p["kind"] for p in prompts[-len(prompts) // 10:]}
    assert len(held) >= 5                                              # the held-out tenth mixes kinds
    eval_text = (ROOT / "data" / "eval" / "eval_text.txt").read_text()
    eval_paras = {q.strip() for q in eval_text.split("\n\n") if len(q.strip()) > 80}
    text = "\n".join(p["messages"][0]["content"] for p in prompts)
    assert not any(q in text for q in eval_paras)
    assert sum(q.strip() in text for q in calib.split("\n\n") if len(q.strip()) > 150) >= 10
    assert all(p["messages"][0]["role"] == "user" for p in prompts)


def test_split_heldout_is_the_last_tenth():
    gens = [([i], [i]) for i in range(30)]
    train, held = T.split_heldout(gens)
    assert train == gens[:27] and held == gens[27:]


# ------------------------------------------------------------------------------------- training
def test_train_draft_lowers_the_loss_on_a_fixed_batch():
    model = T.make_draft_model(T.draft_config(vocab_size=256, hidden_size=64, num_layers=1, intermediate_size=64), seed=0)
    gens = generations(1)
    ids, targets = T.pad_generations(gens)
    with torch.no_grad():
        before = float(T.draft_loss(model, ids, targets))
    emb = model.get_input_embeddings().weight.clone()
    result = T.train_draft(model, gens, steps=2, batch_size=1, lr=1e-2, seed=0)
    with torch.no_grad():
        after = float(T.draft_loss(model, ids, targets))
    assert result.steps == 2 and result.losses[0] == pytest.approx(before, rel=1e-5)
    assert after < before - 1e-3
    assert torch.equal(model.get_input_embeddings().weight, emb)         # frozen unless unfreeze_at


def test_train_draft_unfreezes_the_embedding_late():
    model = T.make_draft_model(T.draft_config(vocab_size=256, hidden_size=64, num_layers=1, intermediate_size=64), seed=0)
    emb = model.get_input_embeddings().weight.clone()
    T.train_draft(model, generations(2), steps=2, batch_size=2, lr=1e-2, unfreeze_at=0.5)
    assert not torch.equal(model.get_input_embeddings().weight, emb)
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_train_medusa_lowers_the_loss_on_a_fixed_batch():
    gens = generations(2)
    h, targets = T.medusa_examples(gens, features(gens), k=3)
    lm_head = TARGET.get_output_embeddings().weight.detach()
    heads = MedusaHeads(64, 3)
    with torch.no_grad():
        before = float(T.medusa_loss(heads, lm_head, h.float(), targets))
    result = T.train_medusa(heads, lm_head, h, targets, steps=2, batch_size=h.shape[0], lr=1e-2)
    with torch.no_grad():
        after = float(T.medusa_loss(heads, lm_head, h.float(), targets))
    assert result.losses[0] == pytest.approx(before, rel=1e-5) and after < before - 1e-3


def test_train_eagle_lowers_the_loss_and_keeps_the_target_frozen():
    gens = generations(2)
    feats = features(gens)
    head = EagleHead(TARGET.config, intermediate_size=64).attach(TARGET)
    emb = TARGET.get_input_embeddings().weight.clone()
    batch = T.eagle_batch(gens, feats)
    with torch.no_grad():
        before = float(T.eagle_loss(head, *batch)[0])
    result = T.train_eagle(head, gens, feats, steps=2, batch_size=2, lr=1e-2)
    with torch.no_grad():
        after = float(T.eagle_loss(head, *batch)[0])
    assert result.losses[0] == pytest.approx(before, rel=1e-5) and after < before - 1e-3
    assert torch.equal(TARGET.get_input_embeddings().weight, emb)


def test_eagle_batch_shifts_features_right():
    gens = generations(2)
    feats = features(gens)
    ids, prev, f, labels, valid = T.eagle_batch(gens, feats)
    n0 = len(gens[0][0]) + len(gens[0][1])
    assert torch.equal(prev[0, 0], torch.zeros(64)) and torch.equal(prev[0, 1:n0], feats[0][:-1].float())
    assert labels[0, :n0 - 1].tolist() == (gens[0][0] + gens[0][1])[1:] and (labels[0, n0 - 1:] == -100).all()
    assert valid[0].sum() == n0 and valid[1].all()


def test_draft_embedding_whitens_the_pca_components():
    from llmso_lab.quant.distill import pca_embedding
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 32, generator=g) * 0.7 ** torch.arange(32.0)          # very unequal spreads
    plain = pca_embedding(weight, 8, 0.2)
    white = T.draft_embedding(weight, 8, std=0.2)
    assert plain.std(0)[0] > 3 * plain.std(0)[-1]                                  # what whitening removes
    torch.testing.assert_close(white.std(0), torch.full((8,), 0.2), atol=1e-5, rtol=0)
    cos = torch.nn.functional.cosine_similarity(white, plain, dim=0)              # each component only rescaled
    torch.testing.assert_close(cos, torch.ones(8), atol=1e-5, rtol=0)
    corr = torch.corrcoef(white.T)                                                 # still uncorrelated components
    torch.testing.assert_close(corr, torch.eye(8), atol=1e-4, rtol=0)
    assert torch.equal(T.draft_embedding(weight, 8, whiten=False), plain)


def test_committed_prompts_are_what_build_prompts_writes():
    import json
    committed = ROOT / "data" / "spec" / "train_prompts.json"
    calib = (ROOT / "data" / "eval" / "calib_text.txt").read_text(encoding="utf-8")
    assert json.loads(committed.read_text(encoding="utf-8")) == T.build_prompts(calib)
