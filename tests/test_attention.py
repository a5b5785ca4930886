"""Attention: torch references vs SDPA, and the Triton kernels (interpreted on CPU) vs the references."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere below

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from llmso_lab import attention as A
from llmso_lab.attention import fallback

needs_triton = pytest.mark.skipif(not A.triton_available(), reason="needs triton (Linux)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: needs CUDA")
REF = dict(atol=1e-5, rtol=1e-5)  # fp32 torch references
KERNEL = dict(atol=1e-4, rtol=1e-4)  # fp32 kernels: exp2 and another summation order; observed error ~5e-7


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors and the numpy-based interpreter gain nothing from threads; OpenMP workers only spin
    (badly so when other jobs share the 2 cores). Restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def qkv(B, H, Hkv, Nq, Nk, D, seed=0, **kw):
    q = rand(B, H, Nq, D, seed=seed, **kw)
    return q, rand(B, Hkv, Nk, D, seed=seed + 1, **kw), rand(B, Hkv, Nk, D, seed=seed + 2, **kw)


def sdpa(q, k, v, causal=False):
    """Independent oracle: torch SDPA, bottom-right causal mask written out with tril."""
    Nq, Nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).tril(diagonal=Nk - Nq) if causal else None
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


def sdpa_lse(q, k, causal=False):
    H = q.shape[1]
    s = q.float() @ k.float().repeat_interleave(H // k.shape[1], 1).transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        Nq, Nk = s.shape[-2:]
        visible = torch.ones(Nq, Nk, dtype=torch.bool, device=s.device).tril(diagonal=Nk - Nq)
        s = s.masked_fill(~visible, float("-inf"))
    return torch.logsumexp(s, -1)


def paged_setup(lens, Hkv, D, block_size, seed=0, dtype=torch.float32):
    """Contiguous per-sequence K/V plus the same data scattered into shuffled cache blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g).tolist()
    kc, vc = (rand(num_blocks, block_size, Hkv, D, seed=seed + i, dtype=dtype) for i in (1, 2))
    tables = torch.full((len(lens), max(max(need), 1)), -1, dtype=torch.int32)  # -1: unused entries
    ks, vs = [], []
    for b, n in enumerate(lens):
        ids = [perm.pop() for _ in range(need[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        ks.append(torch.cat([kc[i] for i in ids])[:n] if ids else kc[:0, 0])  # [n, Hkv, D]
        vs.append(torch.cat([vc[i] for i in ids])[:n] if ids else vc[:0, 0])
    return kc, vc, tables, torch.tensor(lens, dtype=torch.int32), ks, vs


# ---------------------------------------------------------------- torch references

@pytest.mark.parametrize("N", [1, 17, 100, 257])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ratio", [1, 3, 8])
def test_references_match_sdpa(N, causal, ratio):
    q, k, v = qkv(2, ratio, 1, N, N, 32, seed=N)
    want, want_lse = sdpa(q, k, v, causal), sdpa_lse(q, k, causal)
    o, lse = A.naive_attention(q, k, v, causal, return_lse=True)
    torch.testing.assert_close(o, want, **REF)
    torch.testing.assert_close(lse, want_lse, **REF)
    o, lse = A.flash_attention_torch(q, k, v, causal, block_q=16, block_k=32)  # tiles do not divide N
    torch.testing.assert_close(o, want, **REF)
    torch.testing.assert_close(lse, want_lse, **REF)


@pytest.mark.parametrize("Nq,Nk", [(1, 17), (5, 100), (17, 64)])
def test_bottom_right_causal(Nq, Nk):
    q, k, v = qkv(1, 3, 1, Nq, Nk, 16, seed=Nq)
    o, lse = A.flash_attention_torch(q, k, v, causal=True, block_q=8, block_k=16)
    torch.testing.assert_close(o, sdpa(q, k, v, causal=True), **REF)
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal=True), **REF)
    # The last query sees every key, the first sees exactly Nk - Nq + 1 of them.
    torch.testing.assert_close(o[:, :, -1], sdpa(q, k, v)[:, :, -1], **REF)
    first = sdpa(q[:, :, :1], k[:, :, : Nk - Nq + 1], v[:, :, : Nk - Nq + 1])
    torch.testing.assert_close(o[:, :, :1], first, **REF)


@pytest.mark.parametrize("impl", ["naive", "flash_torch", "triton"])
def test_rows_without_visible_keys_are_zero(impl):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key -> o = 0, lse = -inf, never NaN."""
    if impl == "triton" and not A.triton_available():
        pytest.skip("needs triton (Linux)")
    q, k, v = qkv(1, 2, 1, 8, 3, 16)
    fn = {"naive": lambda: A.naive_attention(q, k, v, True, return_lse=True),
          "flash_torch": lambda: A.flash_attention_torch(q, k, v, True, block_q=4, block_k=2),
          "triton": lambda: A.flash_attention(q, k, v, True)}[impl]
    o, lse = fn()
    assert (o[:, :, :5] == 0).all() and torch.isneginf(lse[:, :, :5]).all()
    torch.testing.assert_close(o[:, :, 5:], sdpa(q[:, :, 5:], k, v, causal=True), **KERNEL)


def test_online_softmax_update_is_exact_and_skips_masked_tiles():
    s, v = rand(4, 40, seed=1), rand(40, 8, seed=2)
    m, l, acc = torch.full((4,), float("-inf")), torch.zeros(4), torch.zeros(4, 8)
    masked = torch.full((4, 8), float("-inf"))  # a tile the causal mask hides completely
    m, l, acc = A.online_softmax_update(m, l, acc, masked, rand(8, 8))
    assert not torch.isnan(acc).any() and (l == 0).all()
    for lo, hi in [(0, 7), (7, 30), (30, 40)]:
        m, l, acc = A.online_softmax_update(m, l, acc, s[:, lo:hi], v[lo:hi])
    torch.testing.assert_close(acc / l[:, None], torch.softmax(s, -1) @ v, **REF)
    torch.testing.assert_close(m + l.log(), torch.logsumexp(s, -1), **REF)


def test_merge_attention_states():
    q, k, v = qkv(1, 2, 2, 3, 50, 16)
    full, full_lse = A.naive_attention(q, k, v, return_lse=True)
    o1, l1 = A.naive_attention(q, k[:, :, :20], v[:, :, :20], return_lse=True)
    o2, l2 = A.naive_attention(q, k[:, :, 20:], v[:, :, 20:], return_lse=True)
    o, lse = A.merge_attention_states(o1, l1, o2, l2)
    torch.testing.assert_close(o, full, **REF)
    torch.testing.assert_close(lse, full_lse, **REF)
    empty_o, empty_lse = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))  # a split with no keys
    o, lse = A.merge_attention_states(empty_o, empty_lse, o1, l1)
    torch.testing.assert_close(o, o1, **REF)
    torch.testing.assert_close(lse, l1, **REF)
    o, lse = A.merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_build_cu_seqlens():
    cu = A.build_cu_seqlens([3, 1, 0, 4])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 4, 8]
    assert A.build_cu_seqlens([]).tolist() == [0]


def varlen_case(lq, lk, H=6, Hkv=2, D=16, seed=0):
    q, k, v = rand(sum(lq), H, D, seed=seed), rand(sum(lk), Hkv, D, seed=seed + 1), rand(sum(lk), Hkv, D, seed=seed + 2)
    return q, k, v, A.build_cu_seqlens(lq), A.build_cu_seqlens(lk)


def varlen_oracle(q, k, v, lq, lk, causal):
    """SDPA per sequence; rows of empty sequences are absent."""
    os_, lses, q0, k0 = [], [], 0, 0
    for nq, nk in zip(lq, lk):
        qb, kb, vb = (x.transpose(0, 1)[None] for x in (q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk]))
        if nq:
            os_.append(sdpa(qb, kb, vb, causal)[0].transpose(0, 1))
            lses.append(sdpa_lse(qb, kb, causal)[0].transpose(0, 1))
        q0, k0 = q0 + nq, k0 + nk
    return torch.cat(os_), torch.cat(lses)


VARLEN_CASES = [([1, 17, 0, 5], [1, 17, 0, 5]), ([1, 0, 3, 20], [9, 0, 3, 33])]  # one-token, empty, chunked


@pytest.mark.parametrize("lq,lk", VARLEN_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_reference(lq, lk, causal):
    q, k, v, cu_q, cu_k = varlen_case(lq, lk)
    o, lse = A.varlen_attention_torch(q, k, v, cu_q, cu_k, causal=causal)
    want_o, want_lse = varlen_oracle(q, k, v, lq, lk, causal)
    torch.testing.assert_close(o, want_o, **REF)
    torch.testing.assert_close(lse, want_lse, **REF)


@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_reference(block_size):
    lens = [0, 1, 16, 37]
    kc, vc, tables, ctx, ks, vs = paged_setup(lens, 2, 16, block_size)
    q = rand(4, 6, 16, seed=9)
    o = A.paged_attention_torch(q, kc, vc, tables, ctx)
    assert (o[0] == 0).all()  # empty context -> zeros
    for b in range(1, 4):
        want = sdpa(q[b][None, :, None], ks[b].transpose(0, 1)[None], vs[b].transpose(0, 1)[None])[0, :, 0]
        torch.testing.assert_close(o[b], want, **REF)


@pytest.mark.parametrize("N,splits", [(100, 3), (100, 7), (5, 8), (64, 1)])
def test_flash_decoding_reference(N, splits):
    q, k, v = rand(2, 6, 16), rand(2, 2, N, 16, seed=1), rand(2, 2, N, 16, seed=2)
    o, lse = A.flash_decoding_torch(q, k, v, splits)
    torch.testing.assert_close(o, sdpa(q[:, :, None], k, v)[:, :, 0], **REF)
    torch.testing.assert_close(lse, sdpa_lse(q[:, :, None], k)[:, :, 0], **REF)


# ---------------------------------------------------------------- Triton kernels (interpreted on CPU)

@needs_triton
@pytest.mark.parametrize("N", [1, 17, 100, 257])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ratio", [1, 3, 8])
def test_flash_kernel_dense(N, causal, ratio):
    q, k, v = qkv(1, ratio, 1, N, N, 32, seed=N)
    o, lse = A.flash_attention(q, k, v, causal)
    torch.testing.assert_close(o, sdpa(q, k, v, causal), **KERNEL)
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal), **KERNEL)


@needs_triton
@pytest.mark.parametrize("B,H,Hkv,N,D", [(2, 2, 1, 33, 16), (1, 2, 2, 70, 64), (1, 3, 1, 50, 128), (1, 2, 1, 40, 24)])
def test_flash_kernel_head_dims(B, H, Hkv, N, D):  # D = 24 is padded to 32 inside the kernel
    q, k, v = qkv(B, H, Hkv, N, N, D, seed=D)
    causal = True
    o, lse = A.flash_attention(q, k, v, causal)
    torch.testing.assert_close(o, sdpa(q, k, v, causal), **KERNEL)
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal), **KERNEL)


@needs_triton
@pytest.mark.parametrize("Nq,Nk", [(1, 100), (17, 64), (33, 40)])
def test_flash_kernel_bottom_right_causal(Nq, Nk):
    q, k, v = qkv(1, 4, 2, Nq, Nk, 32, seed=Nk)
    o, lse = A.flash_attention(q, k, v, causal=True, block_m=16, block_n=16)
    torch.testing.assert_close(o, sdpa(q, k, v, causal=True), **KERNEL)
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal=True), **KERNEL)


@needs_triton
def test_flash_kernel_fp16():
    q, k, v = qkv(1, 4, 2, 70, 70, 64, seed=3, dtype=torch.float16)
    o, lse = A.flash_attention(q, k, v, causal=True)
    assert o.dtype == torch.float16
    torch.testing.assert_close(o.float(), sdpa(q, k, v, True), atol=2e-3, rtol=2e-3)  # P is rounded to fp16
    torch.testing.assert_close(lse, sdpa_lse(q, k, True), atol=1e-3, rtol=1e-3)


@needs_triton
@pytest.mark.parametrize("lq,lk", VARLEN_CASES)
def test_flash_kernel_varlen(lq, lk):
    q, k, v, cu_q, cu_k = varlen_case(lq, lk, seed=5)
    if lq == lk:
        o, lse = A.flash_attention(q, k, v, causal=True, cu_seqlens=cu_q)
    else:
        o, lse = A.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    want_o, want_lse = varlen_oracle(q, k, v, lq, lk, True)
    torch.testing.assert_close(o, want_o, **KERNEL)
    torch.testing.assert_close(lse, want_lse, **KERNEL)


@needs_triton
@pytest.mark.parametrize("N,splits,ratio", [(100, 3, 3), (100, 7, 1), (5, 8, 8), (0, 3, 2), (37, 1, 2)])
def test_flash_decoding_kernel(N, splits, ratio):
    q, k, v = rand(2, 2 * ratio, 32, seed=N), rand(2, 2, N, 32, seed=1), rand(2, 2, N, 32, seed=2)
    o, lse = A.flash_decoding(q, k, v, splits)
    if N == 0:  # no keys at all: zeros and lse = -inf, no NaN
        assert (o == 0).all() and torch.isneginf(lse).all()
        return
    torch.testing.assert_close(o, sdpa(q[:, :, None], k, v)[:, :, 0], **KERNEL)
    torch.testing.assert_close(lse, sdpa_lse(q[:, :, None], k)[:, :, 0], **KERNEL)


@needs_triton
@pytest.mark.parametrize("block_size,ratio,splits,dtype", [
    (16, 3, 1, torch.float32), (16, 1, 3, torch.float32), (8, 8, 2, torch.float32), (16, 3, 1, torch.float16),
])
def test_paged_decode_kernel(block_size, ratio, splits, dtype):
    lens = [0, 1, 37, 16, 70]
    kc, vc, tables, ctx, _, _ = paged_setup(lens, 2, 32, block_size, dtype=dtype)
    q = rand(len(lens), 2 * ratio, 32, seed=7, dtype=dtype)
    o = A.paged_decode_attention(q, kc, vc, tables, ctx, num_splits=splits)
    assert o.dtype == dtype and not torch.isnan(o).any()
    assert (o[0] == 0).all()  # empty context
    tol = KERNEL if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    want = A.paged_attention_torch(q.float(), kc.float(), vc.float(), tables, ctx)
    torch.testing.assert_close(o.float(), want, **tol)


@needs_triton
def test_kernel_refuses_cpu_without_interpreter():
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import torch; from llmso_lab.attention import flash_attention\n"
            "x = torch.zeros(1, 1, 4, 16)\n"
            "try:\n    flash_attention(x, x, x)\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "set TRITON_INTERPRET=1 before importing triton" in out.stdout, out.stdout + out.stderr


@needs_triton
def test_kernel_refuses_bf16_in_interpreter():
    if torch.cuda.is_available():
        pytest.skip("compiled kernels on a GPU handle bf16")
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        A.flash_attention(q, q, q)


@needs_triton
def test_flash_kernel_strided_inputs():
    """Engines often hold [B, N, H, D] and pass a transposed view; only the head dim must be contiguous."""
    q, k, v = (rand(1, 30, h, 32, seed=i).transpose(1, 2) for i, h in enumerate((4, 2, 2)))  # [1, H, 30, 32]
    o, lse = A.flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(o, sdpa(q, k, v, True), **KERNEL)
    torch.testing.assert_close(lse, sdpa_lse(q, k, True), **KERNEL)


def test_fallback_matches_references_and_warns_once():
    A.backend._warned = False
    q, k, v = qkv(1, 4, 2, 9, 9, 16)
    with pytest.warns(RuntimeWarning, match="torch reference"):
        o, lse = fallback.flash_attention(q, k, v, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one notice per process: later calls stay quiet
        fallback.flash_attention(q, k, v, causal=True)
        o2, _ = fallback.flash_decoding(q[:, :, -1], k, v, 3)
    torch.testing.assert_close(o, sdpa(q, k, v, True), **REF)
    torch.testing.assert_close(o2, o[:, :, -1], **REF)


# ---------------------------------------------------------------- GPU (compiled kernels)

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_flash_kernel(dtype, causal, D):
    q, k, v = qkv(2, 8, 2, 1000, 1000, D, dtype=dtype, device="cuda")
    o, lse = A.flash_attention(q, k, v, causal)
    torch.testing.assert_close(o.float(), sdpa(q, k, v, causal), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal), atol=1e-2, rtol=1e-2)
    lq = [1, 0, 300, 77]
    qv, kv, vv, cu_q, cu_k = varlen_case(lq, [5, 0, 300, 900], H=8, Hkv=2, D=D)
    qv, kv, vv = (x.to("cuda", dtype) for x in (qv, kv, vv))
    o, lse = A.flash_attention(qv, kv, vv, True, cu_seqlens_q=cu_q.cuda(), cu_seqlens_k=cu_k.cuda())
    want_o, want_lse = varlen_oracle(qv.float().cpu(), kv.float().cpu(), vv.float().cpu(), lq, [5, 0, 300, 900], True)
    torch.testing.assert_close(o.float().cpu(), want_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_kernels(dtype):
    q, k, v = rand(2, 8, 128, dtype=dtype, device="cuda"), rand(2, 2, 5000, 128, seed=1, dtype=dtype, device="cuda"), \
        rand(2, 2, 5000, 128, seed=2, dtype=dtype, device="cuda")
    for splits in (None, 1, 7):
        o, lse = A.flash_decoding(q, k, v, splits)
        torch.testing.assert_close(o.float(), sdpa(q[:, :, None], k, v)[:, :, 0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, sdpa_lse(q[:, :, None], k)[:, :, 0], atol=1e-2, rtol=1e-2)
    lens = [0, 1, 37, 3000]
    kc, vc, tables, ctx, _, _ = paged_setup(lens, 2, 128, 16, dtype=dtype)
    q = rand(4, 8, 128, seed=7, dtype=dtype)
    want = A.paged_attention_torch(q.float(), kc.float(), vc.float(), tables, ctx)
    for splits in (None, 1, 5):
        o = A.paged_decode_attention(q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(), ctx.cuda(), num_splits=splits)
        torch.testing.assert_close(o.float().cpu(), want, atol=1e-2, rtol=1e-2)


def test_gpu_bench_code_path_dry_runs_on_cpu():
    """`make gpu-bench` runs `bench attention` on a GPU we rarely have: its GPU code runs here on tiny shapes under
    the interpreter, so a lent GPU's one try does not die on a typo. The figures themselves mean nothing on CPU."""
    from llmso_lab.bench.attention import _gpu_rows

    rows, ratios = _gpu_rows(False, torch.device("cpu"), small=True)
    assert {r["part"] for r in rows} == {"forward", "paged_decode", "flash_decoding", "mla_decode"}
    assert all(r["max_err_vs_sdpa"] < 1e-5 for r in rows if r["part"] == "forward")
    assert {"mla_over_gqa_decode_time", "paged_decode_over_copy_bandwidth_0k"} <= set(ratios)
