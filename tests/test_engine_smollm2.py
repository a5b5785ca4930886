"""The engine on the real SmolLM2-135M-Instruct: greedy chat answers equal Hugging Face `generate` (fp32)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Explain in two sentences what a KV cache is.",
    "Write a haiku about batching requests on a GPU.",
    "List three prime numbers greater than ten.",
]


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer, chat prompt ids, HF greedy answers)."""
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for c in CHATS]
    eos = model.generation_config.eos_token_id
    return model, tok, prompts, [hf_greedy(model, p, 40, eos_token_id=eos) for p in prompts]


@pytest.mark.parametrize("kw", [dict(enable_prefix_caching=True, max_num_batched_tokens=48),
                                dict(batching="static", max_num_seqs=4)], ids=["continuous-chunked-prefix", "static"])
def test_smollm2_chat_matches_hf_generate(smollm2, kw):
    from llmso_lab.engine import LLM, SamplingParams

    model, tok, prompts, expected = smollm2
    eos = model.generation_config.eos_token_id
    llm = LLM(model, tok, block_size=16, max_model_len=1024, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=40), use_tqdm=False)
    for o, want in zip(outs, expected):
        assert o.outputs[0].token_ids == want, (o.outputs[0].text, tok.decode(want))
        assert o.outputs[0].text == tok.decode(want, skip_special_tokens=True)
        assert o.outputs[0].finish_reason == ("stop" if want[-1] == eos else "length")
    if kw.get("enable_prefix_caching"):
        assert llm.stats()["prefix_cache_hit_rate"] > 0   # the chat template's system prefix is shared


def test_smollm2_beam_search_and_radix_match_hf(smollm2):
    """Beam search (width 4) equals HF's beams on chat prompts, with beams that end at EOS and beams that run to
    max_tokens; radix prefix caching keeps the greedy answers of HF."""
    import torch

    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.engine.beam_search import BeamSearchParams

    model, tok, prompts, expected = smollm2
    llm = LLM(model, tok, block_size=16, max_model_len=1024)
    res = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:3]], BeamSearchParams(beam_width=4, max_tokens=12),
                          use_tqdm=False)
    reasons = set()
    for p, r in zip(prompts[:3], res):
        hf = model.generate(torch.tensor([p]), num_beams=4, do_sample=False, length_penalty=1.0, early_stopping=True,
                            max_new_tokens=12, num_return_sequences=4, output_scores=True, return_dict_in_generate=True)
        fill = {tok.pad_token_id if tok.pad_token_id is not None else model.generation_config.eos_token_id}
        for mine, theirs in zip(r.sequences, hf.sequences.tolist()):   # HF pads a beam that ended at EOS
            assert mine.tokens == theirs[:len(mine.tokens)] and set(theirs[len(mine.tokens):]) <= fill
            reasons.add(mine.finish_reason)
        assert [s.score for s in r.sequences] == pytest.approx(hf.sequences_scores.tolist(), abs=1e-4)
    assert reasons == {"stop", "length"}
    radix = LLM(model, tok, block_size=16, max_model_len=1024, enable_prefix_caching=True, prefix_caching_algo="radix")
    for _ in range(2):   # the second pass hits the radix tree, inside the last block too
        outs = radix.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=40), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert radix.stats()["prefix_cache_hit_tokens"] > 0
