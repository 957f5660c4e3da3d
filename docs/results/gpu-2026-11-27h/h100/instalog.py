"""pytest plugin for the GPU suite runs: each test's outcome and time, and a failure's traceback, written as it
happens (a group killed by its timeout still leaves what ran)."""
import os
import time

_f = None


def pytest_configure(config):
    global _f
    _f = open(os.environ.get("INSTALOG", "/tmp/instalog.txt"), "a", buffering=1)


def pytest_runtest_logstart(nodeid, location):
    _f.write(f"start {time.strftime('%T')} {nodeid}\n")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _f.write(f"{report.outcome} {report.when} {report.duration:.1f}s {report.nodeid}\n")
        if report.failed:
            _f.write(str(report.longrepr)[-6000:] + "\n----\n")
