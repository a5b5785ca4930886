"""Drafters: what proposes the k tokens the target verifies (lecture 2-1). Each one implements

    propose(items) -> [(draft token ids, draft probabilities [s, V] or None), ...]   one pair per scheduled item

where an item (`ScheduledSeq`) is a decoding sequence with `num_lookahead` KV slots reserved after its last
token; a drafter may propose fewer tokens (s <= num_lookahead), or none. Probabilities None mean one-hot drafts
(the drafter is certain, q(d) = 1), which is what greedy drafting and n-gram lookup give.

- `NgramDrafter`: prompt lookup in the sequence's own tokens (`ngram.ngram_propose`'s rule, with an index per
  sequence that grows with it instead of a scan per step).
- `DraftModelDrafter`: a smaller model with the same tokenizer runs k steps ahead. It runs in the engine's own
  model runner, with its own paged KV cache indexed by the *same* block tables as the target's (vLLM does the
  same): the draft's K/V for a token lives in the slot where the target keeps its own. It catches up on the tokens
  it has not seen (the whole prompt at first, then the 1-2 tokens each step emits past its drafts), then proposes.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from llmso_lab.spec.ngram import ngram_propose

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig
    from llmso_lab.engine.scheduler import ScheduledSeq
    from llmso_lab.spec.config import SpeculativeConfig

Proposal = tuple[list[int], "Tensor | None"]


class Drafter:
    """What every drafter offers the engine (`spec.engine.SpeculativeDecoding` calls these). Only `propose` is
    required; the others default to doing nothing."""

    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        raise NotImplementedError

    def observe(self, seq, hidden: Tensor) -> None:
        """After a step: the target's final hidden state behind `seq`'s newest token (Medusa's heads read it)."""

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write in the target's cache: a drafter with its own paged cache copies the same blocks."""

    def forget(self, seq_id: int) -> None:
        """The sequence is retired: drop what is kept about it."""


class NgramDrafter(Drafter):
    """Prompt lookup (`ngram.ngram_propose`'s rule: the longest n from n_max down to n_min, the earliest
    occurrence) without scanning the sequence each step: per sequence, an index from every n-gram that has a token
    after it to where it first started, extended by the tokens appended since the last step. A step costs
    O(new tokens x n-gram sizes) instead of O(sequence length x n), so the draft stays cheap at long contexts
    (vLLM's n-gram proposer uses a KMP scan compiled with numba for the same reason)."""

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max (n-gram sizes), got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, tuple[dict[tuple[int, ...], int], list[int]]] = {}   # seq_id -> (first starts, [indexed])

    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        return [(self.lookup(item.seq.seq_id, item.seq.token_ids, item.num_lookahead), None) for item in items]

    def lookup(self, key: int, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens for the sequence `key` whose tokens are now `token_ids` (the earlier ones unchanged)."""
        first, indexed = self.index.setdefault(key, ({}, [0]))
        length = len(token_ids)
        # an n-gram can be proposed from once a token follows it: index those ending at indexed - 1 .. length - 2
        for end in range(max(indexed[0] - 1, 0), length - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                first.setdefault(tuple(token_ids[end - n + 1:end + 1]), end - n + 1)   # the earliest start stays
        indexed[0] = length
        if k < 1:
            return []
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = first.get(tuple(token_ids[length - n:]))
            if start is not None:
                return list(token_ids[start + n:start + n + k])
        return []

    def forget(self, seq_id: int) -> None:
        self.index.pop(seq_id, None)


def draw(logits: Tensor, params, generator: torch.Generator | None) -> tuple[int, Tensor | None]:
    """One draft token from fp32 logits [V] and the distribution it came from (None when greedy: one-hot)."""
    from llmso_lab.spec.verify import target_probs
    if params.greedy:
        return int(logits.argmax()), None
    q = target_probs(logits[None].cpu(), params)[0]
    return int(torch.multinomial(q, 1, generator=generator)), q


class DraftModelDrafter(Drafter):
    """A draft model run by a second `ModelRunner` (its KV cache indexed by the target's block tables)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target_vocab_size: int) -> None:
        from llmso_lab.engine.inputs import _resolve_model
        from llmso_lab.engine.cache_sizing import check_model_config
        from llmso_lab.engine.model_runner import ModelRunner

        model, _ = _resolve_model(spec.model, None)
        check_model_config(model.config)
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) differs from the target's "
                             f"({target_vocab_size}): a draft must share the target's tokenizer")
        if model.config.max_position_embeddings < config.max_model_len:
            raise ValueError(f"the draft model handles {model.config.max_position_embeddings} positions, fewer than "
                             f"max_model_len={config.max_model_len}; lower max_model_len")
        self.runner = ModelRunner(model, draft_runner_config(config, spec.quantization))
        self.model = model
        self.computed: dict[int, tuple[int, int]] = {}   # seq_id -> (its num_preemptions, tokens with draft K/V)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(mapping)   # copy-on-write copies the draft's K/V along with the target's

    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        from llmso_lab.engine.model_runner import BatchRow
        live = [i for i, item in enumerate(items) if item.num_lookahead > 0]
        if not live:
            return [([], None) for _ in items]
        # Catch up: the tokens whose draft K/V is missing (after a preemption or a new admission: all of them;
        # the draft K/V of rejected drafts is past seq.num_computed_tokens and is simply recomputed).
        rows = []
        for i in live:
            seq = items[i].seq
            nprem, done = self.computed.get(seq.seq_id, (seq.num_preemptions, 0))
            done = 0 if nprem != seq.num_preemptions else min(done, seq.num_computed_tokens)
            rows.append(BatchRow(seq.token_ids[done:], done, seq.block_table))
        def seen(seq, position: int) -> None:   # the draft K/V now covers positions < `position`
            self.computed[seq.seq_id] = (seq.num_preemptions, position)
        return draft_autoregressively(self.runner, items, live, rows, on_draft=seen)

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)


def draft_autoregressively(runner, items: list[ScheduledSeq], live: list[int], rows: list, embeds: list | None = None,
                           next_embed=None, on_draft=None) -> list[Proposal]:
    """A drafter's own model (`runner`, on the target's block tables) drafting up to each item's `num_lookahead`
    tokens: step 0 runs each live item's row in `rows` (its catch-up tokens), later steps one token per item (the one
    it just drafted), one-token rows first (the attention layout). `embeds` [per row]: input embeddings instead of
    token ids (EAGLE), and `next_embed(token, predicted hidden [1, H])` the next step's; `on_draft(seq, position)`
    after a token is drafted at `position`. Returns a proposal per item (those not live: none)."""
    from llmso_lab.engine.model_runner import BatchRow
    tokens: list[list[int]] = [[] for _ in items]
    probs: list[list[Tensor]] = [[] for _ in items]
    step = 0
    while live:
        order = sorted(range(len(rows)), key=lambda r: len(rows[r].token_ids) > 1)   # one-token rows first
        num_decodes = sum(len(rows[r].token_ids) == 1 for r in order)
        batch = runner.prepare_rows([rows[r] for r in order], num_decodes)
        logits = runner.forward(*batch, torch.cat([embeds[r] for r in order]) if embeds is not None else None)
        next_live, next_rows, next_embeds = [], [], []
        for j, r in enumerate(order):
            i, seq = live[r], items[live[r]].seq
            token, q = draw(logits[j], seq.sampling_params, seq.generator)
            tokens[i].append(token)
            if q is not None:
                probs[i].append(q)
            position = rows[r].start + len(rows[r].token_ids)          # where the drafted token goes
            if on_draft is not None:
                on_draft(seq, position)
            if step + 1 < items[i].num_lookahead:
                next_live.append(i)
                next_rows.append(BatchRow([token], position, seq.block_table))
                if embeds is not None:
                    next_embeds.append(next_embed(token, runner.last_hidden[j:j + 1]))
        live, rows, embeds, step = next_live, next_rows, (next_embeds if embeds is not None else None), step + 1
    return [(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]


def draft_runner_config(config: EngineConfig, quantization: str | None = None) -> EngineConfig:
    """The target's engine config for a drafter's own `ModelRunner`: the same blocks, block size, dtype and
    attention backend (its KV cache is indexed by the target's block tables), no speculation of its own."""
    from llmso_lab.engine.config import parse_quantization
    c = copy.copy(config)
    c.quantization, c.quantization_group_size = parse_quantization(quantization) if quantization else (None, 0)
    c.spec, c.num_speculative_tokens = None, 0
    return c


class MedusaDrafter(Drafter):
    """Medusa heads on the hidden state that produced each sequence's last token (`observe`d after each step)."""

    def __init__(self, spec: SpeculativeConfig, target, runner) -> None:
        from llmso_lab.spec.heads import load_head
        self.heads = load_head("medusa", spec.model, target).to(runner.dtype)
        self.runner = runner                                     # the target's: its LM head turns guesses into logits
        self.hidden: dict[int, Tensor] = {}                      # seq_id -> h_t of its last sampled token

    def observe(self, seq, hidden: Tensor) -> None:
        self.hidden[seq.seq_id] = hidden

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        from llmso_lab.engine.ops import linear
        out: list[Proposal] = []
        for item in items:
            h = self.hidden.get(item.seq.seq_id)
            if h is None:    # a forked sample that has not sampled on its own yet
                out.append(([], None))
                continue
            n = min(item.num_lookahead, self.heads.num_heads)
            logits = linear(self.heads(h[None])[:n, 0], self.runner.lm_head).float()   # [n, V]
            drafts = [draw(row, item.seq.sampling_params, item.seq.generator) for row in logits]
            qs = [q for _, q in drafts if q is not None]
            out.append(([t for t, _ in drafts], torch.stack(qs) if qs else None))
        return out

    def forget(self, seq_id: int) -> None:
        self.hidden.pop(seq_id, None)


class EagleDrafter(Drafter):
    """An EAGLE head run by its own one-layer `ModelRunner` on the target's block tables. Its input at position p
    needs the target's feature at p - 1: every token's feature (the target's final-normed hidden state, through the
    runner's `final_hidden_hook`) goes into a paged `feature_cache` that the target's KV store moves with its blocks
    (so prefix-cache hits, preemption and copy-on-write carry features along with K/V). Rejected drafts' features
    are overwritten later, as their K/V is."""

    def __init__(self, spec: SpeculativeConfig, target, config: EngineConfig, runner) -> None:
        from llmso_lab.engine.model_runner import ModelRunner
        from llmso_lab.spec.heads import load_head
        self.head = load_head("eagle", spec.model, target)
        self.target_runner = runner
        self.runner = ModelRunner(self.head.model, draft_runner_config(config))
        self.fc = self.head.fc.to(runner.dtype)
        self.computed: dict[int, tuple[int, int]] = {}          # seq_id -> (num_preemptions, positions done)
        hidden = target.config.hidden_size
        self.feature_cache = torch.zeros(1, runner.null_block + 1, runner.block_size, hidden, dtype=runner.dtype,
                                         device=runner.device)
        runner.kv_store.add_per_block(self.feature_cache)
        runner.final_hidden_hook = self._store_features

    def _store_features(self, features: Tensor, meta) -> None:
        self.feature_cache.view(-1, features.shape[-1]).index_copy_(0, meta.slot_mapping, features)

    def _features(self, seq, positions: list[int]) -> Tensor:
        """The target's features at `positions` (-1: the zero feature before the first token)."""
        bs, table = self.target_runner.block_size, seq.block_table
        cache = self.feature_cache.view(-1, self.feature_cache.shape[-1])
        slots = torch.tensor([table[p // bs] * bs + p % bs if p >= 0 else 0 for p in positions], device=cache.device)
        f = cache.index_select(0, slots)
        return f * torch.tensor([p >= 0 for p in positions], dtype=f.dtype, device=f.device)[:, None]

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        from llmso_lab.engine.model_runner import BatchRow
        live = [i for i, item in enumerate(items) if item.num_lookahead > 0]
        rows, embeds = [], []
        for i in live:   # catch up: positions done .. num_tokens - 1, with the target's features at p - 1
            seq = items[i].seq
            nprem, done = self.computed.get(seq.seq_id, (seq.num_preemptions, 0))
            done = 0 if nprem != seq.num_preemptions else min(done, seq.num_computed_tokens)
            ids = seq.token_ids[done:]
            rows.append(BatchRow(ids, done, seq.block_table))
            embeds.append(self._inputs(ids, self._features(seq, list(range(done - 1, seq.num_tokens - 1)))))
            self.computed[seq.seq_id] = (seq.num_preemptions, seq.num_tokens)   # later positions use guessed features
        return draft_autoregressively(self.runner, items, live, rows, embeds,
                                      next_embed=lambda token, guessed: self._inputs([token], guessed))

    def _inputs(self, token_ids: list[int], prev_features: Tensor) -> Tensor:
        ids = torch.tensor(token_ids, device=prev_features.device)
        emb = torch.nn.functional.embedding(ids, self.runner.embed)
        return self.fc(torch.cat([emb, prev_features.to(emb.dtype)], dim=-1))

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(mapping)

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)


def make_drafter(spec: SpeculativeConfig, config: EngineConfig, target, runner):
    """The drafter for `spec.method`, for the target model `target` run by `runner`."""
    if spec.method == "custom":
        if not isinstance(spec.drafter, Drafter):
            raise ValueError(f"speculative_config 'drafter' must be a llmso_lab.spec.drafters.Drafter (subclass it and "
                             f"override propose), got {type(spec.drafter).__name__}")
        return spec.drafter
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        return DraftModelDrafter(spec, config, runner.vocab_size)
    if spec.method == "medusa":
        return MedusaDrafter(spec, target, runner)
    return EagleDrafter(spec, target, config, runner)
