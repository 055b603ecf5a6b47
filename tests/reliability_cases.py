"""Bad inputs a hostile new user tries, as data: the test suite runs every case
(tests/test_reliability.py) and tests/reliability_table.py turns the same cases into the
table of docs/reliability.md.

Every case must end with exit code 2, one ``fedlora <command>: error: ...`` line and no
traceback, without changing or removing any file that was there before (the run's lock file
aside). ``{tmp}`` is the case's own directory, ``{run}`` a copy of a finished tiny run in
it, ``{data}`` the commonsense data directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
MARKER = "pwned.txt"  # what the malicious checkpoint would create

TINY = [
    "model.name=tiny-llama",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]',
    "data.train_limit=16",
    "data.eval_limit=4",
    "data.max_seq_len=64",
    "data.n_clients=2",
    "data.min_client_examples=2",
    "lora.rank=2",
    'lora.layers="all"',
    "training.rounds=2",
    "training.local_steps=1",
    "training.batch_size=2",
    "training.eval_every=1",
    "training.checkpoint_every=1",
    "method.q=[1.0, 1.0]",
    "method.k=[1, 2]",
]

Setup = Callable[[Path], "Callable[[], None] | None"]


@dataclass
class Case:
    name: str  # the "case" column: what the user did wrong
    argv: list[str]
    expect: str  # a part of the message
    setup: Setup | None = None  # prepares {tmp}; may return a cleanup
    needs_run: bool = False  # {run} is a copy of a finished tiny run
    absent: list[str] = field(default_factory=list)  # paths that must not exist afterwards


# ----------------------------------------------------------------------------- setups


def _write(rel: str, data: bytes | str) -> Setup:
    def setup(tmp: Path) -> None:
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


def _append(rel: str, data: bytes) -> Setup:
    def setup(tmp: Path) -> None:
        with open(tmp / rel, "ab") as f:
            f.write(data)

    return setup


def _chain(*setups: Setup) -> Setup:
    def setup(tmp: Path):
        cleanups = [s(tmp) for s in setups]
        return lambda: [c() for c in cleanups if c]

    return setup


def _user_dir_with_config(tmp: Path) -> None:
    """The issue's P: a user's directory that happens to hold a config.toml."""
    (tmp / "P" / "src").mkdir(parents=True)
    for rel in ("config.toml", "notes.txt", "src/a.py"):
        (tmp / "P" / rel).write_text("mine\n" if rel != "config.toml" else "")


def _run_plus_notes(tmp: Path) -> None:
    (tmp / "run" / "notes.txt").write_text("my notes\n")


def _config_show_plus_user_files(tmp: Path) -> None:
    """Issue 24, case 2: `fedlora config show > P/config.toml` next to the user's own
    profiles file, a draft and an error log (no marker: fedlora never ran there)."""
    from fedlora.config import dump_toml, load_config

    (tmp / "P").mkdir()
    (tmp / "P" / "config.toml").write_text(dump_toml(load_config(None, TINY)))
    (tmp / "P" / "clients.csv").write_text("client,bandwidth_hz\n0,1e6\n1,2e6\n")
    (tmp / "P" / "chapter3.tmp").write_text("draft\n")
    (tmp / "P" / "error.txt").write_text("my notes on an error\n")


def _run_plus(rel: str) -> Setup:
    """{run} plus a user's file at `rel` whose name merely looks like fedlora's."""

    def setup(tmp: Path) -> None:
        p = tmp / "run" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("mine\n")

    return setup


def _old_format_checkpoint(tmp: Path, *, metrics: bytes | None) -> None:
    """Turn {run}'s newest checkpoint into a pre-safetensors round-*.pt without metrics
    lines, and replace metrics.jsonl with `metrics`."""
    import torch

    from fedlora.federation.checkpoints import load_checkpoint

    run = tmp / "run"
    state = load_checkpoint(run, warn=lambda m: None)
    del state["metrics"]
    for p in (run / "checkpoints").iterdir():
        p.unlink()
    torch.save(state, run / "checkpoints" / f"round-{state['round']:06d}.pt")
    if metrics is not None:
        (run / "metrics.jsonl").write_bytes(metrics)


class _Evil:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _malicious_checkpoint(tmp: Path) -> None:
    import torch

    run = tmp / "run"
    for p in (run / "checkpoints").iterdir():
        p.unlink()
    torch.save(
        {"round": 9, "global": _Evil(str(tmp / MARKER))}, run / "checkpoints/round-000009.pt"
    )


def _hold_lock(tmp: Path):
    """Another process holds {run}'s lock (as a second `fedlora run --resume` would)."""
    code = (
        "import fcntl, os, sys, time\n"
        "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp / "run" / ".lock")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"

    def cleanup() -> None:
        proc.kill()
        proc.wait()

    return cleanup


def _disk_full(tmp: Path):
    """Every atomic write fails as on a full disk."""
    import fedlora.federation.rundir as rundir

    original = rundir.atomic_write

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    rundir.atomic_write = full

    def cleanup() -> None:
        rundir.atomic_write = original

    return cleanup


def dev_full_at(path: Path) -> Callable[[], None]:
    """Writing `path` fails with a real ENOSPC from the kernel: fedlora's one opener of files
    it writes (`fedlora.files._open_fd`, which never follows a link there) is handed
    /dev/full for that path. Returns the undo."""
    import fedlora.files as files

    original = files._open_fd

    def opener(p: Path, flags: int) -> int:
        if Path(p) == Path(path):
            return os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        return original(p, flags)

    files._open_fd = opener
    return lambda: setattr(files, "_open_fd", original)


def _dev_full_at(rel: str) -> Setup:
    """{tmp}/`rel` is written on a full disk (`dev_full_at`) while the case runs."""

    def setup(tmp: Path) -> Callable[[], None]:
        return dev_full_at(tmp / rel)

    return setup


def _rewrite_checkpoint(change: Callable[[dict], None]) -> Setup:
    """Replace {run}'s checkpoints by its newest one with `change` applied to the state."""

    def setup(tmp: Path) -> None:
        from safetensors.torch import save_file

        from fedlora.federation.checkpoints import CHECKPOINT_FORMAT, load_checkpoint

        run = tmp / "run"
        state = load_checkpoint(run, warn=lambda m: None)
        change(state)
        for p in (run / "checkpoints").iterdir():
            p.unlink()
        tensors = {f"global/{k}": v.contiguous() for k, v in state.pop("global").items()}
        state.pop("base_delta", None)
        meta = {"format": CHECKPOINT_FORMAT, "state": json.dumps(state)}
        save_file(tensors, str(run / "checkpoints" / f"round-{state['round']:06d}.safetensors"),
                  metadata=meta)  # fmt: skip

    return setup


def _nan_weights(state: dict) -> None:
    for v in state["global"].values():
        v.fill_(float("nan"))


def _nan_clock(state: dict) -> None:
    state["progress"]["sim_time_s"] = float("nan")


def _no_progress(state: dict) -> None:
    del state["progress"]


def _no_checkpoints(tmp: Path) -> None:
    shutil.rmtree(tmp / "run" / "checkpoints")


def _unfinished_no_checkpoints(tmp: Path) -> None:
    """A run stopped after its last recorded round, its checkpoints deleted since."""
    _no_checkpoints(tmp)
    (tmp / "run" / "summary.json").unlink()


def _truncate(rel: str) -> Setup:
    def setup(tmp: Path) -> None:
        p = tmp / rel
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    return setup


def _problem(**change) -> str:
    base = {
        "gamma": 16,
        "f_tot": 2e7,
        "clients": [
            {"a": 0.5, "tau_full_s": 1.0, "t_full": 2.0},
            {"a": 0.5, "tau_full_s": 2.0, "t_full": 1.0},
        ],
        "constants": {"A": 10, "B": 1, "C": 0.1, "D": 0.01},
    }
    base.update(change)
    return json.dumps(base)


_EXTREME_CLIENTS = [
    {"a": 0.5, "tau_full_s": 1e300, "t_full": 1e300},
    {"a": 0.5, "tau_full_s": 1.0, "t_full": 1.0},
]

# ----------------------------------------------------------------------------- the cases


def _manifest_everything(tmp: Path) -> None:
    """{run}'s marker edited so that its manifest lists every name."""
    path = tmp / "run" / ".fedlora-run.json"
    marker = json.loads(path.read_text())
    marker["manifest"]["files"] = ["*"]
    marker["manifest"]["dirs"]["src"] = ["*"]
    path.write_text(json.dumps(marker))


RUN = ["run", *TINY, "--quiet"]
REPORT_TARGET = ["--target", "arc-e=0.5"]
EVAL = ["eval", "--task", "arc-e", "--data-dir", DATA, "--limit", "4"]

CASES: list[Case] = [
    # run: where it writes
    Case("--out under /proc", [*RUN, "--out", "/proc/fedlora-x"], "cannot create"),
    Case(
        "--out is an existing file",
        [*RUN, "--out", "{tmp}/file"],
        "is not a directory",
        _write("file", "keep me\n"),
    ),
    Case("--out is a finished run", [*RUN, "--out", "{run}"], "--resume", needs_run=True),
    Case(
        "--overwrite a user directory holding a config.toml, bad --data-dir",
        [*RUN, "--out", "{tmp}/P", "--overwrite", "--data-dir", "/nonexistent"],
        "/nonexistent",
        _user_dir_with_config,
    ),
    Case(
        "--overwrite a user directory holding a config.toml",
        [*RUN, "--out", "{tmp}/P", "--overwrite"],
        "not a fedlora run directory",
        _user_dir_with_config,
    ),
    Case(
        "--overwrite a directory without config.toml",
        [*RUN, "--out", "{tmp}/D", "--overwrite"],
        "not a fedlora run directory",
        _write("D/thesis.tex", "\\documentclass{article}\n"),
    ),
    Case(
        "--overwrite a run holding the user's notes",
        [*RUN, "--out", "{run}", "--overwrite"],
        "notes.txt",
        _run_plus_notes,
        needs_run=True,
    ),
    Case(
        "--overwrite a run, with a bad new input",
        [*RUN, "--out", "{run}", "--overwrite", "lora.layers=3"],
        "lora.layers",
        needs_run=True,
    ),
    Case("disk full", [*RUN, "--out", "{tmp}/new"], "no space left", _disk_full),
    Case(
        "disk full while resuming (a real ENOSPC)",
        ["run", "--resume", "{run}", "-q"],
        "no space left",
        _dev_full_at("run/metrics.jsonl.tmp"),
        needs_run=True,
    ),
    # run: inputs checked before the model loads
    Case("unknown training task", [*RUN, 'data.tasks=["arc-x"]'], "arc-x"),
    Case("unknown eval task", [*RUN, 'data.eval_tasks=["nope"]'], "nope"),
    Case("no eval task", [*RUN, "data.eval_tasks=[]"], "data.eval_tasks"),
    Case("lora.layers above the model's layers", [*RUN, "lora.layers=3"], "at most the 2"),
    Case("unknown target module", [*RUN, 'lora.target_modules=["qq_proj"]'], "qq_proj"),
    Case("missing task file", [*RUN, 'data.task_files=["/nonexistent.json"]'], "nonexistent"),
    Case(
        "missing profiles file", [*RUN, 'network.profiles_file="/nonexistent.csv"'], "cannot read"
    ),
    Case("missing q file", [*RUN, 'method.q="/nonexistent.json"'], "cannot read"),
    Case("model directory that does not exist", [*RUN, 'model.name="./no-model/"'], "model.name"),
    Case(
        "model directory without config.json",
        [*RUN, 'model.name="{tmp}/m"'],
        "no config.json",
        _write("m/weights.bin", b"\0"),
    ),
    Case("--data-dir that does not exist", [*RUN, "--data-dir", "/nonexistent"], "/nonexistent"),
    Case("unknown config key", [*RUN, "training.round=3"], "did you mean"),
    Case("value out of range", [*RUN, "training.rounds=0"], "training.rounds"),
    Case("empty model name", [*RUN, 'model.name=""'], "model.name"),
    Case("--config that does not exist", [*RUN, "--config", "/nonexistent.toml"], "cannot read"),
    Case(
        "--config not UTF-8",
        [*RUN, "--config", "{tmp}/c.toml"],
        "not UTF-8",
        _write("c.toml", b"[training]\nrounds = 2 # \xff\n"),
    ),
    Case("argument that is no override", [*RUN, "--out", "{tmp}/o", "bogus"], "bogus"),
    # run: options that do not go together
    Case(
        "--resume with another --out",
        ["run", "--resume", "{run}", "--out", "{tmp}/elsewhere"],
        "--out",
        needs_run=True,
    ),
    Case(
        "--resume with --overwrite",
        ["run", "--resume", "{run}", "--overwrite"],
        "--overwrite",
        needs_run=True,
    ),
    Case("--force without --resume", [*RUN, "--out", "{tmp}/n", "--force"], "--force"),
    # run --resume
    Case(
        "--resume a directory that does not exist", ["run", "--resume", "/nonexistent"], "no such"
    ),
    Case(
        "--resume a directory that is not a run",
        ["run", "--resume", "{tmp}/D"],
        "no config.toml",
        _write("D/x.txt", "x\n"),
    ),
    Case(
        "--resume with a changed value",
        ["run", "--resume", "{run}", "training.lr=0.01"],
        "differs from the run's in training.lr; use --force",
        needs_run=True,
    ),
    Case(
        "--resume --force changing the adapter's shape",
        ["run", "--resume", "{run}", "--force", "lora.rank=4"],
        "cannot change on resume",
        needs_run=True,
    ),
    Case(
        "--resume a run another process is running",
        ["run", "--resume", "{run}", "-q"],
        "in use by process",
        _hold_lock,
        needs_run=True,
    ),
    Case(
        "--resume a run whose checkpoint runs code",
        ["run", "--resume", "{run}", "-q"],
        "could not be loaded safely",
        _malicious_checkpoint,
        needs_run=True,
        absent=[MARKER],
    ),
    Case(
        "--resume an old run whose metrics.jsonl lost rounds",
        ["run", "--resume", "{run}", "-q"],
        "are missing",
        lambda tmp: _old_format_checkpoint(tmp, metrics=b'{"round": 0, "sim_time_s": 0.0}\n'),
        needs_run=True,
    ),
    Case(
        "--resume an old run whose metrics.jsonl is not UTF-8",
        ["run", "--resume", "{run}", "-q"],
        "not UTF-8",
        lambda tmp: _old_format_checkpoint(tmp, metrics=b'{"round": 0}\n\xff\xfe\n'),
        needs_run=True,
    ),
    Case(
        "--resume a run whose config.toml is corrupt",
        ["run", "--resume", "{run}"],
        "not valid TOML",
        _write("run/config.toml", "[training\nrounds = 2\n"),
        needs_run=True,
    ),
    Case(
        "--resume a run whose config.toml is not UTF-8",
        ["run", "--resume", "{run}"],
        "not UTF-8",
        _write("run/config.toml", b"[training]\nrounds = 2 # \xff\n"),
        needs_run=True,
    ),
    # report
    Case(
        "report a run with a corrupt summary.json",
        ["report", "{run}", *REPORT_TARGET],
        "summary file",
        _write("run/summary.json", '{"rounds": 2,'),
        needs_run=True,
    ),
    Case(
        "report a run whose summary.json is not an object",
        ["report", "{run}", *REPORT_TARGET],
        "not a JSON object",
        _write("run/summary.json", "[1, 2]"),
        needs_run=True,
    ),
    Case(
        "report a run with a corrupt config.toml",
        ["report", "{run}", *REPORT_TARGET],
        "not valid TOML",
        _write("run/config.toml", "[training\n"),
        needs_run=True,
    ),
    Case(
        "report a run with non-UTF-8 metrics",
        ["report", "{run}", *REPORT_TARGET],
        "not UTF-8",
        _write("run/metrics.jsonl", b'{"round": 0, "sim_time_s": 0.0}\n\xff\n'),
        needs_run=True,
    ),
    Case(
        "report --out under /proc",
        ["report", "{run}", *REPORT_TARGET, "--out", "/proc/fedlora-x"],
        "cannot write",
        needs_run=True,
    ),
    Case(
        "report --out on a full disk (a real ENOSPC)",
        ["report", "{run}", *REPORT_TARGET, "--out", "{tmp}/r"],
        "No space left",
        _dev_full_at("r/report.md.tmp"),
        needs_run=True,
    ),
    Case("report a directory that does not exist", ["report", "/nonexistent"], "no such"),
    Case(
        "report a target above 1",
        ["report", "{run}", "--target", "arc-e=2"],
        "(0, 1]",
        needs_run=True,
    ),  # fmt: skip
    # plan
    Case(
        "plan with calibration = 5",
        ["plan", "{tmp}/p.json"],
        "calibration",
        _write("p.json", _problem(constants=None, calibration=5)),
    ),
    Case(
        "plan of a non-UTF-8 file",
        ["plan", "{tmp}/p.json"],
        "not UTF-8",
        _write("p.json", b'{"gamma": 16 \xff}'),
    ),
    Case(
        "plan with gamma = 10^12",
        ["plan", "{tmp}/p.json"],
        "at most 4096",
        _write("p.json", _problem(gamma=10**12)),
    ),
    Case(
        "plan whose optimum has q_n = 0",
        ["plan", "{tmp}/p.json"],
        "no usable plan",
        _write(
            "p.json",
            _problem(
                clients=_EXTREME_CLIENTS,
                constants={"A": 1e300, "B": 1, "C": 1e-300, "D": 1e-300},
                options={"q_lower_bound": "none"},
            ),
        ),
    ),
    Case(
        "plan that overflows",
        ["plan", "{tmp}/p.json"],
        "overflow",
        _write(
            "p.json",
            _problem(
                clients=_EXTREME_CLIENTS,
                constants={"A": 1, "B": 1e300, "C": 1, "D": 1},
                options={"q_lower_bound": "paper"},
            ),
        ),
    ),
    Case(
        "plan --output on a full disk (a real ENOSPC)",
        ["plan", "{tmp}/p.json", "--output", "/dev/full"],
        "No space left",
        _write("p.json", _problem()),
    ),
    Case("plan of a file that does not exist", ["plan", "/nonexistent.json"], "cannot read"),
    Case("plan of invalid JSON", ["plan", "{tmp}/p.json"], "invalid JSON", _write("p.json", "{")),
    Case(
        "plan --output under /proc",
        ["plan", "{tmp}/p.json", "--output", "/proc/fedlora-x/plan.json"],
        "cannot write",
        _write("p.json", _problem()),
    ),
    # issue 24: the run directory, checkpoints and Flower commands
    Case(
        "--overwrite a run another process is running",
        [*RUN, "--out", "{run}", "--overwrite"],
        "is in use by process",
        _hold_lock,
        needs_run=True,
    ),
    Case(
        "flower run-local --overwrite a run another process is running",
        ["flower", "run-local", *TINY, "--out", "{run}", "--overwrite"],
        "is in use by process",
        _hold_lock,
        needs_run=True,
    ),
    Case(
        "a user directory holding a config.toml from fedlora config show, without --overwrite",
        [*RUN, "--out", "{tmp}/P"],
        "not a fedlora run directory",
        _config_show_plus_user_files,
    ),
    Case(
        "--overwrite a user directory holding a config.toml from fedlora config show",
        [*RUN, "--out", "{tmp}/P", "--overwrite"],
        "not a fedlora run directory",
        _config_show_plus_user_files,
    ),
    Case(
        "--overwrite a user directory holding a config.toml and their own metrics.jsonl",
        [*RUN, "--out", "{tmp}/P", "--overwrite"],
        "not a fedlora run directory",
        _chain(
            _config_show_plus_user_files,
            _write("P/metrics.jsonl", '{"epoch": 1, "loss": 0.5}\n'),
            _write("P/checkpoints/model.pt", "weights\n"),
        ),
    ),
    # a run plus a user's file whose name merely looks like fedlora's: (case, file, expect)
    *[
        Case(
            f"--overwrite a run {what}",
            [*RUN, "--out", "{run}", "--overwrite"],
            expect,
            _run_plus(rel),
            needs_run=True,
        )
        for what, rel, expect in [
            (
                "holding the user's evaluation_scripts/ folder",
                "evaluation_scripts/score.py",
                "evaluation_scripts/",
            ),
            ("holding the user's predictions_v2.csv", "predictions_v2.csv", "predictions_v2.csv"),
            ("holding the user's chapter3.tmp", "chapter3.tmp", "chapter3.tmp"),
            (
                "with the user's file in checkpoints/",
                "checkpoints/notes.txt",
                "checkpoints/notes.txt",
            ),
            ("with the user's file in adapter/", "adapter/my_eval.py", "adapter/my_eval.py"),
        ]
    ],
    Case(
        "--overwrite a run whose marker is damaged",
        [*RUN, "--out", "{run}", "--overwrite"],
        ".fedlora-run.json is damaged",
        _write("run/.fedlora-run.json", "{not json"),
        needs_run=True,
    ),
    Case(
        "flower run-local --overwrite a run holding the user's evaluation_scripts/",
        ["flower", "run-local", *TINY, "--out", "{run}", "--overwrite"],
        "evaluation_scripts/",
        _run_plus("evaluation_scripts/score.py"),
        needs_run=True,
    ),
    Case(
        "--resume a finished run whose checkpoints were deleted",
        ["run", "--resume", "{run}", "-q"],
        "its checkpoints are gone",
        _no_checkpoints,
        needs_run=True,
    ),
    Case(
        "--resume an unfinished run whose checkpoints were deleted",
        ["run", "--resume", "{run}", "-q"],
        "would restart from round 0 and discard them",
        _unfinished_no_checkpoints,
        needs_run=True,
    ),
    Case(
        "--resume a run whose checkpoint is all NaN",
        ["run", "--resume", "{run}", "-q"],
        "(round 2) holds a non-finite value in global.",
        _rewrite_checkpoint(_nan_weights),
        needs_run=True,
    ),
    Case(
        "--resume a run whose checkpoint's clock is NaN",
        ["run", "--resume", "{run}", "-q"],
        "(round 2) holds a non-finite value in progress.sim_time_s",
        _rewrite_checkpoint(_nan_clock),
        needs_run=True,
    ),
    Case(
        "--resume a run whose checkpoint has no progress record",
        ["run", "--resume", "{run}", "-q"],
        "(round-000002.safetensors: damaged: no 'progress' record)",
        _rewrite_checkpoint(_no_progress),
        needs_run=True,
    ),
    Case(
        "flower run-local --timeout-s nan",
        ["flower", "run-local", *TINY, "--out", "{tmp}/o", "--timeout-s", "nan"],
        "--timeout-s = nan is invalid: a finite number of seconds > 0",
        absent=["o"],
    ),
    Case(
        "flower run-local --round-timeout-s -5",
        ["flower", "run-local", *TINY, "--out", "{tmp}/o", "--round-timeout-s", "-5"],
        "--round-timeout-s = -5.0 is invalid: a finite number of seconds > 0",
        absent=["o"],
    ),
    Case(
        "flower run-local with a missing --app-dir",
        ["flower", "run-local", *TINY, "--out", "{tmp}/o", "--app-dir", "{tmp}/nope"],
        "--app-dir",
        absent=["o"],
    ),
    Case(
        "lora.rank beyond int64",
        [*RUN, "--out", "{tmp}/o", "lora.rank=99999999999999999999"],
        "lora.rank = 99999999999999999999, training.slots = ",
    ),
    Case(
        "lora.rank = 10^9 (more memory than the machine has)",
        [*RUN, "--out", "{tmp}/o", "lora.rank=1000000000"],
        "GiB of memory available",
    ),
    Case(
        "lora.rank = 2^31",
        [*RUN, "--out", "{tmp}/o", "lora.rank=2147483648"],
        "GiB of memory available",
    ),
    Case(
        "training.slots = 10^9",
        [*RUN, "--out", "{tmp}/o", "training.slots=1000000000"],
        "training.slots = 1000000000: the adapter needs",
    ),
    Case(
        "q file holding strings",
        [*RUN, "--out", "{tmp}/o", 'method.q="{tmp}/q.json"'],
        'method.q[0] = "a" is invalid: a number',
        _write("q.json", '["a", "b"]'),
        absent=["o"],
    ),
    Case(
        "q file holding true",
        [*RUN, "--out", "{tmp}/o", 'method.q="{tmp}/q.json"'],
        "method.q[0] = true is invalid: a number",
        _write("q.json", "[true, 1.0]"),
        absent=["o"],
    ),
    Case(
        "k file holding true",
        [*RUN, "--out", "{tmp}/o", 'method.k="{tmp}/k.json"'],
        "method.k[1] = true is invalid: a number",
        _write("k.json", "[1, true]"),
        absent=["o"],
    ),
    Case(
        "duplicate training tasks",
        [*RUN, "--out", "{tmp}/o", 'data.tasks=["arc-e", "arc-e"]'],
        "data.tasks = ['arc-e', 'arc-e'] is invalid: each task at most once",
        absent=["o"],
    ),
    Case(
        "duplicate eval tasks",
        [*RUN, "--out", "{tmp}/o", 'data.eval_tasks=["arc-e", "arc-e"]'],
        "data.eval_tasks = ['arc-e', 'arc-e'] is invalid: each task at most once",
        absent=["o"],
    ),
    Case(
        "output.name escaping output.dir",
        [*RUN, 'output.dir="{tmp}/runs"', 'output.name="../escape"'],
        "output.name = '../escape' is invalid: a relative name inside output.dir",
        absent=["escape", "runs"],
    ),
    Case(
        "absolute output.name",
        [*RUN, 'output.dir="{tmp}/runs"', 'output.name="{tmp}/abs"'],
        "is invalid: a relative name inside output.dir",
        absent=["abs", "runs"],
    ),
    Case("--out empty", [*RUN, "--out", ""], "--out = '' is invalid: a directory path"),
    Case(
        "flower run-local --out empty",
        ["flower", "run-local", *TINY, "--out", ""],
        "--out = '' is invalid: a directory path",
    ),
    Case(
        "eval an adapter on a model it was not trained on",
        [*EVAL, "--model", "tiny-qwen2", "--adapter", "{run}/adapter"],
        "was trained on 'tiny-llama', not on --model 'tiny-qwen2'",
        needs_run=True,
    ),
    Case(
        "eval an adapter with a truncated safetensors file",
        [*EVAL, "--model", "tiny-llama", "--adapter", "{run}/adapter"],
        "adapter_model.safetensors is not a readable safetensors file",
        _truncate("run/adapter/adapter_model.safetensors"),
        needs_run=True,
    ),
    Case(
        "eval an adapter whose safetensors file is random bytes",
        [*EVAL, "--model", "tiny-llama", "--adapter", "{run}/adapter"],
        "adapter_model.safetensors is not a readable safetensors file",
        _write("run/adapter/adapter_model.safetensors", bytes(range(256)) * 16),
        needs_run=True,
    ),
    # issue 24 (r24d): simulate takes the lock too; resume with a damaged predictions.jsonl
    Case(
        "flower simulate --overwrite a run another process is running",
        ["flower", "simulate", *TINY, "--out", "{run}", "--overwrite"],
        "is in use by process",
        _hold_lock,
        needs_run=True,
    ),
    Case(
        "--resume a run whose predictions.jsonl is not UTF-8",
        ["run", "--resume", "{run}", "-q"],
        "predictions.jsonl is not UTF-8 (line 4, byte 0xff)",
        _append("run/predictions.jsonl", b"\xff\xfe\n"),
        needs_run=True,
    ),
    Case(
        "plan of a PROBLEM.json nested 100,000 deep",
        ["plan", "{tmp}/p.json"],
        "JSON nested too deeply",
        _write("p.json", "[" * 100_000 + "]" * 100_000),
    ),
    Case(
        "plan with a 5,000-digit gamma",
        ["plan", "{tmp}/p.json"],
        "invalid JSON number",
        _write("p.json", '{"gamma": ' + "9" * 5000 + "}"),
    ),
    # issue 24, the run-directory schema (issue 23 item 4): report on damaged metrics, targets
    Case(
        "report a run whose metrics.jsonl holds only a torn line",
        ["report", "{run}", *REPORT_TARGET],
        "holds no complete round",
        _write("run/metrics.jsonl", '{"round": 0, "sim_ti'),
        needs_run=True,
    ),
    Case(
        "report a run whose metrics.jsonl is empty",
        ["report", "{run}", *REPORT_TARGET],
        "metrics.jsonl' holds no complete round (it is empty)",
        _write("run/metrics.jsonl", ""),
        needs_run=True,
    ),
    Case(
        "report a run whose metrics.jsonl is torn in the middle",
        ["report", "{run}", *REPORT_TARGET],
        "line 1 is not JSON",
        _write("run/metrics.jsonl", '{"round": 0, "sim\n{"round": 1, "sim_time_s": 1.0}\n'),
        needs_run=True,
    ),
    Case(
        "report --target for a task no run evaluated",
        ["report", "{run}", "--target", "arc-c=0.5"],
        "no run evaluated task 'arc-c'; the runs' tasks: arc-e",
        needs_run=True,
    ),
    # ========================================================================================
    # The run's one entry: every check before anything is deleted or started; the marker's
    # manifest trusted only for fedlora's own names; nothing written outside the run
    # directory without the same rule (Flower's log folder); compare checks every run first.
    *[
        Case(
            f"--overwrite a finished run with {what}",
            [*RUN, "--out", "{run}", "--overwrite", *bad],
            expect,
            needs_run=True,
        )
        for what, bad, expect in (
            (
                "method proposed and lora.rank = 1",
                ["method.name=proposed", "lora.rank=1", "method.k=[1, 1]"],
                "lora.rank = 1 is invalid for method.name = 'proposed'",
            ),
            (
                "more clients than examples",
                ["data.n_clients=50", "method.q=full", "method.k=full"],
                "data.n_clients = 50 with data.min_client_examples = 2 is invalid",
            ),
            (
                "an adapter larger than memory",
                ["lora.rank=99999999999999999999"],
                "lora.rank = 99999999999999999999, training.slots",
            ),
            (
                "a noise level that leaves no SNR",
                ["network.noise_psd_dbm_hz=1e300"],
                "network.noise_psd_dbm_hz = 1e+300",
            ),
        )
    ],
    Case(
        "flower simulate --overwrite a finished run with method proposed and lora.rank = 1",
        [
            "flower",
            "simulate",
            *TINY,
            "--out",
            "{run}",
            "--overwrite",
            "method.name=proposed",
            "lora.rank=1",
            "method.k=[1, 1]",
        ],
        "lora.rank = 1 is invalid for method.name = 'proposed'",
        needs_run=True,
    ),
    Case(
        "--overwrite a run whose marker's manifest was edited to everything",
        [*RUN, "--out", "{run}", "--overwrite"],
        "fedlora did not write (src/, thesis.tex)",
        _chain(_run_plus("thesis.tex"), _run_plus("src/main.py"), _manifest_everything),
        needs_run=True,
    ),
    Case(
        "flower run-local --out X where X-logs/ holds the user's files",
        ["flower", "run-local", *TINY, "--out", "{tmp}/X"],
        "was not made by fedlora",
        _write("X-logs/superlink.log", "my own notes\n"),
        absent=["X"],
    ),
    Case(
        "flower simulate --resume a run fedlora run finished",
        ["flower", "simulate", "--resume", "{run}"],
        "is a run `fedlora run` finished",
        needs_run=True,
    ),
    *[
        Case(
            f"a fresh flower simulate with {bad}",
            ["flower", "simulate", *TINY, "--out", "{tmp}/s", bad],
            expect,
            absent=["s"],
        )
        for bad, expect in (
            ("lora.layers=3", "lora.layers = 3 is invalid"),
            ("data.eval_tasks=[]", "data.eval_tasks = [] is invalid"),
            ('lora.target_modules=["nope"]', "nope is no linear module"),
        )
    ],
    Case(
        "compare --methods with a label twice",
        [
            "compare",
            "--suite",
            "methods",
            "--methods",
            "fedavg",
            "fedavg",
            "--out",
            "{tmp}/c",
            *TINY,
        ],
        "each label once (fedavg twice)",
        absent=["c"],
    ),
    Case(
        "compare a suite whose proposed run cannot calibrate (lora.rank = 1)",
        [
            "compare",
            "--suite",
            "methods",
            "--methods",
            "proposed",
            "--out",
            "{tmp}/c",
            "--target",
            "arc-e=0.5",
            *TINY,
            "lora.rank=1",
            "method.k=[1, 1]",
        ],
        "lora.rank = 1 is invalid for method.name = 'proposed'",
        absent=["c"],
    ),
]


# ------------------------------------------- hostile inputs: trackers, bounds, user files
# (a separate block, appended to CASES: the setups it needs, then its cases)


def _link(rel: str, target: str) -> Setup:
    def setup(tmp: Path) -> None:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).symlink_to(target)

    return setup


NODE_TIMES_HEAD = "round,client,node_id,rank_used,local_steps,train_s,upload_params,upload_bytes\n"


def _node_times(*rows: str) -> Setup:
    """{run}/node_times.csv with a good first row and then `rows` (a Flower run's measures)."""
    return _write("run/node_times.csv", NODE_TIMES_HEAD + "1,1,8,2,1,1.0,100,400\n" + "".join(rows))


def _mlflow_resume(tmp: Path) -> None:
    """{run} tracked by MLflow in its own store, whose mlflow_run.json names a run id that
    store does not hold (the store is gone)."""
    run = tmp / "run"
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(text.replace("trackers = []", 'trackers = ["mlflow"]'))
    uri = "sqlite:///" + str((run / "mlflow.db").resolve())
    record = {"tracking_uri": uri, "run_id": "0" * 32, "experiment_id": "1"}
    (run / "mlflow_run.json").write_text(json.dumps(record))


def _server_moments(value: float) -> Setup:
    """{run} with method.server_optimizer = adam and its newest checkpoint holding server
    optimizer moments m, v of `value` (NaN: a file altered or a run diverged)."""

    def setup(tmp: Path) -> None:
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file

        run = tmp / "run"
        text = (run / "config.toml").read_text()
        (run / "config.toml").write_text(
            text.replace('server_optimizer = "avg"', 'server_optimizer = "adam"')
        )
        path = sorted((run / "checkpoints").glob("round-*.safetensors"))[-1]
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        for k in [k for k in tensors if k.startswith("global/")]:
            name = k[len("global/") :]
            tensors[f"server_opt/m/{name}"] = torch.zeros(tensors[k].shape, dtype=torch.float64)
            tensors[f"server_opt/v/{name}"] = torch.full(
                tensors[k].shape, value, dtype=torch.float64
            )
        tensors["server_opt/t"] = torch.tensor([2], dtype=torch.int64)
        save_file(tensors, str(path), metadata=meta)

    return setup


BIG_VALUE = "x" * 10_000_000  # a 10 MB value

CASES += [
    Case(
        "network.tx_power_dbm = 1e300 (uploads would take no time)",
        [*RUN, "--out", "{tmp}/o", "network.tx_power_dbm=1e300"],
        "network.tx_power_dbm = 1e+300 is invalid: must be <= 100",
        absent=["o"],
    ),
    Case(
        "network.noise_psd_dbm_hz = 1e300",
        [*RUN, "--out", "{tmp}/o", "network.noise_psd_dbm_hz=1e300"],
        "network.noise_psd_dbm_hz = 1e+300 is invalid: must be <= 0",
        absent=["o"],
    ),
    Case(
        "--overwrite a run, with network.noise_psd_dbm_hz = 1e300",
        [*RUN, "--out", "{run}", "--overwrite", "network.noise_psd_dbm_hz=1e300"],
        "network.noise_psd_dbm_hz = 1e+300 is invalid",
        needs_run=True,
    ),
    Case(
        "a generated channel whose SNR rounds the upload rate to 0",
        [*RUN, "--out", "{tmp}/o", "network.noise_psd_dbm_hz=-1", "network.tx_power_dbm=-100"],
        "gives the generated clients an SNR of",
        absent=["o"],
    ),
    Case(
        "method.server_lr = 1e308 (adam)",
        [*RUN, "--out", "{tmp}/o", "method.server_optimizer=adam", "method.server_lr=1e308"],
        "method.server_lr = 1e+308 is invalid: must be <= 1000",
        absent=["o"],
    ),
    Case(
        "method.server_weight_decay flipping the adapter's sign",
        [*RUN, "--out", "{tmp}/o", "method.server_optimizer=adam", "method.server_weight_decay=5"],
        "method.server_weight_decay = 5.0 is invalid: server_lr × server_weight_decay must be <= 1",
        absent=["o"],
    ),
    Case(
        "--resume a run whose server-optimizer moments are NaN",
        ["run", "--resume", "{run}", "-q"],
        "holds a non-finite value in server_opt.v/",
        _server_moments(float("nan")),
        needs_run=True,
    ),
    Case(
        "--resume a run whose server-optimizer second moment is negative",
        ["run", "--resume", "{run}", "-q"],
        "holds a negative server optimizer second moment in server_opt.v/",
        _server_moments(-1.0),
        needs_run=True,
    ),
    Case(
        "output.mlflow_uri a plain path",
        [*RUN, "--out", "{tmp}/o", 'output.trackers=["mlflow"]', 'output.mlflow_uri="{tmp}/store"'],
        "output.mlflow_uri = '",
        absent=["o", "store"],
    ),
    Case(
        "output.mlflow_uri that does not parse",
        [*RUN, "--out", "{tmp}/o", 'output.trackers=["mlflow"]', 'output.mlflow_uri="http://[::1"'],
        "output.mlflow_uri = 'http://[::1' is invalid: it does not parse as a URI",
        absent=["o"],
    ),
    Case(
        "--overwrite a run, with an output.mlflow_uri that does not parse",
        [
            *RUN,
            "--out",
            "{run}",
            "--overwrite",
            'output.trackers=["mlflow"]',
            'output.mlflow_uri="http://[::1"',
        ],
        "output.mlflow_uri = 'http://[::1' is invalid",
        needs_run=True,
    ),
    Case(
        "unknown tracker",
        [*RUN, "--out", "{tmp}/o", 'output.trackers=["wandb"]'],
        "output.trackers[0] = 'wandb' is invalid: allowed: tensorboard, mlflow",
        absent=["o"],
    ),
    Case(
        "--resume with an MLflow run id its store does not hold",
        ["run", "--resume", "{run}", "-q"],
        "output.mlflow_uri = 'sqlite:///",
        _mlflow_resume,
        needs_run=True,
    ),
    Case(
        "--config a link to /dev/zero",
        [*RUN, "--out", "{tmp}/o", "--config", "{tmp}/c.toml"],
        "is not a regular file (a device, pipe or socket)",
        _link("c.toml", "/dev/zero"),
        absent=["o"],
    ),
    Case(
        "q file a link to /dev/zero",
        [*RUN, "--out", "{tmp}/o", 'method.q="{tmp}/q.json"'],
        "method.q = '",
        _link("q.json", "/dev/zero"),
        absent=["o"],
    ),
    Case(
        "profiles file /dev/zero",
        [*RUN, "--out", "{tmp}/o", 'network.profiles_file="/dev/zero"'],
        "network.profiles_file = '/dev/zero': '/dev/zero' is not a regular file",
        absent=["o"],
    ),
    Case(
        "a 10 MB value in a config file",
        [*RUN, "--out", "{tmp}/o", "--config", "{tmp}/c.toml"],
        "(10,000,002 characters) is invalid",
        _write("c.toml", f'[training]\nlr = "{BIG_VALUE}"\n'),
        absent=["o"],
    ),
    Case(
        "profiles fit on node_times.csv with train_s = nan",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "node_times.csv: line 3: train_s = 'nan' is invalid: a number > 0",
        _node_times("1,0,7,2,1,nan,100,400\n"),
        needs_run=True,
        absent=["p.csv"],
    ),
    Case(
        "profiles fit on node_times.csv with train_s < 0",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "train_s = '-2.5' is invalid",
        _node_times("1,0,7,2,1,-2.5,100,400\n"),
        needs_run=True,
        absent=["p.csv"],
    ),
    Case(
        "profiles fit on node_times.csv with train_s = inf",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "line 3: train_s = 'inf' is invalid: a number > 0",
        _node_times("1,0,7,2,1,inf,100,400\n"),
        needs_run=True,
        absent=["p.csv"],
    ),
    Case(
        "profiles fit on node_times.csv with client 99 of 2",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "line 4: client = '99' is invalid: an integer >= 0 and <= 1 (the run's data.n_clients = 2)",
        _node_times("1,0,7,2,1,1.0,100,400\n2,99,7,2,1,1.0,100,400\n"),
        needs_run=True,
        absent=["p.csv"],
    ),
    Case(
        "profiles fit on node_times.csv with client -1",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "client = '-1' is invalid",
        _node_times("1,-1,7,2,1,1.0,100,400\n"),
        needs_run=True,
        absent=["p.csv"],
    ),
    Case(
        "profiles fit on node_times.csv with upload_params = 1e999",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "upload_params = '1e999' is invalid: an integer >= 1",
        _node_times("1,0,7,2,1,1.0,1e999,400\n"),
        needs_run=True,
        absent=["p.csv"],
    ),
    Case(
        "profiles fit on a node_times.csv of random bytes",
        ["profiles", "fit", "{run}", "-o", "{tmp}/p.csv"],
        "node_times.csv is not UTF-8 text (line 1, byte 0x",
        _write("run/node_times.csv", bytes(range(128, 256)) * 8),
        needs_run=True,
        absent=["p.csv"],
    ),
]


# ----------------------------------------------------------------------------- running


def make_finished_run(path: Path) -> None:
    """A finished two-round tiny run at `path` (the template of {run})."""
    from fedlora.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main([*RUN, "--out", str(path)])
    assert rc == 0, f"the template run failed with {rc}"


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != ".lock":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str
    lost: list[str]  # files removed or changed
    present: list[str]  # `absent` paths that exist


def run_case(case: Case, tmp: Path, template: Path | None = None) -> Outcome:
    """Run one case in `tmp` (in this process) and report what it did."""
    from fedlora.cli import main

    tmp.mkdir(parents=True, exist_ok=True)
    if case.needs_run:
        assert template is not None, f"{case.name}: needs the finished run"
        shutil.copytree(template, tmp / "run")
    cleanup = case.setup(tmp) if case.setup else None
    before = _snapshot(tmp)
    argv = [a.format(tmp=tmp, run=tmp / "run", data=DATA) for a in case.argv]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse errors
                rc = int(e.code or 0)
    finally:
        if cleanup:
            cleanup()
    after = _snapshot(tmp)
    lost = [k for k, v in before.items() if after.get(k) != v]
    present = [a for a in case.absent if (tmp / a).exists()]
    return Outcome(rc, out.getvalue(), err.getvalue(), lost, present)


def message(outcome: Outcome, tmp: Path) -> str:
    """The error line with the machine-specific parts replaced (for the docs)."""
    lines = [x for x in outcome.stderr.splitlines() if "error:" in x]
    text = lines[-1] if lines else outcome.stderr.strip()
    text = text.replace(str(tmp), "<tmp>").replace(DATA, "<data>")
    text = re.sub(r"process \d+", "process <pid>", text)
    return re.sub(r"usage: .*", "", text).strip()


# ----------------------------------------------------------------------------- report inputs
# `fedlora report`: repeated targets, runs of different configs under one label, a damaged
# suite.toml or metrics value (each a one-line refusal, nothing written).


def _second_run(n_clients: int, seed: int) -> Setup:
    """{tmp}/other: a copy of {run} with data.n_clients and the seed changed."""

    def setup(tmp: Path) -> None:
        other = tmp / "other"
        shutil.copytree(tmp / "run", other)
        text = (other / "config.toml").read_text(encoding="utf-8")
        text = re.sub(r"(?m)^n_clients = \d+", f"n_clients = {n_clients}", text)
        text = re.sub(r"(?m)^seed = \d+", f"seed = {seed}", text)
        (other / "config.toml").write_text(text, encoding="utf-8")
        summary = json.loads((other / "summary.json").read_text(encoding="utf-8"))
        (other / "summary.json").write_text(json.dumps({**summary, "seed": seed}))

    return setup


def _suite_with(suite_toml: bytes) -> Setup:
    """{tmp}/suite: {run} as a suite's one run, with the given suite.toml."""

    def setup(tmp: Path) -> None:
        shutil.copytree(tmp / "run", tmp / "suite" / "fslora-seed0")
        (tmp / "suite" / "suite.toml").write_bytes(suite_toml)

    return setup


def _metrics_time(value: str) -> Setup:
    def setup(tmp: Path) -> None:
        path = tmp / "run" / "metrics.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        first = json.loads(lines[0])
        first["sim_time_s"] = value
        path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n", encoding="utf-8")

    return setup


CASES += [
    Case(
        "report with the same task's --target twice",
        ["report", "{run}", "--target", "arc-e=0.5", "--target", "arc-e=0.6"],
        "one --target per task ('arc-e' twice)",
        needs_run=True,
    ),
    Case(
        "report two runs of different configs as seeds of one method",
        ["report", "{run}", "{tmp}/other", "--out", "{tmp}/r"],
        "their configs differ in data.n_clients (2 vs 3)",
        _second_run(3, 1),
        needs_run=True,
        absent=["r"],
    ),
    Case(
        "report a suite whose suite.toml is not UTF-8",
        ["report", "{tmp}/suite", "--out", "{tmp}/r"],
        "suite.toml: not UTF-8 text",
        _suite_with(b"title = '\xff'\n"),
        needs_run=True,
        absent=["r"],
    ),
    Case(
        "report a suite whose suite.toml says targets = 3",
        ["report", "{tmp}/suite", "--out", "{tmp}/r"],
        "targets = 3 is invalid: a table of task = accuracy in (0, 1]",
        _suite_with(b"targets = 3\n"),
        needs_run=True,
        absent=["r"],
    ),
    Case(
        'report a run whose metrics say sim_time_s: "abc"',
        ["report", "{run}", "--out", "{tmp}/r"],
        "sim_time_s = 'abc' is invalid: a finite number",
        _metrics_time("abc"),
        needs_run=True,
        absent=["r"],
    ),
]
