"""`llmso-lab bench cow`: KV blocks saved by copy-on-write sharing, for parallel sampling and beam search (lecture 1-2).

1. SmolLM2 on one ~512-token prompt, 64 output tokens (EOS ignored for sampling; beam search stops as HF
   does): `SamplingParams(n=N, temperature=1, seed)` for N = 2, 4, 8 and `LLM.beam_search` with beam width
   2, 4, 8, each run twice: `share_kv_blocks=True` (forks share blocks, a write into a shared block copies it)
   and `share_kv_blocks=False` (every fork copies all its parent's blocks at once, the baseline without
   reference counts). Reported: the engine's peak blocks in use, the saving, the copies made, and whether
   both runs gave the same tokens (they must: sharing changes memory, not arithmetic).
2. What drives the saving (the vLLM paper: 6-10% for parallel sampling, 37-55% for beam search on its
   traces): for parallel sampling only the prompt is shared, so the saving is about
   (N-1)/N x prompt / (prompt + output); the sweep runs n = 4 over prompt and output lengths on the tiny
   model (block counts do not depend on the weights when EOS is ignored). Beams also share the output
   tokens they have in common, and pruned beams free theirs.
`--quick`: a 128-token prompt, 16 output tokens, N and widths 2 and 4, a smaller sweep.
"""
from __future__ import annotations

import datetime
import time

from tqdm.auto import tqdm

from llmso_lab.bench.attention import _device_name

TEXT = ("PagedAttention stores the key and value vectors of every sequence in fixed-size blocks, like pages of "
        "virtual memory. A block table maps each sequence's logical blocks to physical blocks, so the memory of "
        "one request need not be contiguous, and blocks can be shared between sequences with reference counts. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    text, ids = TEXT, []
    while len(ids) < n:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        text += TEXT
    return ids[:n]


def _engine(model, tokenizer, share: bool, max_len: int):
    from llmso_lab.engine import LLM

    return LLM(model, tokenizer, share_kv_blocks=share, max_model_len=max_len, max_num_seqs=16, num_kv_blocks=16 * -(-max_len // 16))


def _run(model, tokenizer, ids: list[int], kind: str, width: int, max_tokens: int, share: bool) -> dict:
    from llmso_lab.engine import SamplingParams
    from llmso_lab.engine.beam_search import BeamSearchParams

    llm = _engine(model, tokenizer, share, len(ids) + max_tokens)
    t0 = time.perf_counter()
    if kind == "parallel_sampling":
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=width, temperature=1.0, seed=0,
                                                                         max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
        tokens = [o.token_ids for o in out.outputs]
    else:
        out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=width, max_tokens=max_tokens),
                              use_tqdm=False)[0]
        tokens = [s.tokens for s in out.sequences]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "blocks leaked"
    return {"peak_blocks": llm.peak_blocks_used, "copies": llm.stats()["num_cow_copies"],
            "wall_s": time.perf_counter() - t0, "tokens": tokens}


def sweep(prompt_lens, output_lens, n: int = 4, block_size: int = 16) -> list[dict]:
    """Parallel sampling on the tiny model: peak blocks shared vs not over prompt and output lengths."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.models import tiny_llama

    model, rows = tiny_llama(), []
    for p in prompt_lens:
        for o in output_lens:
            peaks = {}
            for share in (True, False):
                llm = LLM(model, share_kv_blocks=share, block_size=block_size, max_model_len=p + o,
                          num_kv_blocks=n * -(-(p + o) // block_size))
                llm.generate([[5] * p], SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=o, ignore_eos=True),
                             use_tqdm=False)
                peaks[share] = llm.peak_blocks_used
            rows.append({"n": n, "prompt": p, "output": o, "peak_shared": peaks[True], "peak_unshared": peaks[False],
                         "saving": 1 - peaks[True] / peaks[False],
                         "formula": (n - 1) / n * p / (p + o)})
    return rows


def run(quick: bool = False) -> dict:
    from llmso_lab.models import load_model

    prompt_len, max_tokens, widths = (128, 16, (2, 4)) if quick else (512, 64, (2, 4, 8))
    model, tok = load_model("smollm2-135m")
    ids = prompt_ids(tok, prompt_len)
    rows = []
    jobs = [(kind, w) for kind in ("parallel_sampling", "beam_search") for w in widths]
    for kind, w in tqdm(jobs, desc="bench cow"):
        shared, unshared = (_run(model, tok, ids, kind, w, max_tokens, share) for share in (True, False))
        rows.append({"kind": kind, "width": w, "peak_blocks_shared": shared["peak_blocks"],
                     "peak_blocks_unshared": unshared["peak_blocks"],
                     "saving": round(1 - shared["peak_blocks"] / unshared["peak_blocks"], 3),
                     "cow_copies": shared["copies"], "same_tokens": shared["tokens"] == unshared["tokens"],
                     "wall_s_shared": round(shared["wall_s"], 2), "wall_s_unshared": round(unshared["wall_s"], 2)})
    sw = sweep((32, 512) if quick else (16, 128, 512), (64,) if quick else (64, 256, 1024))
    by = {(r["kind"], r["width"]): r["saving"] for r in rows}
    return {
        "name": "cow", "device": _device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workload": {"model": "smollm2-135m", "prompt_tokens": prompt_len, "max_tokens": max_tokens, "block_size": 16},
        "table": rows, "sweep": sw,
        "ratios": {**{f"saving_{k}_{w}": v for (k, w), v in by.items()},
                   "all_same_tokens": all(r["same_tokens"] for r in rows)},
    }
