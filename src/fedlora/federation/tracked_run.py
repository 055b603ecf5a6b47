"""A run's open trackers (`Trackers`, from `open_trackers`): every metrics line logged to
each, and at the end closed as finished, with the run's files as artifacts, or as FAILED.

A run that ends any other way than by finishing closes its tracked runs as FAILED: an
exception (the round loop's), Ctrl-C or any exit of the process with trackers still open
(`atexit`), and SIGTERM, which unwinds like an exception while trackers are open (exit 143).
The trackers themselves and their table are `fedlora.federation.tracking`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import cut
from fedlora.federation.tracking import Tracker, check_trackers, scalars, tracker_class

__all__ = ["ARTIFACTS", "Trackers", "open_trackers", "close_open_trackers"]

ARTIFACTS = ("config.toml", "summary.json", "metrics.jsonl", "report.md", "adapter")

_OPEN: list[Trackers] = []  # opened and not yet finished: closed as FAILED at exit


class Trackers:
    """The run's open trackers (none: every call does nothing)."""

    def __init__(self, trackers: list[Tracker], run_dir: Path) -> None:
        self.trackers, self.run_dir = trackers, run_dir
        self._sigterm = False
        if trackers:
            _OPEN.append(self)
            self._sigterm = _unwind_on_sigterm()

    def log(self, line: dict[str, Any]) -> None:
        """One metrics line, at step = its round."""
        if self.trackers:
            values = scalars(line)
            for t in self.trackers:
                t.log_metrics(int(line["round"]), values)

    def finish(self, run_dir: Path | None = None, *, failed: bool = False) -> None:
        """Close every tracker: finished (the run's files as artifacts: after summary.json
        and the adapter were written) or FAILED. A failure to close a FAILED run is said on
        stderr, not raised (the run's own error is the one to see); when a finished run's
        tracker fails, the others close as FAILED and the error is raised."""
        trackers, self.trackers = self.trackers, []
        if self in _OPEN:
            _OPEN.remove(self)
        run_dir = Path(run_dir or self.run_dir)
        error: Exception | None = None  # the first failure of a finished run's close
        try:
            for t in trackers:
                try:
                    if not failed and error is None:
                        for name in ARTIFACTS:
                            if (run_dir / name).exists():
                                t.log_artifact(run_dir / name)
                        t.close(failed=False)
                    else:  # the others still close: as FAILED
                        t.close(failed=True)
                except Exception as e:  # noqa: BLE001 - see the docstring
                    if failed or error is not None:
                        print(
                            f"fedlora: tracker {t.name} not closed: {cut(str(e))}", file=sys.stderr
                        )
                    else:
                        error = e
                        with contextlib.suppress(Exception):
                            t.close(failed=True)
            if error is not None:
                raise error
        finally:
            if self._sigterm and signal.getsignal(signal.SIGTERM) is _terminated:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm = False


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _unwind_on_sigterm() -> bool:
    """SIGTERM raises SystemExit(143) (the round loop's clean-up runs, the trackers close as
    FAILED), when nobody else handles it; True when installed here."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _terminated)
    return True


def close_open_trackers() -> None:
    """Close, as FAILED, every tracker opened in this process and not finished (at exit)."""
    for trackers in list(_OPEN):
        trackers.finish(failed=True)


_at_exit = threading.Lock()
_registered: list[bool] = []


def open_trackers(
    cfg: ExperimentConfig, run_dir: Path, *, resume: bool, next_step: int
) -> Trackers:
    """The trackers of `output.trackers`, open; `next_step`: the first round this process
    logs. A tracker that fails to open closes the ones opened before it as FAILED."""
    check_trackers(cfg)
    opened: list[Tracker] = []
    try:
        for name in cfg.output.trackers:
            tracker = tracker_class(name)()
            tracker.open(cfg, run_dir, resume=resume, next_step=next_step)
            opened.append(tracker)
    except BaseException:
        Trackers(opened, run_dir).finish(failed=True)
        raise
    with _at_exit:
        if opened and not _registered:  # after MLflow's own: runs before them at exit
            atexit.register(close_open_trackers)
            _registered.append(True)
    return Trackers(opened, run_dir)
