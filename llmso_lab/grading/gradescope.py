"""Gradescope: the autograder package (`llmso-lab release --gradescope --lab NN`) and what runs inside it.

Gradescope builds one image per assignment from the zip (running `setup.sh` once, as root) and then runs
`run_autograder` once per submission, in a fresh container: the student's files are in
`/autograder/submission`, the result must be written to `/autograder/results/results.json`. Layout of the zip:

    setup.sh           installs Python, the CPU torch wheel and this package; makes the package root-only
    run_autograder     grades the submitted notebook as lab NN; always writes results.json
    config.json        {"lab", "hidden_visibility", "needs_model", "torch_spec"}
    llmso-lab/         this package (pyproject, llmso_lab/ with the hidden checks of lab NN only, data/)

The grader runs as root; each exercise runs in the sandbox (`sandbox.py`): isolated where the container
allows namespaces, otherwise as an unprivileged uid, which cannot read the root-only package and hidden
checks. `python -m llmso_lab.grading.gradescope run --root DIR` is the runner; `--root` (default
/autograder) lets tests lay out a temporary directory like Gradescope's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback
import zipfile
from pathlib import Path

__all__ = ["build_package", "run", "HIDDEN_VISIBILITY"]

HIDDEN_VISIBILITY = ("hidden", "after_due_date", "after_published", "visible")
TORCH_SPEC = "torch==2.13.0"

SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image (not per submission).
set -euo pipefail
SRC=/autograder/source
cd "$SRC"
cfg() { python3 -c "import json, sys; print(json.load(open('$SRC/config.json'))[sys.argv[1]])" "$1"; }
if ! command -v python3 >/dev/null || ! python3 -c "import venv, sys; assert sys.version_info >= (3, 10)"; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip >/dev/null
fi
python3 -m venv /autograder/venv
PIP="/autograder/venv/bin/pip"
"$PIP" install -q --upgrade pip
# The CPU build of torch (the default wheel on PyPI is the multi-GB CUDA one).
"$PIP" install -q "$(cfg torch_spec)" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
"$PIP" install -q "$SRC/llmso-lab"
# The library (with the hidden checks) and this folder are for the grading process only: root-only. Each
# exercise's sandboxed process gets its own readable copy of the library without them.
PKG="$(/autograder/venv/bin/python -c 'import llmso_lab, os; print(os.path.dirname(llmso_lab.__file__))')"
chmod -R go-rwx "$PKG" "$SRC"
if [ "$(cfg needs_model)" = "True" ]; then
    /autograder/venv/bin/llmso-lab model fetch   # cached once in the image, not per submission
fi
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this once per submission, as root. It always leaves a results.json behind.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PY="${LLMSO_PYTHON:-$ROOT/venv/bin/python}"
mkdir -p "$ROOT/results"
cd "$ROOT/source" || true
"$PY" -m llmso_lab.grading.gradescope run --root "$ROOT" --config "$ROOT/source/config.json"
status=$?
if [ ! -s "$ROOT/results/results.json" ]; then
    printf '{"score": 0.0, "output": "The autograder failed before grading (exit status %s). Please tell your instructor.", "tests": []}\\n' \\
        "$status" > "$ROOT/results/results.json"
fi
exit 0
"""


def build_package(lab: str, out_dir: Path, hidden_visibility: str = "after_published", root: Path | None = None,
                  timeout_s: float | None = None) -> Path:
    """Write `autograder_labNN.zip` into `out_dir`; returns its path. `timeout_s`: one wall-clock limit (seconds)
    for every exercise instead of each exercise's own (config.json's "timeout_s"; e.g. a slower grading machine)."""
    from llmso_lab.grading.registry import exercises
    from llmso_lab.grading.tripwire import PACKAGE_DIR

    if hidden_visibility not in HIDDEN_VISIBILITY:
        raise ValueError(f"hidden visibility {hidden_visibility!r}: choose one of {', '.join(HIDDEN_VISIBILITY)}")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r}: give a positive number of seconds, or None for each exercise's own limit")
    exs = exercises(lab)   # checks the lab exists
    lab = exs[0].lab
    checkout = Path(root) if root else PACKAGE_DIR.parent
    if not (checkout / "pyproject.toml").exists():
        raise ValueError(f"{checkout} has no pyproject.toml: build the package from a checkout of llmso-lab")
    spec = sys.modules[f"llmso_lab.grading.specs.lab{lab}"]
    config = {"lab": lab, "hidden_visibility": hidden_visibility, "needs_model": bool(getattr(spec, "NEEDS_MODEL", False)),
              "torch_spec": TORCH_SPEC, "timeout_s": timeout_s}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    zip_path = out_dir / f"autograder_lab{lab}.zip"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "llmso-lab"
        keep_hidden = {"__init__.py", f"lab{lab}.py"}
        shutil.copytree(checkout / "llmso_lab", src / "llmso_lab", ignore=lambda d, names: [
            n for n in names if n in ("__pycache__",) or n.endswith(".pyc")
            or (Path(d).name == "hidden" and n not in keep_hidden)])
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (checkout / name).exists():
                shutil.copy2(checkout / name, src / name)
        if (checkout / "data").is_dir():
            shutil.copytree(checkout / "data", src / "data", ignore=shutil.ignore_patterns("gpu_results_raw"))
        with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
            for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
                info = zipfile.ZipInfo(name)
                info.external_attr = 0o100755 << 16   # executable, as Gradescope expects
                z.writestr(info, text)
            z.writestr("config.json", json.dumps(config, indent=1) + "\n")
            for path in sorted(src.rglob("*")):
                if path.is_file():
                    z.write(path, Path("llmso-lab") / path.relative_to(src))
    return zip_path


def _find_notebook(submission: Path, lab: str) -> Path:
    found = sorted(p for p in submission.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if not found:
        names = ", ".join(sorted(p.name for p in submission.rglob("*") if p.is_file())[:10]) or "nothing"
        raise ValueError(f"no .ipynb notebook in the submission (found: {names}); submit your lab {lab} notebook")
    if len(found) == 1:
        return found[0]
    named = [p for p in found if p.name.startswith(f"{lab}_")]
    if len(named) == 1:
        return named[0]
    raise ValueError(f"{len(found)} notebooks in the submission ({', '.join(p.name for p in found)}); submit only "
                     f"your lab {lab} notebook (e.g. {lab}_....ipynb)")


def run(root: Path, config: Path) -> dict:
    """Grade the one notebook in `root/submission`; write and return `root/results/results.json`."""
    results = Path(root) / "results"
    results.mkdir(parents=True, exist_ok=True)
    try:
        cfg = json.loads(Path(config).read_text())
        lab = cfg["lab"]
        from llmso_lab.grading.grader import grade_notebook

        nb = _find_notebook(Path(root) / "submission", lab)
        res = grade_notebook(nb, lab=lab, hidden_visibility=cfg.get("hidden_visibility", "after_published"),
                             timeout_s=cfg.get("timeout_s"))
        if all(t["score"] == 0 and "no code cell defines" in t["output"] for t in res["tests"] if t["max_score"] > 0):
            res["output"] += (f" No exercise cell of lab {lab} was found in {nb.name}: is this the lab {lab} notebook, "
                              "with the exercise functions still named as in the lab?")
        else:
            res["output"] += " Hidden checks are graded now; their details may appear later."
    except Exception as exc:   # never leave without a result: say what went wrong
        detail = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        res = {"score": 0.0, "output": f"The submission could not be graded: {detail}", "tests": [],
               "extra_data": {"error": traceback.format_exc()[-4000:]}}
    tmp = results / "results.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, results / "results.json")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmso_lab.grading.gradescope")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="grade /autograder/submission into /autograder/results/results.json")
    r.add_argument("--root", default="/autograder")
    r.add_argument("--config", default=None)
    args = p.parse_args(argv)
    run(Path(args.root), Path(args.config or Path(args.root) / "source" / "config.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
