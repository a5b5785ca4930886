"""The student bundle: stubs, library, public tests, data — no solutions, no hidden checks."""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from llmso_lab.grading.release import build_bundle, check_labs, find_solution_leaks, write_labs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "student"
    build_bundle(out)
    return out


def test_bundle_has_labs_library_tests_and_data_but_no_solutions(bundle):
    assert sorted(p.name for p in (bundle / "labs").glob("*.ipynb")) == sorted(
        p.name for pattern in ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb") for p in (ROOT / "solutions").glob(pattern))
    assert (bundle / "llmso_lab" / "grading" / "specs" / "lab00.py").exists()
    assert not (bundle / "solutions").exists()
    hidden = list((bundle / "llmso_lab" / "grading" / "hidden").glob("lab*.py"))
    assert hidden == [], "hidden checks must not ship"
    assert (bundle / "tests" / "test_hardware.py").exists()
    assert not (bundle / "tests" / "test_grading.py").exists()
    assert (bundle / "README.md").exists() and (bundle / "Makefile").exists()
    for nb in (bundle / "labs").glob("*.ipynb"):
        cells = nbformat.read(str(nb), as_version=4).cells
        assert all(not c.get("outputs") for c in cells if c.cell_type == "code")


def test_bundle_contains_no_solution_text(bundle):
    assert find_solution_leaks(bundle) == []


def test_leak_detector_catches_a_planted_solution(bundle, tmp_path):
    leaky = tmp_path / "leaky"
    shutil.copytree(bundle, leaky)
    sol = nbformat.read(str(ROOT / "solutions" / "00_roofline.ipynb"), as_version=4)
    src = next(c.source for c in sol.cells if "def roofline_time" in c.source)
    (leaky / "llmso_lab" / "notes.py").write_text(src.replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", ""))
    assert any("contains a solution block" in x for x in find_solution_leaks(leaky))


def test_bundle_grades_public_checks_only(bundle, tmp_path):
    env_path = f"{bundle}"
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; sys.path.insert(0, sys.argv[1]);"
                           "from llmso_lab.grading import exercises;"
                           "print(sum(c.hidden for e in exercises('00') for c in e.cases))", env_path],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"


def test_release_check_flags_hand_edited_labs(tmp_path):
    root = tmp_path / "repo"
    (root / "solutions").mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / "00_roofline.ipynb", root / "solutions")
    write_labs(root)
    assert check_labs(root) == []
    lab = root / "labs" / "00_roofline.ipynb"
    nb = nbformat.read(str(lab), as_version=4)
    nb.cells[0].source += "\nedited by hand"
    nbformat.write(nb, str(lab))
    (root / "labs" / "99_orphan.ipynb").write_text(lab.read_text())
    problems = check_labs(root)
    assert any("00_roofline.ipynb differs" in p for p in problems)
    assert any("99_orphan.ipynb has no solutions/ source" in p for p in problems)


def test_release_refuses_to_overwrite_a_non_bundle_folder(tmp_path):
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("do not delete")
    with pytest.raises(ValueError, match="not an earlier student bundle"):
        build_bundle(precious)
    assert (precious / "chapter1.tex").read_text() == "do not delete"
    with pytest.raises(ValueError, match="over the repository"):
        build_bundle(ROOT)
