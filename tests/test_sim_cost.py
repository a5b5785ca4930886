"""Roofline step cost against hand formulas."""
import pytest

from llmso_lab.hardware import ACCELERATORS
from llmso_lab.models.shapes import LLAMA3_8B, LLAMA3_70B, SMOLLM2_135M
from llmso_lab.sim import StepCost, UnitCost

H100 = ACCELERATORS["H100-SXM"]


def test_70b_batch1_decode_on_h100_is_about_42ms():
    cost = StepCost(H100, LLAMA3_70B, dtype_bytes=2)
    t = cost.step_time(decode=[1])
    assert t == pytest.approx(LLAMA3_70B.param_count * 2 / 3.35e12, rel=1e-3)  # 141 GB / 3.35 TB/s
    assert t == pytest.approx(0.042, abs=0.001)
    assert cost.breakdown(decode=[1]).bound == "memory"


def test_batch1_decode_time_scales_with_weight_bytes():
    times = {b: StepCost(H100, LLAMA3_8B, dtype_bytes=b).step_time(decode=[1]) for b in (0.5, 1, 2, 4)}
    for b, t in times.items():
        assert t == pytest.approx(times[1] * b, rel=0.01)
    small, big = (StepCost(H100, m).step_time(decode=[1]) for m in (LLAMA3_8B, LLAMA3_70B))
    assert big / small == pytest.approx(LLAMA3_70B.param_count / LLAMA3_8B.param_count, rel=0.01)


def test_batching_decode_amortises_the_weights():
    cost = StepCost(H100, LLAMA3_70B)
    per_token = {b: cost.step_time(decode=[512] * b) / b for b in (1, 8, 64, 256)}
    assert per_token[1] > 7 * per_token[8] > 7 * 7 * per_token[64]
    assert per_token[256] < per_token[64]
    # the KV reads grow with the batch, so the step itself does get longer
    assert cost.step_time(decode=[512] * 64) > cost.step_time(decode=[512])


def test_long_prefill_is_compute_bound_on_h100():
    cost = StepCost(H100, LLAMA3_70B)
    b = cost.breakdown(prefill=[(4096, 0)])
    assert b.bound == "compute" and b.intensity > H100.ridge
    attn_pairs = 4096 * 4097 // 2
    flops = 2 * LLAMA3_70B.body_matmul_params() * 4096 + 2 * LLAMA3_70B.head_params + 4 * 80 * 64 * 128 * attn_pairs
    assert b.flops == flops
    assert b.time_s == pytest.approx(flops / H100.peak_flops)


def test_efficiency_overhead_and_overlap():
    base = StepCost(H100, LLAMA3_8B)
    b = base.breakdown(prefill=[(100, 0)], decode=[300, 400])
    tuned = StepCost(H100, LLAMA3_8B, compute_efficiency=0.5, bandwidth_efficiency=0.8, overhead_s=1e-3)
    assert tuned.step_time([(100, 0)], [300, 400]) == pytest.approx(1e-3 + max(2 * b.compute_s, b.memory_s / 0.8))
    summed = StepCost(H100, LLAMA3_8B, overlap=False)
    assert summed.step_time([(100, 0)], [300, 400]) == pytest.approx(b.compute_s + b.memory_s)
    assert base.step_time() == 0.0


def test_count_work_is_exact_for_decode_steps():
    cost = StepCost(H100, SMOLLM2_135M, dtype_bytes=4)
    assert cost.count_work(0, 3, 600) == cost.work((), [100, 200, 300])
    f_exact, _ = cost.work([(64, 0)])
    f_count, _ = cost.count_work(64, 0, 64)
    assert f_exact <= f_count < 1.02 * f_exact  # attention: an upper bound, a small share here


def test_swap_time_and_kv_capacity():
    cost = StepCost(H100, LLAMA3_70B)
    assert cost.swap_time(1000) == pytest.approx(1000 * 327_680 / 64e9)
    with pytest.raises(ValueError, match="do not fit"):
        cost.kv_capacity_tokens()  # 141 GB of weights on an 80 GB GPU
    cap = StepCost(H100, LLAMA3_8B).kv_capacity_tokens(0.9)
    assert cap == int((72e9 - LLAMA3_8B.weight_bytes()) // 131_072)


def test_unit_cost():
    assert UnitCost().step_time([(5, 0)]) == 1.0 and UnitCost().step_time() == 0.0
