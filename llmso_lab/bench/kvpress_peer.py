"""NVIDIA kvpress as a peer of the project's KV eviction (Lab 10), run in its own venv `.venv-kvpress`.

kvpress 0.5.5 pins transformers < 5.3 while the project uses 5.x, so this script runs under `.venv-kvpress`
(`make peers-kvpress`) and imports only torch, transformers, kvpress and the standard library -- never
llmso_lab. `llmso_lab.bench.kvpress_runner.run_kvpress` writes the job file, runs this script as a subprocess
and reads its output:

    .venv-kvpress/bin/python llmso_lab/bench/kvpress_peer.py JOB.json OUT.json

The job (JSON): `model_dir` (a local Hugging Face folder; the hub is never contacted, HF_HUB_OFFLINE=1),
`cases` (`{"name", "context", "question", "answer"}`), `presses` (kvpress class names, or
`{"name", "kwargs"}`), `ratios` (kvpress `compression_ratio` = fraction of the KV pairs removed),
optional `modes` (default `["agnostic"]`), `max_new_tokens` (8), `threads` (1) and `perplexity`
(`{"name", "context", "continuation"}`).

How kvpress is called -- the calls of its own `KVPressTextGenerationPipeline._forward`, minus the chat template
(the project's needle is a plain completion prompt, and the same token ids must reach both implementations):

- prefill: `with press(model): model(input_ids=context_ids, past_key_values=cache)`; the press's forward hooks
  prune each layer's `DynamicCache` rows right after that layer's attention ran.
- mode "agnostic" (the pipeline's behaviour): only the context is compressed; the question is then fed into the
  pruned cache with explicit `position_ids` (its true positions) and the answer decoded greedily, as the
  pipeline's `generate_answer` does. The cache could serve any later question.
- mode "aware" (kvpress's `compress_questions=True` in its evaluation): context + question are prefilled and
  compressed together, so the question is in SnapKV's observation window; the first answer token comes from the
  prefill's logits (computed before pruning), the rest are decoded from the pruned cache.
- mode "pipeline": kvpress's own `KVPressTextGenerationPipeline._forward({"context_ids", "questions_ids"},
  max_new_tokens, press)` on the same token ids (its `preprocess`, which applies the chat template, is skipped).
  It must agree with "agnostic" token for token: the check that the calls above are kvpress's.
- a baseline row with no press (`press` "none", ratio 0) per mode.
- perplexity: the context is prefilled under the press, then the continuation is scored teacher-forced from the
  pruned cache (its first token from the prefill's last logits, the others from one forward of the
  continuation at its true positions).

Greedy, fp32, batch 1. A row that fails (a press that cannot run here) carries `error` instead of an answer.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODES = ("agnostic", "aware", "pipeline")


def answer_correct(generated: str, answer: str) -> bool:
    """The project's needle rule (`llmso_lab.kv.needle.needle_correct`, repeated here because this venv has no
    llmso_lab): the first number in the generated text must be the code."""
    found = re.findall(r"\d+", generated)
    return bool(found) and found[0] == answer


def make_press(spec, ratio: float):
    """A kvpress press from a class name (or `{"name", "kwargs"}`) and a compression ratio; None for "none"."""
    import kvpress

    name, kwargs = (spec, {}) if isinstance(spec, str) else (spec["name"], dict(spec.get("kwargs", {})))
    if name == "none":
        return None
    cls = getattr(kvpress, name, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, kvpress.BasePress):
        raise ValueError(f"kvpress {importlib.metadata.version('kvpress')} has no press {name!r}")
    return cls(compression_ratio=ratio, **kwargs)


def press_name(spec) -> str:
    """The class name, with its non-default arguments when the spec gives some: "SnapKVPress(window_size=16)"."""
    if isinstance(spec, str) or not spec.get("kwargs"):
        return spec if isinstance(spec, str) else spec["name"]
    return spec["name"] + "(" + ", ".join(f"{k}={v}" for k, v in spec["kwargs"].items()) + ")"


def _press_ctx(press, model):
    return press(model) if press is not None else contextlib.nullcontext()


def _feed(model, cache, ids, start: int):
    """Forward `ids` [1, n] into the (pruned) cache at true positions start..start+n-1; logits of all n.

    When the layers hold different lengths (PyramidKV) the causal mask, sized from layer 0, would be wrong for
    several queries at once, so the tokens are then fed one at a time (one query needs no mask under SDPA).
    """
    import torch

    lengths = {cache.get_seq_length(i) for i in range(len(cache.layers))}
    chunks = [ids] if len(lengths) == 1 else list(ids.split(1, dim=1))
    logits, pos = [], start
    for chunk in chunks:
        position_ids = torch.arange(pos, pos + chunk.shape[1]).unsqueeze(0)
        logits.append(model(input_ids=chunk, past_key_values=cache, position_ids=position_ids).logits[0])
        pos += chunk.shape[1]
    return torch.cat(logits)


def kept_tokens(cache) -> list[int]:
    """Tokens each layer's cache holds after the prefill."""
    return [cache.get_seq_length(i) for i in range(len(cache.layers))]


def answer_one(model, tok, press, context: str, question: str, mode: str, max_new_tokens: int) -> dict:
    """Compress, ask, decode greedily: `{"answer_text", "context_tokens", "question_tokens", "kept", times}`."""
    import torch
    from transformers import DynamicCache

    enc = lambda s: torch.tensor([tok(s, add_special_tokens=False)["input_ids"]])
    ctx, q = enc(context), enc(question)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    cache = DynamicCache()
    t0 = time.perf_counter()
    if mode == "agnostic":
        with _press_ctx(press, model):
            model.model(input_ids=ctx, past_key_values=cache)             # the pipeline's prefill call
        t1 = time.perf_counter()
        kept = kept_tokens(cache)
        first = _feed(model, cache, q, ctx.shape[1])[-1].argmax()
        pos = ctx.shape[1] + q.shape[1]
    elif mode == "aware":
        ids = torch.cat([ctx, q], dim=1)
        with _press_ctx(press, model):
            first = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1].argmax()
        t1 = time.perf_counter()
        kept = kept_tokens(cache)
        pos = ids.shape[1]
    elif mode == "pipeline":
        from kvpress import KVPressTextGenerationPipeline

        pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
        text = pipe._forward({"context_ids": ctx, "questions_ids": [q]}, max_new_tokens=max_new_tokens,
                             press=press, cache=cache)[0]
        t1 = time.perf_counter()
        return {"answer_text": text, "answer_ids": None, "context_tokens": ctx.shape[1], "question_tokens": q.shape[1],
                "prefill_s": None, "decode_s": None, "total_s": round(t1 - t0, 4)}
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out = [int(first)]
    while len(out) < max_new_tokens and out[-1] not in eos:
        logits = _feed(model, cache, torch.tensor([[out[-1]]]), pos)
        out.append(int(logits[-1].argmax()))
        pos += 1
    t2 = time.perf_counter()
    return {"answer_text": tok.decode(out, skip_special_tokens=True), "answer_ids": out,
            "context_tokens": ctx.shape[1], "question_tokens": q.shape[1], "kept_min": min(kept),
            "kept_max": max(kept), "kept_mean": round(sum(kept) / len(kept), 2),
            "prefill_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4)}


def perplexity_one(model, tok, press, context: str, continuation: str) -> dict:
    """Perplexity of `continuation` given `context` whose KV cache was compressed by `press` during its prefill."""
    import torch
    from transformers import DynamicCache

    enc = lambda s: torch.tensor([tok(s, add_special_tokens=False)["input_ids"]])
    ctx, cont = enc(context), enc(continuation)
    cache = DynamicCache()
    t0 = time.perf_counter()
    with _press_ctx(press, model):
        first = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    kept = kept_tokens(cache)
    logits = [first[None]]
    if cont.shape[1] > 1:
        logits.append(_feed(model, cache, cont[:, :-1], ctx.shape[1]))
    logp = torch.log_softmax(torch.cat(logits).float(), dim=-1)
    nll = -logp.gather(1, cont[0][:, None]).mean().item()
    return {"ppl": round(math.exp(nll), 4), "nll": round(nll, 6), "context_tokens": ctx.shape[1],
            "continuation_tokens": cont.shape[1], "kept_min": min(kept), "kept_max": max(kept),
            "kept_mean": round(sum(kept) / len(kept), 2), "seconds": round(time.perf_counter() - t0, 4)}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def run_job(job: dict) -> dict:
    """Every (mode, press, ratio, case) row plus a "none" baseline per mode and case, and perplexity rows."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(0)
    model_dir = job["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    modes = job.get("modes", ["agnostic"])
    max_new = int(job.get("max_new_tokens", 8))
    grid = [("none", 0.0)] + [(p, float(r)) for p in job["presses"] for r in job["ratios"]]
    rows, ppl_rows = [], []
    with torch.no_grad():
        for mode in modes:
            for spec, ratio in grid:
                for case in job["cases"]:
                    row = {"press": press_name(spec), "compression_ratio": ratio, "mode": mode, "case": case["name"]}
                    try:
                        res = answer_one(model, tok, make_press(spec, ratio), case["context"], case["question"],
                                         mode, max_new)
                        row.update(res, correct=answer_correct(res["answer_text"], case["answer"]))
                    except Exception as exc:  # noqa: BLE001 -- the failure is the result
                        row["error"] = _error(exc)
                    rows.append(row)
        for spec, ratio in grid:
            for case in job.get("perplexity", []):
                row = {"press": press_name(spec), "compression_ratio": ratio, "case": case["name"]}
                try:
                    row.update(perplexity_one(model, tok, make_press(spec, ratio), case["context"],
                                              case["continuation"]))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = _error(exc)
                ppl_rows.append(row)
    versions = {p: importlib.metadata.version(p) for p in ("kvpress", "transformers", "torch")}
    return {"versions": versions, "python": sys.version.split()[0], "model_dir": model_dir,
            "attn_implementation": model.config._attn_implementation, "threads": torch.get_num_threads(),
            "transformers_path": os.path.dirname(transformers.__file__), "rows": rows, "perplexity": ppl_rows}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: kvpress_peer.py JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    t0 = time.perf_counter()
    result = run_job(job)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    with open(argv[1], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
