"""`llmso-lab` command line: env, model fetch, demo, bench, release, grade."""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


def _cmd_env(args) -> int:
    import torch

    from llmso_lab import hardware as hw
    from llmso_lab.models import cache_dir, is_cached, model_dir

    try:
        import triton
        triton_v = triton.__version__
    except Exception as exc:  # triton is Linux-only
        triton_v = f"not available ({type(exc).__name__})"
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (kernels run under TRITON_INTERPRET=1)"
    rows = [("python", platform.python_version()), ("platform", platform.platform()), ("torch", torch.__version__),
            ("triton", triton_v), ("cuda", cuda), ("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "(unset)")),
            ("cpu threads", str(torch.get_num_threads())), ("cache", str(cache_dir())),
            ("smollm2-135m", f"ready ({model_dir('smollm2-135m')})" if is_cached("smollm2-135m")
             else "not fetched yet: run `llmso-lab model fetch`")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.bfloat16, torch.float16):
        native, why = hw.native_matmul(dtype, device)
        rows.append((f"{str(dtype)[6:]} matmul", f"{'native' if native else 'emulated'}: {why}"))
    auto, why = hw.auto_dtype(device)
    rows.append(("LLM(dtype='auto')", why))
    for k, v in rows:
        print(f"{k:<18} {v}")
    return 0


def _cmd_model(args) -> int:
    from llmso_lab.models import fetch_model, load_model

    t0 = time.perf_counter()
    path = fetch_model(args.name, force=args.force)
    print(f"{args.name}: {path} (fetch step {time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    load_model(args.name)
    print(f"{args.name}: loads from the cache in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_release(args) -> int:
    from llmso_lab.grading.release import build_bundle, check_labs, write_labs

    if args.gradescope:
        from llmso_lab.grading.gradescope import build_package

        if not args.lab:
            raise ValueError("release --gradescope needs --lab NN (one autograder per assignment)")
        path = build_package(args.lab, Path(args.out or "dist"), hidden_visibility=args.hidden_visibility,
                             timeout_s=args.timeout_s)
        print(f"Gradescope autograder: {path} ({path.stat().st_size / 1e6:.1f} MB). Upload it as the assignment's "
              f"autograder (Ubuntu base image); students submit their {args.lab}_*.ipynb.")
        return 0
    if args.check:
        problems = check_labs()
        for p in problems:
            print(p)
        if problems:
            print("labs/ is generated from solutions/: run `llmso-lab release --labs` and commit the result.")
            return 1
        print("labs/ matches solutions/")
        return 0
    names = write_labs()
    print(f"wrote labs/: {', '.join(names)}")
    if args.out:
        files = build_bundle(Path(args.out))
        print(f"student bundle: {args.out} ({len(files)} files; no solutions, no hidden checks)")
    return 0


def _cmd_grade(args) -> int:
    from llmso_lab.grading.grader import format_table, grade_notebook

    batch = args.csv or args.json_dir or len(args.submission) > 1 or Path(args.submission[0]).is_dir() \
        or not Path(args.submission[0]).exists()
    if batch:
        from llmso_lab.grading.batch import grade_batch, summary

        if not args.lab:
            raise ValueError("grading several submissions needs --lab NN")
        rows = grade_batch(args.submission, args.lab, workers=args.workers, csv_path=Path(args.csv) if args.csv else None,
                           json_dir=Path(args.json_dir) if args.json_dir else None, force=args.force,
                           timeout_s=args.timeout)
        print(summary(rows, args.lab))
        if args.csv:
            print(f"gradebook: {args.csv}")
        return 0
    try:
        res = grade_notebook(args.submission[0], lab=args.lab, only=args.exercise, timeout_s=args.timeout)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
        print(f"results: {args.json}")
    return 0


def _cmd_bench(args) -> int:
    name = args.name
    try:   # a benchmark is the module llmso_lab/bench/NAME.py; the command line may write "_" as "-"
        mod = importlib.import_module(f"llmso_lab.bench.{name.replace('-', '_')}")
    except ModuleNotFoundError:
        from importlib import resources
        known = sorted(p.name[:-3].replace("_", "-") for p in resources.files("llmso_lab.bench").iterdir()
                       if p.name.endswith(".py") and not p.name.startswith("_"))
        print(f"error: unknown benchmark {name!r}; available: {', '.join(known)}", file=sys.stderr)
        return 2
    kwargs = {}
    if args.dtype:
        if "dtype" not in inspect.signature(mod.run).parameters:
            print(f"error: benchmark {name!r} has no --dtype", file=sys.stderr)
            return 2
        kwargs["dtype"] = args.dtype
    for opt in ("base_url", "rates", "num_prompts", "workload", "model", "slo_ttft_ms", "slo_tpot_ms"):
        if getattr(args, opt) is not None:
            if opt not in inspect.signature(mod.run).parameters:
                flag = "--rate" if opt == "rates" else "--" + opt.replace("_", "-")
                print(f"error: benchmark {name!r} has no {flag}", file=sys.stderr)
                return 2
            kwargs[opt] = getattr(args, opt)
    res = mod.run(quick=args.quick, **kwargs)
    res.setdefault("command", " ".join(["llmso-lab", *sys.argv[1:]]))
    res.setdefault("date", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    print_table(res.get("table", []))
    for title, rows in res.get("tables", {}).items():   # further tables a benchmark shows
        print(f"\n{title}:")
        print_table(rows)
    if res.get("ratios"):
        print("ratios (measured in this run):")
        for k, v in res["ratios"].items():
            print(f"  {k:<40} {v:.2f}" if isinstance(v, (int, float)) else f"  {k:<40} {v}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"json: {args.json}")
    return 0


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in cols))


def _cmd_demo(args) -> int:
    from llmso_lab.demo import run_demo

    return run_demo(out_dir=Path(args.out))


ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
                "kv_cache_memory_bytes", "dtype",
                "quantization", "kv_cache_dtype", "scheduling_policy", "seed", "enable_prefix_caching",
                "enable_chunked_prefill")


def _cmd_serve(args) -> int:
    from llmso_lab.serve import serve

    engine_args = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
          served_model_name=args.served_model_name, **engine_args)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmso-lab", description="LLM serving optimization labs")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="report Python, torch, triton, CUDA, the cache and the model").set_defaults(fn=_cmd_env)
    m = sub.add_parser("model", help="manage the real model")
    msub = m.add_subparsers(dest="action", required=True)
    f = msub.add_parser("fetch", help="download and cache SmolLM2 (once)")
    f.add_argument("name", nargs="?", default="smollm2-135m")
    f.add_argument("--force", action="store_true", help="fetch again even if cached")
    f.set_defaults(fn=_cmd_model)
    d = sub.add_parser("demo", help="instructor demo: ceilings, a SmolLM2 answer, one workload through HF and the engine (table + plots in out/demo/)")
    d.add_argument("--out", default="out/demo")
    d.set_defaults(fn=_cmd_demo)
    b = sub.add_parser("bench", help="benchmarks that report ratios measured in one run")
    b.add_argument("name")
    b.add_argument("--quick", action="store_true", help="smaller workload (about a minute)")
    b.add_argument("--json", help="write the figures to this JSON file")
    b.add_argument("--dtype", help="engine dtype where the benchmark takes one (batching, vllm, serve): auto, float32, bfloat16, float16")
    b.add_argument("--base-url", help="serve: the OpenAI-compatible server to load (default: start the engine's own)")
    b.add_argument("--rate", type=float, action="append", dest="rates", help="serve: requests/s (repeat for a sweep; inf: all at once)")
    b.add_argument("--num-prompts", type=int, help="serve: requests per rate")
    b.add_argument("--workload", help="serve: random, chat or shared-prefix")
    b.add_argument("--model", help="serve: the model name to request (default: the server's first)")
    b.add_argument("--slo-ttft-ms", type=float, help="serve: the TTFT goodput counts against")
    b.add_argument("--slo-tpot-ms", type=float, help="serve: the TPOT goodput counts against")
    b.set_defaults(fn=_cmd_bench)
    sv = sub.add_parser("serve", help="an OpenAI-compatible server in front of the engine (vLLM's `vllm serve`), on 127.0.0.1")
    sv.add_argument("model", nargs="?", default="smollm2-135m", help="registry name (default smollm2-135m)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every /v1 route")
    sv.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait beyond max_num_seqs; more get HTTP 503 (default 64)")
    for flag, kind in (("--max-num-seqs", int), ("--max-num-batched-tokens", int), ("--max-model-len", int),
                       ("--block-size", int), ("--num-kv-blocks", int), ("--kv-cache-memory-bytes", int), ("--dtype", str), ("--quantization", str),
                       ("--kv-cache-dtype", str), ("--scheduling-policy", str), ("--seed", int)):
        sv.add_argument(flag, type=kind, help="engine argument (vLLM's name)")
    sv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    sv.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    sv.set_defaults(fn=_cmd_serve)
    r = sub.add_parser("release", help="generate labs/ from solutions/ and build the student bundle")
    r.add_argument("--out", help="write the student bundle here")
    r.add_argument("--check", action="store_true", help="fail if labs/ differs from what solutions/ generates")
    r.add_argument("--labs", action="store_true", help="only regenerate labs/ (the default without --out)")
    r.add_argument("--gradescope", action="store_true", help="build the Gradescope autograder zip of --lab NN into --out")
    r.add_argument("--lab", help="lab number (with --gradescope)")
    r.add_argument("--hidden-visibility", default="after_published",
                   help="Gradescope visibility of the hidden checks' results: hidden, after_due_date, after_published "
                        "(default) or visible")
    r.add_argument("--timeout-s", type=float, default=None,
                   help="with --gradescope: one wall-clock limit in seconds for every exercise (default: each exercise's own)")
    r.set_defaults(fn=_cmd_release)
    g = sub.add_parser("grade", help="grade submitted notebooks in a sandbox (one: a table; several: a gradebook)")
    g.add_argument("submission", nargs="+", help="notebooks, folders of notebooks or glob patterns")
    g.add_argument("--lab", help="lab number (default for one file: its NN_ prefix; required for several)")
    g.add_argument("--json", help="write Gradescope results.json here (one submission)")
    g.add_argument("--exercise", action="append", help="grade only this exercise (repeatable; one submission)")
    g.add_argument("--timeout", type=float, help="override the per-exercise time limit (seconds)")
    g.add_argument("--workers", type=int, help="submissions graded at once (default: the number of cores)")
    g.add_argument("--csv", help="the gradebook: one row per submission (kept and reused on the next run)")
    g.add_argument("--json-dir", help="write each submission's results.json into this folder")
    g.add_argument("--force", action="store_true", help="grade again submissions the gradebook already has")
    g.set_defaults(fn=_cmd_grade)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except Exception as exc:
        from llmso_lab.models import ModelFetchError

        if isinstance(exc, (ModelFetchError, ValueError)):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
