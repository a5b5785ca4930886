"""Plot helpers return Figures, touch no pyplot state, and draw what they are given."""
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from llmso_lab.hardware import ACCELERATORS  # noqa: E402
from llmso_lab.sim import lecture_slot_grids  # noqa: E402
from llmso_lab.viz import plot_latency_cdf, plot_roofline, plot_slot_grid, plot_tradeoff  # noqa: E402


def test_plots_return_figures_without_pyplot(tmp_path):
    before = plt.get_fignums()
    grid = lecture_slot_grids()["static"]
    figs = [
        plot_slot_grid(grid, "Static batching"),
        plot_roofline(ACCELERATORS["H100-SXM"], [("decode b=1", 1.0), ("prefill 4K", 2000.0, 8e14)]),
        plot_latency_cdf({"fcfs": [1.0, 2.0, 5.0], "sjf": [0.5, 1.0, 6.0]}, xlabel="E2E (s)"),
        plot_tradeoff([1.0, 0.6, 0.4], [0.02, 0.03, 0.05], labels=[256, 1024, 4096]),
    ]
    assert plt.get_fignums() == before
    for i, fig in enumerate(figs):
        assert isinstance(fig, matplotlib.figure.Figure) and fig.axes
        fig.savefig(tmp_path / f"{i}.png")
    assert figs[0].axes[0].get_title() == "Static batching: 12 of 28 cells idle"
    labels = [t.get_text() for t in figs[0].axes[0].texts]
    assert sorted(labels) == sorted(str(v) for v in grid[grid >= 0])


def test_roofline_ridge_is_drawn():
    h = ACCELERATORS["A100-80GB"]
    ax = plot_roofline(h).axes[0]
    x, y = ax.lines[0].get_data()
    assert np.isclose(y.max(), h.peak_flops) and np.isclose(ax.lines[1].get_xdata()[0], h.ridge)
