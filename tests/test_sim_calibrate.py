"""Calibration of the CPU profile: fitting synthetic step records recovers the parameters."""
import numpy as np
import pytest

from llmso_lab.hardware import Accelerator
from llmso_lab.models.shapes import SMOLLM2_135M
from llmso_lab.sim import calibrate, cpu_profile, relative_errors, simulate
from llmso_lab.workloads import make_workload

CPU = Accelerator("test-cpu", 2e11, 2e10, 0.0, "none", 0.0, 0.0)  # fixed, so no measurement runs in tests
TRUE = dict(compute_efficiency=0.35, bandwidth_efficiency=0.6, overhead_s=4e-3)


def synthetic_records(n: int, seed: int, noise: float = 0.01) -> list[tuple[int, int, int, float]]:
    """Steps like an engine's: decode-only, prefill-only and mixed, timed by the true profile (+ noise)."""
    rng = np.random.default_rng(seed)
    true = cpu_profile(SMOLLM2_135M, CPU, **TRUE)
    records = []
    for i in range(n):
        kind = i % 3
        dec = 0 if kind == 1 else int(rng.integers(1, 33))
        pre = 0 if kind == 0 else int(rng.integers(16, 1024))
        ctx = int(rng.integers(dec * 32, dec * 768 + 1)) + pre
        t = true.time_of(*true.count_work(pre, dec, ctx)) * (1 + noise * rng.standard_normal())
        records.append((pre, dec, ctx, t))
    return records


def test_calibration_recovers_known_parameters_exactly_without_noise():
    fitted = calibrate(synthetic_records(60, seed=0, noise=0.0), SMOLLM2_135M, CPU)
    for name, value in TRUE.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name
    assert fitted.overlap is False and fitted.dtype_bytes == 4


def test_calibration_with_noisy_records():
    fitted = calibrate(synthetic_records(300, seed=0, noise=0.01), SMOLLM2_135M, CPU)
    assert fitted.compute_efficiency == pytest.approx(TRUE["compute_efficiency"], rel=0.03)
    assert fitted.bandwidth_efficiency == pytest.approx(TRUE["bandwidth_efficiency"], rel=0.03)
    # overhead and the weight read are both paid once per step: their sum is what the data pins down
    fixed = lambda c: c.overhead_s + SMOLLM2_135M.weight_bytes(4) / (c.bandwidth_efficiency * CPU.mem_bandwidth)
    assert fixed(fitted) == pytest.approx(fixed(cpu_profile(SMOLLM2_135M, CPU, **TRUE)), rel=0.03)
    held_out = synthetic_records(100, seed=1, noise=0.0)
    assert np.abs(relative_errors(fitted, held_out)).max() < 0.02


def test_calibration_is_non_negative():
    # memory-bound steps with no overhead: the missing terms must come out as zero, not negative
    true = cpu_profile(SMOLLM2_135M, CPU, compute_efficiency=1e9, overhead_s=0.0)
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(30):
        d, ctx = int(rng.integers(1, 32)), int(rng.integers(100, 20_000))
        recs.append((0, d, ctx, true.time_of(*true.count_work(0, d, ctx)) * (1 + 0.01 * rng.standard_normal())))
    fitted = calibrate(recs, SMOLLM2_135M, CPU)
    assert fitted.overhead_s >= 0 and fitted.compute_efficiency > 0 and fitted.bandwidth_efficiency > 0
    assert fitted.bandwidth_efficiency == pytest.approx(1.0, rel=0.05)


def test_calibrated_on_simulated_steps_predicts_held_out_throughput():
    true = cpu_profile(SMOLLM2_135M, CPU, **TRUE)
    train = simulate(make_workload(40, rate=5.0, prompt_len=(32, 512), output_len=(16, 128), seed=0), true,
                     max_num_seqs=8, max_num_batched_tokens=512)
    fitted = calibrate(train.steps, SMOLLM2_135M, CPU)        # SimStep records carry the same four fields
    test_w = make_workload(40, rate=5.0, prompt_len=(32, 512), output_len=(16, 128), seed=1)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=512)
    ratio = simulate(test_w, fitted, **kw).output_throughput / simulate(test_w, true, **kw).output_throughput
    assert ratio == pytest.approx(1.0, rel=0.05)


def test_calibrate_needs_records():
    with pytest.raises(AssertionError, match="at least 3"):
        calibrate([(0, 1, 10, 0.01)], SMOLLM2_135M, CPU)
