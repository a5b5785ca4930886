"""Speculative decoding in the engine (lecture 2-1), as a feature of its loop (`engine.features`).

`speculative_config={"method": "ngram" | "draft_model" | "medusa" | "eagle", "num_speculative_tokens": k, ...}`
(vLLM's names; `spec.config`). Each decoding sequence reserves k lookahead KV slots (the scheduler's `lookahead`),
a drafter fills them (`spec.drafters`), the target computes its last token and the k drafts in the same forward as
the rest of the batch, and rejection sampling (`spec.verify`; greedy: argmax matching) decides what is emitted:
greedy outputs equal plain decoding, sampled ones follow the target's distribution. Rejected drafts' slots are
rolled back and the blocks only they used freed (`accept`, `BlockManager.trim`). `llm.stats()` adds
`spec_num_draft_tokens`, `spec_num_accepted_tokens`, the acceptance rate and the mean accepted length.

Seams used: the scheduler's `lookahead` (`slots`, `accept`); hooks `after_schedule` (propose drafts into the reserved slots), `on_block_copies` (a drafter with its own
paged cache copies the same blocks), `take_logits` (verify each speculative row group, let Medusa see the hidden
states), `after_sample` (a decode whose slots got no draft emits its one token as a list), `on_retire`, `stats`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llmso_lab.spec.drafters import make_drafter
from llmso_lab.spec.verify import greedy_verify, speculative_verify, target_probs, verify_batch


class SpeculativeDecoding:
    name = "speculative_config"
    batched_verification: bool | None = None   # None: on a GPU (one Triton kernel for the batch); else per request

    def __init__(self, engine) -> None:
        c = engine.config
        self.drafter = make_drafter(c.spec, c, engine.model, engine.model_runner)
        self.k, self.max_model_len = c.num_speculative_tokens, c.max_model_len
        self.num_spec_steps = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.draft_probs: dict[int, Tensor] = {}   # this step's draft distributions (sampled drafts only)
        engine.scheduler.lookahead = self

    # ---- the scheduler's lookahead seam ----------------------------------------------------------------------
    def check_request(self, params) -> None:
        """Verification draws from `spec.verify.target_probs` (temperature, top-k, top-p), emits several tokens per
        step and keeps no log-probs: a request that processes its logits, uses min-p or asks for logprobs is refused."""
        if params.processes_logits or params.min_p > 0 or params.logprobs is not None:
            raise ValueError("speculative decoding serves temperature / top-k / top-p only: leave out the penalties, "
                             "min_tokens, min_p and logprobs, or start the engine without speculative_config")

    def slots(self, seq) -> int:
        """Draft slots for a decoding `seq`: num_speculative_tokens, fewer near its max_tokens or max_model_len
        (drafts past them could never be used); none for a sequence in a search group (beams)."""
        if seq.group is not None:
            return 0
        return max(0, min(self.k, seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens))

    def accept(self, scheduler, item, emitted: list[int], now: float) -> None:
        """A speculative decode emitted `emitted` (the accepted drafts, then one token from the target). The K/V
        of the last token and of each accepted draft is valid; the slots of rejected drafts are rolled back: the
        sequence's computed length stops before them (they are overwritten later) and the blocks only they
        used are freed. Tokens after a stop (EOS, max_tokens) are dropped."""
        seq = item.seq
        seq.num_computed_tokens += 1
        for j, token in enumerate(emitted):
            if j:
                seq.num_computed_tokens += 1     # draft j - 1 was accepted: its K/V (computed this step) is right
            scheduler.append_token(seq, token, now)
            if seq.is_finished:
                break
        scheduler.block_manager.trim(seq)
        scheduler.block_manager.cache_full_blocks(seq)

    # ---- the loop's hooks ---------------------------------------------------------------------------------------

    def on_retire(self, retired) -> None:
        for seq in retired:
            self.drafter.forget(seq.seq_id)

    def after_schedule(self, out) -> None:
        """Ask the drafter for tokens to fill each decode's reserved slots; the target verifies them in this step's
        forward. Decodes with drafts become multi-token rows, so the one-token rows are put first again."""
        items = [item for item in out.scheduled if item.num_lookahead]
        self.draft_probs = {}
        for item, (tokens, q) in zip(items, self.drafter.propose(items) if items else []):
            item.lookahead_token_ids = list(tokens[:item.num_lookahead])
            item.num_new_tokens = 1 + len(item.lookahead_token_ids)
            if q is not None:
                self.draft_probs[item.seq.seq_id] = q
        out.scheduled.sort(key=lambda item: item.num_query_tokens > 1)
        out.num_decodes = sum(item.num_query_tokens == 1 for item in out.scheduled)

    def on_block_copies(self, mapping) -> None:
        self.drafter.copy_blocks(mapping)

    def take_logits(self, rows, logits: Tensor, hidden: Tensor | None) -> dict[int, list[int]]:
        """rows: (item, first logits row, number of rows) of every item with logits. Verifies the items with drafts
        and returns the tokens each emits; tells the drafter the hidden state behind each sequence's newest token."""
        spec = [(r, item) for item, r, n in rows if item.lookahead_token_ids]
        emitted = self._verify_all(spec, logits)
        if hidden is not None:
            for item, r, n in rows:
                if item.sample:
                    done = emitted.get(item.seq.seq_id)
                    self.drafter.observe(item.seq, hidden[r + (len(done) - 1 if done else 0)])
        return emitted

    def after_sample(self, out, sampled: dict) -> None:
        for item in out.scheduled:   # a decode that reserved draft slots but got no draft: one token, as a list
            if item.num_lookahead and not item.lookahead_token_ids and not isinstance(sampled.get(item.seq.seq_id), list):
                sampled[item.seq.seq_id] = [sampled[item.seq.seq_id]]

    def _verify_all(self, spec: list, logits: Tensor) -> dict[int, list[int]]:
        """The tokens each speculative decode emits: its accepted drafts, then one from the target (a correction at
        the first rejection, or the bonus token after all). An item's rows of `logits` (from its first row r):
        the target at its last token and at each of its s drafts. Greedy: the longest run of drafts equal to the
        target's argmax; sampling: rejection sampling, so the emitted tokens are distributed exactly as the
        target's own samples (`llmso_lab.spec.verify`)."""
        emitted, batch = {}, []
        batched = logits.is_cuda if self.batched_verification is None else self.batched_verification
        for r, item in spec:
            seq, drafts = item.seq, item.lookahead_token_ids
            rows = logits[r:r + 1 + len(drafts)]
            if seq.sampling_params.greedy:
                emitted[seq.seq_id] = greedy_verify(rows.argmax(-1).tolist(), drafts)
                continue
            p = target_probs(rows if batched else rows.cpu(), seq.sampling_params)
            q = self.draft_probs.get(seq.seq_id)
            if q is None:   # one-hot drafts (n-gram lookup, greedy drafting)
                q = torch.zeros(len(drafts), p.shape[-1]).scatter_(1, torch.tensor(drafts)[:, None], 1.0)
            if batched:
                batch.append((seq, p, q.to(p.device), drafts))
            else:
                emitted[seq.seq_id] = speculative_verify(p, q, drafts, seq.generator)
        if batch:
            emitted.update(self._verify_batch(batch))
        for r, item in spec:
            self.num_spec_steps += 1
            self.num_draft_tokens += len(item.lookahead_token_ids)
            self.num_accepted_tokens += len(emitted[item.seq.seq_id]) - 1
        return emitted

    @staticmethod
    def _verify_batch(batch: list) -> dict[int, list[int]]:
        """Every sampled speculative decode of the step in one call (`verify_batch`: the Triton kernel on a GPU),
        padded to the most drafts; each request's random numbers come from its own generator."""
        k, V, dev = max(len(d) for *_, d in batch), batch[0][1].shape[-1], batch[0][1].device
        B = len(batch)
        p, q = torch.zeros(B, k + 1, V, device=dev), torch.zeros(B, k, V, device=dev)
        tokens, u, noise = torch.zeros(B, k, dtype=torch.int64), torch.zeros(B, k), torch.empty(B, V)
        for b, (seq, pb, qb, drafts) in enumerate(batch):
            s = len(drafts)
            p[b, :s + 1], q[b, :s] = pb, qb
            tokens[b, :s] = torch.tensor(drafts, dtype=torch.int64)
            u[b, :s] = torch.rand(s, generator=seq.generator)
            noise[b].exponential_(generator=seq.generator)
        num = torch.tensor([len(d) for *_, d in batch])
        out, n = verify_batch(p, q, tokens.to(dev), num.to(dev), u.to(dev), noise.to(dev))
        out, n = out.cpu(), n.cpu()
        return {seq.seq_id: out[b, :int(n[b])].tolist() for b, (seq, *_) in enumerate(batch)}

    def stats(self) -> dict:
        """vLLM's speculative-decoding metrics: drafts proposed and accepted, the acceptance rate, and the mean
        accepted length = tokens emitted per verification step (accepted drafts + the target's own token)."""
        steps, drafted, accepted = self.num_spec_steps, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_num_steps": steps, "spec_num_draft_tokens": drafted, "spec_num_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0}
