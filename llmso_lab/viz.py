"""Plots for the labs. Each helper builds and returns a matplotlib `Figure` (no pyplot state, no
`plt.show()`), so it works under the Agg backend, in tests, and in notebooks. Labels are English so no CJK
font is needed.

In a notebook the returned figure shows itself as a cell's last value or through `display(fig)`, in a fresh
kernel too: `LabFigure` renders its own PNG (`_repr_png_`), so it does not wait for pyplot's inline backend to
be switched on (a bare `Figure` prints as text `<Figure size ...>` until then). Once the inline backend is on,
IPython's own figure formatter takes over; either way one PNG per display. Nothing is registered with pyplot,
so the inline backend never shows these figures a second time at the end of the cell.
"""
from __future__ import annotations

import io
from typing import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from llmso_lab.hardware import Accelerator

__all__ = ["LabFigure", "plot_slot_grid", "plot_roofline", "plot_latency_cdf", "plot_tradeoff"]


class LabFigure(Figure):
    """A matplotlib `Figure` that IPython displays as a PNG whatever the backend (see the module docstring).

    Make multi-panel figures with `LabFigure(figsize=...).subplots(...)`."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")  # as the inline backend draws figures
        return buf.getvalue()


def plot_slot_grid(grid: np.ndarray, title: str = "", max_labelled_iters: int = 40) -> Figure:
    """The lecture's slot grid: rows = batch slots, columns = iterations, one colour per request,
    idle cells (-1) grey. Up to `max_labelled_iters` columns each cell is labelled with its request id and
    idle cells are hatched; longer runs (engine traces) are drawn compactly at a bounded width."""
    grid = np.asarray(grid)
    n_slots, n_iters = grid.shape
    small = n_iters <= max_labelled_iters
    width = 0.55 * n_iters + 1.5 if small else 16.0
    fig = LabFigure(figsize=(max(4.0, width), max(2.0, (0.55 if small else 0.35) * n_slots + 1.2)))
    ax = fig.add_subplot()
    ids = sorted(int(i) for i in np.unique(grid) if i >= 0)
    colours = ListedColormap([(0.85, 0.85, 0.85, 1.0)] + [tuple(c) for c in _palette(len(ids))])
    index = np.zeros_like(grid)
    for k, rid in enumerate(ids):
        index[grid == rid] = k + 1
    ax.imshow(index, cmap=colours, vmin=0, vmax=len(ids), aspect="equal" if small else "auto", interpolation="nearest")
    if small:
        for (r, c), rid in np.ndenumerate(grid):
            if rid < 0:
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor="0.85", hatch="//", edgecolor="0.6", lw=0))
            else:
                ax.text(c, r, str(rid), ha="center", va="center", fontsize=9)
        ax.set_xticks(np.arange(n_iters), [str(i + 1) for i in range(n_iters)])
        ax.set_xticks(np.arange(-0.5, n_iters), minor=True)
    ax.set_yticks(np.arange(n_slots), [f"slot {i}" for i in range(n_slots)])
    ax.set_yticks(np.arange(-0.5, n_slots), minor=True)
    ax.grid(which="minor", color="white", lw=2 if small else 1)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("iteration (decoding step)")
    idle = int((grid < 0).sum())
    ax.set_title(f"{title}{': ' if title else ''}{idle} of {grid.size} cells idle")
    fig.tight_layout()
    return fig


def plot_roofline(hardware: Accelerator, points: Sequence[tuple] = (), intensity_range: tuple[float, float] | None = None,
                  extra_roofs: Mapping[str, float] | None = None) -> Figure:
    """Log-log roofline of `hardware` with its ridge point.

    points: (label, intensity FLOP/byte) or (label, intensity, achieved FLOP/s); without a measured
    rate a point sits on the roof. extra_roofs: more compute ceilings on the same memory, {label: FLOP/s}
    (e.g. the bf16 and int8 matmul rates next to fp32), each drawn with its own ridge.
    """
    peak, bw = hardware.peak_flops, hardware.mem_bandwidth
    roofs = {f"{hardware.name} roof": peak, **(extra_roofs or {})}
    top_ridge = max(roofs.values()) / bw
    lo, hi = intensity_range or (min([0.1] + [p[1] / 3 for p in points]), max([top_ridge * 30] + [p[1] * 3 for p in points]))
    x = np.geomspace(lo, hi, 200)
    fig = LabFigure(figsize=(6.5, 4.2))
    ax = fig.add_subplot()
    for i, (label, roof) in enumerate(roofs.items()):
        colour = "k" if i == 0 else f"C{i + 6}"
        ax.loglog(x, np.minimum(roof, x * bw), color=colour, lw=2 if i == 0 else 1.5, label=label)
        ax.axvline(roof / bw, color=colour, ls="--", lw=1, alpha=0.6)
        ax.annotate(f"ridge {roof / bw:.0f} FLOP/B", (roof / bw, roof), textcoords="offset points",
                    xytext=(5, -14), fontsize=8, color="0.3")
    placed: list[tuple[float, float]] = []
    for label, intensity, *achieved in points:
        y = achieved[0] if achieved else min(peak, intensity * bw)
        ax.plot(intensity, y, "o")
        # a label goes below its point when an earlier point sits close by (log axes), so labels do not overlap
        near = any(abs(np.log10(intensity / px)) < 0.6 and abs(np.log10(y / py)) < 0.3 for px, py in placed)
        ax.annotate(label, (intensity, y), textcoords="offset points", xytext=(5, -12 if near else 5), fontsize=8)
        placed.append((intensity, y))
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"Roofline: {hardware.name}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def plot_latency_cdf(latencies: Mapping[str, Sequence[float]], xlabel: str = "latency (s)", title: str = "",
                     ax: Axes | None = None) -> Figure:
    """Empirical CDF of each named latency sample (e.g. {"fcfs": e2e, "sjf": e2e}), p50 and p99 marked.

    ax: draw into this panel of a larger figure (e.g. `LabFigure().subplots(1, 2)`) instead of a new figure."""
    if ax is None:
        ax = LabFigure(figsize=(6, 4)).add_subplot()
    for name, values in latencies.items():
        v = np.sort(np.asarray(values, dtype=float))
        (line,) = ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=name)
        for q in (50, 99):
            ax.plot(np.percentile(v, q), q / 100, "o", color=line.get_color(), ms=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "Latency CDF (dots: p50, p99)")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def plot_tradeoff(x: Sequence[float], y: Sequence[float], labels: Sequence[object] = (), xlabel: str = "TTFT p50 (s)",
                  ylabel: str = "TPOT p50 (s)", title: str = "") -> Figure:
    """One sweep as a line of points, each labelled (e.g. by its max_num_batched_tokens)."""
    fig = LabFigure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(x, y, "o-")
    for xi, yi, lab in zip(x, y, labels):
        ax.annotate(str(lab), (xi, yi), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{ylabel} vs {xlabel}")
    fig.tight_layout()
    return fig


def _palette(n: int) -> np.ndarray:
    from matplotlib import colormaps
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return np.array([cmap(i % cmap.N) for i in range(n)])
