"""Quality of a (changed) model: perplexity on the project's eval text, `data/eval/eval_text.txt`.

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

__all__ = ["EVAL_TEXT_PATH", "EVAL_TEXT_SHA256", "load_eval_text", "eval_token_ids", "perplexity"]

EVAL_TEXT_PATH = Path(__file__).resolve().parents[1] / "data" / "eval" / "eval_text.txt"
EVAL_TEXT_SHA256 = "a802b9ebe795149e2163bf5a405a9c33cca5a37c400b769b13a6c130fbb641ef"   # see data/eval/README.md


def load_eval_text(path: str | Path = EVAL_TEXT_PATH) -> str:
    """The eval text (UTF-8). Raises ValueError if it is missing or not the recorded bytes (default path only)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} is missing: it ships with the repository (data/eval/)")
    data = path.read_bytes()
    if path == EVAL_TEXT_PATH and hashlib.sha256(data).hexdigest() != EVAL_TEXT_SHA256:
        raise ValueError(f"{path} differs from the recorded text (sha256); see data/eval/README.md")
    return data.decode("utf-8")


def eval_token_ids(tokenizer=None, max_tokens: int | None = None, path: str | Path = EVAL_TEXT_PATH) -> list[int]:
    """The eval text as token ids (no special tokens), cut to `max_tokens`. `tokenizer=None`: its UTF-8 bytes,
    one id per byte (0..255: the vocabulary of the tiny test models)."""
    text = load_eval_text(path)
    ids = list(text.encode("utf-8")) if tokenizer is None else tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:max_tokens]


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
