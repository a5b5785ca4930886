"""The course as a student meets it (issue 50): every lab reads, runs and grades as one piece.

- each saved solution notebook comes from one run, top to bottom (execution metadata on every code cell, counts
  1, 2, 3, ... in order, each cell started after the one before ended), in at most 8 minutes, with no error and no
  FutureWarning in its outputs;
- no markdown a student reads mentions a busy machine;
- every lab has 3-5 discussion questions, answered in `solutions/` and unanswered in `labs/`;
- the same headings and honour-code line in every lab; each setup cell runs the load guard;
- every "vLLM 0.32에서 찾아보기" citation names a file and a definition that exist in vLLM 0.32 (where `.venv-vllm`
  is installed: `make peers-vllm`).
That each student notebook runs with its exercises unsolved is `make test`'s nbval pass over `labs/`.
"""
import ast
import datetime as dt
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LABS = [p for p in SOLUTIONS if re.match(r"\d\d_", p.name)]
MAX_LAB_SECONDS = 8 * 60
CITATION = re.compile(r"`(vllm/[\w/]+\.py)` · `([A-Za-z_][\w.]*)`")
BUSY = re.compile(r"바쁜|바쁠|바빠|한가할|다른 작업(이|으로|과|을)|부하가 (있는|큰|걸린) (머신|기계)|머신(의)? 부하|"
                  r"다른 프로세스와 나눠|공유 VM|shared VM|busy machine|machine was busy", re.I)

ids = lambda p: p.stem  # noqa: E731


def _nb(path: Path):
    return nbformat.read(str(path), as_version=4)


def _time(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=ids)
def test_saved_solution_comes_from_one_run_in_class_time(path):
    code = [c for c in _nb(path).cells if c.cell_type == "code"]
    spans, counts = [], []
    for i, cell in enumerate(code):
        ex = cell.metadata.get("execution", {})
        assert "iopub.execute_input" in ex and "shell.execute_reply" in ex, (
            f"{path.name}: code cell {i} has no execution metadata (saved from another run, or never run)")
        spans.append((_time(ex["iopub.execute_input"]), _time(ex["shell.execute_reply"])))
        counts.append(cell.execution_count)
        for out in cell.outputs:
            assert out.output_type != "error", f"{path.name}: code cell {i} saved an error"
            text = out.get("text", "") or "".join(str(v) for v in out.get("data", {}).values())
            assert "FutureWarning" not in text and "DeprecationWarning" not in text, f"{path.name}: cell {i} warns"
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: execution counts {counts}, not one run from the top"
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert s1 >= e0, f"{path.name}: a cell started before the one above it ended (stitched from two runs)"
    total = sum((e - s).total_seconds() for s, e in spans)
    assert total <= MAX_LAB_SECONDS, f"{path.name}: its cells ran {total / 60:.1f} min, over {MAX_LAB_SECONDS / 60:.0f}"


@pytest.mark.parametrize("path", sorted((ROOT / "labs").glob("*.ipynb")), ids=ids)
def test_student_markdown_never_speaks_of_a_busy_machine(path):
    for i, cell in enumerate(_nb(path).cells):
        if cell.cell_type == "markdown":
            hit = BUSY.search(cell.source)
            assert hit is None, f"{path.name} cell {i}: {cell.source[max(0, hit.start() - 60):hit.end() + 60]!r}"


def _discussion(nb):
    cells = [c for c in nb.cells if c.cell_type == "markdown" and re.search(r"^## 토론 질문", c.source, re.M)]
    assert len(cells) == 1, "one markdown cell with the heading '## 토론 질문'"
    return cells[0].source.split("## 토론 질문", 1)[1]


def _numbered(text: str) -> int:
    return len(re.findall(r"^\d+\. ", text, re.M))


@pytest.mark.parametrize("path", LABS, ids=ids)
def test_discussion_questions_are_answered_in_solutions_only(path):
    text = _discussion(_nb(path))
    questions, sep, rest = text.partition("### BEGIN SOLUTION")
    assert sep, f"{path.name}: the discussion questions have no model answers (### BEGIN SOLUTION ... ### END SOLUTION)"
    answers = rest.split("### END SOLUTION")[0]
    assert 3 <= _numbered(questions) <= 5, f"{path.name}: {_numbered(questions)} discussion questions, want 3-5"
    assert _numbered(answers) >= _numbered(questions), f"{path.name}: fewer answers than questions"
    student = _discussion(_nb(ROOT / "labs" / path.name))
    assert "BEGIN SOLUTION" not in student and _numbered(student) == _numbered(questions)


@pytest.mark.parametrize("path", LABS, ids=ids)
def test_headings_and_honour_code_read_the_same_in_every_lab(path):
    nb = _nb(path)
    md = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "**Honour code.**" in nb.cells[0].source, f"{path.name}: the first cell carries the honour-code line"
    assert not re.search(r"명예 규약|^#+ 연습", md, re.M), f"{path.name}: 'Exercise' and 'Honour code' as in every lab"
    headings = re.findall(r"^### Exercise.*$", md, re.M)
    assert headings, f"{path.name}: no '### Exercise N — title (P점)' heading"
    for h in headings:
        assert re.match(r"### Exercise \d+ — .+ \(\d+(\.\d+)?점.*\)$", h), f"{path.name}: heading {h!r}"
    assert "## vLLM / SGLang 에서는" in md, f"{path.name}: ends with '## vLLM / SGLang 에서는'"
    assert "`vllm:gpu_cache_usage_perc`" not in md, "vLLM 0.32 calls it vllm:kv_cache_usage_perc"


@pytest.mark.parametrize("path", SOLUTIONS, ids=ids)
def test_setup_cell_guards_against_a_busy_machine(path):
    setup = [c for c in _nb(path).cells if "setup" in c.metadata.get("tags", [])]
    assert setup and "hw.load_guard()" in setup[0].source, f"{path.name}: the setup cell calls hw.load_guard()"


def _citations(path: Path) -> list[tuple[str, str]]:
    cells = [c.source for c in _nb(path).cells if c.cell_type == "markdown" and "### vLLM 0.32에서 찾아보기" in c.source]
    return CITATION.findall(cells[0]) if len(cells) == 1 else []


@pytest.mark.parametrize("path", LABS, ids=ids)
def test_every_lab_says_where_its_mechanisms_live_in_vllm(path):
    assert len(_citations(path)) >= 3, f"{path.name}: one '### vLLM 0.32에서 찾아보기' cell citing 3 or more places"


def _vllm_root() -> Path | None:
    found = sorted((ROOT / ".venv-vllm").glob("lib/python3*/site-packages/vllm/__init__.py"))
    return found[0].parents[1] if found else None


def _defines(tree: ast.Module, dotted: str) -> bool:
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        for node in scope:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part:
                scope = node.body
                break
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                scope = []
                break
        else:
            return False
    return True


def test_defines_finds_classes_methods_and_assignments():
    tree = ast.parse("X = 1\nclass A:\n    def f(self): pass\ndef g(): pass\n")
    assert all(_defines(tree, n) for n in ("X", "A", "A.f", "g")) and not any(_defines(tree, n) for n in ("A.g", "B"))


@pytest.mark.skipif(_vllm_root() is None, reason="needs vLLM 0.32 in .venv-vllm (make peers-vllm)")
@pytest.mark.parametrize("path", LABS, ids=ids)
def test_vllm_citations_exist_in_vllm_0_32(path):
    root = _vllm_root()
    version = (root / "vllm" / "_version.py").read_text()
    assert "0.32" in version, "the labs cite vLLM 0.32"
    for rel, name in _citations(path):
        file = root / rel
        assert file.is_file(), f"{path.name}: {rel} is not in vLLM 0.32"
        assert _defines(ast.parse(file.read_text()), name), f"{path.name}: {rel} defines no {name}"
