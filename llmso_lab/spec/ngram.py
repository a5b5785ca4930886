"""n-gram prompt lookup (lecture 2-1): drafts with no model at all.

When a model quotes, summarises or edits a given text, the tokens it is about to write often follow, somewhere
earlier in the sequence, the very tokens it has just written. Prompt lookup finds the last `n` tokens earlier in
the sequence (the longest n from `n_max` down to `n_min` that matches) and proposes the `k` tokens that followed
that occurrence. The earliest occurrence is used, as Hugging Face's `prompt_lookup_num_tokens` does (vLLM's
`method="ngram"` is the same idea). The draft is one-hot: the drafter is certain of each token (q = 1).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["ngram_propose"]


def ngram_propose(token_ids: Sequence[int], k: int, n_min: int = 2, n_max: int = 4) -> list[int]:
    """Up to `k` draft tokens for the sequence `token_ids` (prompt + output so far); [] when no n-gram of
    n_min..n_max tokens ending the sequence occurred before (with at least one token after it)."""
    if k < 1 or not 1 <= n_min <= n_max:
        raise ValueError(f"need k >= 1 and 1 <= n_min <= n_max, got k={k}, n_min={n_min}, n_max={n_max}")
    tokens, length = list(token_ids), len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        for i in range(length - n):                  # earliest first; i + n < length: something follows it
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []
