"""Quality of a (changed) model: perplexity on the project's eval text, `data/eval/eval_text.txt`
(and the calibration text, `data/eval/calib_text.txt`, for methods that need activations).

Fewer KV heads, quantised weights or a compressed KV cache make serving cheaper; perplexity on one fixed,
ordinary text says what that costs. Perplexity = exp(mean negative log-likelihood of each next token):
1 is a model that is always sure and right, the vocabulary size is a uniform guess.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["EVAL_TEXT_PATH", "EVAL_TEXT_SHA256", "CALIB_TEXT_PATH", "CALIB_TEXT_SHA256", "load_eval_text",
           "eval_token_ids", "calibration_token_ids", "perplexity"]

_DATA = Path(__file__).resolve().parents[1] / "data" / "eval"
EVAL_TEXT_PATH = _DATA / "eval_text.txt"      # scored: authored prose + Python docs prose, 8,832 SmolLM2 tokens
EVAL_TEXT_SHA256 = "01bccde84406343e710ec50c5c94f732077fd347ea8d63eabcae3a2fa274f644"   # see data/eval/README.md
CALIB_TEXT_PATH = _DATA / "calib_text.txt"    # never scored: calibration data (AWQ, GPTQ, SmoothQuant), 3,112 tokens
CALIB_TEXT_SHA256 = "586a4ad8cf3e501e034a04e3b279fe2a5d9a06c15bf31ea32545993aff954376"
_RECORDED = {EVAL_TEXT_PATH: EVAL_TEXT_SHA256, CALIB_TEXT_PATH: CALIB_TEXT_SHA256}


def load_eval_text(path: str | Path = EVAL_TEXT_PATH) -> str:
    """A text of data/eval (UTF-8): the eval text by default. Raises ValueError if it is missing or, for the
    project's two texts, not the recorded bytes (sha256)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} is missing: it ships with the repository (data/eval/)")
    data = path.read_bytes()
    recorded = _RECORDED.get(path.resolve())
    if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
        raise ValueError(f"{path} differs from the recorded text (sha256); see data/eval/README.md")
    return data.decode("utf-8")


def eval_token_ids(tokenizer=None, max_tokens: int | None = None, path: str | Path = EVAL_TEXT_PATH) -> list[int]:
    """The eval text (or the text at `path`) as token ids (no special tokens), cut to `max_tokens`.
    `tokenizer=None`: its UTF-8 bytes, one id per byte (0..255: the vocabulary of the tiny test models)."""
    text = load_eval_text(path)
    ids = list(text.encode("utf-8")) if tokenizer is None else tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:max_tokens]


def calibration_token_ids(tokenizer=None, max_tokens: int | None = None) -> list[int]:
    """The calibration text (`data/eval/calib_text.txt`) as token ids, like `eval_token_ids`. For methods that
    look at activations (AWQ, GPTQ, SmoothQuant); it shares no paragraph with the eval text, so a method is
    never scored on what it was calibrated on."""
    return eval_token_ids(tokenizer, max_tokens, CALIB_TEXT_PATH)


@torch.no_grad()
def perplexity(model, token_ids: Sequence[int], window: int = 512) -> float:
    """Perplexity of a Hugging Face causal LM on `token_ids`, scored in consecutive windows of `window` tokens.

    Each window [t0, t0 + window) is one forward from scratch (no context carried over from the window before),
    predicting its tokens 1..n-1 from those before them; the negative log-likelihoods (natural log, in fp32) of
    all predicted tokens are averaged, then exponentiated. Longer windows give each prediction more context,
    hence a lower perplexity: compare models at the same `window`.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    device = model.get_input_embeddings().weight.device
    total_nll, predicted = 0.0, 0
    for start in range(0, len(token_ids), window):
        chunk = torch.tensor([list(token_ids[start:start + window])], device=device)   # [1, n]
        if chunk.shape[1] < 2:
            break
        logits = model(chunk).logits[0, :-1].float()                                   # [n - 1, vocab]
        total_nll += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        predicted += chunk.shape[1] - 1
    if not predicted:
        raise ValueError("need at least 2 tokens to score")
    return math.exp(total_nll / predicted)
