"""The plumbing every `llmso-lab bench NAME` shares, so that each bench's `run()` reads as what it measures.

- `result`: the dict a `run()` returns (the CLI prints its `table`, `tables` and `ratios` and saves it as JSON):
  name, device, date and command first, then the bench's own fields;
- `shared_cpu`: the caveat every CPU figure carries on a machine other jobs may share, with the load average;
- `rounded`: floats rounded for a table or a ratio, also inside rows and lists of rows;
- `lists`: a workload's settings with their tuples as lists (as JSON writes them), to record the workload;
- `overridden`: a bench's FULL / QUICK settings with the caller's overrides (None: keep the default);
- `alternate`: paired rounds, every system measured in turn, round after round;
- `phase`: one labelled step of a progress bar.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Callable, Iterator, Sequence, TypeVar

from tqdm.auto import tqdm

from llmso_lab.bench.attention import _device_name

__all__ = ["result", "shared_cpu", "rounded", "lists", "overridden", "alternate", "phase"]

S, T = TypeVar("S"), TypeVar("T")


def result(name: str, quick: bool | None, *flags: str, **fields) -> dict:
    """{"name", "device", "date" (UTC), "command", **fields}: what a bench's `run()` returns.

    "command" is the line that repeats the run: `llmso-lab bench NAME` (its underscores written as dashes, as
    the CLI takes them), then " --quick" when `quick`, then each non-empty flag (e.g. "--dtype bfloat16").
    quick=None leaves "command" out: the CLI then records the command line it was run with (--json path and all),
    which is what kv-compress, kv-store and radix have always recorded. `fields` follow in the order given."""
    out = {"name": name, "device": _device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if quick is not None:
        out["command"] = " ".join(["llmso-lab bench", name.replace("_", "-"), *(["--quick"] if quick else []),
                                   *(f for f in flags if f)])
    return {**out, **fields}


def shared_cpu(note: str = "") -> dict:
    """{"load_avg", "note"}: the 1-, 5- and 15-minute load averages now, and the caveat that CPU figures come
    from a machine other jobs may share (`note` is appended to it). Spread it last into `result`."""
    return {"load_avg": [round(x, 2) for x in os.getloadavg()],
            "note": "CPU figures; the machine may be shared with other jobs (see load_avg)." + note}


def rounded(x, nd: int = 3):
    """`x` with every float rounded to `nd` decimals, inside dicts and lists too; anything else as it is
    (ints, bools, strings, None: a row's counts and labels pass through)."""
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, dict):
        return {k: rounded(v, nd) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v, nd) for v in x]
    return x


def lists(settings: dict) -> dict:
    """`settings` with its tuple values as lists (one level: what JSON would write), to record a workload."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}


def overridden(defaults: dict, **overrides) -> dict:
    """A copy of `defaults` (a bench's FULL or QUICK) with every override that is not None."""
    return {**defaults, **{k: v for k, v in overrides.items() if v is not None}}


def alternate(rounds: int, systems: Sequence[S], measure: Callable[[S, int], T],
              desc: str | None = None) -> dict[tuple[S, int], T]:
    """Paired rounds: round 1 measures every system in turn (`measure(system, 1)`), then round 2, and so on (a, b,
    a, b). A shared machine that slows down during the run then slows each round's systems alike, and each round
    gives a paired ratio; a bench keeps each system's best round in its table and the worst paired round beside it.

    Returns {(system, round): what `measure` returned}, in the order measured (rounds count from 1). `desc`: a
    progress bar per round, "desc, round r/rounds". (`rounds.interleaved_rounds` does the same for systems that
    need no round number, with a warm-up first and a noise probe between rounds.)"""
    out = {}
    for r in range(1, rounds + 1):
        for s in systems if desc is None else tqdm(systems, desc=f"{desc}, round {r}/{rounds}"):
            out[(s, r)] = measure(s, r)
    return out


@contextlib.contextmanager
def phase(bar: tqdm, label: str) -> Iterator[None]:
    """One step of a bench's progress bar: `label` shows while the block runs, the bar advances once it is done."""
    bar.set_postfix_str(label)
    yield
    bar.update()
