import pytest

from llmso_lab import hardware as hw


def test_table_has_the_lecture_accelerators_with_sane_numbers():
    for name in ["H100-SXM", "H200", "A100-80GB", "L4", "RTX4090"]:
        acc = hw.get_accelerator(name.lower())
        assert 1e13 < acc.peak_flops < 5e15 and 1e11 < acc.mem_bandwidth < 1e13 and acc.mem_bytes >= 16e9
        assert 10 < acc.ridge < 1000
    assert hw.ACCELERATORS["H100-SXM"].num_sms == 132  # the lecture's SM count
    with pytest.raises(ValueError, match="known: H100-SXM"):
        hw.get_accelerator("TPU")


def test_formulas_match_the_lecture_numbers():
    assert hw.kv_bytes_per_token(80, 8, 128, 2) == 327_680  # "토큰당 약 320KB"
    assert 8192 * hw.kv_bytes_per_token(80, 8, 128, 2) / 1e9 == pytest.approx(2.68, abs=0.01)  # "약 2.6GB"
    h100 = hw.ACCELERATORS["H100-SXM"]
    assert hw.roofline_time(2 * 70e9, 140e9, h100.peak_flops, h100.mem_bandwidth) == pytest.approx(140e9 / 3.35e12)
    assert hw.decode_tokens_per_s_bound(140e9, 3.35e12) == pytest.approx(23.93, abs=0.01)
    assert hw.matmul_arithmetic_intensity(1, 4096, 4096, 2) == pytest.approx(2 * 4096 * 4096 / (2 * (4096 + 4096**2 + 4096)))
    assert hw.decode_bytes_per_step(100.0, [1, 2, 3], 10) == 160.0
    # batching amortises the weights: 8 sequences are nearly 8x one sequence when KV is small
    one = hw.decode_tokens_per_s_bound(140e9, 3.35e12, batch=1, context_len=100, kv_bytes_per_token=327680)
    eight = hw.decode_tokens_per_s_bound(140e9, 3.35e12, batch=8, context_len=100, kv_bytes_per_token=327680)
    assert 7.5 < eight / one < 8.0
    # 70B fp16 on an H100: ~295 tokens per forward before the math outlasts the weight reads ("5 tokens ~ 1")
    assert hw.compute_bound_tokens(140e9, 2 * 70e9, h100.peak_flops, h100.mem_bandwidth) == pytest.approx(h100.ridge)
    assert hw.compute_bound_tokens(4e8, 2e8, 1e11, 1e10) == pytest.approx(20.0)   # fp32: twice the ridge
    assert hw.attainable_flops(1.0, 1e15, 1e12) == 1e12 and hw.attainable_flops(1e6, 1e15, 1e12) == 1e15


def test_measure_cpu_reports_positive_ceilings_quickly():
    cpu = hw.measure_cpu(seconds=0.4, matmul_sizes=(128, 256), copy_mb=16)
    assert 1e8 < cpu.peak_flops < 1e14
    assert 1e8 < cpu.mem_bandwidth < 1e13
    assert cpu.name.startswith("this-cpu (") and "thread" in cpu.name


def test_one_thread_policy(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        assert hw.set_lab_threads(1) == 1 == torch.get_num_threads()
        monkeypatch.setenv("LLMSO_LAB_THREADS", "1")
        assert hw.set_lab_threads() == 1
        monkeypatch.delenv("LLMSO_LAB_THREADS")
        assert hw.set_lab_threads() >= 1
    finally:
        torch.set_num_threads(before)


def test_matmul_ceilings_per_dtype_and_native_detection():
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.int8):   # int8: torch._int_mm, int8 x int8 -> int32
        assert 1e8 < hw.measure_matmul(dtype, seconds=0.1, sizes=(128,)) < 1e15
    assert hw.measure_cpu(seconds=0.2, matmul_sizes=(128,), copy_mb=8, dtype=torch.bfloat16).name.endswith(", bfloat16)")
    for dtype in (torch.bfloat16, torch.float16):
        native, why = hw.native_matmul(dtype, "cpu")
        flags = hw.NATIVE_CPU_FLAGS[dtype]
        assert native == any(f in hw.cpu_flags() for f in flags) and ("has" in why if native else "emulated" in why)
    speed = hw.bf16_matmul_speedup(rows=(4,), k=64, n=64, budget_s=0.001)
    assert set(speed) == {4} and speed[4] > 0


def test_precision_speedup_is_the_byte_ratio_when_memory_bound_and_the_ceiling_ratio_when_compute_bound():
    params, bw = 1e8, 1e10
    assert hw.precision_speedup(1, params, 4, 2, 1e11, 1e12, bw) == pytest.approx(2.0)       # decode: bytes
    assert hw.precision_speedup(4096, params, 4, 2, 1e11, 1e12, bw) == pytest.approx(10.0)   # prefill: ceiling
    # in between: compute-bound before (2*1e8*64/1e11 = 0.128 s > 0.04 s), memory-bound after (0.02 s > 0.0128 s)
    assert hw.precision_speedup(64, params, 4, 2, 1e11, 1e12, bw) == pytest.approx(0.128 / 0.02)
    assert hw.precision_speedup(4096, params, 4, 2, 1e11, 5e10, bw) == pytest.approx(0.5)      # emulated: slower
