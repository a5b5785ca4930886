"""Workload generators are deterministic, in range, and traces round-trip."""
import math

import numpy as np
import pytest

from llmso_lab.workloads import (Request, load_trace, make_workload, mixed_workload, percentiles,
                                 poisson_arrivals, save_trace, uniform_lengths)


def test_seeded_and_deterministic():
    assert mixed_workload(32, rate=4.0, seed=1) == mixed_workload(32, rate=4.0, seed=1)
    assert mixed_workload(32, rate=4.0, seed=1) != mixed_workload(32, rate=4.0, seed=2)


def test_mixed_workload_ranges():
    w = mixed_workload(500, seed=0)
    prompts, outputs = [r.prompt_len for r in w], [r.output_len for r in w]
    assert min(prompts) >= 32 and max(prompts) <= 512 and min(outputs) >= 16 and max(outputs) <= 256
    assert max(prompts) > 480 and min(prompts) < 64            # the whole range is used
    assert all(r.arrival_time == 0.0 for r in w)                # rate=inf: an offline batch
    assert [r.request_id for r in w] == list(range(500))


def test_poisson_rate():
    t = poisson_arrivals(10.0, 5000, seed=3)
    assert np.all(np.diff(t) >= 0)
    assert len(t) / t[-1] == pytest.approx(10.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_arrivals(0, 3)


def test_uniform_lengths_inclusive():
    v = uniform_lengths(2000, 3, 5, seed=0)
    assert set(v) == {3, 4, 5}
    with pytest.raises(ValueError):
        uniform_lengths(3, 5, 3)


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_trace_round_trip(tmp_path, suffix):
    w = make_workload(20, rate=2.0, priorities=[i % 3 for i in range(20)], seed=5)
    save_trace(w, tmp_path / f"trace{suffix}")
    assert load_trace(tmp_path / f"trace{suffix}") == w


def test_trace_from_rows_sorted_by_arrival():
    w = load_trace([(7, 2.0, 10, 5), {"request_id": "a", "arrival_time": 1.0, "prompt_len": 3, "output_len": 4}])
    assert w == [Request("a", 1.0, 3, 4), Request(7, 2.0, 10, 5)]
    with pytest.raises(ValueError, match="output_len"):
        load_trace([(0, 0.0, 10, 0)])


def test_percentiles():
    p = percentiles(list(range(101)))
    assert p == {"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert math.isnan(percentiles([])["p99"])


def test_request_metrics_engine_and_simulator_forms():
    from llmso_lab.workloads import RequestMetrics, latency_summary

    eng = RequestMetrics("a", 1.0, 1.5, 2.6, prompt_len=8, output_len=4, first_scheduled_time=1.2,
                         token_times=[1.5, 1.7, 2.0, 2.4])    # retired one step after its last token
    assert eng.ttft == pytest.approx(0.5) and eng.e2e == pytest.approx(1.6) and eng.queue_time == pytest.approx(0.2)
    assert eng.tpot == pytest.approx(0.3) and eng.itl == pytest.approx([0.2, 0.3, 0.4])
    sim = RequestMetrics(0, 1.0, 1.5, 2.4, prompt_len=8, output_len=4)   # the sim's last token is its finish
    assert sim.tpot == pytest.approx(0.3) and math.isnan(sim.queue_time)
    with pytest.raises(ValueError, match="per-token times"):
        sim.itl
    one = RequestMetrics(1, 0.0, 0.1, 0.1, prompt_len=3, output_len=1)
    s = latency_summary([eng, sim, one], ps=(50,))
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["tpot_s"]["mean"] == pytest.approx(0.3)   # one-token answer left out of TPOT
    assert s["e2e_s"]["mean"] == pytest.approx((1.6 + 1.4 + 0.1) / 3)
