"""Grading: solutions score full marks, blank labs score zero, tampering is contained to one exercise."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from llmso_lab.grading import exercises, get_exercise, labs
from llmso_lab.grading.grader import expected_values, grade_notebook
from llmso_lab.grading.notebook import exercise_cell_source, make_student_notebook
from llmso_lab.grading.release import check_labs
from lab_variants import in_process_verdicts

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
LAB_OF = {p.name[:2]: p for p in SOLUTIONS}


def by_name(res):
    return {t["name"].split("/")[1]: t for t in res["tests"]}


@pytest.mark.parametrize("lab", labs())
def test_every_lab_totals_100_points_with_public_and_hidden_checks(lab):
    exs = exercises(lab)
    assert sum(e.points for e in exs) == 100
    for e in exs:
        assert any(not c.hidden for c in e.cases), f"{e.name} has no public check"
        assert any(c.hidden for c in e.cases), f"{e.name} has no hidden check"
        assert len(expected_values(e)) == len(e.cases)  # the reference runs on every case
    assert lab in LAB_OF, f"lab {lab} has exercises but no solutions/{lab}_*.ipynb"


@pytest.mark.parametrize("lab", labs())
def test_case_arguments_reach_the_students_process_unchanged(lab, tmp_path):
    """The grader sends each case with `protocol.send`; the child reads it with `recv(..., argument_classes())`
    (plain data and protocol.ARGUMENT_CLASSES only). A case that does not survive that kills the child instead of
    failing a check."""
    import os

    from llmso_lab.grading.protocol import argument_classes, recv, send

    path = tmp_path / "case.bin"
    for e in exercises(lab):
        for c in e.cases:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                send(fd, {"args": list(c.args), "kwargs": dict(c.kwargs)})
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            try:
                back = recv(fd, classes=argument_classes())
            except ValueError as exc:
                raise AssertionError(f"{e.key} / {c.label}: {exc}") from None
            finally:
                os.close(fd)
            assert [type(a) for a in back["args"]] == [type(a) for a in c.args], (e.key, c.label)
            assert set(back["kwargs"]) == set(c.kwargs), (e.key, c.label)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebook_scores_full_marks(path):
    res = grade_notebook(path)
    assert res["score"] == res["max_score"] == 100, json.dumps(res, indent=1)


# Through the sandboxed grader: a lab with a Triton kernel exercise and tensors, and one with class exercises
# (test_gradescope grades Lab 01's blank in Gradescope's layout). Every lab's blank cells: the next test.
@pytest.mark.parametrize("lab", ["03", "04"])
def test_blank_lab_scores_zero_with_reasons(lab):
    res = grade_notebook(ROOT / "labs" / LAB_OF[lab].name)
    assert res["score"] == 0
    for t in res["tests"]:
        assert t["score"] == 0 and "not implemented" in t["output"], t


@pytest.mark.parametrize("lab", labs())
def test_every_blank_exercise_fails_every_case_as_not_implemented(lab):
    """Each released blank cell, run as check() runs it (test_lab_variants: the same verdicts as the grader's)."""
    nb = nbformat.read(str(ROOT / "labs" / LAB_OF[lab].name), as_version=4)
    for ex in exercises(lab):
        source = exercise_cell_source(nb, ex.graded_name)
        assert source is not None, f"{ex.key}: no cell defines {ex.graded_name} in the released lab"
        verdicts = in_process_verdicts(ex, source)
        assert all(v is not None and "not implemented" in v.lower() for v in verdicts), (ex.key, verdicts)


def test_labs_are_generated_from_solutions():
    assert check_labs() == []


# ---- adversarial submissions against lab 00: each breaks `roofline_time` (20 points) only ---------------
BROKEN = {
    "infinite_loop": "def roofline_time(flops, bytes_moved, peak_flops, bandwidth):\n    while True:\n        pass\n",
    "sys_exit_inside": "import sys\ndef roofline_time(*a, **k):\n    sys.exit(0)\n",
    "sys_exit_top_level": "import sys\nsys.exit(0)\ndef roofline_time(*a, **k):\n    return 0.0\n",
    "os_exit_inside": "import os\ndef roofline_time(*a, **k):\n    os._exit(0)\n",
    "os_exit_top_level": "import os\nos._exit(0)\ndef roofline_time(*a, **k):\n    return 0.0\n",
    "allocate_50GB": "def roofline_time(*a, **k):\n    big = bytearray(50 * 2**30)\n    return float(len(big))\n",
    "allocate_50GB_torch": "import torch\ndef roofline_time(*a, **k):\n    return torch.ones(50 * 2**30 // 4).sum()\n",
    "patch_allclose": textwrap.dedent("""\
        import torch
        torch.allclose = lambda *a, **k: True
        torch.isclose = lambda a, b, *r, **k: torch.ones_like(a, dtype=torch.bool)
        def roofline_time(*a, **k):
            return 12345.0
        """),
    "patch_grading_and_check": textwrap.dedent("""\
        import llmso_lab.grading as g, llmso_lab.grading.compare as c, llmso_lab.grading.grader as gr
        import llmso_lab.grading.child as ch
        g.check = lambda *a, **k: None
        c.close = lambda *a, **k: (lambda got, exp: None)
        gr.grade_exercise = lambda *a, **k: None
        ch._plain = lambda obj, depth=0: obj
        def roofline_time(*a, **k):
            return -1.0
        """),
    "always_equal_object": textwrap.dedent("""\
        class AlwaysEqual(float):
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            __hash__ = float.__hash__
        def roofline_time(*a, **k):
            return AlwaysEqual(0.0)
        """),
    "calls_the_reference": textwrap.dedent("""\
        import llmso_lab.hardware as hw
        from llmso_lab.hardware import roofline_time as ref
        def roofline_time(*a, **k):
            return ref(*a, **k) if ref is not None else hw.roofline_time(*a, **k)
        """),
    "deleted_cell": None,
}


def tampered_notebook(tmp_path, source):
    nb = nbformat.read(str(LAB_OF["00"]), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "def roofline_time" in c.source]
    assert len(cells) == 1
    if source is None:
        nb.cells.remove(cells[0])
    else:
        cells[0].source = source
        cells[0].outputs = []
    path = tmp_path / "00_roofline_submission.ipynb"
    nbformat.write(nb, str(path))
    return path


@pytest.mark.parametrize("kind", list(BROKEN))
def test_adversarial_submission_loses_exactly_that_exercise(tmp_path, kind):
    path = tampered_notebook(tmp_path, BROKEN[kind])
    # generous for a loaded machine; only the infinite loop waits it out (12 s: Lab 00's honest exercises take ~3 s)
    res = grade_notebook(path, timeout_s=12 if kind == "infinite_loop" else 30)
    tests = by_name(res)
    assert tests["roofline_time"]["score"] == 0, tests["roofline_time"]
    assert res["score"] == 100 - get_exercise("roofline_time").points, json.dumps(res, indent=1)
    out = tests["roofline_time"]["output"]
    expect = {"infinite_loop": "timed out", "sys_exit_inside": "sys.exit", "os_exit_inside": "os._exit",
              "allocate_50GB": "memory", "calls_the_reference": "TRIPWIRE", "deleted_cell": "no code cell defines",
              "always_equal_object": "returned a AlwaysEqual"}
    if kind in expect:
        assert expect[kind] in out, out


def test_results_file_cannot_be_forged_and_cli_exits_zero(tmp_path):
    results = tmp_path / "results.json"
    forge = textwrap.dedent(f"""\
        import json
        FAKE = {{"score": 100.0, "tests": []}}
        open({str(results)!r}, "w").write(json.dumps(FAKE))
        def roofline_time(*a, **k):
            open({str(results)!r}, "w").write(json.dumps(FAKE))
            return 0.0
        """)
    path = tampered_notebook(tmp_path, forge)
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(path), "--json", str(results)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(results.read_text())
    rest = 100 - get_exercise("roofline_time").points
    assert data["score"] == rest and len(data["tests"]) == len(exercises("00"))
    assert {"name", "score", "max_score", "output", "visibility"} <= set(data["tests"][0])
    assert "total" in proc.stdout and f"{rest:.2f}" in proc.stdout


def test_bad_submission_gets_a_clear_error(tmp_path):
    bad = tmp_path / "00_x.ipynb"
    bad.write_text("this is not json")
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a readable Jupyter notebook" in proc.stderr
    nb = nbformat.v4.new_notebook()
    nbformat.write(nb, str(tmp_path / "submission.ipynb"))
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(tmp_path / "submission.ipynb")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--lab NN" in proc.stderr


# ---- the protocol also grades classes and functions that start processes ---------------------------
FIXTURES = Path(__file__).parent / "grading_fixtures"


def fixture_exercises(timeout_s=60):
    from llmso_lab.grading import Case, Exercise
    from llmso_lab.grading.compare import exact

    # The references live outside the library (not visible to the student's process, which needs only the cell).
    return [
        Exercise("allreduce_sum", "99", 50, "procs_ref:allreduce_sum",
                 [Case("3 ranks", ([1.0, 2.0, 4.0],), compare=exact())], timeout_s=timeout_s),
        Exercise("Counter", "99", 50, "procs_ref:Counter",
                 [Case("add then read", (10,), calls=[("add", (5,), {}), ("add", (-20,), {}), ("value", (), {})],
                       compare=exact())], kind="class", timeout_s=timeout_s),
    ]


def fixture_notebook(tmp_path, allreduce_src):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(allreduce_src),
                nbformat.v4.new_code_cell((FIXTURES / "procs_ref.py").read_text().split("# --- class ---")[1])]
    path = tmp_path / "99_procs.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_process_spawning_and_class_exercises_are_graded(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    src = (FIXTURES / "procs_ref.py").read_text().split("# --- class ---")[0]
    res = grade_notebook(fixture_notebook(tmp_path, src), exercise_list=fixture_exercises())
    assert res["score"] == 100, json.dumps(res, indent=1)


def test_hanging_child_processes_are_killed_with_their_group(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    marker = f"llmso-hang-{tmp_path.name}"
    src = textwrap.dedent(f"""\
        import subprocess, sys
        def allreduce_sum(values):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
            while True:
                pass
        """)
    res = grade_notebook(fixture_notebook(tmp_path, src), exercise_list=fixture_exercises(timeout_s=8))
    assert by_name(res)["allreduce_sum"]["score"] == 0 and by_name(res)["Counter"]["score"] == 50
    assert "timed out" in by_name(res)["allreduce_sum"]["output"]
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip()
    assert left == "", f"processes left behind: {left}"


def test_student_stub_keeps_signature_and_drops_solution():
    nb = make_student_notebook(nbformat.read(str(LAB_OF["00"]), as_version=4))
    src = exercise_cell_source(nb, "roofline_time")
    assert src.startswith("def roofline_time(flops, bytes_moved, peak_flops, bandwidth):")
    assert 'raise NotImplementedError("exercise roofline_time")' in src and "compute_s" not in src
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_check_gives_feedback_and_restores_the_reference():
    from llmso_lab import hardware as hw
    from llmso_lab.grading import check

    wrong = check("roofline_time", fn=lambda flops, b, p, bw: flops / p + b / bw)
    assert not wrong.ok and "expected" in repr(wrong) and "allowed atol" in repr(wrong)
    cheat = check("roofline_time", fn=lambda *a: hw.roofline_time(*a))
    assert not cheat.ok and "TRIPWIRE" in repr(cheat)
    assert hw.roofline_time(1.0, 1.0, 1.0, 2.0) == 1.0  # restored after check()
    right = check("roofline_time", fn=lambda f, b, p, bw: max(f / p, b / bw))
    assert right.ok and right.passed == right.total == 2
    assert "PASSED" in right._repr_html_()
    missing = check("roofline_time", fn=None)
    assert not missing.ok and "not defined" in repr(missing)
    with pytest.raises(ValueError, match="known exercises"):
        check("no_such_exercise")


def test_child_prelude_imports_triton_only_where_a_cell_can_use_it():
    from llmso_lab.grading.child import prelude

    assert "import triton" in prelude({"launcher": None, "source": "@triton.jit\ndef k(x_ptr):\n    tl.load(x_ptr)\n"})
    assert "import triton" in prelude({"launcher": "llmso_lab.attention.tile_launcher:launch_attn_fwd_tile", "source": ""})
    assert "import triton" not in prelude({"launcher": None, "source": "def kv(tlx, tritonic):\n    return tlx\n"})
    assert "import torch" in prelude({"launcher": None, "source": ""})


def test_harness_exercises_run_the_students_object_inside_the_library(monkeypatch):
    """A mechanism exercise: the library's harness calls the student's function; the expected value is the same
    harness run with the reference. A harness cannot be disabled, and takes no class kind or launcher."""
    from llmso_lab.grading import Case, Exercise
    from llmso_lab.grading.registry import register
    from llmso_lab.grading.check import check_target, outcome_in_process
    from llmso_lab.grading.compare import exact
    from llmso_lab.grading.grader import expected_values
    from llmso_lab.grading.protocol import verdict

    monkeypatch.syspath_prepend(str(FIXTURES))
    ex = Exercise("square", "99", 10, "harness_ref:square", [Case("x = 3", (3,))], compare=exact(),
                  harness="harness_ref:run_on_two")
    assert expected_values(ex) == [[9, 16]]
    from llmso_lab.grading import judge
    from llmso_lab.grading.protocol import attempt_call
    from llmso_lab.grading.remote import LocalSession

    square = lambda x: x * x  # noqa: E731
    target, _ = check_target(ex, square)
    assert target is square   # the harness calls it; the harness itself runs where the judge is (`judge.run`)
    assert judge.run(ex, LocalSession(square, lambda thunk, raw=False: attempt_call(thunk, None, raw=raw)),
                     ex.cases[0]) == [9, 16]
    assert verdict(ex, ex.cases[0], outcome_in_process(ex, lambda x: x * x, 0), [9, 16]) is None
    assert verdict(ex, ex.cases[0], outcome_in_process(ex, lambda x: 2 * x, 0), [9, 16]) is not None
    with pytest.raises(ValueError, match="kind 'function'"):
        register(Exercise("square_cls", "99", 10, "harness_ref:square", [], kind="class",
                          harness="harness_ref:run_on_two"))
    with pytest.raises(ValueError, match="must not be disabled"):
        register(Exercise("square_dis", "99", 10, "harness_ref:square", [], harness="harness_ref:run_on_two",
                          tripwires=("harness_ref:run_on_two",)))
