"""Figures show up in notebooks: `llmso_lab.viz` figures display as PNG in a fresh kernel whatever ran before
(no pyplot import needed, nothing shown twice), and the saved solution notebooks hold an image wherever a cell
draws one (GitHub shows the saved outputs)."""
import os
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

# (source, number of PNG outputs the cell must have)
CELLS = [
    # a viz figure as the cell's value, before anything touched pyplot (Lab 01's first slot grid)
    ("import numpy as np\nfrom llmso_lab.viz import plot_slot_grid\n"
     "plot_slot_grid(np.array([[0, 0, -1], [1, 1, 1]]), 'grid')", 1),
    # display() of two viz figures, still no pyplot
    ("from IPython.display import display\nfrom llmso_lab.hardware import ACCELERATORS\n"
     "from llmso_lab.viz import plot_roofline, plot_tradeoff\n"
     "display(plot_roofline(ACCELERATORS['H100-SXM'], [('decode', 1.0)]))\n"
     "display(plot_tradeoff([1, 2], [3, 1], [128, 256]))", 2),
    # pyplot switched on (the inline backend): its own figure once
    ("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()", 1),
    # a viz figure after pyplot: IPython's formatter draws it, once
    ("plot_slot_grid(np.array([[0, -1], [1, 1]]))", 1),
    # a panel figure built with LabFigure and filled by a helper, assigned and then shown as the value
    ("from llmso_lab.viz import LabFigure, plot_latency_cdf\nfig = LabFigure(figsize=(8, 3))\nleft, right = fig.subplots(1, 2)\n"
     "plot_latency_cdf({'a': [1.0, 2.0]}, ax=left)\nplot_latency_cdf({'b': [3.0, 4.0]}, ax=right)\nfig", 1),
]


def _pngs(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def test_viz_figures_display_in_a_fresh_kernel(tmp_path):
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src, _ in CELLS])
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}   # as Jupyter starts a kernel: inline backend
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    for cell, (src, want) in zip(nb.cells, CELLS):
        texts = [o["data"].get("text/plain", "") for o in cell.outputs if "data" in o and "image/png" not in o["data"]]
        assert not any(t.startswith("<Figure") for t in texts), f"figure shown as text:\n{src}"
        assert _pngs(cell) == want, f"{_pngs(cell)} PNGs, want {want}:\n{src}"


DRAWS = re.compile(r"plt\.show\(\)|^(?:display\()?plot_\w+\(|^fig$", re.M)


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_saved_solution_notebooks_hold_their_figures(path):
    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        texts = [o["data"].get("text/plain", "") for o in cell.outputs if "data" in o and "image/png" not in o["data"]]
        assert not any(t.startswith("<Figure") for t in texts), f"{path.name}: a figure saved as text:\n{cell.source}"
        if DRAWS.search(cell.source):
            assert _pngs(cell) >= 1, f"{path.name}: this cell draws but saved no image:\n{cell.source}"
