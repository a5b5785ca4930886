"""Grade a submitted notebook: one sandboxed child process per exercise, comparisons here.

`grade_notebook()` returns a Gradescope-style dict (`score`, `tests[]`, `extra_data`); `llmso-lab grade` writes
it as results.json and prints a table. The lab comes from the instructor (`--lab`, or the file name), never
from the notebook. Each exercise runs in its own job (`sandbox.py`): a copy of the student library with the
exercise's references stubbed out, the exercise cell, and the cases sent one at a time. A crash, timeout,
exit or huge allocation in one exercise costs that exercise only; when `grade_notebook` returns, every
process the submission started is gone (isolated sandbox).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmso_lab.grading import sandbox
from llmso_lab.grading.integrity import near_copy
from llmso_lab.grading.notebook import exercise_cell_source, read_notebook
from llmso_lab.grading import judge
from llmso_lab.grading.protocol import recv, send, verdict
from llmso_lab.grading.registry import Exercise, exercises, expected_value, resolve
from llmso_lab.grading.remote import ChannelClosed, Session
from llmso_lab.grading.tripwire import PACKAGE_DIR, operator_tripwires, stub_package

__all__ = ["ExerciseResult", "Runtime", "grade_notebook", "grade_exercise", "expected_values", "format_table",
           "lab_from_name"]


@dataclass(slots=True)
class ExerciseResult:
    exercise: Exercise
    score: float
    passed: int
    total: int
    lines: list[str]
    seconds: float
    note: str | None = None   # for the instructor only (a near-copy of the reference)
    verdicts: list[str | None] | None = None   # per case: None (passed) or why not

    def as_tests(self, hidden_visibility: str | None = None) -> list[dict[str, Any]]:
        """Gradescope tests: one per exercise, or (hidden_visibility set) its public and its hidden checks as two
        tests, the hidden one shown to students as Gradescope's `hidden_visibility` says (e.g. after_published)."""
        ex = self.exercise
        if hidden_visibility is None:
            return [{"name": ex.key, "score": self.score, "max_score": float(ex.points), "output": "\n".join(self.lines),
                     "visibility": "visible"}]
        tests = []
        for hidden, name, vis in ((False, f"{ex.key} (public checks)", "visible"),
                                  (True, f"{ex.key} (hidden checks)", hidden_visibility)):
            idx = [i for i, c in enumerate(ex.cases) if c.hidden == hidden]
            if not idx:
                continue
            verdicts = self.verdicts or [self.lines[-1]] * len(ex.cases)   # no verdicts: the cell was not found
            ok = sum(1 for i in idx if verdicts[i] is None)
            lines = [ln for ln in self.lines if not ln.startswith(("ok   ", "FAIL "))]   # notes about the whole cell
            for i in idx:
                label = f"hidden check {i + 1}" if hidden else f"check {i + 1} ({ex.cases[i].label})"
                lines.append(f"ok   {label}" if verdicts[i] is None else f"FAIL {label}: {verdicts[i]}")
            tests.append({"name": name, "score": round(ex.points * ok / len(ex.cases), 2),
                          "max_score": round(ex.points * len(idx) / len(ex.cases), 2), "output": "\n".join(lines),
                          "visibility": vis})
        return tests


def expected_values(ex: Exercise) -> list[Any]:
    """Run the library reference on every case (in this, the grading, process)."""
    oracle = ex.expected_target()
    return [expected_value(oracle, case, ex.kind) for case in ex.cases]


class Runtime:
    """What the exercises of one grading run share: the student library (a copy without hidden checks) and
    the sandbox level with its read-only mounts."""

    def __init__(self) -> None:
        self.isolation = sandbox.isolation()
        self._tmp = tempfile.TemporaryDirectory(prefix="llmso-grade-lib-")
        self.lib = Path(self._tmp.name) / "llmso_lab"
        # Left out: the hidden checks, and the spec modules (their oracles and case helpers compute answers; the
        # student's process needs neither: the grader sends each case's inputs).
        shutil.copytree(PACKAGE_DIR, self.lib, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "hidden", "specs"))
        for folder, doc in (("hidden", "Hidden checks are not shipped."),
                            ("specs", "The exercise specs are not in the grader's sandbox (the grader sends the cases).")):
            (self.lib / "grading" / folder).mkdir()
            (self.lib / "grading" / folder / "__init__.py").write_text(f'"""{doc}"""\n')
        for path in [self.lib, *self.lib.rglob("*")]:   # readable by the student's uid, whatever the original's mode
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        self.binds: list[tuple[str, str, bool]] = []
        if self.isolation.isolated:
            self.binds = self._system_binds()
            if self.binds is None:
                self.isolation = sandbox.Isolation("uid", "the Python installation contains the instructor's checkout")
                self.binds = []
        # The student's interpreter: the grader's own, or (uid and reduced levels) one other users can run.
        self.python = sys.executable if self.isolation.isolated else os.environ.get("LLMSO_LAB_GRADE_PYTHON", sys.executable)
        if self.isolation.level == "uid" and not sandbox.runnable_by_others(self.python):
            self.close()
            raise ValueError(f"the sandbox uid cannot run {self.python} ({os.path.realpath(self.python)}: a directory on "
                             "the way is not searchable by other users); install Python where any user can run it, "
                             "or set LLMSO_LAB_GRADE_PYTHON to such an interpreter with this package's dependencies")
        # What a uid-level sandbox cannot hide: the unstubbed library (with hidden checks) and the solutions.
        self.exposed = sandbox.exposed_paths([str(PACKAGE_DIR / "grading" / "hidden"), str(PACKAGE_DIR),
                                              str(PACKAGE_DIR.parent / "solutions")]) if self.isolation.level == "uid" else []

    def describe(self) -> str:
        return self.isolation.describe(self.exposed)

    @staticmethod
    def _system_binds() -> list[tuple[str, str, bool]] | None:
        """The Python installation and its import paths, read-only; never the checkout holding the package."""
        checkout = PACKAGE_DIR.parent
        paths = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
        for prefix in list(paths):
            if checkout == prefix or checkout.is_relative_to(prefix):
                return None
        paths |= {Path(p).resolve() for p in sys.path if p and Path(p).is_dir()}
        keep = sorted(p for p in paths if not (checkout == p or checkout.is_relative_to(p) or p.is_relative_to(PACKAGE_DIR)))
        keep = [p for p in keep if not any(p != q and p.is_relative_to(q) for q in keep)]
        binds = [(str(p), str(p), False) for p in keep]
        if (checkout / "data").is_dir() and (checkout / "pyproject.toml").exists():
            binds.append((str(checkout / "data"), str(checkout / "data"), False))
        return binds

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_tree(path: Path) -> None:
    """rmtree that never raises (a job dir may hold read-only dirs or files the student made odd)."""
    def onerror(func, p, exc_info):
        try:
            os.chmod(p, 0o700)
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=onerror)
    shutil.rmtree(path, ignore_errors=True)


def _child_env(ex: Exercise, rt: Runtime, job_root: Path, fds: tuple[int, int]) -> dict[str, str]:
    isolated = rt.isolation.isolated   # isolated: paths inside the sandbox's root; otherwise host paths
    env = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "GLOO_SOCKET_IFNAME": "lo", "TRITON_INTERPRET": "0" if torch.cuda.is_available() else "1", **ex.env}
    # Not the exercise's to change: where the library comes from, and the grader's pipes.
    env.update({"PATH": f"{Path(rt.python).parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                "HOME": "/job" if isolated else str(job_root / "work"), "TMPDIR": "/tmp" if isolated else str(job_root / "work"),
                "PYTHONPATH": str(PACKAGE_DIR.parent) if isolated else str(job_root / "lib"),
                "PYTHONDONTWRITEBYTECODE": "1", "LLMSO_GRADE_FDS": f"{fds[0]},{fds[1]}"})
    return env


def _run_job(ex: Exercise, source: str, timeout_s: float, rt: Runtime) -> tuple[dict | None, dict[int, Any], str]:
    """Run the exercise's cell and cases in a sandboxed job: (header, {case index: outcome}, how it ended)."""
    with sandbox.Slot() if rt.isolation.supervised else _nothing() as slot:
        job_root = Path(tempfile.mkdtemp(prefix=f"llmso-grade-{ex.name}-"))
        fds: list[int] = []
        try:
            pkg = job_root / "lib" / "llmso_lab"
            shutil.copytree(rt.lib, pkg)
            runtime_tripwires = stub_package(pkg, ex.disabled, ex.key)
            work = job_root / "work"
            work.mkdir()
            if slot is not None:   # the library copy: this job's group only (the uid level reads it by its host path)
                sandbox.restrict_to_job(str(job_root), slot.uid)
            rlimits = {"AS": ex.memory_mb * 2**20, "CPU": int(2 * timeout_s + 10), "FSIZE": 64 * 2**20, "CORE": 0,
                       "NOFILE": 1024}
            job = {"exercise": ex.key, "graded_name": ex.graded_name, "launcher": ex.launcher, "harness": ex.harness,
                   "kind": ex.kind,
                   "source": source, "runtime_tripwires": runtime_tripwires,
                   "operator_tripwires": operator_tripwires(ex.disabled),
                   "rlimits": None if rt.isolation.supervised else rlimits}
            (work / "job.json").write_text(json.dumps(job))
            case_r, case_w = os.pipe()
            result_r, result_w = os.pipe()
            log_fd = os.open(job_root / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            fds += [case_r, case_w, result_r, result_w, log_fd]
            os.set_blocking(case_w, False)
            env = _child_env(ex, rt, job_root, (case_r, result_w))
            argv = [rt.python, "-s", "-B", "-m", "llmso_lab.grading.child"]
            if slot is not None:
                proc = sandbox.run_supervised(rt.isolation.level, argv, env, work_dir=str(work),
                                              root_dir=str(job_root / "root"),
                                              binds=[*rt.binds, (str(pkg), str(PACKAGE_DIR), False)], uid=slot.uid,
                                              rlimits=rlimits, memory_bytes=ex.memory_mb * 2**20,
                                              pass_fds=(case_r, result_w), log_fd=log_fd, timeout_s=timeout_s + 15)
            else:
                proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                        stderr=log_fd, pass_fds=(case_r, result_w), start_new_session=True)
            for fd in (case_r, result_w):   # the child holds these now; EOF on result_r means it is gone
                os.close(fd)
                fds.remove(fd)
            header, outcomes, how = _converse(ex, case_w, result_r, time.monotonic() + timeout_s, timeout_s)
            how = _finish(proc, rt, how)
            if os.environ.get("LLMSO_LAB_GRADE_LOG"):   # instructors debugging the grader: the child's output
                sys.stderr.write(f"--- {ex.key} ({how or 'ok'}):\n"
                                 f"{(job_root / 'log.txt').read_text(errors='replace')[-4000:]}\n")
            return header, outcomes, how
        finally:
            for fd in fds:
                os.close(fd)
            _remove_tree(job_root)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _converse(ex: Exercise, case_w: int, result_r: int, deadline: float, timeout_s: float):
    header, outcomes, how = None, {}, ""
    order = [i for i, c in enumerate(ex.cases) if not c.hidden] + [i for i, c in enumerate(ex.cases) if c.hidden]
    try:
        header = recv(result_r, deadline)
        if not isinstance(header, dict):
            raise ValueError("malformed start message")
        if header.get("problem") is None:
            session = Session(lambda m: send(case_w, m, deadline), lambda: recv(result_r, deadline))
            for i in order:
                c = ex.cases[i]
                if ex.harness:   # the harness runs here; the student's object answers its calls from the sandbox
                    outcomes[i] = _judge_case(ex, session, c)
                    continue
                send(case_w, {"args": list(c.args), "kwargs": dict(c.kwargs),
                              "calls": [[m, list(a), dict(k)] for m, a, k in c.calls] if c.calls is not None else None},
                     deadline)
                outcomes[i] = recv(result_r, deadline)
            send(case_w, {"done": True}, deadline)
    except TimeoutError:
        how = f"timed out after {timeout_s:g} s (an infinite loop, or far too slow?)"
    except (EOFError, BrokenPipeError):
        how = "died"
    except ValueError as exc:
        how = str(exc)
    return header, outcomes, how


def _judge_case(ex: Exercise, session: Session, case) -> dict:
    """One case of a mechanism exercise: its harness run in this process on the student's object (`judge.outcome`).
    A child that is gone, too slow or malformed stops the exercise."""
    try:
        return judge.outcome(ex, session, case)
    except ChannelClosed as closed:
        raise closed.why if isinstance(closed.why, (TimeoutError, EOFError, BrokenPipeError, ValueError)) \
            else ValueError(str(closed.why)) from None


def _finish(proc: subprocess.Popen, rt: Runtime, how: str) -> str:
    """Make sure the job is over (every process of it gone, when isolated); describe a death."""
    try:
        proc.wait(timeout=0 if how else 10)
    except subprocess.TimeoutExpired:
        if rt.isolation.supervised:
            proc.send_signal(signal.SIGTERM)   # the supervisor kills the job's processes, then waits for all
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    out, _ = proc.communicate()
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode   # killed by N: 128 + N
    if rt.isolation.supervised:
        try:
            code = json.loads(out.decode().strip().splitlines()[-1])["status"]
        except (ValueError, IndexError, KeyError, AttributeError):
            code = None
    elif how:
        try:   # a reduced sandbox: at least the process group goes
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if how == "died":
        if code is not None and code > 128:
            sig = code - 128
            name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
            how = f"the process was killed by {name}" + (" (out of memory?)" if sig == signal.SIGKILL else "")
        else:
            how = f"the process ended before finishing (exit code {code}; did the code call os._exit()?)"
    return how


def grade_exercise(ex: Exercise, source: str | None, timeout_s: float | None = None, expected: list | None = None,
                   runtime: Runtime | None = None) -> ExerciseResult:
    """Grade one exercise given its cell's source (None: no cell defines it)."""
    t0 = time.perf_counter()
    total = len(ex.cases)
    if source is None:
        return ExerciseResult(ex, 0.0, 0, total, [f"no code cell defines `{ex.graded_name}` (was the exercise cell "
                                                  f"deleted or the function renamed?)"], time.perf_counter() - t0)
    expected = expected if expected is not None else expected_values(ex)
    own = runtime is None
    rt = runtime or Runtime()
    try:
        header, outcomes, how = _run_job(ex, source, timeout_s or ex.timeout_s, rt)
    finally:
        if own:
            rt.close()
    lines, passed, reasons, verdicts = [], 0, [], []
    if header and header.get("cell_error"):
        lines.append(f"the exercise cell raised while running: {str(header['cell_error'])[:2000]}")
    if header and header.get("problem"):
        lines.append(str(header["problem"])[:500])
    for i, case in enumerate(ex.cases):
        label = f"hidden check {i + 1}" if case.hidden else f"check {i + 1} ({case.label})"
        if i not in outcomes:
            reason = f"not run ({how or 'the exercise stopped early'})"
        else:
            reason = verdict(ex, case, outcomes[i], expected[i])
        verdicts.append(reason)
        if reason is None:
            passed += 1
            lines.append(f"ok   {label}")
        else:
            reasons.append(reason)
            lines.append(f"FAIL {label}: {reason}")
    if how and len(outcomes) == total:
        lines.append(f"note: {how}")
    if ex.launcher and passed < total:
        lines.append(f"note: graded is your kernel `{ex.graded_name}`, launched by {ex.launcher.replace(':', '.')}; "
                     "other functions in the cell are not called, so the work must happen inside the kernel")
    if ex.harness and passed < total:
        lines.append(f"note: graded is your `{ex.graded_name}`, run for real by {ex.harness.replace(':', '.')} "
                     "(see its docstring for what it is given and what it must return)")
    if passed == 0 and total > 1 and len(set(reasons)) == 1:
        # the same reason for every check (e.g. "not implemented yet"): say it once
        lines = [ln for ln in lines if not ln.startswith("FAIL ")] + [f"FAIL all {total} checks: {reasons[0]}"]
    score = round(ex.points * passed / total, 2) if total else 0.0
    return ExerciseResult(ex, score, passed, total, lines, time.perf_counter() - t0, near_copy(ex, source), verdicts)


def lab_from_name(path: str | Path) -> str | None:
    m = re.match(r"(\d{2})_", Path(path).name)
    return m.group(1) if m else None


def _metadata_lab(nb) -> str | None:
    meta = nb.metadata.get("llmso", {}) if isinstance(nb.metadata.get("llmso"), dict) else {}
    value = meta.get("lab")
    try:
        return None if value is None else f"{int(value):02d}"
    except (TypeError, ValueError):
        return str(value)[:20]


def grade_notebook(path: str | Path, lab: str | None = None, only: list[str] | None = None,
                   timeout_s: float | None = None, exercise_list: list[Exercise] | None = None,
                   workers: int | None = None, details: list | None = None,
                   hidden_visibility: str | None = None) -> dict[str, Any]:
    """Grade every exercise of `lab` (default: the NN_ prefix of the file name; the notebook's own metadata is
    only compared, never trusted) or of `exercise_list`; return a Gradescope results dict."""
    t0 = time.perf_counter()
    nb = read_notebook(path)
    notes = []
    if exercise_list is None:
        lab = lab if lab is not None else lab_from_name(path)
        if lab is None:
            raise ValueError(f"cannot tell which lab {Path(path).name} is: pass --lab NN (or name it NN_topic.ipynb)")
        exs = exercises(lab)
        lab = exs[0].lab
        meta = _metadata_lab(nb)
        if meta is not None and meta != lab:
            notes.append(f"the notebook's metadata says lab {meta}; it was graded as lab {lab}, as the instructor chose")
    else:
        exs = exercise_list
        lab = exs[0].lab if exs else lab
    if only:
        unknown = sorted(set(only) - {e.name for e in exs})
        if unknown:
            raise ValueError(f"lab {lab} has no exercise {', '.join(unknown)}; it has {', '.join(e.name for e in exs)}")
        exs = [e for e in exs if e.name in only]
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    sources = {e.name: exercise_cell_source(nb, e.graded_name) for e in exs}
    expected = {e.name: expected_values(e) if sources[e.name] is not None else None for e in exs}
    with Runtime() as rt, ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda e: grade_exercise(e, sources[e.name], timeout_s, expected[e.name], rt), exs))
        sandbox_line = rt.describe()
    if details is not None:   # the ExerciseResults themselves (tests compare per-case verdicts)
        details.extend(results)
    review = [r.note for r in results if r.note]
    tests = [t for r in results for t in r.as_tests(hidden_visibility)]
    tests += [{"name": f"{r.exercise.key} (for the instructor)", "score": 0.0, "max_score": 0.0, "output": r.note,
               "visibility": "hidden"} for r in results if r.note]
    return {
        "score": round(sum(r.score for r in results), 2),
        "max_score": float(sum(e.points for e in exs)),
        "execution_time": round(time.perf_counter() - t0, 1),
        "output": " ".join([f"Graded {Path(path).name} as lab {lab}: {len(exs)} exercises.", *notes]),
        "visibility": "visible",
        "tests": tests,
        "extra_data": {"lab": lab, "sandbox": sandbox_line, "notes": notes, "review": review},
    }


def format_table(res: dict[str, Any]) -> str:
    rows = [f"{'exercise':<40} {'score':>7} / {'max':<5}", "-" * 56]
    for t in res["tests"]:
        if t.get("visibility") == "hidden":
            continue
        rows.append(f"{t['name']:<40} {t['score']:>7.2f} / {t['max_score']:<5g}")
        for ln in t["output"].splitlines():
            if not ln.startswith("ok"):
                rows.append(f"    {ln[:200]}")
    rows += ["-" * 56, f"{'total':<40} {res['score']:>7.2f} / {res['max_score']:<5g}   ({res['execution_time']} s)"]
    extra = res.get("extra_data", {})
    for note in extra.get("notes", []):
        rows.append(f"note: {note}")
    for note in extra.get("review", []):
        rows.append(f"for the instructor: {note}")
    if extra.get("sandbox"):
        rows.append(extra["sandbox"])
    return "\n".join(rows)
