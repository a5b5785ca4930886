"""`llmso-lab bench spec`: speculative decoding on SmolLM2 in the engine — acceptance and tokens/s per drafter, k,
task and batch size, with Hugging Face's assisted generation as the peer, in one run (lecture 2-1).

Prompts: `data/spec/bench_prompts.json`, "copy" tasks (quote or summarise a given passage, edit a JSON document,
answer from a given context, repeat a code snippet) and free "chat" questions; greedy, `new_tokens` per prompt.
Drafters: n-gram prompt lookup, the trained draft model (`data/spec/draft_smollm2.pt`), SmolLM2 itself quantized to
int4 as a draft, Medusa heads and an EAGLE head (`data/spec/*_smollm2.pt`), each at k in {1, 2, 4, 8}.

- `table` (batch 1, requests one at a time): per drafter, k and task — tokens/s and its ratio to plain decoding
  measured in the same run (plain is measured first and last; their mean is the baseline), acceptance rate, mean
  accepted length (tokens per verification step) and how many prompts gave output identical to plain decoding;
- `tables["batch"]`: the same at batch 1 and `batch` (continuous batching) for plain decoding and each drafter at
  its best batch-1 k: the high-load caveat — verification adds work per step that a full batch no longer hides;
- `tables["per_prompt"]`: each prompt's n-gram speed-up (best k) next to how much the model copies: the share of its
  output tokens that prompt lookup drafts correctly (k = 1);
- `tables["hf_peer"]`: Hugging Face `generate` at batch 1 — plain, `prompt_lookup_num_tokens=k`, and
  `assistant_model=` our draft model — on the same prompts and lengths.
Ratios: `ngram_vs_plain_copy_batch1`, `best_learned_vs_plain_chat_batch1` (draft model, Medusa, EAGLE),
`ngram_vs_hf_prompt_lookup_copy_batch1` (same k), and the speed-ups at `batch`.
"""
from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from llmso_lab.bench.attention import _device_name

__all__ = ["run", "FULL", "QUICK", "load_prompts", "copy_rate"]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "data" / "spec" / "bench_prompts.json"
FULL = dict(new_tokens=64, ks=(1, 2, 4, 8), batch=8, prompts=6, methods=("ngram", "draft", "draft-int4", "medusa", "eagle"))
QUICK = dict(new_tokens=12, ks=(2,), batch=4, prompts=2, methods=("ngram", "draft", "medusa", "eagle"))


def load_prompts(tokenizer, n: int | None = None) -> dict[str, list[list[int]]]:
    """{"copy": [...], "chat": [...]}: the bench prompts as chat-templated token ids (first `n` of each task)."""
    data = json.loads(PROMPTS.read_text())
    out = {}
    for task in ("copy", "chat"):
        ids = [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
               for p in data[task][:n]]
        out[task] = [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]
    return out


def copy_rate(prompt: list[int], output: list[int], n_min: int = 2, n_max: int = 4) -> float:
    """The share of `output` tokens that n-gram prompt lookup (one draft token) would have guessed right."""
    from llmso_lab.spec.ngram import ngram_propose
    hits = sum(ngram_propose(prompt + output[:j], 1, n_min, n_max) == [output[j]] for j in range(len(output)))
    return hits / max(len(output), 1)


def _spec_config(method: str, k: int) -> dict | None:
    from llmso_lab.spec.heads import load_draft_model
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if method == "draft":
        return {"method": "draft_model", "num_speculative_tokens": k, "model": load_draft_model()}
    if method == "draft-int4":
        return {"method": "draft_model", "num_speculative_tokens": k, "model": "smollm2-135m", "quantization": "int4"}
    return {"method": method, "num_speculative_tokens": min(k, 4) if method == "medusa" else k}


def _measure(model, tok, prompts: dict, method: str, k: int, batch: int, new_tokens: int) -> dict:
    """Run every prompt (batch 1: one request at a time, timed one by one; else all of a task at once)."""
    from llmso_lab.engine import LLM, SamplingParams
    llm = LLM(model, tok, max_num_seqs=batch, max_model_len=1024, speculative_config=_spec_config(method, k))
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompts["chat"][0]}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    out = {}
    for task, ps in prompts.items():
        before = llm.stats()
        t0 = time.perf_counter()
        if batch == 1:
            outs, secs = [], []
            for p in ps:
                t = time.perf_counter()
                outs += llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
                secs.append(time.perf_counter() - t)
        else:
            outs, secs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False), None
        wall = time.perf_counter() - t0
        after = llm.stats()
        tokens = [o.outputs[0].token_ids for o in outs]
        d = {key: after.get(key, 0) - before.get(key, 0) for key in ("spec_num_steps", "spec_num_draft_tokens",
                                                                    "spec_num_accepted_tokens")}
        out[task] = {"tokens": tokens, "seconds": secs, "tok_s": sum(map(len, tokens)) / wall,
                     "acceptance_rate": d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"] if d["spec_num_draft_tokens"] else None,
                     "mean_accepted_length": 1 + d["spec_num_accepted_tokens"] / d["spec_num_steps"] if d["spec_num_steps"] else None}
    return out


def _hf_peer(model, tok, prompts: dict, new_tokens: int, k: int) -> list[dict]:
    """Hugging Face `generate` at batch 1: plain, prompt lookup (k tokens), and our draft model as assistant."""
    from llmso_lab.spec.heads import load_draft_model
    draft = load_draft_model()
    rows = []
    for label, kw in (("HF generate (plain)", {}), (f"HF prompt_lookup_num_tokens={k}", {"prompt_lookup_num_tokens": k}),
                      ("HF assistant_model=draft", {"assistant_model": draft})):
        row = {"peer": label}
        for task, ps in prompts.items():
            model.generate(torch.tensor([ps[0]]), max_new_tokens=4, do_sample=False, **kw)   # warm-up
            n, t0, tokens = 0, time.perf_counter(), []
            for p in ps:
                with torch.no_grad():
                    out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         max_new_tokens=new_tokens, do_sample=False, **kw)
                tokens.append(out[0, len(p):].tolist())
                n += len(tokens[-1])
            row[f"{task}_tok_s"] = round(n / (time.perf_counter() - t0), 2)
            row[f"{task}_tokens"] = tokens
        rows.append(row)
    return rows


def run(quick: bool = False, **overrides) -> dict:
    from tqdm.auto import tqdm

    from llmso_lab.models import load_model

    cfg = {**(QUICK if quick else FULL), **overrides}
    t_start = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    prompts = load_prompts(tok, cfg["prompts"])
    N, B = cfg["new_tokens"], cfg["batch"]
    runs = [("plain", 0)] + [(m, k) for m in cfg["methods"] for k in cfg["ks"] if not (m == "medusa" and k > 4)] + [("plain", 0)]
    results = []
    for method, k in tqdm(runs, desc="spec batch 1"):
        results.append((method, k, _measure(model, tok, prompts, method, k, 1, N)))
    plain = {task: (results[0][2][task]["tok_s"] + results[-1][2][task]["tok_s"]) / 2 for task in prompts}
    ref = results[0][2]
    table = []
    for method, k, res in results[1:-1]:
        for task in prompts:
            r = res[task]
            same = sum(a == b for a, b in zip(r["tokens"], ref[task]["tokens"]))
            table.append({"method": method, "k": k, "task": task, "tok_s": round(r["tok_s"], 2),
                          "vs_plain": round(r["tok_s"] / plain[task], 3),
                          "acceptance_rate": None if r["acceptance_rate"] is None else round(r["acceptance_rate"], 3),
                          "mean_accepted_length": None if r["mean_accepted_length"] is None else round(r["mean_accepted_length"], 3),
                          "identical_outputs": f"{same}/{len(r['tokens'])}"})
    best = {}   # (method, task) -> the batch-1 row with the highest tok/s
    for row in table:
        key = (row["method"], row["task"])
        if key not in best or row["tok_s"] > best[key]["tok_s"]:
            best[key] = row
    batch_rows = []
    for method in ("plain",) + tuple(cfg["methods"]):
        for task in prompts:
            k = 0 if method == "plain" else best[(method, task)]["k"]
            r = _measure(model, tok, {task: prompts[task]}, method, k, B, N)[task]
            batch_rows.append({"method": method, "k": k, "task": task, "batch": B, "tok_s": round(r["tok_s"], 2)})
    plain_b = {r["task"]: r["tok_s"] for r in batch_rows if r["method"] == "plain"}
    for r in batch_rows:
        r["vs_plain"] = round(r["tok_s"] / plain_b[r["task"]], 3)
        r["vs_plain_batch1"] = None if r["method"] == "plain" else best[(r["method"], r["task"])]["vs_plain"]
    # per prompt: copy rate vs the n-gram speed-up (best k on copy prompts), both tasks
    k_ng = best[("ngram", "copy")]["k"]
    ng = next(res for m, k, res in results if m == "ngram" and k == k_ng)
    per_prompt = []
    for task, ps in prompts.items():
        for i, p in enumerate(ps):
            per_prompt.append({"task": task, "prompt": i, "output_tokens": len(ref[task]["tokens"][i]),
                               "copy_rate": round(copy_rate(p, ref[task]["tokens"][i]), 3),
                               "ngram_speedup": round(results[0][2][task]["seconds"][i] / ng[task]["seconds"][i], 3)})
    peer = _hf_peer(model, tok, prompts, N, k_ng)
    for row in peer:
        for task in prompts:
            row[f"{task}_identical_to_engine"] = f"{sum(a == b for a, b in zip(row.pop(f'{task}_tokens'), ref[task]['tokens']))}/{len(prompts[task])}"
    learned = [m for m in ("draft", "medusa", "eagle") if m in cfg["methods"]]
    ratios = {"ngram_vs_plain_copy_batch1": best[("ngram", "copy")]["vs_plain"],
              "ngram_vs_plain_chat_batch1": best[("ngram", "chat")]["vs_plain"],
              "best_learned_vs_plain_chat_batch1": max(best[(m, "chat")]["vs_plain"] for m in learned),
              "best_learned_vs_plain_copy_batch1": max(best[(m, "copy")]["vs_plain"] for m in learned),
              "ngram_vs_hf_prompt_lookup_copy_batch1": round(best[("ngram", "copy")]["tok_s"] / peer[1]["copy_tok_s"], 3),
              "engine_plain_vs_hf_plain_batch1_chat": round(plain["chat"] / peer[0]["chat_tok_s"], 3)}
    for r in batch_rows:
        if r["method"] != "plain":
            ratios[f"{r['method']}_vs_plain_{r['task']}_batch{B}"] = r["vs_plain"]
    return {"name": "spec", "device": _device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "llmso-lab bench spec" + (" --quick" if quick else ""), "config": {**cfg, "ks": list(cfg["ks"])},
            "plain_tok_s_batch1": {t: round(v, 2) for t, v in plain.items()},
            "plain_tok_s_batch1_first_last": {t: [round(results[0][2][t]["tok_s"], 2), round(results[-1][2][t]["tok_s"], 2)]
                                               for t in prompts},
            "table": table, "tables": {"batch": batch_rows, "per_prompt": per_prompt, "hf_peer": peer},
            "ratios": ratios, "seconds": round(time.perf_counter() - t_start, 1)}
