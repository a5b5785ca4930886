"""Benchmark for lecture 1-1: static vs continuous batching on a real model (SmolLM2-135M, CPU; fp32 unless
`--dtype` says otherwise: the engine and Hugging Face then both run in that dtype).

`run(quick)` returns {"name", "table", "ratios", "device", "date", "command", ...} (`bench.harness.result`).
One offline workload (all requests arrive at t = 0; prompts 32-512 tokens, outputs 16-256, EOS ignored)
goes through, with the same max batch size everywhere:

- engine continuous  `LLM(batching="continuous")`: iteration-level scheduling;
- engine static      `LLM(batching="static")`: batches of `max_num_seqs` in arrival order, padded prompts,
                     finished rows keep (and pay for) their slot until the batch's longest row is done;
- HF static          Hugging Face `generate` on the same padded batches (left padding, attention mask,
                     max_new_tokens = min_new_tokens = the batch's longest request): only the tokens each
                     request asked for count as useful output.

Each row: output tokens/s, TTFT, TPOT and E2E p50/p99, padded tokens, preemptions and prefix cache hit rate
(`_engine`, `_hf_static` and `workload` also run the serving table of `llmso-lab demo`).

Then batch-1 decode speed (tokens/s after the first token, median of 3 alternating runs) of the engine vs
`generate`, printed beside the engine's weight matmuls run alone and the memory-bandwidth ceiling (each
decode step reads all weights once; the ceiling is the higher of the copy-bandwidth bound and the
matmuls' own rate, since a read stream can beat a measured copy); `batch1_step_ms` splits each step into
weight streaming and everything else.
Ratios (same run): continuous_vs_static, continuous_vs_hf_static (output tokens/s), batch1_vs_hf.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from tqdm.auto import tqdm

from llmso_lab import hardware as hw
from llmso_lab.bench import harness
from llmso_lab.workloads import Request, RequestMetrics, latency_summary, make_workload

__all__ = ["run", "workload", "warm_up"]

FULL = dict(num_requests=64, prompt_len=(32, 512), output_len=(16, 256), max_num_seqs=16, batch1_tokens=64)
QUICK = dict(num_requests=16, prompt_len=(32, 256), output_len=(16, 96), max_num_seqs=8, batch1_tokens=32)


def workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
             seed: int = 0, shared_prefix: int = 0) -> tuple[list[Request], list[list[int]]]:
    """The requests and their prompt token ids (seeded random ids; with EOS ignored the text does not matter).

    shared_prefix > 0: every prompt starts with the same `shared_prefix` ids (a system prompt), then its own ids.
    """
    reqs = make_workload(num_requests, prompt_len=prompt_len, output_len=output_len, seed=seed)
    g = torch.Generator().manual_seed(seed)
    own = [torch.randint(3, vocab_size, (r.prompt_len,), generator=g).tolist() for r in reqs]
    prefix = torch.randint(3, vocab_size, (shared_prefix,), generator=g).tolist()
    reqs = [dataclasses.replace(r, prompt_len=shared_prefix + r.prompt_len) for r in reqs]
    return reqs, [prefix + p for p in own]


def _latency_row(name: str, metrics: list[RequestMetrics], seconds: float, **extra) -> dict:
    """One table row: output tokens/s over `seconds` and the TTFT/TPOT/E2E percentiles of `metrics`."""
    summary = latency_summary(metrics, (50, 99))
    t, d, e = summary["ttft_s"], summary["tpot_s"], summary["e2e_s"]
    out_tokens = sum(m.output_len for m in metrics)
    return {"system": name, "requests": len(metrics), "output_tokens": out_tokens, "seconds": round(seconds, 2),
            "output_tok_s": round(out_tokens / seconds, 1), "ttft_p50_s": round(t["p50"], 2),
            "ttft_p99_s": round(t["p99"], 2), "tpot_p50_ms": round(1e3 * d["p50"], 1),
            "tpot_p99_ms": round(1e3 * d["p99"], 1), "e2e_p50_s": round(e["p50"], 2), "e2e_p99_s": round(e["p99"], 2),
            **extra}


def _engine(model, tokenizer, batching: str, reqs, prompts, max_num_seqs: int, max_model_len: int,
            label: str | None = None, warmup_prompt: list[int] | None = None, **llm_kwargs) -> tuple[dict, list, list]:
    """One engine run of the workload, step by step. `llm_kwargs` go to `LLM` (e.g. enable_prefix_caching=True,
    num_kv_blocks=...); `warmup_prompt` is served first, untimed (e.g. a system prompt, so that the prefix
    cache starts warm). Returns (table row, outputs in request order, the step traces)."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.sim.calibrate import run_on_engine

    label = label or f"engine {batching}"
    llm = LLM(model, tokenizer, batching=batching, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **llm_kwargs)
    if warmup_prompt is not None:
        llm.generate([{"prompt_token_ids": warmup_prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    run = run_on_engine(llm, reqs, prompts=prompts, desc=label)
    outs = run.outputs
    assert run.num_output_tokens == sum(r.output_len for r in reqs), "the engine must make exactly the requested tokens"
    st = llm.stats()
    cached = sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)   # these requests only
    row = _latency_row(label, [o.metrics for o in outs], run.wall_s, padded_tokens=st["num_padded_tokens"],
                       preemptions=st["num_preemptions_total"], prefix_hit_rate=round(cached, 2))
    return row, outs, run.traces


class _StepClock:
    """A logits processor that only records when each generation step happens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def _hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> list[float]:
    """Greedy `generate` of a left-padded batch, exactly `new_tokens` tokens per row. Returns step times."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    clock = _StepClock()
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]),
                   top_k=None, top_p=None, temperature=None)
    return clock.times


def _hf_static(model, reqs, prompts, max_num_seqs: int, pad_id: int) -> tuple[dict, list[RequestMetrics]]:
    """HF `generate` on static batches. Returns (table row, metrics per request)."""
    metrics = []
    t0 = time.perf_counter()
    for first in tqdm(range(0, len(reqs), max_num_seqs), desc="HF generate (static batches)"):
        rs = reqs[first:first + max_num_seqs]
        times = _hf_generate(model, prompts[first:first + max_num_seqs], max(r.output_len for r in rs), pad_id)
        done = time.perf_counter()   # a static batch returns all its rows together
        # every request arrived at t0; its own tokens are the batch's first output_len, the rest of its row is
        # wasted work
        metrics += [RequestMetrics(first + i, t0, times[0], done, r.prompt_len, r.output_len,
                                   token_times=times[:r.output_len]) for i, r in enumerate(rs)]
    row = _latency_row("HF generate static", metrics, time.perf_counter() - t0, preemptions=0, prefix_hit_rate="-")
    return row, metrics


def _matmuls_only(runner, steps: int = 8) -> float:
    """Seconds per batch-1 decode step spent on the runner's weight matmuls alone (4 per layer + the LM head):
    the step with every small op (norms, RoPE, KV write, attention, SwiGLU, residuals) taken out. What a
    decode step costs above this is per-op overhead, which GPU engines remove with CUDA graphs and fusion."""
    from llmso_lab.engine.ops import linear

    weights = runner.weight_matrices()
    inputs = {n: torch.ones(1, n, dtype=runner.dtype, device=runner.device) for n in {m.shape[0] for m in weights}}
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            t = time.perf_counter()
            for m in weights:
                linear(inputs[m.shape[0]], m)   # the engine's kernel (a prepacked or quantized weight is a callable)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _batch1(model, tokenizer, prompt: list[int], new_tokens: int, pad_id: int, max_model_len: int,
            repeats: int = 3, dtype: str = "float32") -> tuple[float, float, float]:
    """Decode tokens/s at batch 1 (after the first token) of the engine, of HF `generate`, and of the
    engine's weight matmuls alone (`_matmuls_only`).

    The three alternate `repeats` times and each reports its median: a shared or throttled machine drifts
    over seconds, and alternating puts all of them under the same drift.
    """
    from llmso_lab.engine import LLM, SamplingParams

    llm = LLM(model, tokenizer, max_num_seqs=1, max_model_len=max_model_len, dtype=dtype)
    engine, hf, matmuls = [], [], []
    for _ in range(repeats):
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
        ts = out.metrics.token_times
        engine.append((len(ts) - 1) / (ts[-1] - ts[0]))
        ts = _hf_generate(model, [prompt], new_tokens, pad_id)
        hf.append((len(ts) - 1) / (ts[-1] - ts[0]))
        matmuls.append(1.0 / _matmuls_only(llm.model_runner))
    return statistics.median(engine), statistics.median(hf), statistics.median(matmuls)


def warm_up(model, tokenizer, prompts, max_num_seqs: int, max_model_len: int, dtype: str) -> None:
    """A full batch of the workload's prompts (2 tokens each) on a fresh engine, untimed: first-call allocations and
    the first large prefill cost seconds once, and must not land in a timed run."""
    warm = [Request(i, 0.0, len(p), 2) for i, p in enumerate(prompts[:max_num_seqs])]
    _engine(model, tokenizer, "continuous", warm, prompts[:max_num_seqs], max_num_seqs, max_model_len, dtype=dtype)


def _batch1_rows(net, dtype: str, itemsize: int, eng1: float, hf1: float, mm1: float, context: int,
                 mem_bandwidth: float) -> tuple[list[dict], float, int]:
    """The batch-1 decode rows (engine, HF, the engine's matmuls alone, the memory-bandwidth ceiling), the ceiling
    and the weight bytes. Each decode step reads all weights once and the KV of `context` tokens."""
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())   # tied head counted once
    c = net.config
    kv_per_token = hw.kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads,
                                         getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                                         itemsize)
    copy_bound = hw.decode_tokens_per_s_bound(weight_bytes, mem_bandwidth, 1, context, kv_per_token)
    # a copy's measured rate understates what a pure read stream reaches (the matmuls can beat it): the ceiling
    # is whichever of the two is higher
    ceiling = max(copy_bound, mm1)
    rows = [
        {"system": "engine batch-1 decode", "decode_tok_s": round(eng1, 1),
         "of_ceiling": round(eng1 / ceiling, 2)},
        {"system": "HF generate batch-1 decode", "decode_tok_s": round(hf1, 1), "of_ceiling": round(hf1 / ceiling, 2)},
        {"system": "engine's weight matmuls alone, batch 1", "decode_tok_s": round(mm1, 1),
         "of_ceiling": round(mm1 / ceiling, 2), "note": "every other op of the step taken out"},
        {"system": "memory-bandwidth ceiling, batch 1", "decode_tok_s": round(ceiling, 1), "of_ceiling": 1.0,
         "note": f"{weight_bytes / 1e6:.0f} MB {dtype} weights at {mem_bandwidth / 1e9:.1f} GB/s (measured copy): "
                 f"{copy_bound:.1f} tok/s" + ("" if copy_bound >= mm1 else "; the matmuls alone went faster")},
    ]
    return rows, ceiling, weight_bytes


def _step_ms(engine_tok_s: float, hf_tok_s: float, matmuls_tok_s: float) -> dict:
    """One batch-1 decode step in ms = streaming the weights (the matmuls) + everything else; the second part is
    what separates the engine from HF at batch 1, and what a GPU engine's CUDA graphs and fused kernels shrink."""
    step_ms = {"engine": 1e3 / engine_tok_s, "hf_generate": 1e3 / hf_tok_s, "matmuls_only": 1e3 / matmuls_tok_s}
    step_ms.update(engine_other_ops=step_ms["engine"] - step_ms["matmuls_only"],
                   hf_other_ops=step_ms["hf_generate"] - step_ms["matmuls_only"])
    return step_ms


def run(quick: bool = False, *, model: str = "smollm2-135m", num_requests: int | None = None,
        max_num_seqs: int | None = None, prompt_len: tuple[int, int] | None = None,
        output_len: tuple[int, int] | None = None, batch1_tokens: int | None = None,
        measure_seconds: float | None = None, dtype: str = "float32") -> dict:
    """Run the batching benchmark (quick=True: 16 requests, batch 8, about a minute on 2 cores).

    The keyword arguments override the workload (the tests use `model="tiny-llama"` and a few requests);
    `dtype` is the engine's (`LLM(dtype=...)`, "auto" resolved here) and Hugging Face's.
    """
    from llmso_lab.engine.config import resolve_dtype
    from llmso_lab.models import load_model

    cfg = harness.overridden(QUICK if quick else FULL, num_requests=num_requests, max_num_seqs=max_num_seqs,
                             prompt_len=prompt_len, output_len=output_len, batch1_tokens=batch1_tokens)
    requested = dtype
    torch_dtype, dtype_reason = resolve_dtype(dtype, torch.device("cpu"))
    dtype = str(torch_dtype).removeprefix("torch.")
    net, tokenizer = load_model(model, dtype=torch_dtype)
    pad_id = net.config.pad_token_id if net.config.pad_token_id is not None else 0
    reqs, prompts = workload(cfg["num_requests"], cfg["prompt_len"], cfg["output_len"], net.config.vocab_size)
    max_model_len = min(net.config.max_position_embeddings, cfg["prompt_len"][1] + cfg["output_len"][1] + 16)
    B, n1 = cfg["max_num_seqs"], cfg["batch1_tokens"]
    warm_up(net, tokenizer, prompts, B, max_model_len, dtype)   # both code paths, outside the timed runs
    _hf_generate(net, prompts[:B], 2, pad_id)

    table = []
    with tqdm(total=5, desc="bench batching") as bar:   # 5 phases: engine x 2, HF, batch 1, bandwidth
        for batching in ("continuous", "static"):
            with harness.phase(bar, f"engine {batching}"):
                table.append(_engine(net, tokenizer, batching, reqs, prompts, B, max_model_len, dtype=dtype)[0])
        with harness.phase(bar, "HF generate"):
            table.append(_hf_static(net, reqs, prompts, B, pad_id)[0])
        with harness.phase(bar, "batch 1"):
            eng1, hf1, mm1 = _batch1(net, tokenizer, prompts[0][:32], n1, pad_id, max_model_len, dtype=dtype)
        with harness.phase(bar, "memory bandwidth"):
            cpu = hw.measure_cpu(seconds=measure_seconds if measure_seconds is not None else (1.0 if quick else 2.0))
    rows, ceiling, weight_bytes = _batch1_rows(net, dtype, torch_dtype.itemsize, eng1, hf1, mm1, 32 + n1 // 2,
                                               cpu.mem_bandwidth)
    table += rows
    tok_s = {r["system"]: r["output_tok_s"] for r in table if "output_tok_s" in r}
    ratios = {"continuous_vs_static": round(tok_s["engine continuous"] / tok_s["engine static"], 2),
              "continuous_vs_hf_static": round(tok_s["engine continuous"] / tok_s["HF generate static"], 2),
              "batch1_vs_hf": round(eng1 / hf1, 2)}
    return harness.result("batching", quick, f"--dtype {requested}" if requested != "float32" else "",
                          table=table, ratios=ratios, dtype=dtype, dtype_reason=dtype_reason, model=model,
                          workload=harness.lists(cfg), memory_bandwidth_GB_s=round(cpu.mem_bandwidth / 1e9, 2),
                          weight_bytes=weight_bytes, batch1_ceiling_tok_s=round(ceiling, 1),
                          batch1_step_ms=harness.rounded(_step_ms(eng1, hf1, mm1), 2), **harness.shared_cpu())


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1))
