"""Perplexity on the shared eval text: the texts are the recorded ones, and `perplexity` equals exp(HF's own loss)."""
from __future__ import annotations

import hashlib
import importlib.util
import math
import platform

import pytest
import torch

from llmso_lab.models import tiny_llama
from llmso_lab.quality import (CALIB_TEXT_PATH, CALIB_TEXT_SHA256, EVAL_TEXT_PATH, EVAL_TEXT_SHA256,
                               calibration_token_ids, eval_token_ids, load_eval_text, perplexity)

AUTHORED_BYTES = 12862   # the project's own prose: the start of eval_text.txt, unchanged since Lab 05 recorded it


def _builder():
    spec = importlib.util.spec_from_file_location("build_pydoc_text", EVAL_TEXT_PATH.parent / "build_pydoc_text.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _paragraphs(text: str) -> set[str]:
    return {p.strip() for p in text.split("\n\n") if p.strip()}


def test_eval_text_is_the_recorded_one():
    text = load_eval_text()
    data = text.encode()
    assert hashlib.sha256(data).hexdigest() == EVAL_TEXT_SHA256
    assert len(text.split()) == 6555 and len(data) == 40504
    # the authored part is unchanged: Lab 05's recorded results score it
    assert hashlib.sha256(data[:AUTHORED_BYTES]).hexdigest() == \
        "a802b9ebe795149e2163bf5a405a9c33cca5a37c400b769b13a6c130fbb641ef"
    assert len(data[:AUTHORED_BYTES].decode().split()) == 2314
    readme = (EVAL_TEXT_PATH.parent / "README.md").read_text()
    for needle in ("Apache-2.0", "Python Software Foundation License", EVAL_TEXT_PATH.name, CALIB_TEXT_PATH.name):
        assert needle in readme, needle
    ids = eval_token_ids()   # no tokenizer: UTF-8 bytes
    assert ids == list(data) and max(ids) < 256 and eval_token_ids(max_tokens=100) == ids[:100]


def test_calibration_text_is_recorded_and_disjoint_from_the_eval_text():
    calib = load_eval_text(CALIB_TEXT_PATH)
    assert hashlib.sha256(calib.encode()).hexdigest() == CALIB_TEXT_SHA256
    assert len(calib.split()) == 2365 and len(calib.encode()) == 14555
    assert calibration_token_ids() == list(calib.encode()) and calibration_token_ids(max_tokens=7) == list(calib.encode()[:7])
    shared = _paragraphs(calib) & _paragraphs(load_eval_text())
    assert not shared, f"calibration and eval texts share {len(shared)} paragraphs"
    assert len(_paragraphs(calib)) > 40


def test_a_changed_text_is_refused(tmp_path, monkeypatch):
    import llmso_lab.quality as quality

    fake = tmp_path / "calib_text.txt"
    fake.write_text(load_eval_text(CALIB_TEXT_PATH) + "one more line\n")
    monkeypatch.setitem(quality._RECORDED, fake.resolve(), CALIB_TEXT_SHA256)
    with pytest.raises(ValueError, match="differs from the recorded text"):
        load_eval_text(fake)
    with pytest.raises(ValueError, match="missing"):
        load_eval_text(tmp_path / "nothing.txt")


@pytest.mark.skipif(platform.python_version() != "3.11.7",
                    reason="the texts were built from Python 3.11.7's pydoc_data; other releases edit the docs")
def test_the_builder_reproduces_both_files():
    b = _builder()
    appended, eval_paras = b.build(b.EVAL_TOPICS)
    calib, calib_paras = b.build(b.CALIB_TOPICS)
    assert load_eval_text().encode()[AUTHORED_BYTES:] == b"\n" + appended.encode()
    assert load_eval_text(CALIB_TEXT_PATH) == calib
    assert not set(b.EVAL_TOPICS) & set(b.CALIB_TOPICS) and not set(eval_paras) & set(calib_paras)
    # what the filter drops: grammar, code, short lines; what it joins: wrapped lines, hyphen breaks
    assert all("::=" not in p and ">>>" not in p and len(p) >= b.MIN_CHARS and "\n" not in p for p in eval_paras)
    assert b._join(["a reference-", "counting scheme"]) == "a reference-counting scheme"


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
    assert len(ids) == 8832 >= 8192 and len(calibration_token_ids(tok)) == 3112
    # the authored part tokenizes as before: its 2,687 tokens start the text (Lab 05 scores the first 512)
    authored = load_eval_text().encode()[:AUTHORED_BYTES].decode()
    assert ids[:2687] == tok(authored, add_special_tokens=False)["input_ids"]
    ppl = perplexity(model, ids[:1024], window=512)
    assert 5 < ppl < 40, ppl   # ordinary prose for a 135M model; a uniform guess would be 49,152
