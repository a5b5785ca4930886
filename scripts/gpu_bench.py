"""`make gpu-bench`: every Triton kernel checked against its torch reference on the GPU, then the kernel benchmarks.

One process, one call, each part isolated (a kernel that fails to compile is recorded with its traceback and the
rest still runs). Writes, into --out (default data/gpu_results/):
  attention-<GPU>.json   `llmso-lab bench attention` (Lab 03's GPU cells read the newest one; Labs 04/05: paged, MLA)
  w4a16-<GPU>.json       `llmso-lab bench w4a16` (Lab 06)
  gpu-bench-<GPU>.json   versions, hardware, date, the correctness table and each part's wall time and status
Each file is rewritten as soon as its part ends, so a run cut off by a time limit keeps what it finished.

Without CUDA (`--dry-run`, used by the tests) the same code runs on tiny CPU shapes under TRITON_INTERPRET=1:
checks the plumbing and the JSON's shape, not the speed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # a host whose python already has torch + triton runs this without installing us

import torch  # noqa: E402


def _versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                   sm_count=p.multi_processor_count, gpu_memory_GiB=round(p.total_memory / 2**30, 1))
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0


# ------------------------------------------------------------------ correctness: each kernel vs its torch oracle
# Tolerances: outputs are O(1); fp16 rounding of O ~ 1e-3, bf16 ~ 8e-3 (8 mantissa bits), fp32 (dry run) ~ 1e-5.
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


def _check_flash(dev, dtype) -> list[dict]:
    from llmso_lab.attention import build_cu_seqlens, flash_attention, naive_attention, varlen_attention_torch
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for (b, h, hkv, nq, nk, d, causal) in [(2, 8, 2, 128, 128, 64, False), (2, 8, 2, 200, 200, 64, True),
                                           (1, 9, 3, 77, 301, 64, True), (1, 4, 4, 64, 64, 128, True)]:
        q = torch.randn(b, h, nq, d, device=dev, dtype=dtype, generator=g)
        k, v = (torch.randn(b, hkv, nk, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
        o, lse = flash_attention(q, k, v, causal)
        o_ref, lse_ref = naive_attention(q.float(), k.float(), v.float(), causal, return_lse=True)
        rows.append({"kernel": "flash_attention", "case": f"B{b} H{h}/{hkv} Nq{nq} Nk{nk} D{d} causal={causal}",
                     "max_err": _err(o, o_ref), "lse_err": _err(lse, lse_ref)})
    lens = [5, 64, 130]   # varlen: the engine's packed prefill
    cu = build_cu_seqlens(lens, device=dev)
    q = torch.randn(sum(lens), 9, 64, device=dev, dtype=dtype, generator=g)
    k, v = (torch.randn(sum(lens), 3, 64, device=dev, dtype=dtype, generator=g) for _ in range(2))
    o, _ = flash_attention(q, k, v, True, cu_seqlens=cu)
    o_ref = varlen_attention_torch(q.float(), k.float(), v.float(), cu, cu, causal=True)[0]
    rows.append({"kernel": "flash_attention", "case": f"varlen {lens} H9/3 D64 causal", "max_err": _err(o, o_ref)})
    return rows


def _check_decode(dev, dtype) -> list[dict]:
    from llmso_lab.attention import flash_decoding, naive_attention, paged_attention_torch, paged_decode_attention
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for (b, h, hkv, n, d, splits) in [(2, 32, 8, 1000, 128, None), (1, 9, 3, 4097, 64, None), (3, 8, 8, 77, 64, 1)]:
        q = torch.randn(b, h, d, device=dev, dtype=dtype, generator=g)
        k, v = (torch.randn(b, hkv, n, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
        o, _ = flash_decoding(q, k, v, splits)
        o_ref = naive_attention(q.float()[:, :, None], k.float(), v.float())[:, :, 0]
        rows.append({"kernel": "flash_decoding", "case": f"B{b} H{h}/{hkv} N{n} D{d} splits={splits or 'auto'}",
                     "max_err": _err(o, o_ref)})
    bs, hkv, h, d = 16, 3, 9, 64
    lens = torch.tensor([1, 17, 300, 0, 1024], dtype=torch.int32, device=dev)   # a zero-length row gives zeros
    max_blocks = (int(lens.max()) + bs - 1) // bs
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, device=dev)[:len(lens) * max_blocks].view(len(lens), -1).to(torch.int32)
    kc, vc = (torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
    q = torch.randn(len(lens), h, d, device=dev, dtype=dtype, generator=g)
    o_ref = paged_attention_torch(q.float(), kc.float(), vc.float(), tables, lens)
    for splits in (None, 1, 4):
        rows.append({"kernel": "paged_decode_attention", "case": f"lens {lens.tolist()} bs{bs} splits={splits or 'auto'}",
                     "max_err": _err(paged_decode_attention(q, kc, vc, tables, lens, num_splits=splits), o_ref)})
    # the INT8 KV cache (Lab 10): codes and per-(token, head) scales, dequantized inside the kernel
    ks, vs = (cache.float().abs().amax(-1).clamp_min(1e-6) / 127 for cache in (kc, vc))   # per (token, head)
    k8, v8 = ((cache.float() / sc[..., None]).round().clamp(-127, 127).to(torch.int8) for cache, sc in ((kc, ks), (vc, vs)))
    o_ref8 = paged_attention_torch(q.float(), k8.float() * ks[..., None], v8.float() * vs[..., None], tables, lens)
    o8 = paged_decode_attention(q, k8, v8, tables, lens, k_scale=ks.contiguous(), v_scale=vs.contiguous())
    rows.append({"kernel": "paged_decode_attention", "case": "int8 KV cache with scales", "max_err": _err(o8, o_ref8)})
    return rows


def _check_mla(dev, dtype) -> list[dict]:
    from llmso_lab.attention import mla_paged_decode_attention
    from llmso_lab.attention.mla import mla_paged_decode_torch
    g = torch.Generator(device=dev).manual_seed(2)
    r, dr, h, bs = 512, 64, 16, 16
    lens = torch.tensor([3, 100, 777], dtype=torch.int32, device=dev)
    max_blocks = (int(lens.max()) + bs - 1) // bs
    num_blocks = len(lens) * max_blocks
    tables = torch.randperm(num_blocks, device=dev).view(len(lens), -1).to(torch.int32)
    cache = torch.randn(num_blocks, bs, 1, r + dr, device=dev, dtype=dtype, generator=g)
    q = torch.randn(len(lens), h, r + dr, device=dev, dtype=dtype, generator=g)
    scale = (r + dr) ** -0.5 / 4
    want = mla_paged_decode_torch(q.float(), cache.float(), tables, lens, r, scale)
    return [{"kernel": "mla_paged_decode_attention", "case": f"lens {lens.tolist()} H{h} r{r}+{dr} splits={s or 'auto'}",
             "max_err": _err(mla_paged_decode_attention(q, cache, tables, lens, r, scale, num_splits=s), want)}
            for s in (None, 1)]


def _check_w4a16(dev, dtype) -> list[dict]:
    from llmso_lab.quant.rtn import quantize
    from llmso_lab.quant.triton_w4a16 import w4a16_matmul, w4a16_reference
    rows = []
    for (m, n, k, gs) in [(1, 576, 576, 64), (7, 1536, 576, 32), (64, 576, 1536, 128)]:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.02
        qt = quantize(w, 4, group_size=gs, symmetric=False)
        args = (qt.packed.to(dev), qt.scale.to(dev, dtype), qt.minimum.to(dev, dtype), gs)
        x = torch.randn(m, k, device=dev, dtype=dtype)
        want = w4a16_reference(x.float(), args[0], args[1].float(), args[2].float(), gs)
        got = w4a16_matmul(x, *args)
        rows.append({"kernel": "w4a16_matmul", "case": f"M{m} N{n} K{k} G{gs}",
                     "max_err": _err(got, want) / max(float(want.abs().max()), 1e-6), "relative": True})
    return rows


def _check_verify(dev, dtype) -> list[dict]:
    from llmso_lab.spec import verify_batch_reference, verify_batch_triton
    g = torch.Generator(device=dev).manual_seed(3)
    b, k = 8, 4   # SmolLM2's vocabulary on a GPU: many tiles of the kernel's vocabulary loop (the interpreter: a few)
    vocab = 49152 if dev.type == "cuda" else 1000
    p = torch.softmax(torch.randn(b, k + 1, vocab, device=dev, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(b, k, vocab, device=dev, generator=g) * 3, -1)
    d = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(b, k)
    n = torch.randint(0, k + 1, (b,), device=dev, generator=g)
    u = torch.rand(b, k, device=dev, generator=g)
    noise = torch.empty(b, vocab, device=dev).exponential_(generator=g)
    ref_out, ref_num = verify_batch_reference(p, q, d, n, u, noise)
    out, num = verify_batch_triton(p, q, d, n, u, noise)
    same = bool(torch.equal(out, ref_out) and torch.equal(num, ref_num))
    return [{"kernel": "verify_batch_triton", "case": f"B{b} k{k} V{vocab}", "max_err": 0.0 if same else 1.0,
             "exact": same}]


CHECKS: list[tuple[str, Callable]] = [("flash", _check_flash), ("decode", _check_decode), ("mla", _check_mla),
                                      ("w4a16", _check_w4a16), ("verify", _check_verify)]


class Recorder:
    """Runs parts, catching their errors; rewrites the summary JSON after each."""

    def __init__(self, out: Path, tag: str, dry_run: bool):
        self.out, self.tag = out, tag
        self.summary = {"name": "gpu-bench", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "command": "make gpu-bench" + (" (dry run: CPU, interpreter)" if dry_run else ""),
            "versions": _versions(), "parts": [], "correctness": []}
        out.mkdir(parents=True, exist_ok=True)

    def part(self, name: str, fn: Callable[[], object]):
        t0, status, result = time.time(), "ok", None
        print(f"== {name}", flush=True)
        try:
            result = fn()
        except Exception:   # noqa: BLE001 - a part's failure is recorded, the next part still runs
            status = "error: " + traceback.format_exc(limit=8)
            print(status, flush=True)
        self.summary["parts"].append({"part": name, "status": status if status == "ok" else status.splitlines()[-1],
                                      "traceback": None if status == "ok" else status,
                                      "seconds": round(time.time() - t0, 1)})
        self.write("gpu-bench", self.summary)
        return result

    def write(self, stem: str, record: dict) -> Path:
        path = self.out / f"{stem}-{self.tag}.json"
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "gpu_results")
    ap.add_argument("--quick", action="store_true", help="the benchmarks' reduced sweeps")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: tiny CPU shapes under the interpreter")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device: nothing to measure (`--dry-run` checks the plumbing on CPU)", file=sys.stderr)
        return 2
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("--dry-run on CPU needs TRITON_INTERPRET=1 (set before Triton is imported)", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    tag = torch.cuda.get_device_name(0).replace(" ", "-") if cuda else "cpu-dry-run"
    rec = Recorder(args.out, tag, not cuda)
    print(json.dumps(rec.summary["versions"]), flush=True)

    dtypes = [torch.float16, torch.bfloat16] if cuda else [torch.float32]
    for name, check in CHECKS:
        for dtype in dtypes:
            rows = rec.part(f"check {name} {str(dtype).removeprefix('torch.')}", lambda: check(dev, dtype)) or []
            for r in rows:
                r.update(dtype=str(dtype).removeprefix("torch."), ok=r["max_err"] <= TOL[dtype])
            rec.summary["correctness"] += rows
    failed = [r for r in rec.summary["correctness"] if not r["ok"]]
    rec.summary["correctness_ok"] = not failed and all(p["status"] == "ok" for p in rec.summary["parts"])
    rec.write("gpu-bench", rec.summary)
    for r in failed:
        print(f"MISMATCH {r['kernel']} {r['dtype']} {r['case']}: max_err {r['max_err']:.3g}", flush=True)

    if cuda:
        from llmso_lab.bench import attention, w4a16
        for stem, mod in (("w4a16", w4a16), ("attention", attention)):
            result = rec.part(f"bench {stem}", lambda: mod.run(quick=args.quick))
            if result is not None:
                print(f"wrote {rec.write(stem, result)}", flush=True)
                for key, value in result.get("ratios", {}).items():
                    print(f"  {key}: {value}")
    else:   # the benchmarks' GPU code paths on tiny shapes (their own dry-run helpers)
        from llmso_lab.bench.attention import _gpu_rows
        from llmso_lab.bench.w4a16 import kernel_rows
        rec.part("bench attention (tiny)", lambda: _gpu_rows(True, dev, small=True))
        rec.part("bench w4a16 (tiny)", lambda: kernel_rows(dev, {"tiny": (64, 128)}, [1, 16], group_size=32))
    ok = rec.summary["correctness_ok"] and all(p["status"] == "ok" for p in rec.summary["parts"])
    print(f"gpu-bench: {'all parts ran, every kernel matches its reference' if ok else 'FAILURES above'}; "
          f"{args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
