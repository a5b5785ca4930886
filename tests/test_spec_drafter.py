"""Lab 07's drafter seam: the engine's n-gram drafter (an index per sequence) proposes exactly what the scan
`ngram_propose` does, a drafter written outside the library plugs in as `speculative_config={"method": "custom",
"drafter": ...}`, and `spec.harness.run_drafter` (how the lab's drafter exercise is graded) runs it in the engine
and refuses drafters that break the engine's contract."""
from __future__ import annotations

import random

import pytest

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.models import tiny_llama
from llmso_lab.spec.drafters import Drafter, NgramDrafter
from llmso_lab.spec.harness import run_drafter
from llmso_lab.spec.ngram import ngram_propose


@pytest.mark.parametrize("n_min,n_max,vocab", [(2, 4, 5), (1, 3, 3), (3, 3, 4), (1, 1, 6)])
def test_ngram_index_equals_the_scan_as_sequences_grow_by_several_tokens(n_min, n_max, vocab):
    """The reference is the stateless scan; the sequences grow by 1..5 tokens between lookups (accepted drafts),
    two sequences interleave, and a forgotten sequence id starts over."""
    rng = random.Random(n_min * 10 + n_max)
    drafter = NgramDrafter(n_min, n_max)
    seqs = {0: [rng.randrange(vocab)], 1: [rng.randrange(vocab) for _ in range(7)]}
    for step in range(120):
        sid = step % 2
        seqs[sid] += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        k = rng.randint(1, 6)
        assert drafter.lookup(sid, seqs[sid], k) == ngram_propose(seqs[sid], k, n_min, n_max), (step, seqs[sid])
        if step == 60:
            drafter.forget(1)
            seqs[1] = [rng.randrange(vocab) for _ in range(3)]


def test_a_custom_drafter_plugs_into_the_engine_and_bad_configs_are_refused():
    model = tiny_llama(num_layers=1, initializer_range=0.1, seed=0)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_seqs=2, block_size=4, num_kv_blocks=64, max_model_len=128)

    class Counting(NgramDrafter):
        calls = 0

        def propose(self, items):
            Counting.calls += 1
            return super().propose(items)

    plain = LLM(model, None, **kw).generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model, None, **kw, speculative_config={"method": "custom", "num_speculative_tokens": 3,
                                                     "drafter": Counting(2, 4)})
    assert llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert Counting.calls > 0 and llm.stats()["spec_num_draft_tokens"] > 0
    with pytest.raises(ValueError, match="needs 'drafter'"):
        LLM(model, None, **kw, speculative_config={"method": "custom", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="goes with method 'custom'"):
        LLM(model, None, **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "drafter": Counting()})
    with pytest.raises(ValueError, match="no propose"):
        LLM(model, None, **kw, speculative_config={"method": "custom", "num_speculative_tokens": 3, "drafter": object()})
    with pytest.raises(ValueError, match="must be a llmso_lab.spec.drafters.Drafter"):
        class Duck:
            def propose(self, items):
                return [([], None) for _ in items]
        LLM(model, None, **kw, speculative_config={"method": "custom", "num_speculative_tokens": 3, "drafter": Duck()})


def test_run_drafter_reports_exactness_rollback_and_the_metric():
    res = run_drafter(NgramDrafter, 4, 2, 4)
    assert res["tokens_equal_plain"] and res["blocks_free_after"]
    assert 0 < res["spec_num_accepted_tokens"] <= res["spec_num_draft_tokens"]
    assert res["spec_acceptance_rate"] == round(res["spec_num_accepted_tokens"] / res["spec_num_draft_tokens"], 6)
    assert res["target_forwards_spec"] < res["target_forwards_plain"]   # accepted drafts save target forwards
    assert run_drafter(NgramDrafter, 4, 2, 4) == res                      # deterministic: graded exactly


class _Scan(Drafter):
    def __init__(self, n_min=2, n_max=4):
        self.n_min, self.n_max = n_min, n_max

    def drafts(self, item):
        return ngram_propose(item.seq.token_ids, item.num_lookahead, self.n_min, self.n_max)


class _TooMany(_Scan):
    def propose(self, items):
        return [(self.drafts(item) + [3] * 9, None) for item in items]


class _Mutates(_Scan):
    def propose(self, items):
        out = [(self.drafts(item), None) for item in items]
        for item, (d, _) in zip(items, out):
            item.seq.token_ids.extend(d)
        return out


class _OneShort(_Scan):
    def propose(self, items):
        return [(self.drafts(item), None) for item in items][1:]


class _Right(_Scan):
    def propose(self, items):
        return [(self.drafts(item), None) for item in items]


@pytest.mark.parametrize("cls,match", [(_TooMany, "at most num_lookahead"), (_Mutates, "changed seq.token_ids"),
                                       (_OneShort, "one per item")])
def test_run_drafter_refuses_a_drafter_that_breaks_the_contract(cls, match):
    with pytest.raises(ValueError, match=match):
        run_drafter(cls, 4, 2, 4)
    assert run_drafter(_Right, 4, 2, 4) == run_drafter(NgramDrafter, 4, 2, 4)
