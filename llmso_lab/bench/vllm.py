"""`llmso-lab bench vllm`: the project's engine against vLLM 0.32 (`.venv-vllm`, `make peers-vllm`) on SmolLM2, in
bf16 and fp32, on the same token ids with the same settings.

Workloads (greedy, EOS ignored, every request arriving at t = 0):
- continuous: the batching bench's workload (`bench.batching.workload`; FULL: 64 requests, prompts 32-512,
  outputs 16-256, max_num_seqs 16; `--quick`: its QUICK one, 16 requests, batch 8);
- batch-1 decode: one 32-token prompt, `batch1_tokens` new tokens, `batch1_repeats` times (median decode tokens/s
  after the first token, = 1 / TPOT);
- prefix caching: the prefix bench's requests (`bench.prefix`: a shared 512-token system prompt + a short question,
  32 requests x 32 tokens; `--quick`: 256 tokens, 12 x 16), the system prompt served first, untimed, so that the
  prefix cache starts warm (as there).
Settings, identical on both sides and with vLLM's names: dtype, max_num_seqs (the workload's), max_num_batched_tokens
2048, max_model_len (the longest request + 16), block_size 32 (vLLM's CPU backend wants multiples of 32),
enable_prefix_caching=True (vLLM's default; one vLLM per dtype serves all three workloads, so the engine runs with it
too; each workload starts from an empty cache: the engine builds a fresh `LLM`, vLLM calls `reset_prefix_cache`),
enable_chunked_prefill=True, kv_cache_memory_bytes 1 GiB, and this process's torch threads. On a CPU vLLM runs its
engine core and model in the peer's one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with as many torch threads as
the engine: its fastest setting on 2 cores, ahead of its default processes (see `vllm_peer`).

Alternation. vLLM takes ~3 min to load and torch.compile SmolLM2 on 2 cores, so it is loaded ONCE per dtype: the
peer (`vllm_runner.VllmPeer`) stays alive and reads one round of workloads per line on its stdin. The rounds still
interleave in time -- for each dtype: engine round 1, vLLM round 1, engine round 2, vLLM round 2 -- because the
driver sends vLLM's round r only after the engine's round r is done and starts the engine's next round only after
vLLM has answered (`timeline` in the JSON records it). The peer is idle while the engine runs; the CPU seconds its
processes used meanwhile are recorded per round (`peer_cpu_s_during_engine`, ~0 when it really sleeps). vLLM's
load and compile time and its warm-up are reported apart (`vllm.load_s`, `vllm.warmup_s`), never in a round; the
engine is warmed per round on a full batch (as in `bench batching`), vLLM once after loading on the same batch.

Timing: TTFT, TPOT and E2E per request, from each system's own clock: the engine's `RequestOutput.metrics`; for vLLM,
TTFT and TPOT from its `RequestOutput.metrics` (`RequestStateStats`), E2E from the peer's `LLMEngine.step()` loop
(`vllm.timing_source`). Output tokens/s = all output tokens / the workload's wall time.

The table keeps each system's best round per workload (as `bench precision` does); the round-by-round table has the
paired ratios. Ratios (same run; > 1: the engine is better): `engine_vs_vllm_continuous_<bf16|fp32>` (output
tokens/s), `engine_vs_vllm_batch1_<dtype>` (decode tokens/s), `engine_vs_vllm_prefix_ttft_p50` (bf16; `_fp32` too:
vLLM's TTFT p50 over the engine's), each with `_worst_round` (the worst paired round), and
`tokens_equal_<workload>_<dtype>`: greedy agreement, the share of the engine's tokens that vLLM matched before
each request's first divergence (`precision.greedy_agreement`, round 1's outputs).

A third system runs where it builds on this machine: the engine with its opt-in native path (`engine.native`,
`LLMSO_LAB_NATIVE=1`: decode steps of up to a few sequences as one C++ call, decode attention read through the block
tables), in the same alternation, ratios `engine_native_vs_vllm_*` (`native=False` leaves it out; `native` in the
JSON says whether it ran and why).

Without `.venv-vllm` the bench says how to build it and measures the engine alone (no ratios).
"""
from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from llmso_lab.bench import batching, harness, vllm_runner as vr
from llmso_lab.bench.precision import greedy_agreement

__all__ = ["run", "FULL", "QUICK", "schedule", "engine_settings", "prefix_workload"]

FULL = dict(workload=batching.FULL, prefix=dict(num_requests=32, prefix_tokens=512, max_tokens=32), batch1_repeats=3,
            rounds=2, max_num_batched_tokens=2048, block_size=32, kv_cache_memory_bytes=1 << 30)
QUICK = dict(workload=batching.QUICK, prefix=dict(num_requests=12, prefix_tokens=256, max_tokens=16), batch1_repeats=2,
             rounds=2, max_num_batched_tokens=2048, block_size=32, kv_cache_memory_bytes=1 << 30)
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
NATIVE = "engine + native path"   # the engine with `engine.native` (opt-in, LLMSO_LAB_NATIVE=1): a third system
WORKLOADS = ("continuous", "batch1", "prefix")


def schedule(dtypes, rounds: int, with_vllm: bool = True, native: bool = False) -> list[tuple[str, int, str]]:
    """The order of the timed turns: (dtype, round, system); per dtype the systems alternate round by round."""
    return [(d, r, s) for d in dtypes for r in range(1, rounds + 1) for s in _systems(with_vllm, native)]


def _systems(with_vllm: bool, native: bool) -> tuple[str, ...]:
    return ("engine",) + ((NATIVE,) if native else ()) + (("vllm",) if with_vllm else ())


def engine_settings(cfg: dict, dtype: str, max_model_len: int) -> dict:
    """The settings both systems get (vLLM's keyword names; `llmso_lab.engine.LLM` takes the same)."""
    return dict(dtype=dtype, max_num_seqs=cfg["workload"]["max_num_seqs"],
                max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=max_model_len,
                block_size=cfg["block_size"], enable_prefix_caching=True, enable_chunked_prefill=True,
                kv_cache_memory_bytes=cfg["kv_cache_memory_bytes"], seed=0)


def prefix_workload(tokenizer, vocab_size: int, num_requests: int, prefix_tokens: int) -> tuple[list[int], list[list[int]]]:
    """(shared system prompt, request prompts): the prefix bench's (`bench.prefix._prompts`); a model without a
    tokenizer (the tests' tiny one) gets seeded random ids with a shared prefix of the same length."""
    if tokenizer is not None:
        from llmso_lab.bench.prefix import _prompts
        return _prompts(tokenizer, num_requests, prefix_tokens)
    _, prompts = batching.workload(num_requests, (4, 12), (1, 1), vocab_size, seed=1, shared_prefix=prefix_tokens)
    return prompts[0][:prefix_tokens], prompts


def _engine_requests(outs) -> list[dict]:
    """The engine's outputs as the per-request dicts `vllm_runner.summarize` reads."""
    return [{"output_token_ids": list(o.outputs[0].token_ids), "prompt_len": len(o.prompt_token_ids),
             "num_cached_tokens": o.num_cached_tokens, "ttft_s": o.metrics.ttft, "tpot_s": o.metrics.tpot,
             "e2e_s": o.metrics.e2e} for o in outs]


def _engine_workload(net, tokenizer, w: dict, kw: dict, desc: str | None = None) -> dict:
    """One workload on a fresh engine (`LLM(**kw)`), step by step (`run_on_engine`, as `batching._engine`): prime
    prompts first, untimed. Returns `{"name", "wall_s", "requests"}` like a parsed vLLM result."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.sim.calibrate import run_on_engine
    from llmso_lab.workloads import Request

    llm = LLM(net, tokenizer, batching="continuous", **kw)
    for p in w.get("prime") or []:
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1), use_tqdm=False)
    reqs = [Request(i, 0.0, len(p), n) for i, (p, n) in enumerate(zip(w["prompt_token_ids"], w["max_tokens"]))]
    run = run_on_engine(llm, reqs, prompts=w["prompt_token_ids"], desc=desc)
    assert run.num_output_tokens == sum(w["max_tokens"]), "the engine must make exactly the requested tokens"
    return {"name": w["name"], "wall_s": run.wall_s, "requests": _engine_requests(run.outputs)}


def _round_figures(results: dict, repeats: int) -> dict:
    """A round's figures from its workload results (by name): continuous and prefix summaries, batch-1 decode
    tokens/s (median over the repeats), and each workload's output tokens (for agreement)."""
    cont, pre = results["continuous"], results["prefix"]
    b1 = [results[f"batch1-{k}"]["requests"][0] for k in range(repeats)]
    return {"continuous": vr.summarize(cont["requests"], cont["wall_s"]), "prefix": vr.summarize(pre["requests"], pre["wall_s"]),
            "batch1_tok_s": statistics.median(vr.decode_tok_s(r) for r in b1),
            "tokens": {"continuous": [r["output_token_ids"] for r in cont["requests"]],
                       "batch1": [b1[0]["output_token_ids"]],
                       "prefix": [r["output_token_ids"] for r in pre["requests"]]}}


def _roofline_bounds(net, model: str, dtypes, reqs, max_num_seqs: int, batch1_context: int, seconds: float) -> dict:
    """Per dtype, this machine's bounds for the two timed shapes, measured now (no peer alive): the continuous
    workload's roofline bound (`precision.roofline_share`: prefill FLOPs at the dtype's measured matmul ceiling, every
    decode step's weight and KV reads at the measured copy bandwidth) and batch-1 decode's bandwidth ceiling (all
    weights and the KV read once per token). Both systems' tokens/s are then a share of the same bound."""
    from llmso_lab import hardware as hw
    from llmso_lab.bench.precision import roofline_share
    from llmso_lab.models.shapes import ModelShape

    shape = ModelShape.from_hf_config(net.config, name=model)
    cpu = hw.measure_cpu(seconds=seconds)
    out = {}
    for d in dtypes:
        dt = getattr(torch, d)
        peak = cpu.peak_flops if dt == torch.float32 else hw.measure_matmul(dt, seconds / 2)
        cont, _ = roofline_share(1.0, [r.prompt_len for r in reqs], [r.output_len for r in reqs], max_num_seqs, shape,
                                 dt.itemsize, peak, cpu.mem_bandwidth)
        b1 = hw.decode_tokens_per_s_bound(shape.weight_bytes(dt.itemsize), cpu.mem_bandwidth, 1, batch1_context,
                                          shape.kv_bytes_per_token(dt.itemsize))
        out[d] = {"continuous": cont, "batch1": b1, "matmul_TFLOP_s": peak / 1e12, "copy_GB_s": cpu.mem_bandwidth / 1e9}
    return out


def _inputs(cfg: dict, net, tokenizer) -> dict:
    """The timed workloads of one turn (continuous, `batch1_repeats` x batch 1, prefix), the continuous workload's
    requests, the warm-up batch and the max_model_len that fits the longest request."""
    vocab, w, p = net.config.vocab_size, cfg["workload"], cfg["prefix"]
    reqs, prompts = batching.workload(w["num_requests"], w["prompt_len"], w["output_len"], vocab)
    system, prefix_prompts = prefix_workload(tokenizer, vocab, p["num_requests"], p["prefix_tokens"])
    workloads = [vr.make_workload("continuous", prompts, [r.output_len for r in reqs])]
    workloads += [vr.make_workload(f"batch1-{k}", [prompts[0][:32]], w["batch1_tokens"])
                  for k in range(cfg["batch1_repeats"])]
    workloads.append(vr.make_workload("prefix", prefix_prompts, p["max_tokens"], prime=[system]))
    longest = max(len(q) + n for x in workloads for q, n in zip(x["prompt_token_ids"], x["max_tokens"]))
    return {"workloads": workloads, "reqs": reqs,
            "max_model_len": min(net.config.max_position_embeddings, longest + 16),
            # a full batch: first-call allocations, the first big prefill
            "warm": vr.make_workload("warmup", prompts[:w["max_num_seqs"]], 2)}


@contextlib.contextmanager
def _model_folder(model: str, net) -> Iterator[Path]:
    """The folder vLLM loads: SmolLM2's cache (fetched once), or for a model built in memory (the tests' tiny one)
    a temporary save_pretrained folder, removed after the block."""
    if model == "smollm2-135m":
        from llmso_lab.models.registry import fetch_model, is_cached, model_dir as cached_dir
        if not is_cached(model):
            fetch_model(model)
        yield cached_dir(model)
    else:
        with tempfile.TemporaryDirectory(prefix="vllm-model-") as tmp:
            net.save_pretrained(tmp)
            yield Path(tmp)


def _measure(net, tokenizer, dtypes, cfg: dict, inputs: dict, model_dir: Path, python: Path, script,
             with_vllm: bool, native: bool = False) -> tuple[dict, list[dict], dict]:
    """The timed turns (`schedule`). Per dtype one vLLM peer is loaded, compiled and warmed up before its first turn
    and closed after its last (freeing its cores); then the engine and vLLM alternate round by round, the engine
    warmed up untimed on a fresh engine before each of its turns. Returns ({(dtype, system, round): the turn's
    `_round_figures`}, the timeline, each dtype's peer start-up report)."""
    from llmso_lab.engine import native as native_path

    systems = _systems(with_vllm, native)
    workloads, warm = inputs["workloads"], inputs["warm"]
    t_start, timeline, figures, peers = time.perf_counter(), [], {}, {}
    bar = tqdm(total=len(schedule(dtypes, cfg["rounds"], with_vllm, native)), desc="bench vllm")

    def turn(d: str, kw: dict, peer, s: str, r: int) -> dict:
        with harness.phase(bar, f"{d} round {r} {s}"):
            cpu0 = peer.cpu_seconds() if peer is not None else None
            with native_path.enabled(s == NATIVE):   # the plain engine without it whatever the environment says
                if s != "vllm":
                    _engine_workload(net, tokenizer, warm, kw)   # warm-up on a fresh engine, untimed
                t0 = time.perf_counter()
                if s != "vllm":
                    res = {x["name"]: _engine_workload(net, tokenizer, x, kw) for x in workloads}
                else:
                    res = {x["name"]: x for x in peer.run(workloads, round=r)}
            t1 = time.perf_counter()
            event = {"dtype": d, "round": r, "system": s, "start_s": round(t0 - t_start, 3),
                     "end_s": round(t1 - t_start, 3)}
            if s != "vllm" and cpu0 is not None:   # the peer should sleep while the engine runs
                cpu1 = peer.cpu_seconds()
                event["peer_cpu_s_during_engine"] = round(cpu1 - cpu0, 2) if cpu1 is not None else None
            timeline.append(event)
            return _round_figures(res, cfg["batch1_repeats"])
    try:
        for d in dtypes:
            kw = engine_settings(cfg, d, inputs["max_model_len"])
            peer = None
            if with_vllm:
                bar.set_postfix_str(f"loading vLLM {d}")
                job = vr.make_job([], model_dir=model_dir, warmup=warm, **kw)
                peer = vr.VllmPeer(job, python=python, script=script)
            try:
                if peer is not None:
                    peers[d] = peer.start()   # load + compile + warm-up: before any timed turn of this dtype
                turns = harness.alternate(cfg["rounds"], systems, lambda s, r: turn(d, kw, peer, s, r))
                figures.update({(d, s, r): f for (s, r), f in turns.items()})
            finally:
                if peer is not None:
                    peer.close()
    finally:
        bar.close()
    return figures, timeline, peers


def _best_row(d: str, label: str, mine: list[dict], bound: dict) -> dict:
    """One system's table row for dtype `d` from its rounds `mine`: the best round per workload (highest
    continuous and batch-1 tokens/s, lowest prefix TTFT p50) and both throughputs as a share of `bound`."""
    c = max(mine, key=lambda f: f["continuous"]["output_tok_s"])["continuous"]
    pre = min(mine, key=lambda f: f["prefix"]["ttft_p50_s"])["prefix"]
    r3 = harness.rounded   # seconds to 3 decimals
    row = {"dtype": d, "system": label, "output_tok_s": round(c["output_tok_s"], 1),
           "ttft_p50_s": r3(c["ttft_p50_s"]), "ttft_p99_s": r3(c["ttft_p99_s"]),
           "tpot_p50_ms": round(c["tpot_p50_ms"], 1), "tpot_p99_ms": round(c["tpot_p99_ms"], 1),
           "e2e_p50_s": r3(c["e2e_p50_s"]), "batch1_tok_s": round(max(f["batch1_tok_s"] for f in mine), 1),
           "prefix_ttft_p50_s": r3(pre["ttft_p50_s"]), "prefix_ttft_p99_s": r3(pre["ttft_p99_s"]),
           "prefix_hit_rate": r3(pre.get("prefix_hit_rate", float("nan"))),
           "same_tokens_every_round": all(f["tokens"] == mine[0]["tokens"] for f in mine)}
    row.update(roofline_bound_tok_s=round(bound["continuous"], 1),
               roofline_share=round(c["output_tok_s"] / bound["continuous"], 3),
               batch1_ceiling_tok_s=round(bound["batch1"], 1),
               batch1_share=round(row["batch1_tok_s"] / bound["batch1"], 3))
    return row


def _round_row(d: str, r: int, e: dict, v: dict | None, timeline: list[dict], n: dict | None = None) -> dict:
    """Round `r` of dtype `d`: the engine's figures `e` (and `n`, the engine with its native path, where it ran), and
    with vLLM's `v` the paired ratios (> 1: the engine is better) and the CPU seconds the peer used during the
    engine's turn."""
    row = {"dtype": d, "round": r, "engine_tok_s": e["continuous"]["output_tok_s"],
           "engine_batch1_tok_s": e["batch1_tok_s"], "engine_prefix_ttft_p50_s": e["prefix"]["ttft_p50_s"]}
    if n is not None:
        row.update(native_tok_s=n["continuous"]["output_tok_s"], native_batch1_tok_s=n["batch1_tok_s"],
                   native_prefix_ttft_p50_s=n["prefix"]["ttft_p50_s"])
    if v is not None:
        row.update(vllm_tok_s=v["continuous"]["output_tok_s"], vllm_batch1_tok_s=v["batch1_tok_s"],
                   vllm_prefix_ttft_p50_s=v["prefix"]["ttft_p50_s"])
        for prefix, x in (("", e), ("native_", n)):
            if x is not None:
                row.update({f"{prefix}continuous_ratio": x["continuous"]["output_tok_s"] / v["continuous"]["output_tok_s"],
                            f"{prefix}batch1_ratio": x["batch1_tok_s"] / v["batch1_tok_s"],
                            f"{prefix}prefix_ttft_ratio": v["prefix"]["ttft_p50_s"] / x["prefix"]["ttft_p50_s"]})
        ev = next(x for x in timeline if (x["dtype"], x["round"], x["system"]) == (d, r, "engine"))
        row["peer_cpu_s_during_engine"] = ev.get("peer_cpu_s_during_engine")
    return row


def _compare(d: str, e1: dict, v1: dict, table: list[dict], by_round: list[dict]) -> tuple[list[dict], dict]:
    """Engine against vLLM in dtype `d`: greedy agreement per workload (round 1's tokens `e1`, `v1`) and the ratios:
    best round over best round, and the worst paired round."""
    agreement, ratios, k = [], {}, SHORT[d]
    for name in WORKLOADS:
        a = greedy_agreement(e1[name], v1[name])
        div = [f for f in a["first_divergence"] if f is not None]
        agreement.append({"dtype": d, "workload": name, "tokens_equal": round(a["tokens_equal"], 3),
                          "identical": round(a["identical"], 3),
                          "first_divergence_median": statistics.median(div) if div else "-"})
        ratios[f"tokens_equal_{name}_{k}"] = a["tokens_equal"]
    rows = {t["system"]: t for t in table if t["dtype"] == d}
    v = next(t for name, t in rows.items() if name.startswith("vLLM"))
    mine = [x for x in by_round if x["dtype"] == d]
    for system, name, prefix in (("engine", "engine", ""), (NATIVE, "engine_native", "native_")):
        if system not in rows:
            continue
        e = rows[system]
        ratios[f"{name}_vs_vllm_continuous_{k}"] = e["output_tok_s"] / v["output_tok_s"]
        ratios[f"{name}_vs_vllm_continuous_{k}_worst_round"] = min(x[f"{prefix}continuous_ratio"] for x in mine)
        ratios[f"{name}_vs_vllm_batch1_{k}"] = e["batch1_tok_s"] / v["batch1_tok_s"]
        ratios[f"{name}_vs_vllm_batch1_{k}_worst_round"] = min(x[f"{prefix}batch1_ratio"] for x in mine)
        pk = f"{name}_vs_vllm_prefix_ttft_p50" + ("" if d == "bfloat16" else f"_{k}")
        # best round over best round from the unrounded figures (the table's 3 decimals can round a fast TTFT to 0)
        ratios[pk] = (min(x["vllm_prefix_ttft_p50_s"] for x in mine)
                      / min(x[f"{'engine' if name == 'engine' else 'native'}_prefix_ttft_p50_s"] for x in mine))
        ratios[pk + "_worst_round"] = min(x[f"{prefix}prefix_ttft_ratio"] for x in mine)
    return agreement, ratios


def _vllm_info(peers: dict, skipped: str | None) -> dict:
    """What each dtype's peer reported (versions, load and warm-up seconds, settings, ...), or why it was skipped."""
    if skipped:
        return {"skipped": skipped}
    info = {d: {k: m.get(k) for k in ("versions", "load_s", "warmup_s", "start_s", "settings", "engine_args",
                                      "omp_threads_bind", "threads", "torch_threads", "v1_multiprocessing", "device",
                                      "python")} for d, m in peers.items()}
    info["timing_source"] = next(iter(peers.values())).get("timing_source")
    return info


def run(quick: bool = False, *, model: str = "smollm2-135m", dtype: str | None = None,
        dtypes: tuple[str, ...] | None = None, python: str | Path | None = None,
        script: str | Path = vr.PEER_SCRIPT, native: bool | None = None, **overrides) -> dict:
    """Run the engine-vs-vLLM benchmark. `dtype` (the CLI's --dtype) or `dtypes` choose the dtypes (default bf16 and
    fp32); `python` / `script`: the peer's interpreter and script (the tests use a fake); `native`: also time the
    engine with its opt-in native path (`engine.native`) as a third system (None: where it builds here); `overrides`
    replace entries of FULL / QUICK (the tests use `model="tiny-llama"` and tiny sizes)."""
    from llmso_lab.engine import native as native_path
    from llmso_lab.engine.config import resolve_dtype
    from llmso_lab.models import load_model

    cfg = {**(QUICK if quick else FULL), **overrides}
    if dtypes is None:
        dtypes = (str(resolve_dtype(dtype, torch.device("cpu"))[0]).removeprefix("torch."),) if dtype else \
            ("bfloat16", "float32")
    net, tokenizer = load_model(model)   # fp32; each engine casts its own copy, vLLM loads the folder in its dtype
    inputs, w, rounds = _inputs(cfg, net, tokenizer), cfg["workload"], range(1, cfg["rounds"] + 1)
    with _model_folder(model, net) as model_dir:
        python = Path(python) if python is not None else vr.default_python()
        skipped = None if python.exists() else vr.missing_venv_message(python)
        if skipped:
            print(skipped + " -- measuring the engine alone")
        native_why = native_path.load()[1] if native is not False else "not asked for (native=False)"
        native = native is not False and native_path.load()[0] is not None
        figures, timeline, peers = _measure(net, tokenizer, dtypes, cfg, inputs, model_dir, python, script,
                                            with_vllm=skipped is None, native=native)
    systems = _systems(skipped is None, native)
    bounds = _roofline_bounds(net, model, dtypes, inputs["reqs"], w["max_num_seqs"], 32 + w["batch1_tokens"] // 2,
                              cfg.get("measure_seconds", 1.0 if quick else 3.0))
    table, by_round, agreement, ratios = [], [], [], {}
    for d in dtypes:
        table += [_best_row(d, f"vLLM {peers[d]['versions'].get('vllm', '?')}" if s == "vllm" else s,
                            [figures[(d, s, r)] for r in rounds], bounds[d]) for s in systems]
        by_round += [_round_row(d, r, figures[(d, "engine", r)], figures.get((d, "vllm", r)), timeline,
                                figures.get((d, NATIVE, r))) for r in rounds]
        if skipped is None:
            e1, v1 = figures[(d, "engine", 1)]["tokens"], figures[(d, "vllm", 1)]["tokens"]
            rows, more = _compare(d, e1, v1, table, by_round)
            agreement += rows
            ratios.update(more)
    return harness.result(
        "vllm", quick, f"--dtype {dtype}" if dtype else "", table=table, ratios=harness.rounded(ratios), model=model,
        dtypes=list(dtypes), threads=torch.get_num_threads(),
        settings={d: engine_settings(cfg, d, inputs["max_model_len"]) for d in dtypes},
        workload={"continuous": harness.lists(w),
                  "batch1": {"prompt_len": 32, "max_tokens": w["batch1_tokens"], "repeats": cfg["batch1_repeats"]},
                  "prefix": dict(cfg["prefix"]), "rounds": cfg["rounds"]},
        tables={"round by round (engine and vLLM alternate; ratios > 1: the engine is better)":
                harness.rounded(by_round),
                "greedy agreement, engine vs vLLM (round 1, tokens before the first divergence)": agreement},
        ceilings=harness.rounded(bounds), timeline=timeline, vllm=_vllm_info(peers, skipped), native=native_why,
        **harness.shared_cpu(" vLLM's load/compile time is not in any round (vllm.<dtype>.load_s)."))


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1, default=str))
