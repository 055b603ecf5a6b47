"""A quiet terminal: what other libraries print (transformers' deprecation notices, weight
loading and download progress bars, MLflow's store messages, Python warnings raised outside
fedlora) is silenced unless ``fedlora --verbose``; fedlora's own messages, progress bars and
warnings are unchanged. A silenced Python warning still goes to the ``fedlora.libraries``
logger (DEBUG), so an embedding program can route it to its log."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

FEDLORA_DIR = str(Path(__file__).resolve().parents[1])  # src/fedlora
LIBRARY_LOGGERS = ("mlflow", "alembic", "absl", "urllib3", "filelock", "datasets", "peft")
_log = logging.getLogger("fedlora.libraries")
_log.addHandler(logging.NullHandler())
_log.propagate = False


def quiet_libraries(verbose: bool) -> None:
    """Silence other libraries' terminal output for this process and the processes it starts
    (environment variables), unless `verbose`."""
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # weight loading, downloads
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:  # imported already: the variables came too late
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # Flower's own progress lines stay; its notices about its deprecated APIs (which fedlora,
    # not the user, calls) do not
    flwr = logging.getLogger("flwr")
    if not any(getattr(f, "fedlora_quiet", False) for f in flwr.filters):
        flwr.addFilter(_not_deprecation)
    warnings.showwarning = _show_own_warnings(warnings.showwarning)


def _not_deprecation(record: logging.LogRecord) -> bool:
    return "DEPRECATED FEATURE" not in record.getMessage()


_not_deprecation.fedlora_quiet = True  # type: ignore[attr-defined]


def _show_own_warnings(show):  # noqa: ANN001, ANN202 - warnings.showwarning's signature
    if getattr(show, "fedlora_quiet", False):
        return show

    def showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if str(filename).startswith(FEDLORA_DIR):
            show(message, category, filename, lineno, file, line)
        else:
            _log.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)

    showwarning.fedlora_quiet = True  # type: ignore[attr-defined]
    return showwarning
