"""`make demo` / `llmso-lab demo`: the real model, this machine's roofline, and the lecture's serving comparison.

Prints the ceilings (at the labs' thread count, `hardware.set_lab_threads`) and answers a chat prompt with
SmolLM2 (tqdm bar over generated tokens). Then one workload goes through Hugging Face static batching and the
engine (static; continuous; continuous + prefix caching with the system prompt already cached; the same with a
KV cache that holds only the longest request, so requests get preempted): 12 requests that share a 64-token
system prompt, EOS ignored, 4 slots, and output lengths that differ a lot — every 4th request wants a long
answer, so each static batch holds one long request and its other slots idle until it ends (the lecture's
head-of-line blocking). The four timed systems are warmed up, then take turns in 3 short rounds (HF, static,
continuous, prefix, HF, ...; `bench.rounds`): the ratios are paired per round (median, worst round beside it),
and a fixed matmul timed between rounds measures the machine's own noise — on a busy machine one line above the
ratios says so. A table of throughput, TTFT/TPOT p50/p99, E2E p50, preemptions and prefix cache hit rate (each
system's median round), the round-by-round table, and the ratios. Plots in `out/demo/`: roofline, the lecture's
slot grids, the engine's real slot grids (static, continuous) and the TTFT/TPOT CDFs of every system.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

PROMPT = "What is machine learning? Answer in two sentences."   # one a 135M model answers well (greedy)


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
    from llmso_lab.models.timing import time_forwards
    from llmso_lab.sim import lecture_slot_grids
    from llmso_lab.viz import plot_roofline, plot_slot_grid

    warnings.filterwarnings("ignore", category=FutureWarning)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = hw.set_lab_threads()
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    print(f"SmolLM2-135M loaded in {time.perf_counter() - t0:.1f} s")

    cpu = hw.measure_cpu(seconds=2.0)
    print(f"\nRoofline ceilings (this machine measured at {threads} thread(s), best runs; GPUs from datasheets)")
    print(f"{'device':<22} {'peak TFLOP/s':>13} {'mem GB/s':>10} {'ridge FLOP/B':>13}")
    for acc in [cpu, *hw.ACCELERATORS.values()]:
        print(f"{acc.name:<22} {acc.peak_flops / 1e12:>13.3f} {acc.mem_bandwidth / 1e9:>10.1f} {acc.ridge:>13.1f}")

    shape = ModelShape.from_hf_config(model.config, name="SmolLM2-135M")
    weights = shape.weight_bytes(4)
    bound = hw.decode_tokens_per_s_bound(weights, cpu.mem_bandwidth)
    print(f"\nbatch-1 decode ceiling for SmolLM2 fp32 ({weights / 1e6:.0f} MB) here: {bound:.0f} tokens/s")

    print(f"\nQ: {PROMPT}")
    text, tps = chat(model, tok, PROMPT)
    print(f"A: {text}\n({tps:.1f} tokens/s with a plain Hugging Face decode loop, {tps / bound:.0%} of the ceiling)")

    from llmso_lab.sim import StepCost

    points, cost, ns = [], StepCost(cpu, shape, dtype_bytes=4), (1, 16, 256)
    for n, t in zip(ns, time_forwards(model, [(n, 1) for n in ns], context_len=128, rounds=2)):
        flops, moved = cost.work(prefill=[(n, 128)])
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
HF, STATIC, CONT, PREFIX = ("HF generate static", "engine static", "engine continuous",
                            "engine continuous + prefix cache")   # the systems timed in alternating rounds, in order


def round_figures(by_round: list[dict]) -> list[dict[str, dict[str, float]]]:
    """Per round, each system's output tokens/s and unrounded TTFT p50 (from `serving_demo`'s per-round results:
    {system: (row, metrics, tokens, traces)})."""
    return [{"tok_s": {k: v[0]["output_tok_s"] for k, v in r.items()},
             "ttft_p50": {k: statistics.median(m.ttft for m in v[1]) for k, v in r.items()}} for r in by_round]


def serving_headline(figs: list[dict[str, dict[str, float]]], busy: dict[str, float] | None = None,
                     noise=None) -> list[str]:
    """The demo's headline lines from per-round figures (`round_figures`): paired per-round ratios, median with
    the worst round beside it; `busy`: slot utilization per batching mode. When `noise` (`bench.rounds.MachineNoise`)
    says the machine was busy, one warning line comes first; otherwise a last line says it was quiet."""
    from llmso_lab.bench.rounds import median_and_worst, paired

    tok, ttft = [f["tok_s"] for f in figs], [f["ttft_p50"] for f in figs]
    n = f"median of {len(figs)} round{'s' if len(figs) > 1 else ''}"
    cs, cs_worst = median_and_worst(paired(tok, CONT, STATIC))
    ch, ch_worst = median_and_worst(paired(tok, CONT, HF))
    pc, pc_worst = median_and_worst(paired(ttft, CONT, PREFIX))   # > 1: prefix caching answers sooner
    slots = f"; slots busy {busy['continuous']:.0%} vs {busy['static']:.0%}" if busy else ""
    off, on = (statistics.median(r[k] for r in ttft) for k in (CONT, PREFIX))
    warn = noise.line("the demo") if noise is not None else None
    lines = [warn] if warn else []
    lines += [f"continuous batching vs static batching: {cs:.2f}x output tokens/s ({n}, worst round {cs_worst:.2f}x"
              f"{slots}); vs HF static batching: {ch:.2f}x (worst {ch_worst:.2f}x)",
              f"TTFT p50 without / with prefix caching: {off:.2f} s / {on:.2f} s ({pc:.1f}x, {n}, worst round "
              f"{pc_worst:.1f}x)"]
    if noise is not None and not warn:
        lines.append(f"the machine was quiet during the rounds ({noise.describe()})")
    return lines


def round_table(figs: list[dict[str, dict[str, float]]], probe_ms: list[float] | None = None) -> list[dict]:
    """One row per round: each system's tokens/s, the paired ratios, TTFT p50 without/with prefix caching and
    (`probe_ms`, one per round) the noise probe's median matmul after that round."""
    rows = []
    for i, f in enumerate(figs):
        t, p = f["tok_s"], f["ttft_p50"]
        row = {"round": i + 1, "HF tok/s": t[HF], "static": t[STATIC], "continuous": t[CONT], "+ prefix": t[PREFIX],
               "cont/static": round(t[CONT] / t[STATIC], 2), "cont/HF": round(t[CONT] / t[HF], 2),
               "static/HF": round(t[STATIC] / t[HF], 2), "TTFT p50 s": round(p[CONT], 2),
               "prefix-cached": round(p[PREFIX], 2), "TTFT ratio": round(p[CONT] / p[PREFIX], 2)}
        if probe_ms is not None:
            row["probe ms"] = round(probe_ms[i], 2)
        rows.append(row)
    return rows


def serving_demo(model, tok, out_dir: Path, num_requests: int = 12, prefix_len: int = 64,
                 own_len: tuple[int, int] = (4, 12), output_len: tuple[int, int] = (2, 6),
                 long_output_len: tuple[int, int] = (24, 32), slots: int = 4, seed: int = 1, rounds: int = 3,
                 probe=None) -> list[dict]:
    """One workload whose prompts share a system prompt, through HF static batches and four engine settings.

    Requests 0, slots, 2 * slots, ... want `long_output_len` tokens, the others `output_len`: every static
    batch (arrival order) holds one long request, so its other slots idle until that one ends.
    HF static, engine static, continuous and continuous + prefix cache are each warmed up on a few requests, then
    timed in `rounds` alternating rounds of the whole workload (HF, static, continuous, prefix, HF, ...), with
    `probe` (a `bench.rounds.NoiseProbe`, made here if None) timing a fixed matmul between rounds; the small-KV
    setting (preemptions) runs once, after them. The table shows each timed system's median round by tokens/s;
    then a round-by-round table and the headline (`serving_headline`: paired per-round ratios, median and worst
    round, one warning line first if the machine was busy). Checks that every engine run makes the same greedy
    tokens, writes latency_cdf.png and engine_slot_grid_{static,continuous}.png (from the rows' rounds) to out_dir.
    Returns the table rows.
    """
    from matplotlib.figure import Figure

    from llmso_lab.bench.batching import _engine, _hf_static, workload
    from llmso_lab.bench.rounds import NoiseProbe, interleaved_rounds
    from llmso_lab.cli import print_table
    from llmso_lab.kv.block_manager import cdiv
    from llmso_lab.sim.grid import slot_utilization, trace_slot_grid
    from llmso_lab.viz import plot_latency_cdf, plot_slot_grid
    from llmso_lab.workloads import Request, uniform_lengths

    reqs, prompts = workload(num_requests, own_len, output_len, model.config.vocab_size, seed, shared_prefix=prefix_len)
    long_lens = uniform_lengths(num_requests, *long_output_len, seed=seed + 1)
    reqs = [dataclasses.replace(r, output_len=long_lens[i]) if i % slots == 0 else r for i, r in enumerate(reqs)]
    system = prompts[0][:prefix_len]   # served once before the prefix-cache runs: the cache starts warm, as in
                                       # production, where the system prompt was already seen by earlier requests
    max_len = max(r.prompt_len + r.output_len for r in reqs)
    small_kv = cdiv(max_len, 16)   # 16-token blocks for the longest request alone: the others must wait or be preempted
    pad_id = model.config.pad_token_id or 0
    print(f"\nServing {num_requests} requests: a shared {prefix_len}-token system prompt + {own_len[0]}-{own_len[1]} "
          f"own tokens; every {slots}th asks for {long_output_len[0]}-{long_output_len[1]} output tokens, the others for "
          f"{output_len[0]}-{output_len[1]} (EOS ignored); {slots} slots. {HF}, {STATIC}, {CONT} and {PREFIX} take "
          f"turns, {rounds} rounds after a warm-up")

    def engine(batching: str, label: str, rs, ps, **kw):
        def run():
            row, outs, traces = _engine(model, tok, batching, rs, ps, slots, max_len, label, **kw)
            return row, [o.metrics for o in outs], [list(o.outputs[0].token_ids) for o in outs], traces
        return run

    def systems(rs, ps, tag: str = "") -> dict:   # label: () -> (row, metrics per request, greedy tokens, step traces)
        return {HF: lambda: (*_hf_static(model, rs, ps, slots, pad_id), None, None),
                STATIC: engine("static", STATIC + tag, rs, ps),
                CONT: engine("continuous", CONT + tag, rs, ps),
                PREFIX: engine("continuous", PREFIX + tag, rs, ps, enable_prefix_caching=True, warmup_prompt=system)}

    warm = [Request(i, 0.0, len(p), 2) for i, p in enumerate(prompts[:slots])]   # first calls pay one-off costs
    probe = probe if probe is not None else NoiseProbe()
    by_round = interleaved_rounds(systems(reqs, prompts), rounds, warmup=systems(warm, prompts[:slots], " (warm-up)"),
                                  between=probe)
    small_label = f"{PREFIX}, {small_kv} KV blocks"
    small = engine("continuous", small_label, reqs, prompts, enable_prefix_caching=True, warmup_prompt=system,
                   num_kv_blocks=small_kv)()
    tokens = [res[2] for r in by_round for k, res in r.items() if k != HF] + [small[2]]
    assert all(t == tokens[0] for t in tokens), "every engine run must make the same greedy tokens"

    # each timed system's median round by tokens/s (a real run: its latencies and step trace go together)
    pick = {k: sorted(range(rounds), key=lambda i: by_round[i][k][0]["output_tok_s"])[(rounds - 1) // 2]
            for k in by_round[0]}
    chosen = {k: by_round[i][k] for k, i in pick.items()} | {small_label: small}
    rows = [res[0] for res in chosen.values()]
    print(f"each system's median round of {rounds} by tokens/s; the small-KV row: one run, after the rounds")
    print_table([{header: r[k] for k, header in COLUMNS.items()} for r in rows])
    figs = round_figures(by_round)
    probe_ms = [1e3 * statistics.median(w) for w in probe.windows[1:]] if len(probe.windows) == rounds + 1 else None
    print("\nround by round (tokens/s; TTFT p50 s without / with prefix caching; probe: the fixed matmul after it)")
    print_table(round_table(figs, probe_ms))
    use = {m: slot_utilization(trace_slot_grid(chosen[f"engine {m}"][3], slots)) for m in ("static", "continuous")}
    print("\n".join(serving_headline(figs, use, probe.noise() if probe.windows else None)))

    ttft = {k: [m.ttft for m in res[1]] for k, res in chosen.items()}
    tpot = {k: [m.tpot for m in res[1]] for k, res in chosen.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    plot_latency_cdf(ttft, "TTFT (s)", "Time to first token (dots: p50, p99)", ax=left)
    plot_latency_cdf({k: [1e3 * t for t in v] for k, v in tpot.items()}, "TPOT (ms)",
                     "Time per output token (dots: p50, p99)", ax=right)
    fig.savefig(out_dir / "latency_cdf.png", dpi=120)
    for mode in ("static", "continuous"):   # the lecture's grid, drawn from the table rows' own step traces
        grid = trace_slot_grid(chosen[f"engine {mode}"][3], slots)
        plot_slot_grid(grid, f"Engine, {mode} batching").savefig(out_dir / f"engine_slot_grid_{mode}.png", dpi=120)
    return rows
