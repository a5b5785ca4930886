"""`llmso-lab bench radix`: prefix caching by hash chain (vLLM) vs radix tree (SGLang), on SmolLM2 (lecture 1-4).

Four workloads, each replayed in rounds (a round's requests arrive together; the next round comes when it is
done, as an agent or a chat user waits for an answer), greedy, 16 output tokens (EOS ignored):
- `few_shot`: one few-shot prompt of 8 worked examples; each request keeps the first k examples (k varies)
  and asks its own question, so prompts diverge wherever an example ends: mid-block, mostly.
- `agent_tree`: a task description, then tool calls that branch 3 ways, then 3 ways again (1 + 3 + 9
  requests, one round per level); each node's prompt is its parent's prompt + the parent's answer + its call.
- `multi_turn`: 4 conversations x 4 turns; a turn's prompt is the previous prompt + the previous answer +
  the new user message.
- `system_prompt`: `bench prefix`'s workload: one warm-up request with the system prompt, then 16 requests
  that share it (512 tokens, a multiple of the block size) and add their own question.
Each workload runs with caching off, `prefix_caching_algo="hash"` and `"radix"` (fresh engines). Reported per
run: prompt tokens served from the cache, hit rate, prompt tokens computed, TTFT p50 and output tokens/s; and
whether the outputs equal caching off (they must). A hash chain caches whole 16-token blocks, so per request
it can miss up to 15 tokens that a radix tree finds; the difference is bounded by the block size.
`--quick`: fewer requests and shorter prompts.
"""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from llmso_lab.bench import harness
from llmso_lab.bench.prefix import QUESTIONS, SYSTEM, _pct

EXAMPLE = "Q: {q}\nA: The answer depends on the block table, the batch and the cache; here it is {i}.\n"


def _tok(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def few_shot(tokenizer, n: int) -> list[list[list[int]]]:
    """Rounds of prompts: 8 examples, request i keeps the first 2 + i % 6 of them, then its question."""
    examples = [_tok(tokenizer, EXAMPLE.format(q=QUESTIONS[i % len(QUESTIONS)], i=i)) for i in range(8)]
    head = _tok(tokenizer, "Answer like the examples.\n")
    prompts = []
    for i in range(n):
        k = 2 + i % 6
        prompts.append(head + sum(examples[:k], []) + _tok(tokenizer, f"Q: question number {i}?\nA:"))
    return [prompts[i:i + 4] for i in range(0, n, 4)]


def system_prompt(tokenizer, n: int, prefix_tokens: int) -> list[list[list[int]]]:
    from llmso_lab.bench.prefix import _prompts

    prefix, prompts = _prompts(tokenizer, n, prefix_tokens)
    return [[prefix], prompts]


def _run(llm_factory, rounds, grow, max_tokens: int) -> dict:
    """Replay `rounds`. `grow(round_index, outputs)` may return the next round (agent tree, chat) instead."""
    from llmso_lab.engine import SamplingParams

    llm = llm_factory()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs, ttft, gen, wall, r, current = [], [], 0, 0.0, 0, rounds[0]
    while current:
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in current], sp, use_tqdm=False)
        wall += time.perf_counter() - t0
        ttft += [o.metrics.ttft for o in res]
        gen += sum(len(o.outputs[0].token_ids) for o in res)
        outs += [o.outputs[0].token_ids for o in res]
        r += 1
        current = grow(r, current, res) if grow else (rounds[r] if r < len(rounds) else None)
    st = llm.stats()
    return {"hit_tokens": st["prefix_cache_hit_tokens"], "hit_rate": round(st["prefix_cache_hit_rate"], 3),
            "prompt_tokens": st["num_prompt_tokens"], "computed_prompt_tokens": st["num_prompt_tokens"] - st["prefix_cache_hit_tokens"],
            "ttft_p50_s": _pct(ttft, 50), "output_tok_per_s": gen / wall, "wall_s": wall, "_outputs": outs}


def _agent_grow(tokenizer, levels: int, fanout: int):
    def grow(r, prompts, results):
        if r >= levels:
            return None
        return [p + o.outputs[0].token_ids + _tok(tokenizer, f"\nTool call {r}.{j}: search('{QUESTIONS[j]}')\nResult:")
                for p, o in zip(prompts, results) for j in range(fanout)]
    return grow


def _chat_grow(tokenizer, turns: int):
    def grow(r, prompts, results):
        if r >= turns:
            return None
        return [p + o.outputs[0].token_ids + _tok(tokenizer, f"\nUser: {QUESTIONS[(r + i) % len(QUESTIONS)]} Tell me more.\nAssistant:")
                for i, (p, o) in enumerate(zip(prompts, results))]
    return grow


def _workloads(tok, quick: bool) -> tuple[dict, dict]:
    """{name: (rounds of prompts, grow or None)} for the four workloads, and their sizes for the JSON."""
    n_few, n_sys, sys_len, n_chat, turns, max_tokens = (8, 8, 256, 2, 3, 8) if quick else (16, 16, 512, 4, 4, 16)
    task = _tok(tok, SYSTEM + "Task: plan the KV-cache budget for a chat service. ")
    chat = [_tok(tok, f"System: you are a helpful assistant.\nUser: {QUESTIONS[i]}\nAssistant:") for i in range(n_chat)]
    workloads = {
        "few_shot": (few_shot(tok, n_few), None),
        "agent_tree": ([[task]], _agent_grow(tok, 3, 3)),
        "multi_turn": ([chat], _chat_grow(tok, turns)),
        "system_prompt": (system_prompt(tok, n_sys, sys_len), None),
    }
    sizes = {"model": "smollm2-135m", "block_size": 16, "max_tokens": max_tokens, "few_shot_requests": n_few,
             "agent_tree": "1 + 3 + 9", "multi_turn": f"{n_chat} x {turns}", "system_prompt": f"{n_sys} x {sys_len}"}
    return workloads, sizes


def _ratios(rows: list[dict], workloads) -> dict:
    """Per workload, hash chain against radix tree: hit rates, the extra tokens the tree finds, TTFT p50."""
    get = {(r["workload"], r["caching"]): r for r in rows}
    ratios = {}
    for w in workloads:
        h, x = get[(w, "hash")], get[(w, "radix")]
        ratios[f"{w}_hit_rate_hash"] = h["hit_rate"]
        ratios[f"{w}_hit_rate_radix"] = x["hit_rate"]
        ratios[f"{w}_extra_hit_tokens_radix"] = x["hit_tokens"] - h["hit_tokens"]
        ratios[f"{w}_ttft_p50_hash_over_radix"] = h["ttft_p50_s"] / x["ttft_p50_s"]
    return ratios


def run(quick: bool = False) -> dict:
    from llmso_lab.engine import LLM
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    workloads, sizes = _workloads(tok, quick)
    rows, outputs = [], {}
    jobs = [(w, algo) for w in workloads for algo in ("off", "hash", "radix")]
    for w, algo in tqdm(jobs, desc="bench radix"):
        rounds, grow = workloads[w]
        factory = lambda: LLM(model, tok, enable_prefix_caching=algo != "off",  # noqa: E731
                              prefix_caching_algo="hash" if algo == "off" else algo, max_num_seqs=16)
        row = _run(factory, rounds, grow, sizes["max_tokens"])
        outputs[(w, algo)] = row.pop("_outputs")
        rows.append({"workload": w, "caching": algo, **row})
    same = {w: outputs[(w, "hash")] == outputs[(w, "off")] == outputs[(w, "radix")] for w in workloads}
    return harness.result("radix", None,   # no "command": the CLI records the command line it ran
                          workload=sizes, outputs_identical=same, table=rows, ratios=_ratios(rows, workloads))
