"""Beam search (vLLM's `LLM.beam_search` / `BeamSearchParams`), scored as Hugging Face `generate` scores it.

A request keeps `beam_width` live beams. Each step every live beam gives the log-probabilities of its next
token; the candidates are all (beam, token) pairs scored by `beam's cumulative log-prob + log p(token)`.
The engine side (`BeamSearch`, the feature behind `LLM.beam_search`) turns the chosen candidates into KV
operations: a beam chosen k times is forked k - 1 times (its blocks shared copy-on-write), a beam chosen 0 times is
pruned (its blocks freed). A beam's logits are taken from the loop (`take_logits`) instead of sampled; once every
live beam of a group has its log-probs, the group steps (`after_update`).

The rules follow Hugging Face `generate(num_beams=W, do_sample=False, early_stopping=True)`:
- the best K = max(2, 1 + #EOS ids) x W candidates are ranked;
- a candidate that ends with EOS, or reaches `max_tokens`, is a finished hypothesis if it ranks among the
  best W candidates, scored `cum_logprob / generated_len ** length_penalty` (EOS counted in the length);
- the best W other candidates are the next live beams;
- the search stops when W hypotheses have finished (early_stopping=True) or when every candidate finished.
vLLM's own beam search scores differently: it divides by the whole sequence's length, prompt included, and
leaves EOS out of that length; with prompts of different lengths that can rank finished beams differently.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from llmso_lab.engine.sequence import Sequence


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]         # prompt + output (vLLM's convention)
    cum_logprob: float        # sum of the output tokens' log-probabilities
    score: float              # cum_logprob / output_len ** length_penalty: what the beams are ranked by
    text: str = ""            # the decoded output (without the prompt)
    finish_reason: str = ""   # "stop" (EOS) | "length" (max_tokens)


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first; beam_width of them


@dataclass(slots=True)
class Candidate:
    parent: int        # index of the live beam it extends
    token: int
    cum_logprob: float


@dataclass(eq=False)
class BeamSearchGroup:
    """One prompt's search state. `beams[i]` is live with cumulative log-prob `scores[i]`."""
    request_id: str
    prompt_len: int
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    beams: list[Sequence] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    pending: dict[int, Tensor] = field(default_factory=dict)   # seq_id -> log-probs [V] of its next token
    done: bool = False

    def ready(self) -> bool:
        """Has every live beam given its next-token log-probs?"""
        return not self.done and all(b.seq_id in self.pending for b in self.beams)

    def step(self) -> list[Candidate]:
        """Rank the candidates, record the finished hypotheses; return the next live beams' candidates
        (best first). Sets `done` when the search is over."""
        W, V = self.params.beam_width, next(iter(self.pending.values())).shape[-1]
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        acc = torch.stack([self.pending[b.seq_id] + s for b, s in zip(self.beams, self.scores)])   # [B, V] fp32
        self.pending.clear()
        values, indices = acc.flatten().topk(min(max(2, 1 + len(eos)) * W, acc.numel()))
        gen_len = len(self.beams[0].token_ids) - self.prompt_len + 1
        was_full, live, hits = len(self.finished) == W, [], 0
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            parent, token = divmod(index, V)
            if token in eos or gen_len >= self.params.max_tokens:
                hits += 1
                if rank < W and not was_full:   # only the best W may finish (the rest are spares)
                    self.finished.append(BeamSearchSequence(
                        self.beams[parent].token_ids + [token], value, value / gen_len ** self.params.length_penalty,
                        finish_reason="stop" if token in eos else "length"))
            elif len(live) < W:
                live.append(Candidate(parent, token, value))
        self.finished = sorted(self.finished, key=lambda h: h.score, reverse=True)[:W]
        self.done = len(self.finished) == W or hits == len(values)
        return [] if self.done else live


class BeamSearch:
    """The engine feature behind `LLM.beam_search` (always present; idle unless a beam search runs)."""
    name = "beam_search"

    def __init__(self, engine) -> None:
        self.engine = engine
        self.groups: dict[str, BeamSearchGroup] = {}   # beam searches in progress
        self.touched: dict[str, BeamSearchGroup] = {}  # groups that got log-probs this step

    def stats(self) -> dict:
        return {}

    def take_logits(self, rows, logits: Tensor, hidden) -> dict[int, None]:
        """A beam's next-token log-probs wait for the rest of its group (`_step_group`): not sampled."""
        taken = {}
        for item, r, n in rows:
            group = item.seq.group
            if group is not None and item.sample:
                group.pending[item.seq.seq_id] = logits[r].float().cpu().log_softmax(-1)
                self.touched[group.request_id] = group
                taken[item.seq.seq_id] = None
        return taken

    def after_update(self, now: float) -> None:
        for group in self.touched.values():
            if group.ready():
                self._step_group(group, now)
        self.touched = {}

    def _step_group(self, group: BeamSearchGroup, now: float) -> None:
        """Every live beam of `group` has its next-token log-probs: choose the next beams, then fork the beams
        chosen more than once (blocks shared), extend the others and prune the beams nobody chose."""
        engine = self.engine
        chosen = group.step()
        kept = {cand.parent for cand in chosen}
        for p, parent in enumerate(group.beams):
            if p not in kept:
                engine.scheduler.abort(parent)   # pruned: its blocks go back (those it shared stay with the others)
        # A parent chosen k times is forked k - 1 times before any beam grows, so each child starts from its tokens.
        beams, seen = [], set()
        for cand in chosen:
            parent = group.beams[cand.parent]
            beams.append(parent if cand.parent not in seen else
                         engine.fork(parent, len(engine.samples[group.request_id]), parent.seed))
            seen.add(cand.parent)
        for beam, cand in zip(beams, chosen):
            beam.append_token(cand.token, now)
        group.beams, group.scores = beams, [cand.cum_logprob for cand in chosen]
        engine.num_generated_tokens += len(chosen)
        if group.done:
            for beam in group.beams:
                engine.scheduler.abort(beam)
            group.beams = []

    def run(self, prompts, params: BeamSearchParams, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """`LLM.beam_search`: beams fork by copy-on-write and free their blocks when pruned; the scores follow Hugging
        Face (above). Returns, per prompt, its `beam_width` best sequences, best first."""
        from llmso_lab.engine.sampling_params import SamplingParams
        engine, config = self.engine, self.engine.config
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        for feature in engine.features:   # what cannot fork and prune (lock-step batches, KV eviction) says so
            if hasattr(feature, "check_search"):
                feature.check_search()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sp = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True)
        checked = [engine.validate(p, sp, 0) for p in prompts]
        num_blocks = engine.block_manager.num_blocks
        for ids, _ in checked:
            need = params.beam_width * -(-(len(ids) + params.max_tokens) // config.block_size)
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} exceeds "
                                 f"max_model_len={engine.max_model_len}")
            if need > num_blocks:
                raise ValueError(f"beam_width={params.beam_width} beams of {len(ids)} + {params.max_tokens} tokens may "
                                 f"need {need} KV blocks but the cache has {num_blocks}; raise "
                                 "num_kv_blocks or lower beam_width / max_tokens")
        groups = []
        for ids, text in checked:
            group = BeamSearchGroup("", len(ids), params, engine.eos_token_ids)
            group.request_id = engine.add_checked(ids, text, sp, 0, None, group=group)
            group.beams, group.scores = list(engine.samples[group.request_id]), [0.0]
            self.groups[group.request_id] = group
            groups.append(group)
        from tqdm.auto import tqdm
        with tqdm(total=len(groups), desc="beam_search", disable=not use_tqdm) as bar:
            def collect(finished) -> None:
                engine.undelivered.extend(finished)
                bar.n = sum(g.done for g in groups)
                bar.refresh()
            engine.run_until(lambda: all(g.done for g in groups), collect, what="beam search")
        results = []
        for group in groups:
            del self.groups[group.request_id]
            engine.samples.pop(group.request_id, None)
            for h in group.finished:
                h.text = engine.decode(h.tokens[group.prompt_len:])
            results.append(BeamSearchOutput(group.finished))
        return results
