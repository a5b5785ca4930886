"""Sampling: greedy / temperature / top-k / top-p are statistically right, and a seeded request's random draws
do not depend on what else shares its batch (nor, on this tiny model without near-ties, do its tokens)."""
from __future__ import annotations

import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.sampler import filter_logits, sample_token
from llmso_lab.models import tiny_llama

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
N = 20_000


def empirical(params: SamplingParams, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.tensor([sample_token(LOGITS, params, g) for _ in range(N)]), minlength=5)
    return counts.float() / N


def test_temperature_matches_softmax():
    expected = torch.softmax(LOGITS / 0.7, -1)
    got = empirical(SamplingParams(temperature=0.7))
    assert (got - expected).abs().max() < 0.015, (got, expected)   # ~4 standard errors at N=20000


def test_top_k_renormalises_over_the_k_best():
    expected = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    got = empirical(SamplingParams(temperature=1.0, top_k=2))
    assert got[2:].sum() == 0 and (got[:2] - expected).abs().max() < 0.015


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.softmax(LOGITS, -1)   # 0.57, 0.21, 0.13, ...: top_p=0.7 keeps the first two
    filtered = filter_logits(LOGITS, top_p=0.7)
    assert torch.isfinite(filtered).tolist() == [True, True, False, False, False]
    got = empirical(SamplingParams(temperature=1.0, top_p=0.7))
    assert (got[:2] - probs[:2] / probs[:2].sum()).abs().max() < 0.015 and got[2:].sum() == 0


def test_greedy_is_argmax():
    assert sample_token(LOGITS, SamplingParams(), None) == 0


MODEL = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, max_position_embeddings=256, initializer_range=0.05)
PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * j) % 250 + 3 for j in range(4 + 3 * i)]} for i in range(6)]


def engine(**kw):
    return LLM(MODEL, block_size=4, max_model_len=64, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_top_k_one_and_tiny_top_p_equal_greedy():
    greedy = tokens(engine().generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False))
    for params in (SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, top_k=1),
                   SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, top_p=1e-6)):
        assert tokens(engine().generate(PROMPTS, params, use_tqdm=False)) == greedy


def test_sampling_is_random_but_seeded():
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0)
    a = tokens(engine(seed=1).generate(PROMPTS, params, use_tqdm=False))
    b = tokens(engine(seed=1).generate(PROMPTS, params, use_tqdm=False))
    c = tokens(engine(seed=2).generate(PROMPTS, params, use_tqdm=False))
    greedy = tokens(engine().generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False))
    assert a == b and a != c and a != greedy


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=5), dict(batching="static", max_num_seqs=3)])
def test_seeded_request_does_not_depend_on_the_batch(kw):
    mine = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, top_p=0.9, seed=1234)
    alone = tokens(engine().generate(PROMPTS[2], mine, use_tqdm=False))[0]
    others = [SamplingParams(max_tokens=5 + i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(5)]
    crowd = engine(**kw).generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], others[:2] + [mine] + others[2:], use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=5), dict(batching="static", max_num_seqs=3)])
def test_a_requests_random_draws_do_not_depend_on_the_batch(kw, monkeypatch):
    """The draws themselves, not just the tokens: the seeded request's generator is in the same state before
    each of its draws whether it runs alone or in a crowd (only its logits can change with the batch)."""
    from llmso_lab.engine import sampler

    states: dict[int, list[torch.Tensor]] = {}
    draw = sampler.sample_token

    def spy(logits, params, generator):
        states.setdefault(generator.initial_seed(), []).append(generator.get_state().clone())
        return draw(logits, params, generator)

    monkeypatch.setattr(sampler, "sample_token", spy)
    mine = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, top_p=0.9, seed=1234)
    engine().generate(PROMPTS[2], mine, use_tqdm=False)
    alone = states.pop(1234)
    others = [SamplingParams(max_tokens=5 + i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(5)]
    engine(**kw).generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], others[:2] + [mine] + others[2:], use_tqdm=False)
    crowd = states[1234]
    assert len(alone) == len(crowd) == 20 and all(torch.equal(a, b) for a, b in zip(alone, crowd))
