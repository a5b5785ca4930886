"""`llmso-lab bench spec`: speculative decoding on SmolLM2 in the engine — acceptance and tokens/s per drafter, k,
task and batch size, with Hugging Face's assisted generation as the peer, in one run (lecture 2-1).

Prompts: `data/spec/bench_prompts.json`, "copy" tasks (quote or summarise a given passage, edit a JSON document,
answer from a given context, repeat a code snippet) and free "chat" questions; greedy, `new_tokens` per prompt.
Drafters: n-gram prompt lookup, the trained draft model (`data/spec/draft_smollm2.pt`), SmolLM2 itself quantized to
int4 as a draft, Medusa heads and an EAGLE head (`data/spec/*_smollm2.pt`), each at k in {1, 2, 4, 8}.

- `table` (batch 1, requests one at a time): per drafter, k and task — tokens/s and its ratio to plain decoding,
  acceptance rate, mean accepted length (tokens per verification step) and how many prompts gave output identical
  to plain decoding. Every engine (plain included) is built first, then each prompt goes through all of them in
  turn, so drift of the machine during the run hits every configuration alike;
- `tables["batch"]`: the same at batch 1 and `batch` (continuous batching) for plain decoding and each drafter at
  its best batch-1 k: the high-load caveat — verification adds work per step that a full batch no longer hides;
- `tables["per_prompt"]`: each prompt's n-gram speed-up (best k) next to how much the model copies: the share of its
  output tokens that prompt lookup drafts correctly (k = 1);
- `tables["hf_peer"]`: Hugging Face `generate` at batch 1 — plain, `prompt_lookup_num_tokens=k`, and
  `assistant_model=` our draft model — on the same prompts and lengths.
Ratios: `ngram_vs_plain_copy_batch1` (all copy tasks), `ngram_vs_plain_copy_heavy_batch1` (the copy prompts where the
model copies: n-gram lookup drafts >= 50% of its plain output right), `best_learned_vs_plain_chat_batch1` (draft model, Medusa, EAGLE),
`ngram_vs_hf_prompt_lookup_copy_batch1` (same k), and the speed-ups at `batch`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from llmso_lab import hardware as hw
from llmso_lab.bench import harness

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


def _engine(model, tok, method: str, k: int, batch: int):
    from llmso_lab.engine import LLM, SamplingParams
    llm = LLM(model, tok, max_num_seqs=batch, max_model_len=1024, speculative_config=_spec_config(method, k))
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    return llm


def _spec_counts(llm) -> dict:
    st = llm.stats()
    return {key: st.get(key, 0) for key in ("spec_num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")}


def _interleaved_batch1(engines: list, prompts: dict, new_tokens: int) -> dict:
    """Every prompt through every engine in turn, one request at a time (batch 1), the order rotated from prompt to
    prompt: a machine that speeds up or slows down during the run affects every engine alike."""
    from llmso_lab.engine import SamplingParams
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    out = {key: {} for key, _ in engines}
    for task, ps in prompts.items():
        before = {key: _spec_counts(llm) for key, llm in engines}
        for key, _ in engines:
            out[key][task] = {"tokens": [], "seconds": []}
        for i, p in enumerate(ps):
            for j in range(len(engines)):
                key, llm = engines[(i + j) % len(engines)]
                t = time.perf_counter()
                o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
                out[key][task]["seconds"].append(time.perf_counter() - t)
                out[key][task]["tokens"].append(o.outputs[0].token_ids)
        for key, llm in engines:
            r, d0, d1 = out[key][task], before[key], _spec_counts(llm)
            d = {c: d1[c] - d0[c] for c in d1}
            r["tok_s"] = sum(map(len, r["tokens"])) / sum(r["seconds"])
            r["acceptance_rate"] = d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"] if d["spec_num_draft_tokens"] else None
            r["mean_accepted_length"] = 1 + d["spec_num_accepted_tokens"] / d["spec_num_steps"] if d["spec_num_steps"] else None
    return out


def _batched(model, tok, ps: list, method: str, k: int, batch: int, new_tokens: int, repeats: int = 2) -> float:
    """Tokens/s of one engine serving all of `ps` at once (continuous batching, `batch` slots): best of `repeats`
    (no warm-up run)."""
    from llmso_lab.engine import SamplingParams
    llm = _engine(model, tok, method, k, batch)

    def seconds_per_token() -> float:   # per token, not per run: a run may stop early at EOS
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=new_tokens), use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return (time.perf_counter() - t) / tokens
    return 1.0 / hw.best_seconds(seconds_per_token, 0, min_runs=repeats, warmup=False, self_timed=True)


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


def _batch1_table(res: dict, runs: list, prompts: dict) -> list[dict]:
    """A row per drafter, k and task from the interleaved batch-1 results: tokens/s against plain decoding,
    acceptance and how many outputs equal plain decoding's."""
    ref = res[("plain", 0)]
    table = []
    for method, k in runs[1:]:
        for task in prompts:
            r = res[(method, k)][task]
            same = sum(a == b for a, b in zip(r["tokens"], ref[task]["tokens"]))
            table.append({"method": method, "k": k, "task": task, "tok_s": round(r["tok_s"], 2),
                          "vs_plain": round(r["tok_s"] / ref[task]["tok_s"], 3),
                          "acceptance_rate": harness.rounded(r["acceptance_rate"]),   # None without drafts
                          "mean_accepted_length": harness.rounded(r["mean_accepted_length"]),
                          "identical_outputs": f"{same}/{len(r['tokens'])}"})
    return table


def _best_k(table: list[dict]) -> dict:
    """(method, task) -> the batch-1 row with the highest tokens/s (the first of equals)."""
    best = {}
    for row in table:
        key = (row["method"], row["task"])
        if key not in best or row["tok_s"] > best[key]["tok_s"]:
            best[key] = row
    return best


def _batch_rows(model, tok, prompts: dict, methods, best: dict, batch: int, new_tokens: int) -> list[dict]:
    """Plain decoding and each drafter at its best batch-1 k, serving each task's prompts `batch` at a time."""
    rows = []
    for method in ("plain",) + tuple(methods):
        for task in prompts:
            k = 0 if method == "plain" else best[(method, task)]["k"]
            rows.append({"method": method, "k": k, "task": task, "batch": batch,
                         "tok_s": round(_batched(model, tok, prompts[task], method, k, batch, new_tokens), 2)})
    plain = {r["task"]: r["tok_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        r["vs_plain"] = round(r["tok_s"] / plain[r["task"]], 3)
        r["vs_plain_batch1"] = None if r["method"] == "plain" else best[(r["method"], r["task"])]["vs_plain"]
    return rows


def _copying(prompts: dict, ref: dict, ng: dict) -> tuple[list[dict], list[int], float | None]:
    """Per prompt, how much the model copies (`copy_rate` of plain decoding's output) next to n-gram's speed-up
    (`ng`: n-gram at its best k on copy prompts); the copy-heavy prompts (copy rate >= 50%), and n-gram's tokens/s
    over plain decoding's on them (None without any)."""
    per_prompt = []
    for task, ps in prompts.items():
        for i, p in enumerate(ps):
            per_prompt.append({"task": task, "prompt": i, "output_tokens": len(ref[task]["tokens"][i]),
                               "copy_rate": round(copy_rate(p, ref[task]["tokens"][i]), 3),
                               "ngram_speedup": round(ref[task]["seconds"][i] / ng[task]["seconds"][i], 3)})
    heavy = [i for i, p in enumerate(prompts["copy"]) if copy_rate(p, ref["copy"]["tokens"][i]) >= 0.5]
    heavy_ratio = None
    if heavy:
        heavy_ratio = (sum(ref["copy"]["seconds"][i] for i in heavy) / sum(ng["copy"]["seconds"][i] for i in heavy)
                       * sum(len(ng["copy"]["tokens"][i]) for i in heavy) / sum(len(ref["copy"]["tokens"][i]) for i in heavy))
    return per_prompt, heavy, heavy_ratio


def _ratios(best: dict, heavy_ratio: float | None, peer: list[dict], plain: dict, batch_rows: list[dict],
            methods, batch: int) -> dict:
    """Speed-ups over plain decoding at batch 1 (each drafter at its best k) and at `batch`, and against the HF peer
    (`peer`: plain, prompt lookup, assistant model)."""
    learned = [m for m in ("draft", "medusa", "eagle") if m in methods]
    ratios = {"ngram_vs_plain_copy_batch1": best[("ngram", "copy")]["vs_plain"],
              "ngram_vs_plain_chat_batch1": best[("ngram", "chat")]["vs_plain"],
              "ngram_vs_plain_copy_heavy_batch1": None if heavy_ratio is None else round(heavy_ratio, 3),
              "best_learned_vs_plain_chat_batch1": max((best[(m, "chat")]["vs_plain"] for m in learned), default=None),
              "best_learned_vs_plain_copy_batch1": max((best[(m, "copy")]["vs_plain"] for m in learned), default=None),
              "ngram_vs_hf_prompt_lookup_copy_batch1": round(best[("ngram", "copy")]["tok_s"] / peer[1]["copy_tok_s"], 3),
              "engine_plain_vs_hf_plain_batch1_chat": round(plain["chat"] / peer[0]["chat_tok_s"], 3)}
    for r in batch_rows:
        if r["method"] != "plain":
            ratios[f"{r['method']}_vs_plain_{r['task']}_batch{batch}"] = r["vs_plain"]
    return ratios


def run(quick: bool = False, **overrides) -> dict:
    from tqdm.auto import tqdm

    from llmso_lab.models import load_model

    cfg = {**(QUICK if quick else FULL), **overrides}
    t_start = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    prompts = load_prompts(tok, cfg["prompts"])
    N, B = cfg["new_tokens"], cfg["batch"]
    runs = [("plain", 0)] + [(m, k) for m in cfg["methods"] for k in cfg["ks"] if not (m == "medusa" and k > 4)]
    engines = [((m, k), _engine(model, tok, m, k, 1)) for m, k in tqdm(runs, desc="spec engines")]
    res = _interleaved_batch1(engines, prompts, N)
    del engines
    plain = {task: res[("plain", 0)][task]["tok_s"] for task in prompts}
    ref = res[("plain", 0)]
    table = _batch1_table(res, runs, prompts)
    best = _best_k(table)
    batch_rows = _batch_rows(model, tok, prompts, cfg["methods"], best, B, N)
    k_ng = best[("ngram", "copy")]["k"]   # n-gram at its best k on copy prompts, for both tasks
    per_prompt, heavy, heavy_ratio = _copying(prompts, ref, res[("ngram", k_ng)])
    peer = _hf_peer(model, tok, prompts, N, k_ng)
    for row in peer:   # its outputs against the engine's plain decoding
        for task in prompts:
            same = sum(a == b for a, b in zip(row.pop(f"{task}_tokens"), ref[task]["tokens"]))
            row[f"{task}_identical_to_engine"] = f"{same}/{len(prompts[task])}"
    return harness.result("spec", quick, config={**cfg, "ks": list(cfg["ks"])},
                          plain_tok_s_batch1={t: round(v, 2) for t, v in plain.items()}, copy_heavy_prompts=heavy,
                          table=table, tables={"batch": batch_rows, "per_prompt": per_prompt, "hf_peer": peer},
                          ratios=_ratios(best, heavy_ratio, peer, plain, batch_rows, cfg["methods"], B),
                          seconds=round(time.perf_counter() - t_start, 1))
