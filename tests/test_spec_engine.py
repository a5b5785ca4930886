"""Speculative decoding in the engine: greedy outputs identical to plain decoding for every drafter, KV rollback
without leaks under batching / chunked prefill / prefix caching / preemption, and, with temperature > 0, the
output distribution of the target (a chi-square test against the exact probabilities)."""
from __future__ import annotations

import math

import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.models import tiny_llama
from llmso_lab.spec.heads import EagleHead, MedusaHeads

TARGET = tiny_llama(num_layers=2, hidden_size=64, seed=0)
DRAFT = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1)   # same vocabulary, another model


def heads(kind: str, target=TARGET, seed: int = 0):
    """Untrained heads (random, seeded): acceptance is low, but outputs must still equal plain decoding."""
    torch.manual_seed(seed)
    if kind == "medusa":
        h = MedusaHeads(target.config.hidden_size, 3)
        for lin in h.res:
            torch.nn.init.normal_(lin.weight, std=0.05)
        return h
    return EagleHead(target.config, intermediate_size=64)


def spec_for(method: str, k: int = 3, target=TARGET) -> dict:
    extra = {"ngram": {"prompt_lookup_min": 1}, "draft_model": {"model": DRAFT if target is TARGET else
                                                                 tiny_llama(vocab_size=16, num_layers=1, seed=4)},
             "medusa": {"model": heads("medusa", target)}, "eagle": {"model": heads("eagle", target)}}[method]
    return {"method": method, "num_speculative_tokens": k, **extra}


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):   # repeated phrases, so that n-gram lookup finds matches
        phrase = torch.randint(3, 256, (5 + i,), generator=g).tolist()
        out.append(phrase * 3 + torch.randint(3, 256, (i + 2,), generator=g).tolist())
    return out


def run(llm: LLM, ps, max_tokens=24, check=False, **sp):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp)
    if not check:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in ps]
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step()[0]:
            done[o.request_id] = o.outputs[0].token_ids
        llm.scheduler.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks   # every block back: no leak
    return [done[i] for i in ids]


SPECS = [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    {"method": "draft_model", "num_speculative_tokens": 4, "model": DRAFT},
    {"method": "draft_model", "num_speculative_tokens": 2, "model": TARGET},
    spec_for("medusa", 3), spec_for("eagle", 4),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['method']}-k{s['num_speculative_tokens']}")
def test_greedy_speculative_equals_plain_decoding(spec):
    ps = prompts()
    plain = run(LLM(TARGET, max_model_len=256), ps)
    llm = LLM(TARGET, max_model_len=256, speculative_config=spec)
    assert run(llm, ps, check=True) == plain
    st = llm.stats()
    assert st["spec_num_steps"] > 0 and st["spec_num_draft_tokens"] > 0
    assert st["num_generated_tokens"] == sum(map(len, plain))
    if spec.get("model") is TARGET:   # the target drafting for itself: every draft is accepted
        assert st["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=16), dict(enable_prefix_caching=True),
                                dict(enable_prefix_caching=True, prefix_caching_algo="radix"),
                                dict(num_kv_blocks=16, block_size=4), dict(num_kv_blocks=16, block_size=4,
                                                                           preemption_mode="swap")],
                         ids=["chunked", "prefix-hash", "prefix-radix", "preempt-recompute", "preempt-swap"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "medusa", "eagle"])
def test_speculative_with_chunked_prefill_prefix_caching_and_preemption(kw, method):
    ps = prompts(5)
    ps = ps + [ps[0][:12] + [7, 8, 9]]   # shares a prefix with the first prompt
    spec = spec_for(method)
    kw = {"max_model_len": 64 if "num_kv_blocks" in kw else 128, **kw}
    plain = run(LLM(TARGET, **kw), ps, max_tokens=20)
    llm = LLM(TARGET, speculative_config=spec, **kw)
    assert run(llm, ps, max_tokens=20, check=True) == plain
    if "num_kv_blocks" in kw:
        assert llm.stats()["num_preemptions_total"] > 0


def test_stops_inside_the_accepted_drafts_and_at_max_tokens():
    ps = prompts(4)
    plain = LLM(TARGET, max_model_len=256)
    spec = LLM(TARGET, max_model_len=256, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                                               "model": TARGET})
    for max_tokens in (1, 2, 5, 7):
        assert run(spec, ps, max_tokens) == run(plain, ps, max_tokens)
    stop = run(plain, ps[:1], 12)[0][6]   # a token the first prompt emits 7th: stop there, inside a drafted run
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop])
    a = spec.generate([{"prompt_token_ids": ps[0]}], params, use_tqdm=False)[0].outputs[0]
    b = plain.generate([{"prompt_token_ids": ps[0]}], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.token_ids[-1] == stop and a.finish_reason == "stop"


def test_speculation_with_n_samples_and_beams_left_alone():
    llm = LLM(TARGET, max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    plain = LLM(TARGET, max_model_len=256)
    p = {"prompt_token_ids": prompts(1)[0]}
    sp = SamplingParams(n=3, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert ([c.token_ids for c in llm.generate([p], sp, use_tqdm=False)[0].outputs] ==
            [c.token_ids for c in plain.generate([p], sp, use_tqdm=False)[0].outputs])


def test_bad_speculative_config_is_refused_clearly():
    for bad, match in [({"method": "lookahead", "num_speculative_tokens": 2}, "unknown speculative method"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown speculative_config keys"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
                       ({"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_llama(vocab_size=300)},
                        "vocabulary")]:
        with pytest.raises(ValueError, match=match):
            LLM(TARGET, max_model_len=256, speculative_config=bad)
    with pytest.raises(ValueError, match="continuous"):
        LLM(TARGET, max_model_len=256, batching="static", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


# ---- sampling: the output distribution is the target's -------------------------------------------------------

def chi2_pvalue(counts: dict, probs: dict) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    n = sum(counts.values())
    cells, pool_o, pool_e = [], 0.0, 0.0
    for key, p in probs.items():
        if n * p >= 5:
            cells.append((counts.get(key, 0), n * p))
        else:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + n * p
    pool_o += sum(c for key, c in counts.items() if key not in probs)
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("method,batched", [("ngram", False), ("draft_model", True), ("medusa", False),
                                            ("eagle", False)])
def test_sampled_tokens_follow_the_target_distribution(method, batched):
    """Tokens 2 and 3 of each sample come from speculative steps (drafted, then accepted or corrected); the joint
    distribution of the three must be the target's: p(t1) p(t2 | t1) p(t3 | t1 t2)."""
    target = tiny_llama(vocab_size=16, seed=3)           # a small vocabulary: every token occurs in the prompt,
    prompt = list(range(3, 16)) + [9, 4, 12, 3, 7]       # so n-gram lookup always has a draft to propose
    sp = dict(temperature=1.0, top_k=6)
    spec = spec_for(method, 2, target)
    llm = LLM(target, max_model_len=64, max_num_seqs=256, speculative_config=spec)
    llm.feature("speculative_config").batched_verification = batched   # True: the GPU path (verify_batch; on CPU its torch reference)
    n = 1500
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(max_tokens=3, ignore_eos=True, seed=i, **sp) for i in range(n)], use_tqdm=False)
    assert llm.stats()["spec_num_draft_tokens"] > 0 and 0 < llm.stats()["spec_acceptance_rate"] < 1
    counts: dict = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1

    def dist(ids):
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 6)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    probs = {(a, b, c): pa * pb * pc for a, pa in dist(prompt).items() for b, pb in dist(prompt + [a]).items()
             for c, pc in dist(prompt + [a, b]).items()}
    assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-5)
    assert chi2_pvalue(counts, probs) > 1e-3
