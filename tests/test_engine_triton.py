"""The engine on the Triton kernels (under the interpreter on CPU) gives the torch backend's tokens."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmso_lab.engine import LLM, SamplingParams  # noqa: E402
from llmso_lab.models import tiny_llama  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 5, 9, 13, 17, 21, 25, 29, 60, 61], [7], [3, 4, 5, 6, 7, 8]]
MAX_TOKENS = [9, 5, 12, 7]


def run(backend, **kw):
    model = tiny_llama(max_position_embeddings=128)
    llm = LLM(model, block_size=4, max_model_len=64, attention_backend=backend, **kw)
    calls = {"flash": 0, "paged": 0}
    b = llm.model_runner.backend
    if backend == "triton":  # count kernel launches: the kernels, not the torch fallback, must do the work
        flash, paged = b._flash, b._paged
        b._flash = lambda *a, **k: (calls.__setitem__("flash", calls["flash"] + 1), flash(*a, **k))[1]
        b._paged = lambda *a, **k: (calls.__setitem__("paged", calls["paged"] + 1), paged(*a, **k))[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], {**llm.stats(), **calls}


@pytest.mark.parametrize("kw", [
    dict(),                                                                     # whole prefills + paged decodes
    dict(enable_chunked_prefill=True, max_num_batched_tokens=5, enable_prefix_caching=True),  # chunks after cache
    dict(batching="static", max_num_seqs=2),                                    # padded static rows, idle rows
], ids=["continuous", "chunked-prefix", "static"])
def test_triton_backend_matches_torch_backend(kw):
    ref, _ = run("torch", **kw)
    got, stats = run("triton", **kw)
    assert got == ref
    assert sum(map(len, got)) == sum(MAX_TOKENS)
    assert stats["paged"] > 0 and stats["flash"] > 0
    if kw.get("enable_prefix_caching"):
        assert stats["prefix_cache_hit_rate"] > 0
