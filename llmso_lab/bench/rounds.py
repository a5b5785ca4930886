"""Comparing systems on a machine that may be shared: alternating rounds, paired ratios, and the machine's own noise.

A system timed once, after another, is compared with a different machine if the host got busier in between. So:
every system is warmed up, then all of them run in short rounds in the same order (a, b, c, a, b, c, ...), on the
same inputs each round. A drift slows every system of a round alike, and each round gives a paired ratio (a's
figure over b's in that same round); report the median over rounds with the worst round beside it
(`bench precision` pairs its dtypes the same way).

Between rounds `NoiseProbe` times a fixed small matmul. On a quiet machine its typical (median) run stays close to
its fastest; when other jobs share the cores it does not (torch's threads wait for the one that got descheduled: a
job on one of 2 cores made it 5-10x slower), and other jobs also show in the load average beside this process's own
CPU use. `MachineNoise.line` then says so in one line, to
print above the ratios instead of letting a contradictory ranking pass for a result.

Everything that reads a clock takes it as an argument, so tests drive it with fake clocks and fake systems.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable, Mapping, Sequence, TypeVar

import torch

__all__ = ["interleaved_rounds", "paired", "median_and_worst", "NoiseProbe", "MachineNoise"]

T = TypeVar("T")

BUSY_SLOWDOWN = 1.5   # the probe's median run over its fastest (quiet 2-core VM: 1.0-1.3, one window now and then
                      # up to 1.6x; a job on one of the 2 cores: 5-10x)
BUSY_OTHERS_LOAD = 0.5   # other processes kept this share of the cores busy (1-minute load average)


def interleaved_rounds(systems: Mapping[str, Callable[[], T]], rounds: int,
                       warmup: Mapping[str, Callable[[], object]] | None = None,
                       between: Callable[[], object] | None = None) -> list[dict[str, T]]:
    """Run `warmup` (untimed, discarded), then `rounds` rounds of every system in `systems`' order: a, b, c, a, b, c...

    `between()` runs before the first round and after every round (e.g. a `NoiseProbe`). Returns one
    {system: its result} per round; what a result holds (a row, its timings) is the systems' business."""
    for fn in (warmup or {}).values():
        fn()
    if between is not None:
        between()
    out = []
    for _ in range(rounds):
        out.append({name: fn() for name, fn in systems.items()})
        if between is not None:
            between()
    return out


def paired(by_round: Sequence[Mapping[str, float]], num: str, den: str) -> list[float]:
    """Each round's `num` figure over the same round's `den` figure."""
    return [r[num] / r[den] for r in by_round]


def median_and_worst(ratios: Sequence[float]) -> tuple[float, float]:
    """(median, worst) of paired ratios oriented so that higher is better (the worst round is the lowest)."""
    assert ratios, "no rounds"
    return statistics.median(ratios), min(ratios)


@dataclasses.dataclass(frozen=True)
class MachineNoise:
    """What the machine did besides the measured work (see `NoiseProbe.noise`).

    slowdown: the probe's median matmul over its fastest, over all windows (1.0: steady); worst_window: the slowest
    window's median over the fastest (one burst shows here, and in that round's paired ratios, not in `busy`).
    load_avg: the 1-minute load average at the end; own_load: this process's CPU seconds per wall second over the
    probed span (its busy threads on average); cpus: `os.cpu_count()`."""
    slowdown: float
    load_avg: float
    own_load: float
    cpus: int
    size: int = 512
    worst_window: float | None = None

    @property
    def others_load(self) -> float:
        """Runnable threads that were not this process's (load average minus own load, at least 0)."""
        return max(0.0, self.load_avg - self.own_load)

    def busy(self, max_slowdown: float = BUSY_SLOWDOWN, max_others: float = BUSY_OTHERS_LOAD) -> bool:
        return self.slowdown > max_slowdown or self.others_load > max_others * self.cpus

    def describe(self) -> str:
        worst = f", {self.worst_window:.2f}x in its slowest window" if self.worst_window is not None else ""
        return (f"a fixed {self.size}x{self.size} matmul timed between rounds took a median {self.slowdown:.2f}x its "
                f"fastest run{worst}; load average {self.load_avg:.1f} on {self.cpus} cores, {self.own_load:.1f} of it "
                f"this process")

    def line(self, during: str = "the run", **thresholds) -> str | None:
        """The one warning line when `busy()`, else None."""
        if not self.busy(**thresholds):
            return None
        return f"this machine was busy during {during} ({self.describe()}): ratios may be off; rerun on a quiet machine"


class NoiseProbe:
    """Call it between rounds: each call runs a fixed matmul (`size` x `size`, fp32, outputs preallocated as in
    `hardware.measure_matmul`, at torch's thread count) `warmup` times untimed (waking torch's threads), then times
    `runs` runs and keeps them as one window (about 0.1 s on 2 cores).

    `op`, `clock` (wall seconds), `cpu_clock` (this process's CPU seconds, all threads), `loadavg` and `cpus` are
    injectable (tests pass fakes)."""

    def __init__(self, size: int = 512, runs: int = 50, warmup: int = 3, op: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] = time.process_time,
                 loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg, cpus: int | None = None) -> None:
        if op is None:
            a, b = torch.randn(size, size), torch.randn(size, size)
            c = torch.empty(size, size)
            op = lambda: torch.mm(a, b, out=c)  # noqa: E731
            op()   # first call: one-off allocation and thread start-up
        self.size, self.runs, self.warmup, self.op = size, runs, warmup, op
        self.clock, self.cpu_clock, self.loadavg = clock, cpu_clock, loadavg
        self.cpus = cpus or os.cpu_count() or 1
        self.windows: list[list[float]] = []
        self._start: tuple[float, float] | None = None   # (wall, cpu) at the first call

    def __call__(self) -> list[float]:
        if self._start is None:
            self._start = (self.clock(), self.cpu_clock())
        for _ in range(self.warmup):
            self.op()
        samples = []
        for _ in range(self.runs):
            t0 = self.clock()
            self.op()
            samples.append(self.clock() - t0)
        self.windows.append(samples)
        self._end = (self.clock(), self.cpu_clock())
        return samples

    def slowdown(self) -> float:
        """The median run over the fastest run, all windows together: steady (1.0-1.3 on a quiet machine) unless
        other jobs held cores for much of the probed time; one busy window does not move it (see `worst_window`)."""
        assert self.windows, "call the probe first"
        return statistics.median(x for w in self.windows for x in w) / min(min(w) for w in self.windows)

    def worst_window(self) -> float:
        """The slowest window's median run over the fastest run seen."""
        assert self.windows, "call the probe first"
        return max(statistics.median(w) for w in self.windows) / min(min(w) for w in self.windows)

    def noise(self) -> MachineNoise:
        assert self._start is not None, "call the probe first"
        wall, cpu = self._end[0] - self._start[0], self._end[1] - self._start[1]
        return MachineNoise(self.slowdown(), float(self.loadavg()[0]), cpu / wall if wall > 0 else 0.0, self.cpus,
                            self.size, self.worst_window())
