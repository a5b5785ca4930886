"""`make demo` / `llmso-lab demo`: the real model, this machine's roofline, and the lecture's slot grid.

Prints the ceilings, answers a chat prompt with SmolLM2 (tqdm bar over generated tokens), then runs one
small workload through Hugging Face static batching, the engine's static batching and the engine's
continuous batching (table: throughput, TTFT/E2E p50/p99, padding), and writes plots to `out/demo/`:
roofline, the lecture's slot grids, the engine's real slot grids and the latency CDFs.
"""
from __future__ import annotations

import os
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
    serving_comparison(model, tok, out_dir)
    print(f"\nplots: {', '.join(sorted(p.name for p in out_dir.glob('*.png')))} in {out_dir}/")
    return 0


def serving_comparison(model, tok, out_dir: Path, num_requests: int = 8) -> None:
    """HF static batches vs engine static vs engine continuous on one workload (EOS ignored)."""
    from llmso_lab.bench.batching import _engine, _hf_static, workload
    from llmso_lab.cli import print_table
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.sim.grid import trace_slot_grid
    from llmso_lab.viz import plot_slot_grid

    reqs, prompts = workload(num_requests, (32, 128), (8, 48), model.config.vocab_size, seed=1)
    slots = 4
    print(f"\nServing {num_requests} requests (prompts 32-128, outputs 8-48 tokens, {slots} slots):")
    rows = [_hf_static(model, reqs, prompts, slots, tok.pad_token_id or 0)]
    rows += [_engine(model, tok, mode, reqs, prompts, slots, 512) for mode in ("static", "continuous")]
    print_table(rows)
    print(f"continuous vs HF static: {rows[2]['output_tok_s'] / rows[0]['output_tok_s']:.2f}x output tokens/s")
    for mode in ("static", "continuous"):  # the lecture's grid, drawn from the engine's own step traces
        llm = LLM(model, tok, batching=mode, max_num_seqs=slots, max_model_len=512)
        for p, r in zip(prompts, reqs):
            llm.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
        traces = []
        while llm.has_unfinished_requests():
            traces.append(llm.step()[1])
        plot_slot_grid(trace_slot_grid(traces, slots), f"Engine, {mode} batching (SmolLM2)").savefig(
            out_dir / f"engine_slot_grid_{mode}.png", dpi=120)
