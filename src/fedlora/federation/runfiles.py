"""The files a run appends to and rewrites, written so that a crash leaves each one whole.

- `atomic_write` writes a temporary file next to the target, fsyncs it and renames it over
  the target: a reader sees the old content or the new, never half of it.
- metrics.jsonl gets one JSON line per round, fsynced (`append_metrics`); reading it back
  stops at the first torn or foreign line (`read_metrics_lines`), and a resume cuts it back
  to the lines its checkpoint recorded (`restore_metrics`, `truncate_metrics`).
- `os_error_message` is the one-line message for a failed write (a full disk named as such).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from fedlora.errors import DataError


def _named(e: OSError, path: Path) -> OSError:
    """`e` with the file named (a failed write or fsync does not name it)."""
    return e if e.filename else OSError(e.errno, e.strerror, str(path))


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back
        raise _named(e, path) from None
    os.replace(tmp, path)


def os_error_message(e: OSError) -> str:
    """One line for an OSError; a full disk is named as such."""
    where = f" {e.filename!r}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on device while writing{where}: free some space, then run again "
            "(--resume DIR continues a run that had started)"
        )
    return f"{e.strerror or e}:{where}" if where else f"{e.strerror or e}"


def append_metrics(path: Path, line: dict[str, Any]) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _named(e, path) from None


def read_metrics_lines(path: Path) -> list[str]:
    """The complete JSON lines of a metrics file, in order; a torn or foreign line ends them.

    Non-UTF-8 bytes raise `DataError` naming the file."""
    if not path.exists():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{str(path)!r} is not UTF-8 text (byte {e.start}): the metrics file is damaged"
        ) from None
    lines = []
    for raw in text.split("\n")[:-1]:  # the last piece has no newline: torn or empty
        try:
            if not isinstance(json.loads(raw), dict):
                break
        except json.JSONDecodeError:
            break
        lines.append(raw)
    return lines


def truncate_metrics(path: Path, lines: int) -> None:
    """Cut metrics.jsonl back to its first `lines` lines (those a checkpoint recorded).

    Refuses (`DataError`) when fewer complete lines are there: rounds would be missing."""
    if not path.exists() and lines == 0:
        return
    kept = read_metrics_lines(path)
    if len(kept) < lines:
        raise DataError(
            f"{str(path)!r} holds {len(kept)} complete lines but the checkpoint recorded "
            f"{lines} (rounds {len(kept)}..{lines - 1} are missing) and, written by an older "
            "fedlora, does not hold them: restore the file from a backup, or start the run "
            "again with --overwrite"
        )
    atomic_write(path, "".join(line + "\n" for line in kept[:lines]).encode())


def _has_lines(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def restore_metrics(path: Path, state: dict[str, Any] | None, warn=print) -> None:
    """Make metrics.jsonl agree with the checkpoint a run resumes from.

    A checkpoint holds its metrics lines: they are written back exactly (whatever happened
    to the file since). Without a checkpoint the run starts over (the file is emptied),
    unless the run had finished (its checkpoints were deleted: refused, the metrics kept);
    an old checkpoint without lines falls back to `truncate_metrics`."""
    if state is None:
        # a finished run without checkpoints: they were deleted (a run killed before its
        # first checkpoint has no summary and starts over, as it would have anyway)
        if (path.parent / "summary.json").exists() and _has_lines(path):
            raise DataError(
                f"{str(path.parent)!r}: its checkpoints are gone but {path.name} holds the "
                "finished run's rounds, which a resume would have to discard: restore "
                "checkpoints/ from a backup, or start the run again with --overwrite "
                "(or another --out)"
            )
        path.unlink(missing_ok=True)
        return
    lines = state.get("metrics")
    if lines is None:
        truncate_metrics(path, int(state["progress"]["metrics_lines"]))
        return
    try:
        current = read_metrics_lines(path)
    except DataError:
        current = []
    if current[: len(lines)] != lines:
        warn(f"{path} did not match the checkpoint: rewrote its {len(lines)} lines from it")
    atomic_write(path, "".join(line + "\n" for line in lines).encode())
