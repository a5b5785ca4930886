"""`make test` prints each notebook's run time (nbval over solutions/ and labs/), so a lab that outgrows its class
time shows in every CI log: under LLMSO_LAB_QUICK=1 a lab must run in 3 minutes (issue 50)."""
import collections
import os

QUICK_LIMIT_S = 180
_times: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _times[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    quick = os.environ.get("LLMSO_LAB_QUICK") == "1"
    terminalreporter.section("notebook run times" + (" (quick mode)" if quick else ""))
    for path, seconds in sorted(_times.items()):
        over = quick and seconds > QUICK_LIMIT_S
        terminalreporter.write_line(f"{seconds:7.0f} s  {path}" + (f"  OVER the {QUICK_LIMIT_S} s quick-mode budget" if over else ""))
