"""`llmso-lab release`: solutions/ -> labs/ (stubs) and the student bundle.

labs/ is GENERATED: `release --check` fails when any labs/*.ipynb differs from what solutions/ gives.
The bundle holds the labs, the library without hidden checks, the public tests and data — never solution
text (verified on every build).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

from llmso_lab.grading.notebook import make_student_notebook, read_notebook, solution_blocks

__all__ = ["repo_root", "render_labs", "write_labs", "check_labs", "build_bundle", "INSTRUCTOR_TESTS"]

# Tests that need solutions/ or hidden checks stay with the instructor.
INSTRUCTOR_TESTS = ("test_grading", "test_release", "test_notebooks", "test_lab_notebooks", "test_lab_variants", "lab_variants", "variants_lab")   # variants hold answers
BUNDLE_FILES = ("README.md", "pyproject.toml", "Makefile", "LICENSE")
BUNDLE_DIRS = ("llmso_lab", "data", "tests")


def repo_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "solutions").is_dir():
        raise ValueError(f"{root} has no solutions/ folder: release runs from an instructor checkout of llmso-lab")
    return root


def _dumps(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def render_labs(root: Path | None = None) -> dict[str, str]:
    """{file name: student notebook text} for every lab (solutions/NN_*.ipynb) and appendix (solutions/AN_*.ipynb,
    optional reading that the labs link to, not graded)."""
    root = root or repo_root()
    paths = sorted((root / "solutions").glob("[0-9][0-9]_*.ipynb")) + sorted((root / "solutions").glob("A[0-9]_*.ipynb"))
    return {p.name: _dumps(make_student_notebook(read_notebook(p))) for p in paths}


def write_labs(root: Path | None = None) -> list[str]:
    root = root or repo_root()
    (root / "labs").mkdir(exist_ok=True)
    rendered = render_labs(root)
    for name, text in rendered.items():
        (root / "labs" / name).write_text(text)
    return sorted(rendered)


def check_labs(root: Path | None = None) -> list[str]:
    """Problems found (empty when labs/ matches solutions/)."""
    root = root or repo_root()
    rendered = render_labs(root)
    problems = []
    for name, text in rendered.items():
        path = root / "labs" / name
        if not path.exists():
            problems.append(f"labs/{name} is missing")
        elif path.read_text() != text:
            problems.append(f"labs/{name} differs from what solutions/{name} generates")
    for path in sorted((root / "labs").glob("*.ipynb")):
        if path.name not in rendered:
            problems.append(f"labs/{path.name} has no solutions/ source")
    return problems


def build_bundle(out: Path, root: Path | None = None) -> list[Path]:
    """Write the student bundle to `out` (replaced if it exists); return the files written."""
    root = root or repo_root()
    out, r = Path(out).resolve(), root.resolve()
    if out == r or out in r.parents or (out.parent == r and (r / out.name).exists() and out.name not in ("dist", "out")):
        raise ValueError(f"refusing to write the bundle over the repository ({out}); choose e.g. --out dist/student")
    if out.exists() and any(out.iterdir()):
        if not ((out / "labs").is_dir() and (out / "llmso_lab").is_dir()):
            raise ValueError(f"{out} exists and is not an earlier student bundle; choose an empty or new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "hidden", "gpu_results_raw")
    for d in BUNDLE_DIRS:
        if (root / d).is_dir():
            shutil.copytree(root / d, out / d, ignore=ignore)
    for f in BUNDLE_FILES:
        if (root / f).exists():
            shutil.copy2(root / f, out / f)
    for p in (out / "tests").glob("*.py"):
        if p.stem.startswith(INSTRUCTOR_TESTS):
            p.unlink()
    (out / "llmso_lab" / "grading" / "hidden").mkdir(exist_ok=True)
    (out / "llmso_lab" / "grading" / "hidden" / "__init__.py").write_text('"""Hidden checks are not shipped."""\n')
    (out / "labs").mkdir()
    for name, text in render_labs(root).items():
        (out / "labs" / name).write_text(text)
    leaks = find_solution_leaks(out, root)
    if leaks:
        shutil.rmtree(out)
        raise RuntimeError("solution text found in the bundle (removed it): " + "; ".join(leaks[:5]))
    return sorted(p for p in out.rglob("*") if p.is_file())


def _norm(text: str) -> str:
    return "\n".join(ln.strip() for ln in text.strip().splitlines() if ln.strip())


def find_solution_leaks(bundle: Path, root: Path | None = None) -> list[str]:
    """Files in `bundle` that contain a solution block or a hidden-test block of any solution notebook."""
    root = root or repo_root()
    blocks = [_norm(b) for p in sorted((root / "solutions").glob("*.ipynb")) for b in solution_blocks(read_notebook(p))]
    leaks = []
    for path in sorted(p for p in Path(bundle).rglob("*") if p.is_file()):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.suffix == ".ipynb":
            nb = nbformat.reads(text, as_version=4)
            text = "\n".join(c.source for c in nb.cells)
            if "### BEGIN SOLUTION" in text or "### BEGIN HIDDEN TESTS" in text:
                leaks.append(f"{path.relative_to(bundle)} contains solution markers")
        norm = _norm(text)
        leaks += [f"{path.relative_to(bundle)} contains a solution block" for b in blocks if b and b in norm]
    return leaks
