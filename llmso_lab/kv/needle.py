"""Needle in a haystack on the project's own text: is one fact still retrievable after KV eviction?

The haystack is consecutive sentences of the eval text (`data/eval/eval_text.txt`, starting at a seeded sentence),
the needle is "The secret code is NNNN." placed at a controlled depth (0 = first sentence, 1 = last), and the
question at the end is phrased as a completion, which SmolLM2-135M answers with the full cache at 512 and 1024
tokens (fp32, greedy). Answers are scored by whether the 4-digit code appears in the generated text.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from llmso_lab.quality import load_eval_text

__all__ = ["Needle", "QUESTION", "haystack_sentences", "make_needle", "needle_ids", "needle_correct"]

QUESTION = "\n\nQuestion: What is the secret code?\nAnswer: The secret code is"


@dataclass(frozen=True, slots=True)
class Needle:
    context: str      # filler sentences with the needle sentence inside
    question: str     # appended after the context; the model completes it with the code
    answer: str       # the 4-digit code
    depth: float      # where the needle sits, as a fraction of the filler sentences before it


def haystack_sentences() -> list[str]:
    """Single-line sentences (20..300 characters) of the eval text, in order."""
    parts = re.split(r"(?<=[.!?])\s+", load_eval_text())
    return [s.strip() for s in parts if 20 < len(s.strip()) < 300 and "\n" not in s.strip()]


def make_needle(tokenizer, num_tokens: int, depth: float, seed: int = 0) -> Needle:
    """A haystack of about `num_tokens` tokens (context + question) with the code at `depth` in [0, 1].

    Seeded: the same (num_tokens, depth, seed) gives the same text and code on every machine.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if num_tokens < 64:
        raise ValueError(f"num_tokens must be >= 64 to hold filler, needle and question, got {num_tokens}")
    rng = random.Random(f"needle:{num_tokens}:{depth}:{seed}")
    code = str(rng.randrange(1000, 10000))
    needle = f"The secret code is {code}."
    count = lambda s: len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
    sents = haystack_sentences()
    target = num_tokens - count(needle) - count(QUESTION)
    i, filler, used = rng.randrange(len(sents)), [], 0
    while used + count(sents[i % len(sents)]) <= target:
        filler.append(sents[i % len(sents)])
        used += count(filler[-1])
        i += 1
    k = round(depth * len(filler))
    return Needle(" ".join(filler[:k] + [needle] + filler[k:]), QUESTION, code, depth)


def needle_ids(tokenizer, needle: Needle) -> tuple[torch.Tensor, torch.Tensor]:
    """`(context_ids [1, c], question_ids [1, q])`, tokenized separately so the question can be appended later."""
    enc = lambda s: torch.tensor([tokenizer(s, add_special_tokens=False)["input_ids"]])
    return enc(needle.context), enc(needle.question)


def needle_correct(generated: str, needle: Needle) -> bool:
    """True when the first number in the generated text is the code (so "1234 or 5678" does not count twice)."""
    found = re.findall(r"\d+", generated)
    return bool(found) and found[0] == needle.answer
