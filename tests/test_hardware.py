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
