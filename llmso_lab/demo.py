"""`make demo` / `llmso-lab demo`: the real model, this machine's roofline, and the lecture's serving comparison.

Prints the ceilings and answers a chat prompt with SmolLM2 (tqdm bar over generated tokens). Then one workload
(12 requests that share a 128-token system prompt, EOS ignored, 4 slots) goes through Hugging Face static
batching and the engine (static; continuous; continuous + prefix caching with the system prompt already
cached; the same with a KV cache that holds only the longest request, so requests get preempted): a table
of throughput, TTFT/TPOT p50/p99, E2E p50, preemptions and prefix cache hit rate, and the measured ratios. Plots in `out/demo/`: roofline, the lecture's
slot grids, the engine's real slot grids (static, continuous) and the TTFT/TPOT CDFs of every system.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

PROMPT = "In two sentences, why is LLM decoding limited by memory bandwidth?"


@torch.inference_mode()
def chat(model, tokenizer, prompt: str, max_new_tokens: int = 64) -> tuple[str, float]:
    """Greedy answer with a progress bar; returns (text, tokens/s)."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from llmso_lab.models.timing import cache_kwarg

    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    ids, cache, out = enc["input_ids"], DynamicCache(config=model.config), []
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    pos, t0, key = 0, time.perf_counter(), cache_kwarg(model)
    for _ in tqdm(range(max_new_tokens), desc="SmolLM2 decoding", unit="tok"):
        positions = torch.arange(pos, pos + ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{key: cache}).logits
        pos += ids.shape[1]
        nxt = int(logits[0, -1].argmax())
        if nxt in eos:
            break
        out.append(nxt)
        ids = torch.tensor([[nxt]])
    return tokenizer.decode(out, skip_special_tokens=True), len(out) / (time.perf_counter() - t0)


def run_demo(out_dir: Path = Path("out/demo")) -> int:
    import warnings

    from llmso_lab import hardware as hw
    from llmso_lab.models import load_model
    from llmso_lab.models.shapes import ModelShape
    from llmso_lab.models.timing import time_forward
    from llmso_lab.sim import lecture_slot_grids
    from llmso_lab.viz import plot_roofline, plot_slot_grid

    warnings.filterwarnings("ignore", category=FutureWarning)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    print(f"SmolLM2-135M loaded in {time.perf_counter() - t0:.1f} s")

    cpu = hw.measure_cpu(seconds=2.0)
    print("\nRoofline ceilings (this machine measured; GPUs from datasheets)")
    print(f"{'device':<12} {'peak TFLOP/s':>13} {'mem GB/s':>10} {'ridge FLOP/B':>13}")
    for acc in [cpu, *hw.ACCELERATORS.values()]:
        print(f"{acc.name:<12} {acc.peak_flops / 1e12:>13.3f} {acc.mem_bandwidth / 1e9:>10.1f} {acc.ridge:>13.1f}")

    shape = ModelShape.from_hf_config(model.config, name="SmolLM2-135M")
    weights = shape.weight_bytes(4)
    bound = hw.decode_tokens_per_s_bound(weights, cpu.mem_bandwidth)
    print(f"\nbatch-1 decode ceiling for SmolLM2 fp32 ({weights / 1e6:.0f} MB) here: {bound:.0f} tokens/s")

    print(f"\nQ: {PROMPT}")
    text, tps = chat(model, tok, PROMPT)
    print(f"A: {text}\n({tps:.1f} tokens/s with a plain Hugging Face decode loop, {tps / bound:.0%} of the ceiling)")

    points = []
    for n in (1, 16, 256):
        t = time_forward(model, n, context_len=128, reps=2)
        flops, moved = n * shape.flops_per_token(128), weights + (128 + n) * shape.kv_bytes_per_token(4)
        points.append((f"{n} new tokens", flops / moved, flops / t))
    plot_roofline(cpu, points).savefig(out_dir / "roofline.png", dpi=120)
    grids = lecture_slot_grids()
    plot_slot_grid(grids["static"], "Static batching").savefig(out_dir / "slot_grid_static.png", dpi=120)
    plot_slot_grid(grids["continuous"], "Continuous batching").savefig(out_dir / "slot_grid_continuous.png", dpi=120)
    serving_demo(model, tok, out_dir)
    print(f"\nplots: {', '.join(sorted(p.name for p in out_dir.glob('*.png')))} in {out_dir}/")
    return 0


COLUMNS = {"system": "system", "output_tok_s": "tokens/s", "ttft_p50_s": "TTFT p50 s", "ttft_p99_s": "p99 s",
           "tpot_p50_ms": "TPOT p50 ms", "tpot_p99_ms": "p99 ms", "e2e_p50_s": "E2E p50 s",
           "preemptions": "preemptions", "prefix_hit_rate": "prefix hit rate"}   # row key: table header


def serving_demo(model, tok, out_dir: Path, num_requests: int = 12, prefix_len: int = 128,
                 own_len: tuple[int, int] = (8, 32), output_len: tuple[int, int] = (4, 24), slots: int = 4,
                 seed: int = 1) -> list[dict]:
    """One workload whose prompts share a system prompt, through HF static batches and four engine settings.

    Prints the table and the key ratios, checks that every engine setting makes the same greedy tokens,
    writes latency_cdf.png and engine_slot_grid_{static,continuous}.png to out_dir. Returns the table rows.
    """
    from matplotlib.figure import Figure

    from llmso_lab.bench.batching import _engine, _hf_static, workload
    from llmso_lab.cli import print_table
    from llmso_lab.kv.block_manager import cdiv
    from llmso_lab.sim.grid import trace_slot_grid
    from llmso_lab.viz import plot_latency_cdf, plot_slot_grid

    reqs, prompts = workload(num_requests, own_len, output_len, model.config.vocab_size, seed, shared_prefix=prefix_len)
    system = prompts[0][:prefix_len]   # served once before the prefix-cache runs: the cache starts warm, as in
                                       # production, where the system prompt was already seen by earlier requests
    max_len = max(r.prompt_len + r.output_len for r in reqs)
    small_kv = cdiv(max_len, 16)   # 16-token blocks for the longest request alone: the others must wait or be preempted
    print(f"\nServing {num_requests} requests: a shared {prefix_len}-token system prompt + {own_len[0]}-{own_len[1]} "
          f"own tokens, {output_len[0]}-{output_len[1]} output tokens (EOS ignored), {slots} slots")
    hf_row, hf_metrics = _hf_static(model, reqs, prompts, slots, model.config.pad_token_id or 0)
    settings = {  # row label: (batching, extra LLM arguments)
        "engine static": ("static", {}),
        "engine continuous": ("continuous", {}),
        "engine continuous + prefix cache": ("continuous", {"enable_prefix_caching": True, "warmup_prompt": system}),
        f"engine continuous + prefix cache, {small_kv} KV blocks": ("continuous", {
            "enable_prefix_caching": True, "warmup_prompt": system, "num_kv_blocks": small_kv}),
    }
    runs = {label: _engine(model, tok, batching, reqs, prompts, slots, max_len, label, **kw)
            for label, (batching, kw) in settings.items()}
    tokens = [[list(o.outputs[0].token_ids) for o in outs] for _, outs, _ in runs.values()]
    assert all(t == tokens[0] for t in tokens), "every engine setting must make the same greedy tokens"
    rows = [hf_row] + [row for row, _, _ in runs.values()]
    print_table([{header: r[k] for k, header in COLUMNS.items()} for r in rows])

    metrics = {hf_row["system"]: hf_metrics, **{k: [o.metrics for o in outs] for k, (_, outs, _) in runs.items()}}
    ttft = {k: [m.ttft for m in ms] for k, ms in metrics.items()}
    tpot = {k: [m.tpot for m in ms] for k, ms in metrics.items()}
    speedup = runs["engine continuous"][0]["output_tok_s"] / hf_row["output_tok_s"]
    print(f"continuous batching vs HF static batching: {speedup:.2f}x output tokens/s")
    off, on = (statistics.median(ttft[k]) for k in ("engine continuous", "engine continuous + prefix cache"))
    print(f"TTFT p50 without / with prefix caching: {off:.2f} s / {on:.2f} s ({off / on:.1f}x)")

    out_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    plot_latency_cdf(ttft, "TTFT (s)", "Time to first token (dots: p50, p99)", ax=left)
    plot_latency_cdf({k: [1e3 * t for t in v] for k, v in tpot.items()}, "TPOT (ms)",
                     "Time per output token (dots: p50, p99)", ax=right)
    fig.savefig(out_dir / "latency_cdf.png", dpi=120)
    for mode in ("static", "continuous"):   # the lecture's grid, drawn from the table runs' own step traces
        grid = trace_slot_grid(runs[f"engine {mode}"][2], slots)
        plot_slot_grid(grid, f"Engine, {mode} batching").savefig(out_dir / f"engine_slot_grid_{mode}.png", dpi=120)
    return rows
