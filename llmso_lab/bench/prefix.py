"""`llmso-lab bench prefix`: requests that share a long system prompt, with and without prefix caching.

Workload (issue: 32 requests sharing a 512-token system prompt; `--quick`: 12 requests, 256 tokens): every
request = the same system prompt + its own short question, all arriving at once, 32 new tokens each
(EOS ignored). As in a live server, the system prompt has been seen before: one warm-up request (the
system prompt alone) runs first in both settings, so with caching its full KV blocks are in the cache.
The same engine settings run twice, `enable_prefix_caching` off then on; we report TTFT p50/p99, output
tokens/s and the prompt tokens actually computed, and their ratios (measured in this run).
"""
from __future__ import annotations

import datetime
import platform
import time

import torch

SYSTEM = ("You are a careful assistant for an LLM serving team. Answer with short, correct sentences. "
          "The team runs a paged KV cache with a block size of sixteen tokens, continuous batching, chunked "
          "prefill with a budget of two thousand tokens, and prefix caching keyed by a hash chain over full "
          "blocks. ")
QUESTIONS = ["What is a KV block?", "Why is decode memory-bound?", "What does chunked prefill trade off?",
             "When is swap better than recompute?", "What does the prefix cache key contain?",
             "Why do static batches waste slots?", "What is TTFT?", "What is TPOT?"]


def _prompts(tokenizer, n: int, prefix_tokens: int) -> tuple[list[int], list[list[int]]]:
    """(the shared system prompt, the n request prompts that start with it)."""
    text, ids = SYSTEM, []
    while len(ids) < prefix_tokens:  # grow the shared prompt until it has enough tokens, then cut exactly
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        text += SYSTEM
    prefix = ids[:prefix_tokens]
    return prefix, [prefix + tokenizer(f" Question {i}: {QUESTIONS[i % len(QUESTIONS)]} Answer:",
                               add_special_tokens=False)["input_ids"] for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _run_once(model, tokenizer, prefix: list[int], prompts: list[list[int]], caching: bool, max_tokens: int) -> dict:
    from llmso_lab.engine import LLM, SamplingParams

    llm = LLM(model, tokenizer, enable_prefix_caching=caching, max_num_seqs=32, max_num_batched_tokens=2048)
    llm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=True)
    wall = time.perf_counter() - t0
    ttft = [o.metrics.ttft for o in outs]
    stats = llm.stats()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    computed = stats["num_computed_tokens"] - before["num_computed_tokens"]
    return {"prefix_caching": caching, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "computed_tokens": computed, "hit_rate": round(stats["prefix_cache_hit_rate"], 3),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "output_tok_per_s": gen / wall,
            "wall_s": wall, "_tokens": [o.outputs[0].token_ids for o in outs]}


def run(quick: bool = False) -> dict:
    from llmso_lab.models import load_model

    n, prefix_len, max_tokens = (12, 256, 16) if quick else (32, 512, 32)
    model, tok = load_model("smollm2-135m")
    prefix, prompts = _prompts(tok, n, prefix_len)
    rows = [_run_once(model, tok, prefix, prompts, caching, max_tokens) for caching in (False, True)]
    same = rows[0].pop("_tokens") == rows[1].pop("_tokens")  # caching must not change greedy outputs
    off, on = rows
    return {
        "name": "prefix", "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "llmso-lab bench prefix" + (" --quick" if quick else ""),
        "workload": {"requests": n, "shared_prefix_tokens": prefix_len, "max_tokens": max_tokens, "model": "smollm2-135m"},
        "outputs_identical": same,
        "table": rows,
        "ratios": {"ttft_p50_uncached_over_cached": off["ttft_p50_s"] / on["ttft_p50_s"],
                   "throughput_cached_over_uncached": on["output_tok_per_s"] / off["output_tok_per_s"]},
    }
