"""The Gradescope autograder package: built by `release --gradescope`, unzipped into a directory laid out like
Gradescope's, and run there on a solution, a blank lab, a broken notebook, a notebook with no exercises, two
notebooks and a hostile one. `run_autograder` must always leave an honest results.json behind."""
import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import nbformat
import pytest

from llmso_lab.grading.gradescope import build_package
from lab_variants import ROOT, notebook_with

LAB = "01"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    # 10 s per exercise instead of Lab 01's 30: the hostile submission below loops until it is stopped
    return build_package(LAB, tmp_path_factory.mktemp("gradescope"), hidden_visibility="after_published", timeout_s=10)


def run_autograder(package, tmp_path, submission: dict[str, str | bytes]) -> dict:
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    (root / "submission").mkdir()
    with zipfile.ZipFile(package) as z:
        z.extractall(root / "source")
    os.chmod(root / "source" / "run_autograder", 0o755)
    for name, content in submission.items():
        path = root / "submission" / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    # "The current environment": this Python, but the library and hidden checks from the zip.
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "LLMSO_PYTHON": sys.executable,
           "PYTHONPATH": str(root / "source" / "llmso-lab")}
    proc = subprocess.run([str(root / "source" / "run_autograder")], cwd=root / "source", env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((root / "results" / "results.json").read_text())


def test_the_zip_has_gradescope_s_layout_and_only_this_lab_s_hidden_checks(package):
    with zipfile.ZipFile(package) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        config = json.loads(z.read("config.json"))
    assert {"setup.sh", "run_autograder", "config.json", "llmso-lab/pyproject.toml"} <= names
    assert modes["setup.sh"] & stat.S_IXUSR and modes["run_autograder"] & stat.S_IXUSR
    hidden = sorted(n for n in names if "/grading/hidden/" in n)
    assert hidden == ["llmso-lab/llmso_lab/grading/hidden/__init__.py", f"llmso-lab/llmso_lab/grading/hidden/lab{LAB}.py"]
    assert not any(n.startswith("llmso-lab/solutions") or n.endswith(".ipynb") for n in names)
    assert config == {"lab": LAB, "hidden_visibility": "after_published", "needs_model": False,
                      "torch_spec": "torch==2.13.0", "timeout_s": 10}


def test_solution_scores_100_with_hidden_checks_shown_after_publishing(package, tmp_path):
    res = run_autograder(package, tmp_path, {"01_batching.ipynb": (ROOT / "solutions" / "01_batching.ipynb").read_text()})
    assert res["score"] == 100, json.dumps(res, indent=1)[:3000]
    vis = {t["name"]: t["visibility"] for t in res["tests"]}
    assert vis["lab01/retire_and_admit (public checks)"] == "visible"
    assert vis["lab01/retire_and_admit (hidden checks)"] == "after_published"
    assert sum(t["max_score"] for t in res["tests"]) == pytest.approx(100, abs=0.05)
    assert "Graded 01_batching.ipynb as lab 01" in res["output"]


def test_blank_lab_scores_zero_and_says_not_implemented(package, tmp_path):
    res = run_autograder(package, tmp_path, {"labs_01.ipynb": (ROOT / "labs" / "01_batching.ipynb").read_text()})
    assert res["score"] == 0 and all("not implemented" in t["output"] for t in res["tests"])


def test_broken_notebook_gets_a_result_that_explains(package, tmp_path):
    res = run_autograder(package, tmp_path, {"01_batching.ipynb": b"{this is not json"})
    assert res["score"] == 0 and res["tests"] == []
    assert "could not be graded" in res["output"] and "not a readable Jupyter notebook" in res["output"]


def test_notebook_without_exercises_and_a_missing_notebook(package, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('hello')")]
    res = run_autograder(package, tmp_path / "a", {"01_empty.ipynb": nbformat.writes(nb)})
    assert res["score"] == 0 and "No exercise cell of lab 01" in res["output"]
    res = run_autograder(package, tmp_path / "b", {"notes.txt": "forgot the notebook"})
    assert res["score"] == 0 and "no .ipynb notebook" in res["output"] and "notes.txt" in res["output"]
    res = run_autograder(package, tmp_path / "c", {"a.ipynb": nbformat.writes(nb), "b.ipynb": nbformat.writes(nb)})
    assert res["score"] == 0 and "2 notebooks" in res["output"]


def test_hostile_submission_loses_only_the_attacked_exercise(package, tmp_path):
    hostile = notebook_with(LAB, {"lab01/static_slot_grid": textwrap.dedent("""\
        import glob, os, signal
        def static_slot_grid(output_lens, num_slots):
            found = glob.glob("/**/hidden/lab01.py", recursive=False) + glob.glob("/autograder/**/lab01.py", recursive=True)
            for pid in (os.getppid(), 1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            while True:
                os.fork() if len(found) < 0 else None
        """)}, tmp_path / "hostile.ipynb")
    res = run_autograder(package, tmp_path, {"01_batching.ipynb": hostile.read_text()})
    scores = {t["name"]: t["score"] for t in res["tests"]}
    assert scores["lab01/static_slot_grid (public checks)"] == scores["lab01/static_slot_grid (hidden checks)"] == 0
    assert res["score"] == 75, json.dumps(res, indent=1)[:3000]


def test_a_bad_timeout_is_refused_with_what_to_give(tmp_path):
    for bad in (0, -5, "10"):
        with pytest.raises(ValueError, match="positive number of seconds"):
            build_package(LAB, tmp_path, timeout_s=bad)
    assert not list(tmp_path.iterdir())   # nothing half-written
