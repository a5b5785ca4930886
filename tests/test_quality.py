"""Perplexity on the shared eval text: the text is the recorded one, and `perplexity` equals exp(HF's own loss)."""
from __future__ import annotations

import hashlib
import math

import pytest
import torch

from llmso_lab.models import tiny_llama
from llmso_lab.quality import EVAL_TEXT_PATH, EVAL_TEXT_SHA256, eval_token_ids, load_eval_text, perplexity


def test_eval_text_is_the_recorded_one():
    text = load_eval_text()
    assert hashlib.sha256(text.encode()).hexdigest() == EVAL_TEXT_SHA256
    assert len(text.split()) == 2314 and len(text.encode()) == 12862
    readme = (EVAL_TEXT_PATH.parent / "README.md").read_text()
    assert "Apache-2.0" in readme and EVAL_TEXT_PATH.name in readme
    ids = eval_token_ids()   # no tokenizer: UTF-8 bytes
    assert ids == list(text.encode()) and max(ids) < 256 and eval_token_ids(max_tokens=100) == ids[:100]


def test_perplexity_is_exp_of_hf_loss():
    model, ids = tiny_llama(), eval_token_ids(max_tokens=300)
    with torch.no_grad():
        one = model(torch.tensor([ids[:128]]), labels=torch.tensor([ids[:128]])).loss.item()   # mean over 127
    assert perplexity(model, ids[:128], window=128) == pytest.approx(math.exp(one), rel=1e-5)
    # three windows (128, 128, 44 tokens): predicted-token-weighted mean of HF's per-window losses
    with torch.no_grad():
        losses = [(model(torch.tensor([w]), labels=torch.tensor([w])).loss.item(), len(w) - 1)
                  for w in (ids[:128], ids[128:256], ids[256:300])]
    expected = math.exp(sum(l * n for l, n in losses) / sum(n for _, n in losses))
    assert perplexity(model, ids, window=128) == pytest.approx(expected, rel=1e-5)


def test_a_uniform_guess_scores_the_vocabulary_size():
    model = tiny_llama(vocab_size=256)
    with torch.no_grad():
        model.lm_head.weight.zero_()   # tied: every logit is 0
    assert perplexity(model, eval_token_ids(max_tokens=64), window=32) == pytest.approx(256, rel=1e-6)
    with pytest.raises(ValueError, match="window"):
        perplexity(model, [1, 2, 3], window=1)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(model, [1])


@pytest.mark.slow
def test_smollm2_finds_the_text_ordinary():
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = eval_token_ids(tok)
    assert len(ids) == 2687
    ppl = perplexity(model, ids[:1024], window=512)
    assert 5 < ppl < 40, ppl   # ordinary prose for a 135M model; a uniform guess would be 49,152
