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


# ---- records from real engine traces (tiny model: fast) ------------------------------------------------
from llmso_lab.engine import LLM, SamplingParams  # noqa: E402
from llmso_lab.models.tiny import tiny_llama  # noqa: E402
from llmso_lab.sim import records_from_engine_traces, run_on_engine  # noqa: E402
from llmso_lab.workloads import Request  # noqa: E402


def _run(llm, prompts, max_tokens):
    for p, m in zip(prompts, max_tokens):
        llm.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=m, ignore_eos=True))
    traces = []
    while llm.has_unfinished_requests():
        traces.append(llm.step()[1])
    return traces


def test_records_from_engine_traces_count_tokens_and_contexts():
    llm = LLM(tiny_llama(), max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True, block_size=4)
    traces = _run(llm, [list(range(1, 11)), [5, 6, 7]], [3, 2])
    recs = records_from_engine_traces(traces)
    # step 0: prompt A (10 tokens) gets a chunk of 8; step 1: A's last 2 + B's 3 (both sample);
    # then decodes: A at 11, 12; B at 4.
    assert [(r.num_prefill_tokens, r.num_prefill_seqs, r.num_decode_seqs, r.sum_context_len) for r in recs] == [
        (8, 1, 0, 8), (5, 2, 0, 10 + 3), (0, 0, 2, 11 + 4), (0, 0, 1, 12)]
    assert all(r.seconds > 0 for r in recs)
    assert sum(r.num_prefill_tokens for r in recs) == 13
    assert sum(r.num_decode_seqs for r in recs) == llm.stats()["num_generated_tokens"] - 2  # first tokens come from prefill
    assert records_from_engine_traces(traces, skip_first=1) == recs[1:]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_records_from_engine_traces_follow_preemption(mode):
    # 6 blocks of 4 tokens: two 8-token prompts growing to 8 + 9 tokens cannot both keep their KV
    llm = LLM(tiny_llama(), max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=6, block_size=4,
              max_model_len=20, preemption_mode=mode, swap_space_blocks=8)
    traces = _run(llm, [list(range(1, 9)), list(range(20, 28))], [9, 9])
    assert llm.stats()["num_preemptions_total"] >= 1
    recs = records_from_engine_traces(traces)
    # replaying the trace, a request's context grows by the tokens it computes; the totals must match
    computed = sum(r.num_prefill_tokens + r.num_decode_seqs for r in recs)
    assert computed == llm.stats()["num_computed_tokens"]
    if mode == "swap":   # nothing recomputed: every token is computed once (2 prompts + 8 decodes each)
        assert computed == 8 + 8 + 8 + 8
        assert max(r.sum_context_len for r in recs if r.num_prefill_tokens == 0) <= 17 + 17
    else:                # a re-prefill of the victim's prompt + generated tokens shows up as prefill work
        assert computed > 8 + 8 + 8 + 8
    fitted_input = [(r.num_prefill_tokens, r.num_decode_seqs, r.sum_context_len, r.seconds) for r in recs]
    assert all(c >= p + d for p, d, c, _ in fitted_input)


def test_run_on_engine_and_calibrate_on_its_steps():
    llm = LLM(tiny_llama(), max_num_seqs=4, max_num_batched_tokens=32)
    work = [Request(i, 0.0, p, o) for i, (p, o) in enumerate([(5, 4), (12, 3), (40, 2), (3, 6)])]
    run = run_on_engine(llm, work, seed=1)
    assert [len(o.outputs[0].token_ids) for o in run.outputs] == [4, 3, 2, 6]
    assert run.num_output_tokens == 15 and run.output_throughput > 0
    recs = records_from_engine_traces(run.traces)
    assert sum(r.num_prefill_tokens for r in recs) == 60
    fitted = calibrate(recs, SMOLLM2_135M, CPU)   # any shape works; only the fit machinery is exercised here
    assert fitted.overhead_s >= 0


def test_replaying_poisson_arrivals_gives_latency_percentiles():
    """Online serving: requests arrive at their workload times on the engine clock (Poisson process)."""
    from llmso_lab.workloads import make_workload

    work = make_workload(6, rate=40.0, prompt_len=(4, 12), output_len=(2, 5), seed=3)
    llm = LLM(tiny_llama(), max_num_seqs=2)
    run = run_on_engine(llm, work, replay_arrivals=True)
    t0 = min(o.metrics.arrival_time for o in run.outputs)
    for r, o in zip(work, run.outputs):
        assert o.metrics.arrival_time - t0 == pytest.approx(r.arrival_time - work[0].arrival_time, abs=1e-9)
        assert o.metrics.first_scheduled_time >= o.metrics.arrival_time   # never served before it arrives
        assert len(o.outputs[0].token_ids) == r.output_len
    s = run.summary()
    assert s["num_requests"] == 6 and s["output_tokens_per_s"] > 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert 0 <= s[key]["p50"] <= s[key]["p99"] < 60
    assert run.wall_s >= work[-1].arrival_time - work[0].arrival_time   # the replay took at least the arrival span
