"""Attacks a hostile submission can try on the grader, each of which must fail.

Every test grades a solution notebook with one exercise cell replaced by the attack: the attacked exercise
loses its points (or, where the attack is on the grader rather than the score, the grader survives it), the
other exercises keep theirs, and `grade_notebook` finishes with an honest result.
"""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from llmso_lab.grading import check, get_exercise, sandbox
from llmso_lab.grading.compare import close, exact, guard, same_distribution
from llmso_lab.grading.grader import grade_notebook
from llmso_lab.grading.registry import Case, Exercise, exercises, register
from llmso_lab.grading.tripwire import PACKAGE_DIR, tripwire, why_not_disableable
from lab_variants import ROOT, notebook_with

PTS = {e.name: e.points for e in exercises("00")}   # lab 00 points, as the registry sets them

FIXTURES = Path(__file__).parent / "grading_fixtures"
isolated = pytest.mark.skipif(not sandbox.isolation().isolated,
                              reason=f"needs the isolated sandbox ({sandbox.isolation().reason})")


@pytest.fixture(params=["isolated", "uid"])
def level(request, monkeypatch):
    """Run a test under each sandbox level that contains processes (root only): namespaces, or a plain uid."""
    if not sandbox.isolation().isolated:
        pytest.skip(f"needs root and namespaces ({sandbox.isolation().reason})")
    if request.param == "uid":
        # The uid level runs the student's Python as another user: it needs an interpreter any user can run
        # (this machine's own Python lives under /root): a venv of the system Python that sees our packages.
        venv = Path(tempfile.mkdtemp(prefix="llmso-uidpy-"))   # pytest's own tmp dirs are root-only
        request.addfinalizer(lambda: shutil.rmtree(venv, ignore_errors=True))
        venv.chmod(0o755)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / "grader-packages.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
        monkeypatch.setenv("LLMSO_LAB_SANDBOX", "uid")
        monkeypatch.setenv("LLMSO_LAB_GRADE_PYTHON", str(venv / "bin" / "python"))
        monkeypatch.setattr(sandbox, "_ISOLATION", None)
    return request.param


def graded(tmp_path, lab, cells, only=None, **kw):
    """Grade the lab's solution with `cells` ({"labNN/name": source}) swapped in; {name: test}, results."""
    path = notebook_with(lab, {k: textwrap.dedent(v) for k, v in cells.items()}, tmp_path / f"{lab}_attack.ipynb")
    res = grade_notebook(path, only=only, **kw)
    return {t["name"].split("/")[1]: t for t in res["tests"] if t["visibility"] != "hidden"}, res


def sandbox_processes(marker: str) -> list[str]:
    """Processes still running under a sandbox uid whose command line carries this test's `marker`.

    Only the test's own processes: under pytest-xdist the other worker may be grading at the same moment, and its
    jobs run under sandbox uids too (the slot locks give them other uids, but a uid says nothing of which test)."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    lo, hi = sandbox.UID_BASE, sandbox.UID_BASE + sandbox.NUM_SLOTS
    return [ln for ln in out.splitlines() if ln.split() and lo <= int(ln.split()[0]) < hi and marker in ln]


# ---- 1. reading the answers, writing the grader ----------------------------------------------------
@isolated
def test_submission_cannot_read_solutions_or_hidden_checks(tmp_path):
    tests, res = graded(tmp_path, "00", {"lab00/roofline_time": f"""\
        import glob, importlib, json, os
        import llmso_lab
        def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
            root = os.path.dirname(os.path.dirname(llmso_lab.__file__))
            seen = [p for pattern in (f"{{root}}/solutions/*.ipynb", f"{{root}}/labs/*.ipynb", "{tmp_path}/*.ipynb",
                                      "/tmp/**/*.ipynb") for p in glob.glob(pattern, recursive=True)]
            for path in seen:
                for cell in json.load(open(path))["cells"]:
                    src = "".join(cell["source"])
                    if "def roofline_time" in src and "BEGIN SOLUTION" in src:
                        ns = {{}}
                        exec(src, ns)
                        return ns["roofline_time"](flops, bytes_moved, peak_flops, bandwidth)
            try:
                importlib.import_module("llmso_lab.grading.hidden.lab00")
                hidden = "HIDDEN CHECKS IMPORTED"
            except ImportError:
                hidden = "no hidden checks"
            raise FileNotFoundError(f"nothing to copy ({{hidden}}; {{len(seen)}} notebooks)")
        """}, only=["roofline_time", "kv_bytes_per_token"])
    assert tests["roofline_time"]["score"] == 0, tests["roofline_time"]
    assert "nothing to copy (no hidden checks; 0 notebooks)" in tests["roofline_time"]["output"]
    assert tests["kv_bytes_per_token"]["score"] == PTS["kv_bytes_per_token"]


@isolated
def test_submission_cannot_change_the_grader(tmp_path):
    planted = PACKAGE_DIR / "grading" / "planted_by_submission.py"
    before = (PACKAGE_DIR / "grading" / "compare.py").read_bytes()
    try:
        tests, _ = graded(tmp_path, "00", {"lab00/roofline_time": """\
            import os, llmso_lab
            def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
                grading = os.path.join(os.path.dirname(llmso_lab.__file__), "grading")
                for name, text in (("planted_by_submission.py", "x = 1"), ("compare.py", "close = None")):
                    try:
                        with open(os.path.join(grading, name), "a") as f:
                            f.write(text)
                    except OSError:
                        pass
                return max(flops / peak_flops, bytes_moved / bandwidth)
            """}, only=["roofline_time"])
        assert not planted.exists(), "the submission wrote into the instructor's package"
        assert (PACKAGE_DIR / "grading" / "compare.py").read_bytes() == before
        assert tests["roofline_time"]["score"] == PTS["roofline_time"]   # a correct answer is still a correct answer
    finally:
        planted.unlink(missing_ok=True)


# ---- 2. choosing its own lab -------------------------------------------------------------------------
def test_the_lab_comes_from_the_instructor_not_the_notebook(tmp_path):
    import nbformat

    nb = nbformat.read(str(ROOT / "solutions" / "03_flash_attention.ipynb"), as_version=4)
    nb.metadata.setdefault("llmso", {})["lab"] = "00"
    for name in ("03_relabelled.ipynb", "00_renamed.ipynb", "submission.ipynb"):
        nbformat.write(nb, str(tmp_path / name))
    res = grade_notebook(tmp_path / "03_relabelled.ipynb", only=["build_cu_seqlens"])
    assert [t["name"] for t in res["tests"]] == ["lab03/build_cu_seqlens"] and res["score"] == 10
    assert res["extra_data"]["lab"] == "03" and "metadata says lab 00" in res["output"]
    res = grade_notebook(tmp_path / "00_renamed.ipynb", lab="03", only=["build_cu_seqlens"])
    assert res["extra_data"]["lab"] == "03" and res["score"] == 10
    with pytest.raises(ValueError, match="--lab NN"):
        grade_notebook(tmp_path / "submission.ipynb")


# ---- 3. escaping, forking, killing -----------------------------------------------------------------
def test_detached_processes_do_not_outlive_the_exercise(tmp_path, level):
    marker = f"llmso-escapee-{tmp_path.name}"
    tests, res = graded(tmp_path, "00", {"lab00/roofline_time": f"""\
        import os, subprocess, sys, time
        def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {marker!r}],
                             start_new_session=True)
            if os.fork() == 0:            # a double-forked daemon
                os.setsid()
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
                os._exit(0)
            return max(flops / peak_flops, bytes_moved / bandwidth)
        """}, only=["roofline_time"])
    assert tests["roofline_time"]["score"] == PTS["roofline_time"], tests["roofline_time"]["output"]
    assert level in res["extra_data"]["sandbox"]
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip()
    assert left == "", f"processes left behind: {left}"
    assert sandbox_processes(marker) == []


def test_fork_bomb_is_bounded_and_cleaned_up(tmp_path, level):
    marker = f"llmso-forkbomb-{tmp_path.name}"      # each fork becomes `sleep 120` named by this test's marker
    tests, _ = graded(tmp_path, "00", {"lab00/roofline_time": f"""\
        import os
        def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
            n = 0
            for _ in range(3000):
                try:
                    pid = os.fork()
                except OSError:
                    break
                if pid == 0:
                    try:
                        os.execv("/bin/sleep", [{marker!r}, "120"])
                    finally:
                        os._exit(0)
                n += 1
            return float(n)
        """}, only=["roofline_time", "kv_bytes_per_token"])
    forks = int(float(re.search(r"got ([0-9.e+]+)", tests["roofline_time"]["output"]).group(1)))
    assert forks < sandbox.PIDS_MAX, f"the submission started {forks} processes"
    assert tests["roofline_time"]["score"] == 0 and tests["kv_bytes_per_token"]["score"] == PTS["kv_bytes_per_token"]
    assert sandbox_processes(marker) == []
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip()
    assert left == "", f"processes left behind: {left}"


def test_submission_cannot_kill_the_grader(tmp_path, level):
    path = notebook_with("00", {"lab00/roofline_time": textwrap.dedent("""\
        import os, signal
        def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
            for pid in (os.getppid(), 1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            return max(flops / peak_flops, bytes_moved / bandwidth)
        """)}, tmp_path / "00_killer.ipynb")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(path), "--json", str(out),
                           "--exercise", "roofline_time"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert json.loads(out.read_text())["score"] == PTS["roofline_time"]


def test_results_file_is_written_after_the_submission_is_gone(tmp_path):
    """A forged results.json, written during grading and again later by a detached process, never survives."""
    out = tmp_path / "results.json"
    path = notebook_with("00", {"lab00/roofline_time": textwrap.dedent(f"""\
        import json, subprocess, sys
        FAKE = json.dumps({{"score": 100.0, "tests": []}})
        def roofline_time(*a, **k):
            try:
                open({str(out)!r}, "w").write(FAKE)
                subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(3); open(sys.argv[1], 'w').write(sys.argv[2])",
                                  {str(out)!r}, FAKE], start_new_session=True)
            except OSError:
                pass
            return 0.0
        """)}, tmp_path / "00_forger.ipynb")
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(path), "--json", str(out),
                           "--exercise", "roofline_time"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if sandbox.isolation().isolated:
        time.sleep(4)   # the detached writer would have written by now
    assert json.loads(out.read_text())["tests"][0]["name"] == "lab00/roofline_time"


# ---- 4. leaking hidden inputs ------------------------------------------------------------------------
def test_hidden_inputs_do_not_reach_the_student(tmp_path):
    tests, _ = graded(tmp_path, "00", {"lab00/roofline_time": """\
        import os
        def roofline_time(*args, **kwargs):
            raise ValueError("LEAK" + repr(args) + repr(sorted(os.listdir("."))))
        """}, only=["roofline_time"])
    lines = tests["roofline_time"]["output"].splitlines()
    public = [ln for ln in lines if ln.startswith("FAIL check")]
    hidden = [ln for ln in lines if ln.startswith("FAIL hidden")]
    assert len(public) == 2 and all("LEAK" in ln for ln in public)   # public inputs are the student's anyway
    assert len(hidden) == 3 and not any("LEAK" in ln for ln in hidden), hidden
    assert not any("cases" in ln for ln in public), public   # no file listing the cases in the job dir


# ---- 5. exhausting the grader --------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_huge_result_is_refused_without_converting_it(tmp_path):
    t0 = time.perf_counter()
    tests, _ = graded(tmp_path, "01", {"lab01/static_slot_grid": """\
        import torch
        def static_slot_grid(output_lens, num_slots):
            return torch.zeros(100_000_000)  # 400 MB
        """}, only=["static_slot_grid", "continuous_slot_grid"])
    assert tests["static_slot_grid"]["score"] == 0 and tests["continuous_slot_grid"]["score"] == 35
    assert "too large" in tests["static_slot_grid"]["output"], tests["static_slot_grid"]["output"]
    assert time.perf_counter() - t0 < 120


def test_guard_refuses_stride_zero_views_before_any_conversion():
    t0 = time.perf_counter()
    huge = torch.zeros(1).expand(10**10)   # 40 GB if it were materialised
    assert "far larger than expected" in guard(huge, [[1, 2, 3]])
    assert "far larger than expected" in guard([huge], torch.zeros(3))
    assert guard(torch.zeros(3, 4), torch.zeros(3, 4)) is None
    assert time.perf_counter() - t0 < 1.0


# ---- 6. mutating the inputs --------------------------------------------------------------------------
def test_mutating_the_inputs_does_not_change_later_checks():
    ex = get_exercise("merge_attention_states")
    before = copy.deepcopy([c.args for c in ex.cases])

    def cheat(o1, lse1, o2, lse2):   # empties the second part in place, then "merges"
        o2.zero_()
        lse2.fill_(float("-inf"))
        return o1.clone(), lse1.clone()

    first, second = check("merge_attention_states", fn=cheat), check("merge_attention_states", fn=cheat)
    assert first.passed == second.passed < first.total
    for args, orig in zip([c.args for c in ex.cases], before):
        assert all(torch.equal(a, b) for a, b in zip(args, orig))


# ---- 7. skipping the Triton --------------------------------------------------------------------------
def test_a_torch_only_flash_attention_scores_nothing(tmp_path):
    tests, _ = graded(tmp_path, "03", {"lab03/flash_attention": """\
        import math
        import torch, triton
        import triton.language as tl
        @triton.jit
        def _attn_fwd_tile_kernel(Q, K, V, O, LSE, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                  stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, seqlen_q, seqlen_k,
                                  num_heads, group_size, sm_scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
            pass
        def flash_attention(q, k, v, causal=False):
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) / math.sqrt(q.shape[-1])
            if causal:
                nq, nk = s.shape[-2:]
                s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), float("-inf"))
            lse = torch.logsumexp(s, -1)
            return ((s - lse.unsqueeze(-1)).exp().unsqueeze(-1) * v.unsqueeze(-3)).sum(-2), lse
        """}, only=["flash_attention", "build_cu_seqlens"])
    assert tests["flash_attention"]["score"] == 0 and tests["build_cu_seqlens"]["score"] == 10
    assert "graded is your kernel `_attn_fwd_tile_kernel`" in tests["flash_attention"]["output"]


# ---- 8. dodging the tripwire -------------------------------------------------------------------------
def test_reloading_re_executing_or_respawning_the_reference_scores_nothing(tmp_path):
    tests, _ = graded(tmp_path, "00", {"lab00/roofline_time": """\
        import importlib, inspect, subprocess, sys
        import llmso_lab.hardware as hw
        def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
            args = (flops, bytes_moved, peak_flops, bandwidth)
            tries = [lambda: importlib.reload(hw).roofline_time(*args)]
            def from_source():
                ns = {}
                exec(inspect.getsource(hw), ns)
                return ns["roofline_time"](*args)
            def fresh_interpreter():
                out = subprocess.run([sys.executable, "-c", "import sys; from llmso_lab.hardware import roofline_time as r;"
                                      f"print(r(*{args!r}))"], capture_output=True, text=True)
                return float(out.stdout) if out.returncode == 0 else None
            errors = []
            for attempt in (*tries, from_source, fresh_interpreter):
                try:
                    value = attempt()
                    if value is not None:
                        return value
                except Exception as exc:
                    errors.append(str(exc)[:40])
            raise RuntimeError(" | ".join(errors))
        """, "lab00/kv_bytes_per_token": """\
        from llmso_lab.models.shapes import ModelShape
        def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_elem=2):
            shape = ModelShape("any", num_layers, num_kv_heads * head_dim, num_kv_heads, num_kv_heads, head_dim, 1, 1)
            return shape.kv_bytes_per_token(bytes_per_elem)   # the same formula, elsewhere in the library
        """}, only=["roofline_time", "kv_bytes_per_token", "compute_bound_tokens"])
    assert tests["roofline_time"]["score"] == 0 and "TRIPWIRE" in tests["roofline_time"]["output"]
    assert tests["kv_bytes_per_token"]["score"] == 0 and "TRIPWIRE" in tests["kv_bytes_per_token"]["output"]
    assert tests["compute_bound_tokens"]["score"] == PTS["compute_bound_tokens"]


def test_closures_and_decorated_references_are_tripwired(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import closures_ref

    assert why_not_disableable("closures_ref:scaled") is None
    with tripwire(["closures_ref:scaled", "closures_ref:cached_square"], "demo"):
        alias = closures_ref.scaled
        with pytest.raises(RuntimeError, match="TRIPWIRE"):
            alias(3)
        with pytest.raises(RuntimeError, match="TRIPWIRE"):
            closures_ref.cached_square(4)
    assert closures_ref.scaled(3) == 6 and closures_ref.cached_square(4) == 16


def test_register_refuses_what_it_cannot_disable_and_duplicate_names():
    def ex(name, ref):
        return Exercise(name, "99", 10, ref, [Case("c", (1,))])
    with pytest.raises(ValueError, match="cannot disable"):
        register(ex("not_there", "llmso_lab.hardware:no_such_function"))
    with pytest.raises(ValueError, match="is taken by lab 00"):
        get_exercise("roofline_time")   # make sure lab 00 is loaded
        register(ex("roofline_time", "llmso_lab.hardware:roofline_time"))
    assert get_exercise("lab00/roofline_time") is get_exercise("roofline_time")


@isolated
def test_a_renamed_copy_of_the_library_is_reported_to_the_instructor_only(tmp_path):
    import inspect

    from llmso_lab.sim import step_logic

    src = ("from llmso_lab.batching import prefill_chunk\n\n\n" + inspect.getsource(step_logic._blocks_for) + "\n\n"
           + inspect.getsource(step_logic.retire_and_admit))   # the module's import comes along with the copy
    for old, new in (("survivors", "alive"), ("budget", "tokens_left"), ("free", "avail"),
                     ("counted", "snapshot"), ("req", "item"), ("need", "nb")):
        src = re.sub(rf"\b{old}\b", new, src)
    tests, res = graded(tmp_path, "01", {"lab01/retire_and_admit": src}, only=["retire_and_admit"])
    assert tests["retire_and_admit"]["score"] == 40                       # not penalised
    assert "copied" not in tests["retire_and_admit"]["output"]            # the student is not told
    notes = [t for t in res["tests"] if t["visibility"] == "hidden"]
    assert len(notes) == 1 and "retire_and_admit" in notes[0]["output"] and res["extra_data"]["review"]


# ---- both sandbox levels -----------------------------------------------------------------------------
def test_reduced_sandbox_grades_the_same_and_says_it_is_reduced(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_ISOLATION", sandbox.Isolation("reduced", "a test"))
    tests, res = graded(tmp_path, "00", {}, only=["roofline_time", "kv_bytes_per_token"])
    assert res["score"] == PTS["roofline_time"] + PTS["kv_bytes_per_token"]
    assert "REDUCED (a test)" in res["extra_data"]["sandbox"]


def test_torch_pin_excludes_the_weights_only_loader_cve():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=2\.(6|[7-9]|\d\d)', text), "weights_only loading needs torch >= 2.6 (CVE-2025-32434)"


# ---- messages ----------------------------------------------------------------------------------------
def test_messages_show_the_difference():
    msg = close(atol=0, rtol=1e-9)(torch.tensor(4096.0 / 3), 4096.0 / 3)
    assert "float32 vs float" in msg and re.search(r"got 1365\.333\d+, expected 1365\.333\d+", msg), msg
    msg = exact()([1, 2, 3], [1, 2])
    assert "expected [1, 2]" in msg and "got [1, 2, 3]" in msg


def test_distribution_comparator():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    cmp = same_distribution()
    assert cmp(torch.multinomial(p, 4000, replacement=True, generator=g), p) is None
    assert "do not follow" in cmp(torch.multinomial(torch.tensor([0.4, 0.4, 0.2, 0.0]), 4000, replacement=True,
                                                    generator=g), p)
    assert "probability 0" in cmp(torch.tensor([0, 1, 3]), p)
    assert "integer" in cmp(torch.tensor([0.5]), p)
