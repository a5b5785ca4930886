"""The serving part of `make demo` on a tiny random model (seconds, no download)."""
import types

import pytest

from llmso_lab.bench.rounds import NoiseProbe, interleaved_rounds, median_and_worst, paired
from llmso_lab.demo import CONT, COLUMNS, HF, PREFIX, STATIC, round_figures, round_table, serving_demo, serving_headline
from llmso_lab.models import load_model


def test_serving_demo_table_and_plots(tmp_path, capsys):
    model, tok = load_model("tiny-llama")
    rows = serving_demo(model, tok, tmp_path, num_requests=4, prefix_len=64, own_len=(8, 32), output_len=(8, 24),
                        slots=2)
    table = capsys.readouterr().out
    assert [r["system"] for r in rows][:4] == ["HF generate static", "engine static", "engine continuous",
                                               "engine continuous + prefix cache"]
    assert len(rows) == 5 and "KV blocks" in rows[4]["system"]
    assert all(set(COLUMNS) <= set(r) for r in rows)
    assert all(header in table for header in COLUMNS.values()) and "prefix caching" in table
    assert len({r["output_tokens"] for r in rows}) == 1 and all(r["requests"] == 4 for r in rows)
    hf, static, cont, cached, small = rows
    assert small["preemptions"] > 0
    assert hf["preemptions"] == static["preemptions"] == cont["preemptions"] == cached["preemptions"] == 0
    assert cached["prefix_hit_rate"] > 0 and small["prefix_hit_rate"] > 0
    assert static["prefix_hit_rate"] == cont["prefix_hit_rate"] == 0 and hf["prefix_hit_rate"] == "-"
    assert all(r["tpot_p50_ms"] > 0 for r in rows)
    for name in ("latency_cdf.png", "engine_slot_grid_static.png", "engine_slot_grid_continuous.png"):
        assert (tmp_path / name).stat().st_size > 0


# ---- the timing of the comparison, without timings: fake clocks, fake systems ----------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def fake_system(clock: FakeClock, seconds: list[float], ttft: list[float], tokens: int = 100):
    """A system whose k-th run takes seconds[k] on the fake clock and answers with TTFT ttft[k]: the result
    `serving_demo`'s systems return, (row, metrics, tokens, traces)."""
    runs = iter(zip(seconds, ttft))

    def run():
        s, t = next(runs)
        t0 = clock()
        clock.advance(s)
        row = {"system": "x", "output_tok_s": tokens / (clock() - t0)}
        return row, [types.SimpleNamespace(ttft=t)] * 3, None, None
    return run


def fake_rounds(clock, slow_round: int | None = None, slow_system: str = CONT, factor: float = 3.0, rounds: int = 5):
    """Five rounds on the fake clock: HF 10 s, static 8 s, continuous 4 s, prefix 3 s per run (continuous 2x static,
    2.5x HF), TTFT p50 2 s without / 1 s with prefix caching; `slow_round`: that round's `slow_system` takes
    `factor` times as long (a job took the cores just then)."""
    base = {HF: (10.0, 4.0), STATIC: (8.0, 3.0), CONT: (4.0, 2.0), PREFIX: (3.0, 1.0)}
    systems = {}
    for name, (s, t) in base.items():
        secs = [s * (factor if (r == slow_round and name == slow_system) else 1.0) for r in range(rounds)]
        ttfts = [t * (factor if (r == slow_round and name == slow_system) else 1.0) for r in range(rounds)]
        systems[name] = fake_system(clock, secs, ttfts)
    return interleaved_rounds(systems, rounds)


def test_interleaved_rounds_alternate_after_warmup_with_probe_between():
    calls = []
    systems = {n: (lambda n=n: calls.append(n) or len(calls)) for n in "abc"}
    out = interleaved_rounds(systems, 2, warmup={n: (lambda n=n: calls.append("warm " + n)) for n in "ab"},
                             between=lambda: calls.append("probe"))
    assert calls == ["warm a", "warm b", "probe", "a", "b", "c", "probe", "a", "b", "c", "probe"]
    assert out == [{"a": 4, "b": 5, "c": 6}, {"a": 8, "b": 9, "c": 10}]   # each round's own results, by system


def test_pairing_takes_each_rounds_own_ratio():
    by_round = [{"a": 4.0, "b": 2.0}, {"a": 3.0, "b": 1.0}, {"a": 1.0, "b": 1.0}]
    assert paired(by_round, "a", "b") == [2.0, 3.0, 1.0]   # not mean(a) / mean(b) = 8/4 = 2.0 everywhere
    assert median_and_worst([2.0, 3.0, 1.0]) == (2.0, 1.0)

    figs = round_figures(fake_rounds(FakeClock()))
    assert [f["tok_s"][CONT] for f in figs] == [25.0] * 5 and [f["tok_s"][HF] for f in figs] == [10.0] * 5
    rows = round_table(figs)
    assert [r["cont/static"] for r in rows] == [2.0] * 5 and [r["cont/HF"] for r in rows] == [2.5] * 5
    assert [r["TTFT ratio"] for r in rows] == [2.0] * 5
    lines = serving_headline(figs)
    assert lines[0].startswith("continuous batching vs static batching: 2.00x output tokens/s (median of 5 rounds, "
                               "worst round 2.00x); vs HF static batching: 2.50x (worst 2.50x)")
    assert lines[1] == ("TTFT p50 without / with prefix caching: 2.00 s / 1.00 s (2.0x, median of 5 rounds, "
                        "worst round 2.0x)")


def test_one_slow_round_moves_the_worst_round_not_the_median():
    quiet = round_figures(fake_rounds(FakeClock()))
    slow = round_figures(fake_rounds(FakeClock(), slow_round=3, slow_system=CONT, factor=3.0))
    cs_quiet, cs_slow = (median_and_worst(paired([f["tok_s"] for f in figs], CONT, STATIC)) for figs in (quiet, slow))
    assert cs_quiet == (2.0, 2.0)
    assert cs_slow[1] == pytest.approx(2.0 / 3)     # the slow round's continuous ran at a third of its speed
    assert cs_slow[0] == pytest.approx(2.0)         # four rounds of five still pair 2.0x
    # the same runs compared unpaired, as one pass would: the total time of each system over all rounds
    total = {k: sum(1 / f["tok_s"][k] for f in slow) for k in (CONT, STATIC)}
    assert total[STATIC] / total[CONT] < 1.5        # the slow round drags a sum-based ratio far below 2x
    line = serving_headline(slow)[0]
    assert "2.00x output tokens/s (median of 5 rounds, worst round 0.67x)" in line
    ttft = serving_headline(round_figures(fake_rounds(FakeClock(), slow_round=0, slow_system=PREFIX)))[1]
    assert "(2.0x, median of 5 rounds, worst round 0.7x)" in ttft   # prefix caching slower in that round only


def probe(durations: list[list[float]], load: float = 2.0, cpu_per_wall: float = 2.0, cpus: int = 2,
          call: bool = True) -> NoiseProbe:
    """A NoiseProbe on a fake clock: window k's runs take durations[k]; this process burns `cpu_per_wall` CPU
    seconds per wall second; the 1-minute load average reads `load`. `call`: take every window now (else the
    caller's rounds do)."""
    clock, runs = FakeClock(), iter(d for w in durations for d in w)
    p = NoiseProbe(runs=len(durations[0]), warmup=0, op=lambda: clock.advance(next(runs)), clock=clock,
                   cpu_clock=lambda: cpu_per_wall * clock(), loadavg=lambda: (load, load, load), cpus=cpus)
    for _ in durations if call else ():
        p()
    return p


QUIET = [[1.0e-3, 1.02e-3, 1.01e-3, 1.05e-3, 1.0e-3]] * 4
BURST = [[2.0e-3, 2.5e-3, 3.1e-3, 2.2e-3, 1.4e-3]]   # a window with other jobs on the cores
NOISY = QUIET[:1] + BURST * 3                          # other jobs for most of the run


def test_noise_probe_quiet_and_busy():
    quiet = probe(QUIET).noise()
    assert quiet.slowdown == pytest.approx(1.01) and quiet.own_load == pytest.approx(2.0)
    assert not quiet.busy() and quiet.line() is None
    noisy = probe(NOISY).noise()
    assert noisy.slowdown == pytest.approx(2.0) and noisy.worst_window == pytest.approx(2.2) and noisy.busy()
    assert "a median 2.00x its fastest run, 2.20x in its slowest window" in noisy.line("the demo")
    # one burst: the slowest window shows it (as does that round's paired ratio), the median run does not
    burst = probe(QUIET[:3] + BURST).noise()
    assert burst.worst_window == pytest.approx(2.2) and burst.slowdown < 1.1 and not burst.busy()
    # a steady probe, but the load average shows other jobs beside this process's own 2 busy threads
    loaded = probe(QUIET, load=4.5, cpu_per_wall=2.0).noise()
    assert loaded.slowdown < 1.1 and loaded.others_load == pytest.approx(2.5) and loaded.busy()
    assert not probe(QUIET, load=2.4, cpu_per_wall=2.0).noise().busy()   # 0.4 others on 2 cores: quiet


def test_busy_line_comes_once_above_the_headline_only_when_noisy():
    figs = round_figures(fake_rounds(FakeClock()))
    busy = serving_headline(figs, noise=probe(NOISY).noise())
    assert busy[0].startswith("this machine was busy during the demo (a fixed 512x512 matmul")
    assert busy[0].endswith("ratios may be off; rerun on a quiet machine")
    assert sum("busy" in line for line in busy) == 1 and busy[1].startswith("continuous batching vs static")
    quiet = serving_headline(figs, noise=probe(QUIET).noise())
    assert not any("busy" in line for line in quiet) and quiet[0].startswith("continuous batching vs static")
    assert quiet[-1].startswith("the machine was quiet during the rounds")


def test_serving_demo_prints_the_busy_line_from_its_probe(tmp_path, capsys):
    model, tok = load_model("tiny-llama")
    serving_demo(model, tok, tmp_path, num_requests=2, prefix_len=32, own_len=(4, 8), output_len=(2, 4),
                 long_output_len=(4, 6), slots=2, rounds=2, probe=probe(NOISY[:3], call=False))
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("continuous batching vs static"))
    assert out[first - 1].startswith("this machine was busy during the demo") and "median of 2 rounds" in out[first]
    assert sum(line.startswith("round") for line in out) >= 1   # the round-by-round table
