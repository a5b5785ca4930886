"""Accelerator and interconnect (Link) tables, this machine's measured ceilings, and roofline helpers used across the labs.

Units: FLOP/s, bytes/s, bytes, seconds. Peak numbers are vendor datasheet figures for *dense* BF16
tensor-core math (no 2:4 sparsity), the number a serving engineer should plan with.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "Accelerator", "ACCELERATORS", "get_accelerator", "Link", "LINKS", "get_link", "set_lab_threads", "load_guard", "LoadCheck", "measure_cpu", "measure_matmul",
    "cpu_flags", "native_matmul", "auto_dtype", "bf16_matmul_speedup", "packed_fp32_speedup", "best_seconds", "precision_speedup",
    "matmul_flops", "matmul_arithmetic_intensity", "ridge_point", "attainable_flops", "compute_bound_tokens",
    "roofline_time", "kv_bytes_per_token", "kv_cache_bytes", "mla_kv_bytes_per_token", "mla_kv_cache_bytes",
    "kv_cache_bytes_of_config", "decode_bytes_per_step", "decode_tokens_per_s_bound",
]


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    peak_flops: float        # dense bf16 FLOP/s (a measured CPU: its measured dtype's, fp32 by default)
    mem_bandwidth: float     # HBM (or DRAM) bytes/s
    mem_bytes: float         # device memory in bytes
    interconnect: str        # GPU<->GPU link
    interconnect_bw: float   # bytes/s per direction per GPU
    host_bw: float           # PCIe bytes/s per direction (KV swap to CPU memory)
    num_sms: int = 0         # streaming multiprocessors (0 for a CPU)

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from memory- to compute-bound."""
        return ridge_point(self.peak_flops, self.mem_bandwidth)


T, G = 1e12, 1e9
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS BF16 dense (1,979 with sparsity),
    # 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s total (450 GB/s per direction), PCIe Gen5 x16 64 GB/s.
    "H100-SXM": Accelerator("H100-SXM", 989 * T, 3.35e12, 80 * G, "NVLink4", 450 * G, 64 * G, 132),
    # NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s.
    "H200": Accelerator("H200", 989 * T, 4.8e12, 141 * G, "NVLink4", 450 * G, 64 * G, 132),
    # NVIDIA A100 datasheet (80GB SXM): 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s,
    # PCIe Gen4 x16 32 GB/s.
    "A100-80GB": Accelerator("A100-80GB", 312 * T, 2.039e12, 80 * G, "NVLink3", 300 * G, 32 * G, 108),
    # NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 with sparsity), 300 GB/s GDDR6, 24 GB,
    # no NVLink (PCIe Gen4 x16, 32 GB/s per direction).
    "L4": Accelerator("L4", 121 * T, 300 * G, 24 * G, "PCIe4", 32 * G, 32 * G, 58),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 82.6 TFLOPS BF16 dense with FP32
    # accumulate, 1,008 GB/s GDDR6X, 24 GB, no NVLink (PCIe Gen4 x16).
    "RTX4090": Accelerator("RTX4090", 82.6 * T, 1008 * G, 24 * G, "PCIe4", 32 * G, 32 * G, 128),
}


def get_accelerator(name: str) -> Accelerator:
    """Look up an accelerator by name (case-insensitive)."""
    for key, acc in ACCELERATORS.items():
        if key.lower() == name.lower():
            return acc
    raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")


@dataclass(frozen=True, slots=True)
class Link:
    """A GPU-to-GPU (or node-to-node) link in the alpha-beta model: a message of b bytes takes
    `latency + b / bandwidth` seconds (`llmso_lab.sim.comm` builds collectives from such messages)."""

    name: str
    bandwidth: float    # bytes/s per direction, per GPU (a ring sends and receives at once)
    latency: float      # seconds per message: the fixed cost even an empty message pays

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 bytes/s and latency >= 0 s, "
                             f"got {self.bandwidth!r} and {self.latency!r}")

    def transfer_time(self, nbytes: float) -> float:
        """Seconds for one message of `nbytes` bytes: latency + nbytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth


# Bandwidths are per direction per GPU, from the vendor or standard's line rate. Latencies are ORDER-OF-MAGNITUDE
# figures per message (one step of a ring collective), not measurements of any one system:
# - NVLink: nccl-tests ring all_reduce of a few bytes takes ~34 us on 8 A100s, 14 ring steps of ~2.4 us each, without
#   CUDA graphs (NVIDIA/nccl-tests#123), and ~0.5 us on 4 H800s with CUDA graphs (NVIDIA/nccl#1984); serving engines
#   replay CUDA graphs, so 1 us.
# - PCIe: nccl-tests all_reduce of 8 B on 8 RTX 3090s over PCIe takes ~54 us, ~3.9 us per ring step without CUDA
#   graphs (NVIDIA/nccl#1439): 3 us.
# - InfiniBand: ~1-2 us MPI ping-pong over RDMA (OSU latency benchmark class numbers, ~0.6 us per switch port);
#   NCCL's network proxy adds a few us: 5 us.
# - Ethernet with TCP: the kernel's TCP/IP stack costs tens of us per message (20-50 us typical): 30 us, whatever the
#   line rate (small messages pay the stack, not the wire).
LINKS: dict[str, Link] = {
    # NVIDIA H100 datasheet: NVLink 900 GB/s total = 450 GB/s per direction per GPU (NVLink 4, through NVSwitch).
    "NVLink4": Link("NVLink4", 450 * G, 1e-6),
    # NVIDIA A100 datasheet: NVLink 600 GB/s total = 300 GB/s per direction per GPU (NVLink 3).
    "NVLink3": Link("NVLink3", 300 * G, 1e-6),
    # PCI-SIG: PCIe 5.0 x16 = 32 GT/s x 16 lanes, 128b/130b encoding: ~63 GB/s per direction (NVIDIA quotes 64 GB/s).
    "PCIe5": Link("PCIe5", 64 * G, 3e-6),
    # PCI-SIG: PCIe 4.0 x16 = 16 GT/s x 16 lanes: ~32 GB/s per direction.
    "PCIe4": Link("PCIe4", 32 * G, 3e-6),
    # InfiniBand NDR (NVIDIA ConnectX-7 / Quantum-2): 400 Gb/s = 50 GB/s per direction, one NIC per GPU (DGX H100).
    "IB-NDR": Link("IB-NDR", 50 * G, 5e-6),
    # IEEE 802.3 100 Gigabit Ethernet: 100 Gb/s = 12.5 GB/s per direction, TCP (NCCL's socket transport, or gloo).
    "100GbE": Link("100GbE", 12.5 * G, 30e-6),
    # IEEE 802.3 25 Gigabit Ethernet: 25 Gb/s = 3.125 GB/s per direction, TCP.
    "25GbE": Link("25GbE", 3.125 * G, 30e-6),
}


def get_link(name: str) -> Link:
    """Look up a link by name (case-insensitive)."""
    for key, link in LINKS.items():
        if key.lower() == name.lower():
            return link
    raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}")


def set_lab_threads(num_threads: int | None = None) -> int:
    """The one thread policy of the labs and the demo; returns the thread count torch now uses.

    `num_threads`, else $LLMSO_LAB_THREADS, else every core this process may run on. A CPU's ceilings and
    every model timing hold only for the thread count they were measured with, so each lab's setup cell calls
    this first and "this CPU" means the same thing in every lab.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = num_threads or int(os.environ.get("LLMSO_LAB_THREADS") or 0) or cores
    torch.set_num_threads(n)
    return n


@dataclass(frozen=True, slots=True)
class LoadCheck:
    """What `load_guard` saw: this run's matmul rate, the best this machine has shown at the same thread count,
    and the other processes' share of the cores (1-minute load average minus this process's own use)."""
    gflops: float
    best_gflops: float
    others_load: float
    cpus: int

    @property
    def busy(self) -> bool:
        return self.gflops < LOAD_GUARD_SLOWER * self.best_gflops or self.others_load > 0.5 * self.cpus

    def line(self) -> str:
        seen = (f"fp32 matmul {self.gflops:.1f} GFLOP/s (best seen on this machine {self.best_gflops:.1f}), "
                f"other processes' load {self.others_load:.1f} on {self.cpus} cores")
        if self.busy:
            return (f"WARNING: this machine is busy ({seen}). Timings in this lab will be slower and their ratios may "
                    f"be off: close other jobs (another notebook, a browser tab running a video, a build) and rerun "
                    f"the timed cells.")
        return f"machine check: quiet ({seen}); timings are representative of this machine."


LOAD_GUARD_SLOWER = 0.5   # a run under half the machine's best: a quiet 2-core VM stays within 0.55-1.0 (a fresh kernel included), a busy one is 2-10x slower


def load_guard(seconds: float = 0.3, record: str | os.PathLike | None = None, quiet: bool = False,
               loadavg=os.getloadavg) -> LoadCheck:
    """The setup cell's check that the machine is quiet enough for the lab's timings; prints one line.

    Times a fixed 512x512 fp32 matmul for about `seconds` (best run, at torch's thread count) and compares it with
    the best this machine has shown at that thread count (kept in `record`, default
    `$LLMSO_LAB_CACHE/machine_best.json`, updated when beaten), and reads the load average for other jobs. A machine
    that another job keeps busy runs at well under half its best (2 cores, one busy: 2-10x slower), so the warning is
    rare on a quiet machine and certain on a busy one. The first run on a machine is its own best: only the load average
    can warn then. `loadavg` is injectable (tests)."""
    import json
    from pathlib import Path

    threads = torch.get_num_threads()
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    c = torch.empty(512, 512)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    gflops = matmul_flops(512, 512, 512) / best_seconds(lambda: torch.mm(a, b, out=c), seconds) / 1e9
    own = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    path = Path(record) if record is not None else Path(
        os.environ.get("LLMSO_LAB_CACHE", Path.home() / ".cache" / "llmso_lab")) / "machine_best.json"
    key = f"matmul512_fp32_{threads}threads"
    try:
        best = json.loads(path.read_text())
    except (OSError, ValueError):
        best = {}
    best = best if isinstance(best, dict) else {}   # a broken record is rewritten, never trusted
    if gflops > (best[key] if isinstance(best.get(key), (int, float)) else 0.0):
        best[key] = gflops
        try:   # write then rename: two labs starting at once never leave half a file
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(best))
            os.replace(tmp, path)
        except OSError:
            pass   # a read-only home: the check still runs, it just does not remember
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    check = LoadCheck(gflops, best[key], max(0.0, loadavg()[0] - own), cpus)
    if not quiet:
        print(check.line())
    return check


def measure_matmul(dtype: torch.dtype = torch.float32, seconds: float = 1.0,
                   sizes: Sequence[int] = (256, 512, 1024)) -> float:
    """This CPU's matrix ceiling in `dtype`: the best FLOP/s of one square matmul over `sizes` (the best size
    wins; outputs preallocated, so no page faults are timed), taking about `seconds` at torch's thread count.

    `torch.int8` times `torch._int_mm` (int8 x int8 -> int32, what W8A8 runs) and returns integer ops/s.
    """
    budget, best_rate = seconds / len(sizes), 0.0
    for size in sizes:
        if dtype == torch.int8:
            a, b = (torch.randint(-128, 128, (size, size), dtype=torch.int8) for _ in range(2))
            c = torch.empty(size, size, dtype=torch.int32)
            op = lambda: torch._int_mm(a, b, out=c)  # noqa: E731
        else:
            a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
            c = torch.empty(size, size, dtype=dtype)
            op = lambda: torch.mm(a, b, out=c)  # noqa: E731
        best = best_seconds(op, budget)
        best_rate = max(best_rate, matmul_flops(size, size, size) / best)
    return best_rate


def best_seconds(op, budget_s: float, min_runs: int = 3, *, warmup: bool = True, self_timed: bool = False) -> float:
    """Fastest of repeated `op()` calls over about `budget_s` seconds (after one untimed warm-up call).

    The best run, not the average, because a run that another process interrupted says nothing about the code.
    `budget_s=0` makes exactly `min_runs` runs (a fixed count, for ops that take seconds each);
    `warmup=False` times the first call too. With `self_timed` `op()` returns the seconds to count
    itself (e.g. from the engine's per-token timestamps, leaving the prefill out) instead of its wall time.
    """
    if warmup:
        op()
    n, best, t_end = 0, float("inf"), time.perf_counter() + budget_s
    while time.perf_counter() < t_end or n < min_runs:
        t0 = time.perf_counter()
        if self_timed:
            seconds = op()
        else:
            op()   # drop the result here: holding it would keep two outputs alive and change what allocation costs
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
        n += 1
    return best


def measure_cpu(seconds: float = 2.0, matmul_sizes: Sequence[int] = (256, 512, 1024), copy_mb: int = 256,
                dtype: torch.dtype = torch.float32) -> Accelerator:
    """Measure this machine's matmul FLOP/s in `dtype` (`measure_matmul`) and memory copy bandwidth.

    Both are ceilings, so both are the best single run, not an average (a run that another process
    interrupted says nothing about the hardware): bandwidth is read + write bytes over copies of `copy_mb`
    MiB. Takes about `seconds`, at the thread count torch uses now (see `set_lab_threads`); the name says
    that count (and the dtype when it is not fp32).
    """
    peak = measure_matmul(dtype, seconds / 2, matmul_sizes)
    src = torch.ones(copy_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), seconds / 2)  # a copy reads and writes every byte
    threads = torch.get_num_threads()
    tag = "" if dtype == torch.float32 else f", {str(dtype).removeprefix('torch.')}"
    return Accelerator(f"this-cpu ({threads} thread{'s' if threads > 1 else ''}{tag})", peak, bw, 0.0, "none", 0.0, 0.0, 0)


# ---- precision: which dtype runs natively here --------------------------------------------------------
# x86 matrix (AMX) and vector (AVX-512) units that multiply these dtypes natively; without them torch converts
# to fp32 and back around every matmul
NATIVE_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS or Windows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def native_matmul(dtype: torch.dtype, device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Does `device` multiply `dtype` (bf16 or fp16) matrices natively? (yes/no, why). CUDA asks the driver
    (bf16 needs sm_80+); a CPU needs one of `NATIVE_CPU_FLAGS[dtype]` among its flags."""
    device, name = torch.device(device), str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        ok = torch.cuda.is_bf16_supported() if dtype == torch.bfloat16 else major >= 7
        return ok, f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}) {'has' if ok else 'lacks'} {name} tensor cores"
    if device.type != "cpu":
        return False, f"no {name} detection for {device.type} devices"
    flags = NATIVE_CPU_FLAGS[dtype]
    units = [f for f in flags if f in cpu_flags()]
    cap = torch.backends.cpu.get_cpu_capability()
    if units:
        return True, f"the CPU has {' and '.join(units)} (torch CPU capability {cap})"
    return False, f"the CPU has neither {' nor '.join(flags)} (torch CPU capability {cap}): {name} matmuls are emulated"


@functools.lru_cache(maxsize=None)
def packed_fp32_speedup(rows: int = 16, k: int = 576, n: int = 1536, budget_s: float = 0.02) -> float:
    """`x @ w` time / oneDNN prepacked time for an fp32 [rows, k] x [k, n] product (SmolLM2's MLP size) on this CPU,
    measured once per process (~0.1 s): > 1 means the engine's fp32 weights are worth prepacking
    (`engine.ops.OneDNNLinear`). 0.0 where the packed kernel is missing or not x86-64 (`platform.machine`:
    oneDNN's fp32 kernels elsewhere were not measured here). `LLMSO_LAB_FP32_LINEAR=aten` forces 0.0 (plain `x @ w`),
    `=onednn` forces packing (both for experiments and tests)."""
    import platform

    forced = os.environ.get("LLMSO_LAB_FP32_LINEAR", "")
    if forced in ("aten", "onednn"):
        return 0.0 if forced == "aten" else float("inf")
    if platform.machine().lower() not in ("x86_64", "amd64") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return 0.0
    w, x = torch.randn(n, k), torch.randn(rows, k)
    w_t = w.t().contiguous()   # the engine's plain layout [in, out]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        onednn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        onednn()
    except RuntimeError:
        return 0.0
    # the two kernels take turns (4 windows each, best of all): a burst of other work during one window cannot
    # decide the engine's kernel for the whole process (one 0.02 s window each flipped it now and then)
    packed_s = plain_s = float("inf")
    for _ in range(4):
        packed_s = min(packed_s, best_seconds(onednn, budget_s / 4))
        plain_s = min(plain_s, best_seconds(lambda: x @ w_t, budget_s / 4))
    return plain_s / packed_s


def onednn_linear_available(dtype: torch.dtype, device: str | torch.device = "cpu") -> bool:
    """Does the engine prepack `dtype` weights for oneDNN (`engine.ops.OneDNNLinear`) on `device`? A CPU with PyTorch's
    oneDNN build, and: bf16 that the CPU multiplies natively, or fp32 where the packed kernel measured faster than
    `x @ w` (`packed_fp32_speedup` >= 1.1 at 16 rows, x86-64 only)."""
    if not (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return packed_fp32_speedup() >= 1.1
    return dtype == torch.bfloat16 and native_matmul(dtype, "cpu")[0]


@functools.lru_cache(maxsize=None)
def auto_dtype(device: str = "cpu") -> tuple[torch.dtype, str]:
    """What `LLM(dtype="auto")` runs on `device` ("cpu" or "cuda"), and why.

    bf16 where the hardware multiplies it natively, fp32 elsewhere. On a CPU whose flags say bf16, the
    choice is also measured (`bf16_matmul_speedup`) so that "auto" is never silently slower than fp32: bf16
    is kept only if its matmuls win at 16 and at 256 rows (a decode batch, a prefill). One row (batch-1
    decode) is reported but not required: there the bf16 matrix-vector kernel can lose to fp32 although it
    reads half the bytes (`llmso-lab bench precision` measures it).
    """
    ok, why = native_matmul(torch.bfloat16, device)
    if not ok:
        return torch.float32, f"float32: {why}"
    if torch.device(device).type != "cpu":
        return torch.bfloat16, f"bfloat16: {why}"
    speed = bf16_matmul_speedup()
    measured = ", ".join(f"{m} row{'s' if m > 1 else ''} {x:.1f}x" for m, x in speed.items())
    if speed[16] > 1 and speed[256] > 1:
        note = "" if speed[1] >= 0.9 else "; but 1 row (batch-1 decode) is slower in bf16: its matrix-vector kernel loses"
        return torch.bfloat16, f"bfloat16: {why}; bf16 matmuls measured vs fp32: {measured}{note}"
    return torch.float32, f"float32: {why}, but bf16 matmuls measured slower than fp32 ({measured})"


def bf16_matmul_speedup(rows: Sequence[int] = (1, 16, 256), k: int = 1024, n: int = 2048,
                        budget_s: float = 0.02) -> dict[int, float]:
    """fp32 time / bf16 time of `[rows, k] @ [k, n]` for each row count (best of a few runs each): > 1 means
    bf16 is faster. bf16 runs the kernel the engine uses: oneDNN with the weight prepacked where available
    (`engine.ops.OneDNNLinear`; the plain bf16 `mm` takes a slow matrix-vector path for few rows), else
    `torch.mm`. About 0.1 s."""
    from llmso_lab.engine.ops import OneDNNLinear   # a leaf module (torch only)

    packed = onednn_linear_available(torch.bfloat16, "cpu")
    out = {}
    for m in rows:
        a, b = torch.randn(m, k), torch.randn(k, n)
        c = torch.empty(m, n)
        fp32 = best_seconds(lambda: torch.mm(a, b, out=c), budget_s)
        a16, b16 = a.bfloat16(), b.bfloat16()
        if packed:
            w = OneDNNLinear(b16)
            bf16 = best_seconds(lambda: w(a16), budget_s)
        else:
            c16 = torch.empty(m, n, dtype=torch.bfloat16)
            bf16 = best_seconds(lambda: torch.mm(a16, b16, out=c16), budget_s)
        out[m] = fp32 / bf16
    return out


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of [m, k] @ [k, n]: one multiply and one add per (i, j, l)."""
    return 2 * m * n * k


def matmul_arithmetic_intensity(m: int, n: int, k: int, bytes_per_elem: float = 2) -> float:
    """FLOP per byte of [m, k] @ [k, n] when A and B are read once and C written once."""
    return matmul_flops(m, n, k) / ((m * k + k * n + m * n) * bytes_per_elem)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Intensity (FLOP/byte) at which compute time equals memory time."""
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Roofline: min(peak, intensity * bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


def compute_bound_tokens(weight_bytes: float, flops_per_token: float, peak_flops: float, bandwidth: float) -> float:
    """New tokens per forward at which doing their math takes as long as reading the weights once.

    Below it a forward is memory-bound and costs about the same whatever the token count (a decode step, or
    speculative decoding's verification of a few draft tokens); above it the time grows with the tokens
    (prefill). It is the ridge point in tokens: FLOP/byte of one token per weight byte scaled to the ridge.
    """
    return ridge_point(peak_flops, bandwidth) * weight_bytes / flops_per_token


def roofline_time(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    """Lower bound on run time: the slower of doing the math and moving the bytes."""
    return max(flops / peak_flops, bytes_moved / bandwidth)


def precision_speedup(new_tokens: int, num_params: float, bytes_from: float, bytes_to: float,
                      peak_from: float, peak_to: float, bandwidth: float) -> float:
    """Roofline speed-up of one forward over `new_tokens` tokens when the weights change precision: from
    `bytes_from` to `bytes_to` bytes per parameter, and the matmul ceiling from `peak_from` to `peak_to` FLOP/s
    (the memory is the same). Every weight is read once per forward and each token does 2 FLOP per parameter.
    Returns old time / new time (> 1: faster). Memory-bound forwards (decode) gain the byte ratio,
    compute-bound ones (prefill) the ceiling ratio."""
    flops = 2 * num_params * new_tokens
    before = roofline_time(flops, num_params * bytes_from, peak_from, bandwidth)
    after = roofline_time(flops, num_params * bytes_to, peak_to, bandwidth)
    return before / after


# ---- KV-cache sizing: the one home of the formula (ModelShape, the simulator and the engine call these) ----
def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: float = 2) -> int:
    """KV-cache bytes one token adds: K and V, in every layer, for every KV head."""
    return int(2 * num_layers * num_kv_heads * head_dim * bytes_per_elem)


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float, num_tokens: int,
                   batch: int = 1) -> int:
    """Bytes of the KV cache of `batch` sequences of `num_tokens` tokens each (the lecture's
    2 x layers x kv_heads x head_dim x dtype_bytes x seq_len x batch): `kv_bytes_per_token` times the tokens.

    80 layers x 8 KV heads x 128 x fp16 -> 327,680 bytes (320 KiB) per token; an 8K prompt -> 2.68 GB.
    """
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) * num_tokens * batch


def mla_kv_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: float = 2) -> int:
    """KV-cache bytes one token adds under multi-head latent attention (MLA, DeepSeek-V2/V3).

    Per layer MLA caches one latent vector c_KV [kv_lora_rank], from which both K and V of every head are
    rebuilt, plus one decoupled RoPE key [qk_rope_head_dim] shared by all heads: no factor 2 for K and V,
    and no head count. DeepSeek-V3: 61 x (512 + 64) x 2 bytes = 70,272 bytes per token in bf16.
    """
    return int(num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes)


def mla_kv_cache_bytes(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: float, num_tokens: int,
                       batch: int = 1) -> int:
    """Bytes of an MLA latent cache of `batch` sequences of `num_tokens` tokens each."""
    return mla_kv_bytes_per_token(num_layers, kv_lora_rank, qk_rope_head_dim, dtype_bytes) * num_tokens * batch


def kv_cache_bytes_of_config(config, num_tokens: int, batch: int = 1, dtype_bytes: float = 2) -> int:
    """KV-cache bytes of `batch` sequences of `num_tokens` tokens for a model given by its Hugging Face config
    (a dict, e.g. `model.config.to_dict()`): `num_hidden_layers`, `num_attention_heads`, `hidden_size`,
    `num_key_value_heads` (absent: MHA) and `head_dim` (absent or None: hidden_size // num_attention_heads).
    A config with a `kv_lora_rank` (DeepSeek-V2/V3) caches MLA's latent c_KV and RoPE key instead: no factor 2
    and no head count (`mla_kv_cache_bytes`), whatever its `num_key_value_heads` says.
    """
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return mla_kv_cache_bytes(layers, config["kv_lora_rank"], config["qk_rope_head_dim"], dtype_bytes, num_tokens, batch)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return kv_cache_bytes(layers, kv_heads, head_dim, dtype_bytes, num_tokens, batch)


def decode_bytes_per_step(weight_bytes: float, context_lens: Sequence[int], kv_bytes_per_token: float) -> float:
    """Bytes one decode step reads: all weights once (shared by the batch) + each sequence's KV cache."""
    return weight_bytes + sum(context_lens) * kv_bytes_per_token


def decode_tokens_per_s_bound(weight_bytes: float, bandwidth: float, batch: int = 1, context_len: int = 0,
                              kv_bytes_per_token: float = 0) -> float:
    """Memory-bound upper limit on generated tokens/s for `batch` sequences of `context_len` tokens."""
    step_bytes = decode_bytes_per_step(weight_bytes, [context_len] * batch, kv_bytes_per_token)
    return batch * bandwidth / step_bytes
