"""`llmso-lab bench paged`: how much reserved KV memory holds no token, contiguous vs paged (lecture 1-2).

Workload: the chat length mix of `data/workloads/chat_lengths.json` (1000 seeded log-normal prompt and
output lengths, max_model_len 2048, max_tokens 1024; `llmso_lab.workloads.chat_length_mix`).

1. Formulas (`llmso_lab.kv.fragmentation`) on all 1000 requests: the waste of contiguous allocation
   reserving max_model_len, reserving prompt + max_tokens, and paging with block sizes 1..256, at each
   sequence's final length and over its lifetime; and the largest batch each scheme fits in a fixed KV
   budget (`BUDGET_SLOTS` token slots).
2. The engine itself (`LLM`, continuous batching, EOS ignored so every request makes exactly its output
   length) on the first 128 requests of the mix, 32 slots, block sizes 16, 64 and 256 (`--quick`: 32
   requests, 16 slots, block size 16), reading its block manager after every step: the waste's peak
   and mean over steps, and over all steps together (which equals the lifetime formula when no prompt is
   split into chunks and nothing is preempted). These are counts: they do not depend on the model's weights
   or on timing, so the tiny random model is used by default.

Ratios (same run): `contiguous_waste` (max_model_len reservation, lifetime; the lecture quotes 60-80%),
`contiguous_max_tokens_waste`, `paged_waste_block16` (formula, lifetime), `paged_waste_block16_engine_mean`,
`paged_waste_block16_engine_peak`, `max_batch_*` and `batch_gain_paged16_over_contiguous`.
"""
from __future__ import annotations

import statistics

import numpy as np
from tqdm.auto import tqdm

from llmso_lab.bench import harness
from llmso_lab.kv.fragmentation import engine_occupancy, max_batch, waste
from llmso_lab.models.shapes import LLAMA3_8B
from llmso_lab.workloads import load_chat_lengths

__all__ = ["run", "engine_waste", "BLOCK_SIZES", "BUDGET_SLOTS"]

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
BUDGET_SLOTS = 65_536   # KV token slots: 32 sequences of max_model_len 2048 (8 GiB for Llama-3-8B in bf16)
FULL = dict(engine_requests=128, engine_max_num_seqs=32, engine_block_sizes=(16, 64, 256))
QUICK = dict(engine_requests=32, engine_max_num_seqs=16, engine_block_sizes=(16,))


def engine_waste(model, lengths: list[tuple[int, int]], block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int = 4096, seed: int = 0, desc: str | None = None) -> dict:
    """Run `lengths` = [(prompt_len, output_len)] through the engine (all requests at t = 0, seeded random
    prompt ids, exactly output_len tokens each) and read the KV waste from its block manager after every step.

    Returns {"peak", "mean"} of the per-step waste (steps holding no block skipped), "all_steps" (1 - stored /
    reserved summed over all steps), "steps" and "preemptions". The cache is sized for `max_num_seqs` sequences
    of `max_model_len` tokens, so nothing is preempted.
    """
    from llmso_lab.engine import LLM, SamplingParams

    llm = LLM(model, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=max_num_batched_tokens, seed=seed)
    rng = np.random.default_rng(seed)
    for p, o in lengths:
        ids = rng.integers(3, llm.model_runner.vocab_size, size=p).tolist()
        llm.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=o, ignore_eos=True))
    per_step, stored, reserved = [], 0, 0
    with tqdm(total=len(lengths), desc=desc, disable=desc is None) as bar:
        while llm.has_unfinished_requests():
            finished, _ = llm.step()
            bar.update(len(finished))
            s, r = engine_occupancy(llm)
            if r:
                per_step.append(1 - s / r)
                stored, reserved = stored + s, reserved + r
    return {"peak": max(per_step), "mean": statistics.fmean(per_step), "all_steps": 1 - stored / reserved,
            "steps": llm.num_steps, "preemptions": llm.stats()["num_preemptions_total"]}


def _formula_rows(lengths, max_model_len: int, max_tokens: int) -> list[dict]:
    """Per scheme (contiguous reserving max_model_len or prompt + max_tokens, paged per block size): the waste over
    each sequence's lifetime and at its finish, and the largest batch `BUDGET_SLOTS` fits."""
    schemes = [("contiguous_max_len", None), ("contiguous_max_tokens", None)] + [("paged", b) for b in BLOCK_SIZES]
    rows = []
    for scheme, bs in schemes:
        kw = dict(max_model_len=max_model_len, max_tokens=max_tokens, block_size=bs)
        rows.append({"scheme": scheme, "block_size": bs or "-",
                     "waste_lifetime": round(waste(lengths, scheme, **kw), 4),
                     "waste_at_finish": round(waste(lengths, scheme, moment="at_finish", **kw), 4),
                     "max_batch": max_batch(lengths, scheme, BUDGET_SLOTS, **kw)})
    return rows


def _ratios(table: list[dict], engine: dict) -> dict:
    """Contiguous against paged (block 16): waste (formula; the engine's mean and peak where it ran block 16) and
    the largest batch the budget fits."""
    row = {(r["scheme"], r["block_size"]): r for r in table}
    cont, cont_t, paged16 = row["contiguous_max_len", "-"], row["contiguous_max_tokens", "-"], row["paged", 16]
    ratios = {"contiguous_waste": cont["waste_lifetime"], "contiguous_max_tokens_waste": cont_t["waste_lifetime"],
              "paged_waste_block16": paged16["waste_lifetime"]}
    if 16 in engine:
        ratios.update(paged_waste_block16_engine_mean=round(engine[16]["mean"], 4),
                      paged_waste_block16_engine_peak=round(engine[16]["peak"], 4))
    ratios.update(max_batch_contiguous=cont["max_batch"], max_batch_contiguous_max_tokens=cont_t["max_batch"],
                  max_batch_paged_block16=paged16["max_batch"],
                  batch_gain_paged16_over_contiguous=round(paged16["max_batch"] / cont["max_batch"], 2))
    return ratios


def run(quick: bool = False, *, model: str = "tiny-llama", engine_requests: int | None = None,
        engine_max_num_seqs: int | None = None, engine_block_sizes: tuple[int, ...] | None = None) -> dict:
    """The fragmentation benchmark (quick=True: the engine runs 32 requests at block size 16 only)."""
    from llmso_lab.models import load_model

    cfg = harness.overridden(QUICK if quick else FULL, engine_requests=engine_requests,
                             engine_max_num_seqs=engine_max_num_seqs, engine_block_sizes=engine_block_sizes)
    lengths, params = load_chat_lengths()
    L, T = params["max_model_len"], params["max_tokens"]
    table = _formula_rows(lengths, L, T)
    net, _ = load_model(model)
    sample = lengths[:cfg["engine_requests"]]
    engine = {}
    for bs in cfg["engine_block_sizes"]:
        engine[bs] = engine_waste(net, sample, bs, cfg["engine_max_num_seqs"], L, desc=f"engine, block {bs}")
        table.append({"scheme": "paged: engine", "block_size": bs, "requests": len(sample),
                      "waste_lifetime": round(waste(sample, "paged", block_size=bs), 4),
                      "engine_all_steps": round(engine[bs]["all_steps"], 4),
                      "engine_mean": round(engine[bs]["mean"], 4), "engine_peak": round(engine[bs]["peak"], 4),
                      "steps": engine[bs]["steps"], "preemptions": engine[bs]["preemptions"]})
    return harness.result(
        "paged", quick, table=table, ratios=_ratios(table, engine), model=model,
        workload={"file": "data/workloads/chat_lengths.json", "requests": len(lengths), **params,
                  "mean_prompt_len": round(statistics.fmean(p for p, _ in lengths), 1),
                  "mean_output_len": round(statistics.fmean(o for _, o in lengths), 1)},
        budget_slots=BUDGET_SLOTS,
        budget_note=f"{BUDGET_SLOTS} token slots = "
                    f"{BUDGET_SLOTS * LLAMA3_8B.kv_bytes_per_token(2) / 2**30:.0f} GiB of KV for Llama-3-8B in bf16",
        engine={**{k: v for k, v in cfg.items() if k != "engine_block_sizes"},
                "block_sizes": list(cfg["engine_block_sizes"])},
        note="waste = 1 - tokens stored / slots reserved; lifetime: over every state each sequence passes "
             "through (see llmso_lab.kv.fragmentation); counts, not timings")


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1))
