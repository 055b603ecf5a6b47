"""The run directory's marker, ``.fedlora-run.json``: proof that fedlora created the directory,
and the manifest of what fedlora writes there (the only entries ``--overwrite`` may delete).

`write_marker` is called by `fedlora.federation.rundir.write_run_dir` (the last step of a
run's entry) when it creates (or replaces) a run directory::

    {"format": 1, "run_id": "<uuid4 hex>", "fedlora_version": "0.1.0",
     "created": "2026-11-25T06:20:00Z", "manifest": {"files": [...], "dirs": {...}}}

The manifest is the fixed list `MANIFEST` of the names fedlora's own writers use in a run
directory (the engine, the Flower ServerApp, tracking, the planner and `fedlora report`'s
outputs), recorded at creation: a later fedlora deletes what the run's own fedlora wrote, and only
names fedlora itself writes: an entry counts as fedlora's only when it matches both the
marker's manifest and `MANIFEST` (a marker edited to ``["*"]`` deletes nothing else).
``files`` are glob patterns of top-level files; ``dirs`` maps a folder to the glob patterns
of what fedlora puts inside it. An atomic write's ``<name>.tmp`` belongs with ``<name>``.

A directory without the marker that holds a fedlora config.toml next to fedlora's
metrics.jsonl, summary.json or checkpoints/ was written by a fedlora older than the marker
(a *legacy* run): it resumes as before, and ``--overwrite`` deletes only `MANIFEST`'s names.
"""

from __future__ import annotations

import fnmatch
import json
import time
import uuid
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, DataError
from fedlora.federation.metrics_file import METRICS_FILE, is_metrics_line
from fedlora.federation.runfiles import SUMMARY_FILE, read_summary
from fedlora.files import atomic_write

MARKER_NAME = ".fedlora-run.json"
MARKER_FORMAT = 1
MANIFEST: dict[str, Any] = {
    "files": [
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "clients.csv",
        "machine.jsonl",
        "error.txt",
        "plan.json",
        "node_times.csv",
        "predictions.jsonl",
        "mlflow_run.json",
        "mlflow.db",
        # fedlora report's outputs (fedlora.studies.report / suite_report / html)
        "report.md",
        "report.html",
        "accuracy_vs_time.png",
        "eval_loss_vs_time.png",
        "accuracy_bands.png",
        "eval_loss_bands.png",
        "accuracy_paired.png",
        "eval_loss_paired.png",
        "privacy_trace.png",
    ],
    "dirs": {
        "checkpoints": ["round-*.safetensors", "round-*.pt"],
        "adapter": [
            "adapter_config.json",
            "adapter_model.safetensors",
            "fedlora_adapter.json",
            "README.md",
        ],
        "calibration": ["run-*"],  # the planner's calibration runs (run directories)
        "tensorboard": ["events.out.tfevents.*"],
        "mlflow-artifacts": ["*"],  # MLflow's own store
    },
}
# the names fedlora writes as files in a run directory (each also as `<name>.tmp`)
OWN_FILES = [".lock", MARKER_NAME, *MANIFEST["files"]]
# A run that failed before its first round leaves only these (and the marker): reused silently.
NEVER_STARTED = ("config.toml", "clients.csv", "error.txt")


def new_marker() -> dict[str, Any]:
    from fedlora import __version__

    return {
        "format": MARKER_FORMAT,
        "run_id": uuid.uuid4().hex,
        "fedlora_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "manifest": MANIFEST,
    }


def write_marker(run_dir: Path) -> dict[str, Any]:
    marker = new_marker()
    atomic_write(run_dir / MARKER_NAME, (json.dumps(marker, indent=2) + "\n").encode())
    return marker


def admit_to_manifest(run_dir: Path, name: str) -> bool:
    """Add `name` (one of `MANIFEST`'s files) to the manifest of `run_dir`'s marker when a
    fedlora older than that file wrote the marker, so that a run resumed by this fedlora
    can still be replaced with ``--overwrite``. No marker (a legacy run: today's manifest
    applies), or a manifest that already lists it: nothing is written. Whether it wrote."""
    if not _matches(name, MANIFEST["files"]):
        raise ValueError(f"{name!r} is not a file fedlora writes in a run directory")
    marker = read_marker(run_dir)
    if marker is None or _matches(name, marker["manifest"]["files"]):
        return False
    marker["manifest"]["files"].append(name)
    atomic_write(run_dir / MARKER_NAME, (json.dumps(marker, indent=2) + "\n").encode())
    return True


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """The marker of `run_dir`, None without one; a damaged marker is a ConfigError."""
    path = run_dir / MARKER_NAME
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError("not a regular file")
        marker = json.loads(path.read_bytes().decode("utf-8"))
        manifest = marker["manifest"]
        if not (
            isinstance(manifest["files"], list)
            and isinstance(manifest["dirs"], dict)
            and all(isinstance(p, str) for p in manifest["files"])
            and all(isinstance(v, list) for v in manifest["dirs"].values())
        ):
            raise ValueError("its manifest is malformed")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"run directory {str(run_dir)!r}: its marker {MARKER_NAME} is damaged ({e}); "
            "fedlora will not delete anything there: choose another --out"
        ) from None
    return marker


def _matches(name: str, patterns: list[str]) -> bool:
    base = name[: -len(".tmp")] if name.endswith(".tmp") else name
    return any(fnmatch.fnmatchcase(base, p) for p in patterns)


def sort_entries(run_dir: Path, manifest: dict[str, Any]) -> tuple[list[Path], list[str]]:
    """`run_dir`'s entries as (what fedlora may delete, names of everything else).

    An entry is fedlora's only when the marker's `manifest` lists it and fedlora writes
    that name (`MANIFEST`): the marker is a file in the user's directory, trusted only for
    fedlora's own names. A listed folder counts as fedlora's only when everything in it
    matches its patterns; symbolic links count as files (never followed). The lock file and
    the marker are neither: they are kept and rewritten by the caller."""
    owned: list[Path] = []
    foreign: list[str] = []
    for p in sorted(run_dir.iterdir()):
        if p.name in (".lock", MARKER_NAME):
            continue
        if p.is_dir() and not p.is_symlink():
            patterns = manifest["dirs"].get(p.name)
            ours = MANIFEST["dirs"].get(p.name)
            if patterns is None or ours is None:
                foreign.append(p.name + "/")
                continue
            inside = [
                f"{p.name}/{c.name}"
                for c in sorted(p.iterdir())
                if not (_matches(c.name, patterns) and _matches(c.name, ours))
            ]
            if inside:
                foreign += inside
            else:
                owned.append(p)
        elif _matches(p.name, manifest["files"]) and _matches(p.name, MANIFEST["files"]):
            owned.append(p)
        else:
            foreign.append(p.name)
    return owned, foreign


def linked_names(run_dir: Path) -> list[str]:
    """The names fedlora writes or deletes in `run_dir` (the lock, the marker, `MANIFEST`'s
    files and folders, their ``.tmp``, and everything inside those folders) that are symbolic
    links: a run refuses them rather than write or delete through a link."""
    out: list[str] = []
    for p in sorted(run_dir.iterdir()):
        if p.name in MANIFEST["dirs"]:
            if p.is_symlink():
                out.append(p.name + "/")
            elif p.is_dir():
                out += [f"{p.name}/{c.name}" for c in sorted(p.iterdir()) if c.is_symlink()]
        elif p.is_symlink() and _matches(p.name, OWN_FILES):
            out.append(p.name)
    return out


def folder_names(run_dir: Path) -> list[str]:
    """The names fedlora writes as files in `run_dir` (the lock, the marker, `MANIFEST`'s files
    and their ``.tmp``) that are folders: a run refuses them rather than fail on its first write
    there, after rounds it trained (fedlora never deletes a folder it did not write)."""
    return [
        p.name + "/"
        for p in sorted(run_dir.iterdir())
        if not p.is_symlink() and p.is_dir() and _matches(p.name, OWN_FILES)
    ]


def is_never_started(run_dir: Path, names: list[str]) -> bool:
    """Only what a run that failed before its first round leaves, and fedlora's marker."""
    return (run_dir / MARKER_NAME).is_file() and all(
        _matches(n, list(NEVER_STARTED)) for n in names
    )


def _first_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.readline(1 << 20).decode("utf-8")
    except (OSError, ValueError):
        return ""


def has_legacy_evidence(run_dir: Path) -> bool:
    """A run of a fedlora older than the marker recorded something here: a checkpoint, a
    metrics.jsonl whose first line is a fedlora round, or a fedlora summary.json (a user's
    files of the same names are not enough)."""
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir() and not ckpt.is_symlink() and any(ckpt.glob("round-*")):
        return True
    if is_metrics_line(_first_line(run_dir / METRICS_FILE)):
        return True
    try:
        summary = read_summary(run_dir / SUMMARY_FILE)
    except DataError:
        return False
    return summary.rounds is not None and summary.stop_reason is not None
