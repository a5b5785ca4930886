"""What the OpenAI API adds to SamplingParams: repetition / frequency / presence penalties, min_tokens, min_p,
logprobs and stop strings — each checked against Hugging Face's logits processors or the definition, on the engine."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.logits_processors import process_logits
from llmso_lab.engine.sampler import sample_token
from llmso_lab.models import tiny_llama

PROMPT = [5, 9, 14, 3, 9, 27, 5]
ENGINE = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64)


def engine_out(model, tokenizer=None, prompt=PROMPT, **params):
    return LLM(model, tokenizer, **ENGINE).generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]


@torch.no_grad()
def reference_greedy(model, prompt, steps, process):
    """Full forward of the HF model each step, `process(ids, output, logits)`, argmax: the definition."""
    ids = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        ids.append(int(process(ids, ids[len(prompt):], logits).argmax()))
    return ids[len(prompt):]


def test_repetition_penalty_equals_hugging_face(model):
    got = engine_out(model, max_tokens=16, repetition_penalty=1.7, ignore_eos=True).token_ids
    hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, repetition_penalty=1.7,
                        eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    plain = engine_out(model, max_tokens=16, ignore_eos=True).token_ids
    assert got == hf and got != plain   # the penalty changed the answer, and as HF changes it
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    assert got == reference_greedy(model, PROMPT, 16, lambda ids, out, lg: proc(torch.tensor([ids]), lg[None])[0])


@pytest.mark.parametrize("freq,pres", [(0.8, 0.0), (0.0, 1.5), (0.6, -0.4)])
def test_frequency_and_presence_penalties_follow_openais_definition(model, freq, pres):
    def definition(ids, out, logits):
        logits = logits.clone()
        for tok, count in Counter(out).items():
            logits[tok] -= count * freq + pres
        return logits

    got = engine_out(model, max_tokens=20, frequency_penalty=freq, presence_penalty=pres, ignore_eos=True).token_ids
    assert got == reference_greedy(model, PROMPT, 20, definition)
    assert got != engine_out(model, max_tokens=20, ignore_eos=True).token_ids


def test_min_tokens_masks_stop_ids_until_enough_are_out(model):
    first = engine_out(model, max_tokens=1, ignore_eos=True).token_ids[0]   # greedy's first token: made a stop id
    early = engine_out(model, max_tokens=10, stop_token_ids=[first])
    assert early.token_ids == [first] and early.finish_reason == "stop"
    late = engine_out(model, max_tokens=10, stop_token_ids=[first], min_tokens=3)
    hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, min_new_tokens=3,
                        eos_token_id=[2, first], pad_token_id=0)[0, len(PROMPT):].tolist()
    assert late.token_ids == hf[:len(late.token_ids)] and first not in late.token_ids[:3]
    assert late.finish_reason == ("stop" if late.token_ids[-1] == first else "length")


def test_min_p_keeps_what_hugging_face_keeps_and_draws_in_proportion():
    logits = torch.tensor([2.0, 1.6, 0.9, 0.2, -1.0, -3.0])
    kept = torch.isfinite(MinPLogitsWarper(0.3)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0])
    g = torch.Generator().manual_seed(0)
    draws = torch.bincount(torch.tensor([sample_token(logits, SamplingParams(temperature=1.0, min_p=0.3), g)
                                         for _ in range(20_000)]), minlength=6).float() / 20_000
    assert ((draws > 0) == kept).all(), (draws, kept)
    expected = torch.where(kept, logits.softmax(-1), 0.0)
    assert (draws - expected / expected.sum()).abs().max() < 0.015


def test_logprobs_are_the_models_raw_log_softmax(model):
    out = engine_out(model, max_tokens=6, logprobs=3, ignore_eos=True)
    hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == hf.sequences[0, len(PROMPT):].tolist() and len(out.logprobs) == 6
    for entry, raw, tok in zip(out.logprobs, hf.logits, out.token_ids):
        lp = torch.log_softmax(raw[0].float(), -1)
        assert entry["token_id"] == tok and entry["logprob"] == pytest.approx(float(lp[tok]), abs=1e-4)
        top = torch.topk(lp, 3)
        assert [t for t, _ in entry["top"]] == top.indices.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert engine_out(model, max_tokens=2).logprobs is None   # not asked: not kept


class Letters:
    """Token i decodes to one letter (EOS, id 2, to nothing)."""
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 2 else "abcdefghijklmnopqrstuvwxyz"[i % 26] for i in ids)


def test_stop_strings_cut_the_answer_offline_and_free_the_blocks(model):
    plain = engine_out(model, Letters(), max_tokens=30, ignore_eos=True)
    stop = plain.text[12:14]
    llm = LLM(model, Letters(), **ENGINE)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop, "qqqqqqq"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == plain.text[:plain.text.index(stop)] and out.finish_reason == "stop"
    assert len(out.token_ids) < 30 and out.token_ids == plain.token_ids[:len(out.token_ids)]
    llm.step()
    assert llm.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="give the engine a tokenizer"):
        LLM(model, **ENGINE).generate([PROMPT], SamplingParams(stop="ab"), use_tqdm=False)


@pytest.mark.parametrize("kwargs,words", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens must be an int in [0, max_tokens=4]"),
    (dict(logprobs=21), "logprobs must be None or an int in [0, 20]"),
    (dict(stop=["ok", ""]), "stop must be a string or a list of non-empty strings"),
])
def test_bad_sampling_params_say_what_to_change(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert words in str(e.value)


def test_speculative_decoding_refuses_what_it_cannot_verify(model):
    llm = LLM(model, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    for params in (dict(repetition_penalty=1.2), dict(min_p=0.1, temperature=1.0), dict(logprobs=1)):
        with pytest.raises(ValueError, match="speculative decoding serves temperature / top-k / top-p only"):
            llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)


def test_process_logits_leaves_the_input_alone_and_off_means_off():
    logits = torch.randn(16, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    same = process_logits(logits, SamplingParams(), [1, 2], [3, 3])
    assert torch.equal(same, before) and torch.equal(logits, before)
