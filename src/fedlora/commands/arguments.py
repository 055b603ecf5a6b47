"""Arguments that several subcommands share, declared and checked in one place: the
experiment and its run directory (`run`, `flower run-local`, `flower simulate`), target
accuracies (`compare`, `report`), and the command line a report quotes."""

from __future__ import annotations

import argparse
import sys

from fedlora.errors import bad_value


def add_experiment_arguments(
    p: argparse.ArgumentParser, *, out_help: str, out_required: bool = False, resume: bool = True
) -> None:
    """``--config``, the ``section.key=value`` overrides, ``--out``, ``--resume RUN_DIR``
    (unless `resume` is False) and ``--overwrite``, in this order."""
    p.add_argument("--config", "-c", help="experiment TOML (defaults otherwise)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument("--out", "-o", required=out_required, help=out_help)
    if resume:
        p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")


def add_target_argument(p: argparse.ArgumentParser) -> None:
    """``--target TASK=ACC``, repeatable; read with `parse_targets`."""
    p.add_argument(
        "--target", action="append", metavar="TASK=ACC", help="target accuracy of a task"
    )


def parse_targets(values: list[str] | None) -> dict[str, float]:
    """``TASK=ACCURACY`` pairs (accuracy in (0, 1], or a percentage like 50%)."""
    targets: dict[str, float] = {}
    for text in values or []:
        task, sep, value = text.partition("=")
        if not sep or not task.strip():
            raise bad_value("--target", text, "TASK=ACCURACY, e.g. arc-e=0.5")
        try:
            acc = float(value.rstrip("%")) / (100.0 if value.endswith("%") else 1.0)
        except ValueError:
            raise bad_value(
                "--target", text, "TASK=ACCURACY with a number, e.g. arc-e=0.5"
            ) from None
        if not 0 < acc <= 1:
            raise bad_value("--target", text, "an accuracy in (0, 1] (or 1%..100%)")
        targets[task.strip()] = acc
    return targets


def shell_argv() -> list[str]:
    """The arguments of the `fedlora` command typed in a shell; empty when fedlora runs inside
    another program (tests, a notebook), whose sys.argv is not fedlora's."""
    return sys.argv[1:] if sys.argv and sys.argv[0].endswith("fedlora") else []
