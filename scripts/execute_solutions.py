"""Re-execute solution notebooks in place, one at a time, top to bottom, in the student's default mode.

    .venv/bin/python scripts/execute_solutions.py [solutions/03_flash_attention.ipynb ...]   (default: all)

What a student sees in `solutions/` is then one run per notebook on one machine: every code cell carries its
execution metadata, the counts run 1, 2, 3, ... and `tests/test_lab_notebooks.py` holds each lab to 8 minutes.
Run it on a quiet machine (no other notebook, test run, benchmark or build): before each notebook the load guard
(`hardware.load_guard`) measures the machine, and the script stops rather than save timings from a busy one
(`--force` saves anyway). Afterwards regenerate the student versions: `llmso-lab release --labs`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--force", action="store_true", help="save even when the machine is busy")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = ap.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "solutions").glob("*.ipynb"))
    env = {k: v for k, v in os.environ.items() if k not in ("LLMSO_LAB_QUICK", "MPLBACKEND")}
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    os.environ.update({k: env[k] for k in ("TRITON_INTERPRET", "PYTHONPATH")})
    from llmso_lab import hardware as hw

    hw.set_lab_threads()
    failed: list[str] = []
    for path in paths:
        guard = hw.load_guard()
        if guard.busy and not args.force:
            print(f"stopped before {path.name}: the machine is busy (--force saves anyway)", file=sys.stderr)
            return 1
        nb = nbformat.read(str(path), as_version=4)
        t0 = time.perf_counter()
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", record_timing=True,
                                resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute(env=env)
        except Exception as exc:   # noqa: BLE001 - report it, leave the notebook as it was, go on with the next
            failed.append(path.name)
            print(f"{path.name}: FAILED after {time.perf_counter() - t0:.0f} s, not saved: {exc}", flush=True)
            continue
        nbformat.write(nb, str(path))
        print(f"{path.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
