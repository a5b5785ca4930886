"""What a lab's setup and experiment cells lean on: the load guard (`hardware.load_guard`) and the fallback to the
library when an exercise is not solved yet (`grading.student_or_library`)."""
import json

import pytest

from llmso_lab import hardware as hw
from llmso_lab.grading import check, student_or_library
from llmso_lab.sim.grid import static_slot_grid as library_static_slot_grid

IDLE = lambda: (0.0, 0.0, 0.0)  # noqa: E731  (no other job: the verdict rests on the matmul alone)


def test_load_guard_remembers_the_machines_best_and_warns_far_below_it(tmp_path, capsys):
    record = tmp_path / "best.json"
    first = hw.load_guard(seconds=0.05, record=record, loadavg=IDLE)
    assert "machine check" in capsys.readouterr().out
    saved = json.loads(record.read_text())
    (key, best), = saved.items()
    assert best == pytest.approx(first.gflops) and str(hw.torch.get_num_threads()) in key
    # a best that this run cannot come near (the machine once ran 100x faster): the guard warns, says what to do,
    # and does not lower the record
    record.write_text(json.dumps({key: first.gflops * 100}))
    slow = hw.load_guard(seconds=0.05, record=record, loadavg=IDLE)
    line = capsys.readouterr().out
    assert slow.busy and line.startswith("WARNING: this machine is busy") and "rerun the timed cells" in line
    assert json.loads(record.read_text())[key] == first.gflops * 100


def test_load_guard_survives_a_broken_record(tmp_path):
    record = tmp_path / "best.json"
    record.write_text("{not json")
    check_ = hw.load_guard(seconds=0.05, record=record, quiet=True, loadavg=IDLE)
    assert check_.best_gflops == check_.gflops and not check_.busy
    assert json.loads(record.read_text())   # rewritten as valid JSON


def test_load_check_flags_other_jobs_even_at_full_speed():
    assert not hw.LoadCheck(100.0, 100.0, 0.2, 2).busy
    assert hw.LoadCheck(100.0, 100.0, 1.5, 2).busy       # another job held most of a core of two
    assert hw.LoadCheck(45.0, 100.0, 0.0, 2).busy        # under half the machine's own best
    assert not hw.LoadCheck(55.0, 100.0, 0.0, 2).busy    # a fresh kernel on a quiet machine can be this slow


def _grid_stub(output_lens, num_slots):
    raise NotImplementedError("exercise static_slot_grid")


def _grid_different(output_lens, num_slots):
    """Right, written differently from the library: slot by slot, batch by batch."""
    batches = [list(range(s, min(s + num_slots, len(output_lens)))) for s in range(0, len(output_lens), num_slots)]
    grid = [[] for _ in range(num_slots)]
    for batch in batches:
        span = max(output_lens[i] for i in batch)
        for slot in range(num_slots):
            rid = batch[slot] if slot < len(batch) else -1
            n = output_lens[rid] if rid >= 0 else 0
            grid[slot].extend([rid] * n + [-1] * (span - n))
    return grid


def _grid_wrong(output_lens, num_slots):
    """Plausible and wrong: a slot is freed as soon as its request ends (that is continuous batching)."""
    grid = _grid_different(output_lens, num_slots)
    return [[x for x in row if x >= 0] + [-1] * row.count(-1) for row in grid]


def test_an_unsolved_exercise_falls_back_to_the_library_and_says_so(capsys):
    got = student_or_library("static_slot_grid", _grid_stub)
    out = capsys.readouterr().out
    assert got is library_static_slot_grid
    assert "does not pass its public checks yet" in out and "llmso_lab.sim.grid.static_slot_grid" in out
    assert student_or_library("static_slot_grid", _grid_wrong) is library_static_slot_grid   # wrong: not used


def test_a_solved_exercise_runs_the_students_own_code(capsys):
    assert student_or_library("static_slot_grid", _grid_different) is _grid_different
    assert "your implementation runs here" in capsys.readouterr().out


def test_the_verdict_follows_the_object_that_was_checked(capsys):
    """check() on a right answer, then the student redefines the function with a bug: the new one is checked again,
    not trusted on the old one's verdict."""
    assert check("static_slot_grid", _grid_different).ok
    assert student_or_library("static_slot_grid", _grid_wrong) is library_static_slot_grid
    # found by name in the notebook's namespace, as check() finds it
    notebook = {"student_or_library": student_or_library, "static_slot_grid": _grid_different}
    exec("fn = student_or_library('static_slot_grid')", notebook)
    assert notebook["fn"] is _grid_different


def test_nothing_defined_yet(capsys):
    notebook = {"student_or_library": student_or_library}
    exec("fn = student_or_library('static_slot_grid')", notebook)
    assert notebook["fn"] is library_static_slot_grid
    assert "is not defined yet" in capsys.readouterr().out
