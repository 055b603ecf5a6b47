"""Processes fedlora starts, stopped by PID, never by name: a process's descendants (from
/proc, since Flower and Ray detach some of their children into their own sessions), SIGTERM
then SIGKILL, and two watchdogs that outlive their parent by a moment:

- `watchdog` (`flower run-local`): stops the process groups listed in a file, and what they
  started, once its parent is gone (SIGKILL of the parent included);
- `tree_watchdog` (`flower simulate`): remembers the parent's process tree while the parent
  lives (Ray's GCS, raylet, workers and agents) and stops what is left of it once the parent
  is gone; each remembered PID is signalled only while its start time is the remembered one,
  so a PID the kernel gave to another process since is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """PIDs of every live process below `pid` (from /proc; Flower detaches some children
    into their own sessions, so a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process we started and what it started: SIGTERM, then SIGKILL, by PID."""
    if proc.poll() is not None:
        return
    below = descendants(proc.pid)
    signal_pids([proc.pid], signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        signal_pids([proc.pid], signal.SIGKILL)
        proc.wait(timeout=grace_s)
    signal_pids([p for p in below if Path(f"/proc/{p}").exists()], signal.SIGKILL)


def _tree(pids: Sequence[int]) -> list[int]:
    return [*pids, *(d for pid in pids for d in descendants(pid))]


def watchdog(argv: Sequence[str] | None = None, poll_s: float = 0.2) -> None:
    """`python -c '...watchdog()' PARENT_PID PIDS_FILE`: wait until PARENT_PID is gone (this
    process is re-parented), then SIGTERM each process group listed in PIDS_FILE and every
    descendant, and SIGKILL what is left 3 s later. Exits at once when SIGTERMed itself."""
    parent, pids_file = (argv or sys.argv[1:])[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent cleans up itself
    while os.getppid() == int(parent):
        time.sleep(poll_s)
    pids = [int(x) for x in Path(pids_file).read_text(encoding="utf-8").split()]
    tree = _tree(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)
    signal_pids(tree, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in tree):
        time.sleep(0.1)
    tree = [*tree, *_tree(pids)]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    signal_pids(tree, signal.SIGKILL)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (the start time in clock ticks); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def tree_watchdog(argv: Sequence[str] | None = None, poll_s: float = 0.2) -> None:
    """`python -c '...tree_watchdog()' PARENT_PID`: while PARENT_PID lives, remember its
    descendants (with their start times); once it is gone, SIGTERM what is left of them,
    and SIGKILL it 3 s later. Exits at once when SIGTERMed itself (its parent's clean exit)."""
    parent = int((argv or sys.argv[1:])[0])
    me = os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent cleans up itself
    seen: dict[int, str] = {}
    while os.getppid() == parent:
        for pid in descendants(parent):
            if pid != me and pid not in seen and (start := _start_time(pid)) is not None:
                seen[pid] = start
        time.sleep(poll_s)

    def alive() -> list[int]:
        return [pid for pid, start in seen.items() if _start_time(pid) == start]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        signal_pids([p for q in alive() for p in (q, *descendants(q))], sig)
        deadline = time.monotonic() + 3.0
        while sig == signal.SIGTERM and alive() and time.monotonic() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def watching_tree(env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run the body with a `tree_watchdog` of this process; stopped when the body ends."""
    code = "from fedlora.federation.flower.processes import tree_watchdog; tree_watchdog()"
    dog = subprocess.Popen(
        [sys.executable, "-c", code, str(os.getpid())],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        yield dog
    finally:
        stop_process(dog, grace_s=5.0)
