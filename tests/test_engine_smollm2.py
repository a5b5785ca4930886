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
