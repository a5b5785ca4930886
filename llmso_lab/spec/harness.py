"""Run a drafter in the engine, as Lab 07's drafter exercise is graded: `run_drafter(drafter_cls, ...)`.

The drafter class gets `drafter_cls(n_min, n_max)` (the n-gram sizes of prompt lookup) and must be a
`spec.drafters.Drafter`: `propose(items)` returns one `(draft token ids, None)` per scheduled item, at most
`item.num_lookahead` tokens each, reading `item.seq.token_ids` (prompt + output so far) without changing it;
`forget(seq_id)` is called when a sequence retires. The harness runs the engine (`LLM`) on a seeded tiny Llama
(`models.tiny`; its greedy output repeats itself in places, so prompt lookup gets drafts accepted) twice with the
same prompts: plain greedy decoding, and `speculative_config={"method": "custom", "drafter": ...}`. It returns
plain data: whether the speculative tokens equal plain decoding's, whether every KV block is free afterwards,
the engine's speculative metrics (drafts proposed and accepted, acceptance rate, mean accepted length = tokens per
verification step, the lecture's metric) and how many target forwards (engine steps) each run took.
A drafter that breaks the contract (a wrong number of proposals, too many tokens, ids outside the vocabulary,
changing the sequence's tokens) raises a ValueError that says so.
"""
from __future__ import annotations

import torch

from llmso_lab.spec.drafters import Drafter

__all__ = ["run_drafter", "repetitive_prompts"]


class _Checked(Drafter):
    """The drafter under test, with the engine's contract checked on every call."""

    def __init__(self, inner, vocab_size: int) -> None:
        self.inner, self.vocab_size = inner, vocab_size

    def propose(self, items):
        before = [list(item.seq.token_ids) for item in items]
        out = self.inner.propose(items)
        try:
            out = list(out)
        except TypeError:
            raise ValueError(f"propose must return a list of (token ids, None) pairs, got {type(out).__name__}") from None
        if len(out) != len(items):
            raise ValueError(f"propose got {len(items)} items and returned {len(out)} proposals: one per item")
        checked = []
        for item, old, proposal in zip(items, before, out):
            if list(item.seq.token_ids) != old:
                raise ValueError("propose changed seq.token_ids: the sequence's tokens belong to the engine, a drafter "
                                 "only reads them (drafts go in the returned list)")
            if not (isinstance(proposal, (tuple, list)) and len(proposal) == 2):
                raise ValueError(f"each proposal is a pair (token ids, None), got {proposal!r:.80}")
            tokens, probs = proposal
            tokens = [int(t) for t in tokens]
            if len(tokens) > item.num_lookahead:
                raise ValueError(f"{len(tokens)} draft tokens for an item with num_lookahead={item.num_lookahead} "
                                 "reserved KV slots: propose at most num_lookahead")
            if any(not 0 <= t < self.vocab_size for t in tokens):
                raise ValueError(f"draft token ids {tokens} outside the vocabulary [0, {self.vocab_size})")
            checked.append((tokens, probs))
        return checked

    def observe(self, seq, hidden) -> None:
        self.inner.observe(seq, hidden)

    def copy_blocks(self, mapping) -> None:
        self.inner.copy_blocks(mapping)

    def forget(self, seq_id: int) -> None:
        self.inner.forget(seq_id)


def repetitive_prompts(num_prompts: int, seed: int, vocab_size: int = 256) -> list[list[int]]:
    """Random token prompts that repeat a passage (A B A B[:3]), as a quoting or editing prompt does."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num_prompts):
        a = torch.randint(3, vocab_size, (12,), generator=g).tolist()
        b = torch.randint(3, vocab_size, (8,), generator=g).tolist()
        prompts.append(a + b + a + b[:3])
    return prompts


def run_drafter(drafter_cls, k: int = 4, n_min: int = 2, n_max: int = 4, num_prompts: int = 4, max_tokens: int = 48,
                seed: int = 0, num_kv_blocks: int = 128, block_size: int = 4) -> dict:
    """The engine run with `drafter_cls(n_min, n_max)` drafting k tokens per step, against plain greedy decoding
    (see the module docstring). A small `num_kv_blocks` makes the engine preempt (recompute) sequences."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=1, initializer_range=0.1, seed=seed)
    vocab = model.config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(num_prompts, seed, vocab)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine_args = dict(max_num_seqs=num_prompts, block_size=block_size, num_kv_blocks=num_kv_blocks, max_model_len=128)
    plain = LLM(model, None, **engine_args)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    drafter = drafter_cls(n_min, n_max)
    if not isinstance(drafter, Drafter):
        raise ValueError(f"{type(drafter).__name__} must subclass llmso_lab.spec.drafters.Drafter")
    llm = LLM(model, None, **engine_args, speculative_config={"method": "custom", "num_speculative_tokens": k,
                                                              "drafter": _Checked(drafter, vocab)})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    s = llm.stats()
    return {"tokens_equal_plain": got == want,
            "blocks_free_after": llm.block_manager.num_free_blocks == llm.block_manager.num_blocks,
            "spec_num_draft_tokens": s["spec_num_draft_tokens"], "spec_num_accepted_tokens": s["spec_num_accepted_tokens"],
            "spec_acceptance_rate": round(s["spec_acceptance_rate"], 6),
            "spec_mean_accepted_length": round(s["spec_mean_accepted_length"], 6),
            "target_forwards_plain": plain.stats()["num_steps"], "target_forwards_spec": s["num_steps"]}
