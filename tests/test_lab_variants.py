"""Every exercise: a wrong-but-plausible answer loses its points, a correct-but-different one keeps them, and
`check()` (in the notebook's process) gives the same verdict as the sandboxed grader on every case."""
import pytest

from llmso_lab.grading import exercises, labs
from llmso_lab.grading.grader import grade_notebook
from lab_variants import VARIANTS, cell_source, in_process_verdicts, notebook_with


def test_every_exercise_has_wrong_and_right_variants():
    keys = {ex.key for lab in labs() for ex in exercises(lab)}
    assert keys == set(VARIANTS), f"missing: {sorted(keys - set(VARIANTS))}, unknown: {sorted(set(VARIANTS) - keys)}"
    for key, v in VARIANTS.items():
        assert v["wrong"] and v["right"], key


def _variants(lab, kind, index):
    """The index-th variant of every exercise that has one (run 0: every exercise)."""
    return {ex.key: cell_source(ex.key, VARIANTS[ex.key][kind][index])
            for ex in exercises(lab) if index < len(VARIANTS[ex.key][kind])}


def _runs():
    """(lab, kind, i): one grading run per lab and variant index; run i grades only the exercises with an i-th variant
    (grading the others again would repeat run i - 1)."""
    for lab in labs():
        for kind in ("wrong", "right"):
            for i in range(max(len(VARIANTS[ex.key][kind]) for ex in exercises(lab))):
                yield pytest.param(lab, kind, i, id=f"lab{lab}-{kind}{i}")


@pytest.mark.parametrize("lab,kind,index", list(_runs()))
def test_variants_are_graded_as_they_deserve_and_check_agrees(lab, kind, index, tmp_path):
    sources = _variants(lab, kind, index)
    details = []
    graded = [ex for ex in exercises(lab) if ex.key in sources]
    res = grade_notebook(notebook_with(lab, sources, tmp_path / f"{lab}_{kind}.ipynb"), details=details,
                         only=[ex.name for ex in graded])
    for r in details:
        ex = r.exercise
        if kind == "right":
            assert r.score == ex.points, f"{ex.key}: a correct answer lost points:\n" + "\n".join(r.lines)
        else:
            assert r.score < ex.points, f"{ex.key}: a wrong answer kept full marks:\n{sources[ex.key]}"
        mine = in_process_verdicts(ex, sources[ex.key])
        assert [v is None for v in mine] == [v is None for v in r.verdicts], (ex.key, mine, r.verdicts)
        public = [i for i, c in enumerate(ex.cases) if not c.hidden]
        assert [mine[i] for i in public] == [r.verdicts[i] for i in public], ex.key   # same messages too
    assert len(details) == len(graded) and res["max_score"] == sum(ex.points for ex in graded)
    if index == 0:
        assert res["max_score"] == 100
