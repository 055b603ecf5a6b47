"""Issue 24: `fedlora flower run-local` owns its process tree and checks its timeouts.

The slow tests SIGKILL and SIGTERM run-local mid-training (tiny model, two clients, started
with the docs' override lora.layers="all"), or let its --timeout-s expire, and check, by PID,
that no process of its tree (workers, SuperLink, SuperNodes, the ServerApp) is alive 10 s
later and that the run directory's lock is free."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.federation.flower.processes import descendants
from flower_cases import DATA, REPO, needs_data, write_config


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie runs nothing


def _start_run_local(tmp_path: Path, *args: str, stderr=subprocess.DEVNULL):  # noqa: ANN001, ANN202
    """`fedlora flower run-local` on a run far longer than the test (its own session), and
    its run directory."""
    cfg = write_config(tmp_path, rounds=200, q="[1.0, 1.0]")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "FEDLORA_DATA": DATA}
    cmd = [sys.executable, "-m", "fedlora.cli", "flower", "run-local", "--config", str(cfg)]
    cmd += ["--out", str(out), *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
    )
    return proc, out


def _assert_gone_and_unlocked(tree: set[int] | list[int], out: Path) -> None:
    """Within 10 s no process of `tree` runs, and the run directory's lock is free."""
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in tree if _alive(p)] == []
    with open(out / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def _kill_what_is_left(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--timeout-s", "nan"),
        ("--timeout-s", "inf"),
        ("--timeout-s", "0"),
        ("--round-timeout-s", "-5"),
        ("--round-timeout-s", "nan"),
    ],
)
def test_timeouts_must_be_finite_and_positive(option, value, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["flower", "run-local", "--out", str(out), option, value, "model.name=tiny-llama"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and "usage:" not in err
    assert f"{option} = {float(value)!r} is invalid: a finite number of seconds > 0" in err
    assert not out.exists()


def test_missing_app_dir_is_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["flower", "run-local", "--out", str(out), "--app-dir", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert rc == 2 and "--app-dir" in err and "pyproject.toml" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize(
    "value",
    [
        "'lora.layers=\"all\"' 'method.q=[0.5, 0.5]'",  # the docs' own override, shell-quoted
        'a\\b"c\nd\te',
        "é ü",
        "",
    ],
)
def test_run_config_strings_reach_the_server_app_unchanged(value) -> None:
    from flwr.common.config import parse_config_args

    from fedlora.federation.flower.deploy import _toml_scalar

    parsed = parse_config_args([f"fedlora-overrides={_toml_scalar(value)} round-timeout-s=5.0"])
    assert parsed == {"fedlora-overrides": value, "round-timeout-s": 5.0}


@pytest.mark.slow
@needs_data
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_kill_of_run_local_leaves_nothing_running(sig, tmp_path: Path) -> None:
    # Prepare: a run long enough to be mid-training when killed; the override with '"' (the
    # docs' lora.layers="all", the config's own value) has to reach the ServerApp intact
    proc, out = _start_run_local(tmp_path, "--timeout-s", "600", 'lora.layers="all"')
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists():  # the ServerApp is training
            assert proc.poll() is None, "run-local exited early"
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        tree = descendants(proc.pid)
        assert len(tree) >= 5  # watchdog, 2 workers, SuperLink, 2 SuperNodes (+ ServerApp...)
        # Execute: signal the parent only
        os.kill(proc.pid, sig)
        proc.wait(timeout=10)
        # Assert: nothing of its tree runs, and the run directory is free again
        _assert_gone_and_unlocked(tree, out)
    finally:
        _kill_what_is_left(proc)


@pytest.mark.slow
@needs_data
def test_timeout_of_run_local_leaves_nothing_running(tmp_path: Path) -> None:
    # Prepare: a run far longer than its --timeout-s
    with open(tmp_path / "stderr.txt", "w") as err:
        proc, out = _start_run_local(tmp_path, "--timeout-s", "20", stderr=err)
    tree: set[int] = set()  # every process seen below run-local while it ran
    try:
        # Execute: let --timeout-s expire
        deadline = time.monotonic() + 300
        while proc.poll() is None:
            assert time.monotonic() < deadline, "run-local did not time out"
            tree.update(descendants(proc.pid))
            time.sleep(0.2)
        # Assert: exit 2 with one line, then nothing of its tree runs and the lock is free
        text = (tmp_path / "stderr.txt").read_text()
        assert proc.returncode == 2 and "Traceback" not in text, text
        assert "did not appear within 20.0 s" in text.strip().splitlines()[-1]
        assert len(tree) >= 5  # watchdog, 2 workers, SuperLink, 2 SuperNodes (+ ServerApp...)
        _assert_gone_and_unlocked(tree, out)
    finally:
        _kill_what_is_left(proc)
