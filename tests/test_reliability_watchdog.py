"""`flower simulate`'s watchdog (`fedlora.federation.flower.processes.tree_watchdog`): when
the command is SIGKILLed, what it started (Ray's processes, detached into their own
sessions) is stopped by PID; on a clean exit the watchdog goes with it and stops nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")

# a parent that runs the watchdog, starts a detached child (like Ray's raylet) and waits
PARENT = """
import subprocess, sys, time
from fedlora.federation.flower.processes import watching_tree
with watching_tree() as dog:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             start_new_session=True)
    print(dog.pid, child.pid, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
    time.sleep(0.6)  # the watchdog has seen the child
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _start(mode: str) -> tuple[subprocess.Popen, int, int]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True, env=env
    )
    dog, child = (int(x) for x in proc.stdout.readline().split())
    return proc, dog, child


def test_sigkill_of_the_command_stops_what_it_started():
    proc, dog, child = _start("wait")
    try:
        time.sleep(1.0)  # the watchdog polls every 0.2 s
        assert _alive(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert _gone_within([child, dog], 10.0)
    finally:
        for pid in (child, dog):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_clean_exit_stops_the_watchdog_only():
    proc, dog, child = _start("exit")
    try:
        assert proc.wait(timeout=30) == 0
        assert _gone_within([dog], 10.0)
        assert _alive(child)  # a clean exit leaves the clean-up to its owner
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
