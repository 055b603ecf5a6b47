"""metrics.jsonl, owned here: one JSON line per round, appended and fsynced
(`append_metrics`); read back by one torn-line rule (`read_metrics`, `read_metrics_lines`:
only the last line may be torn, and is dropped); a resume cuts it back to the lines its
checkpoint recorded (`restore_metrics`, `truncate_metrics`). The run directory's other files
are `fedlora.federation.runfiles`'.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlora.errors import DataError
from fedlora.federation.runfiles import SUMMARY_FILE, read_run_text
from fedlora.files import append_file, atomic_write, remove_own_file

__all__ = [
    "METRICS_FILE",
    "append_metrics",
    "is_metrics_line",
    "read_metrics_lines",
    "read_metrics",
    "truncate_metrics",
    "restore_metrics",
]

METRICS_FILE = "metrics.jsonl"


def append_metrics(path: Path, line: dict[str, Any]) -> None:
    """One line appended and fsynced, never through a link (`fedlora.files.append_file`)."""
    append_file(path, (json.dumps(line) + "\n").encode("utf-8"))


# The one torn-line rule. A metrics line is a JSON object with `round` and `sim_time_s`, one a
# line. Only the LAST line may be torn (a run killed mid-write) or foreign: it is dropped, with
# a warning naming the file and the line. Any other line that is not a metrics line means the
# file is damaged: a DataError naming the file and the line. Blank lines are skipped; a missing
# file holds no lines.


def _metrics_line(raw: str) -> tuple[dict[str, Any] | None, str]:
    """(the line, "") for a metrics line, else (None, why it is not one)."""
    try:
        line = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or an integer of thousands of digits
        return None, f"is not JSON ({getattr(e, 'msg', e)})"
    if not isinstance(line, dict):
        return None, "is not a fedlora metrics line (not a JSON object)"
    missing = [key for key in ("round", "sim_time_s") if key not in line]
    if missing:
        return None, f"is not a fedlora metrics line (no {', '.join(missing)})"
    return line, ""


def is_metrics_line(raw: str) -> bool:
    """Whether one line of text is a fedlora metrics line (JSON with round and sim_time_s)."""
    return _metrics_line(raw)[0] is not None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _scan_metrics(path: Path, warn: Callable[[str], Any] | None) -> list[tuple[str, dict]]:
    """(text, line) of every metrics line of `path`, by the one rule above."""
    if not path.exists():
        return []
    text = read_run_text(path, "metrics file")
    numbered = [(i + 1, raw) for i, raw in enumerate(text.split("\n")) if raw.strip()]
    out = []
    for j, (number, raw) in enumerate(numbered):
        line, problem = _metrics_line(raw)
        if line is not None:
            out.append((raw, line))
        elif j < len(numbered) - 1:
            raise DataError(
                f"metrics file {str(path)!r}: line {number} {problem}; only the last line may "
                "be torn: the file is damaged"
            )
        elif warn is not None:
            warn(
                f"warning: {path}: dropped its last line {number}, which {problem} "
                "(a run stopped while writing it?)"
            )
    return out


def read_metrics_lines(path: Path, warn: Callable[[str], Any] | None = None) -> list[str]:
    """The metrics lines of `path` as written (JSON text), by the one rule above; a dropped
    last line is reported to `warn` (silent when None)."""
    return [raw for raw, _ in _scan_metrics(path, warn)]


def read_metrics(path: Path, warn: Callable[[str], Any] | None = _stderr) -> list[dict[str, Any]]:
    """The metrics lines of `path` as dicts, by the one rule above (a dropped last line is
    warned about on stderr by default). Dicts, not a dataclass: a line's keys depend on the
    method, the eval tasks and the runtime, and a reader must keep the keys of older or
    newer runs it does not know."""
    return [line for _, line in _scan_metrics(path, warn)]


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
        if (path.parent / SUMMARY_FILE).exists() and _has_lines(path):
            raise DataError(
                f"{str(path.parent)!r}: its checkpoints are gone but {path.name} holds the "
                "finished run's rounds, which a resume would have to discard: restore "
                "checkpoints/ from a backup, or start the run again with --overwrite "
                "(or another --out)"
            )
        remove_own_file(path)
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
