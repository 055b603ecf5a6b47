"""fedlora.commands.arguments: the arguments `run`, `flower run-local|simulate`, `compare` and
`report` share (issue 11: declared once)."""

from __future__ import annotations

import argparse
import sys

import pytest

from fedlora.commands.arguments import (
    add_experiment_arguments,
    add_target_argument,
    parse_targets,
    shell_argv,
)
from fedlora.errors import ConfigError


def test_experiment_arguments_parse_like_every_experiment_command() -> None:
    p = argparse.ArgumentParser()
    add_experiment_arguments(p, out_help="run directory")
    args = p.parse_args(["-c", "exp.toml", "training.rounds=2", "--out", "r", "--overwrite"])
    assert (args.config, args.overrides, args.out) == ("exp.toml", ["training.rounds=2"], "r")
    assert args.overwrite and args.resume is None


def test_experiment_arguments_without_resume_and_with_a_required_out() -> None:
    p = argparse.ArgumentParser()
    add_experiment_arguments(p, out_help="run directory", out_required=True, resume=False)
    assert not hasattr(p.parse_args(["--out", "r"]), "resume")
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_targets_are_fractions_or_percentages() -> None:
    p = argparse.ArgumentParser()
    add_target_argument(p)
    args = p.parse_args(["--target", "arc-e=0.5", "--target", " boolq =75%"])
    assert parse_targets(args.target) == {"arc-e": 0.5, "boolq": 0.75}
    assert parse_targets(None) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [("arc-e", "TASK=ACCURACY, e.g."), ("=0.5", "TASK=ACCURACY, e.g."),
     ("arc-e=high", "with a number"), ("arc-e=0", r"in \(0, 1\]"), ("arc-e=120%", r"in \(0, 1\]")],
)  # fmt: skip
def test_bad_targets_name_the_argument(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"--target = .*{message}"):
        parse_targets([text])


def test_shell_argv_is_fedlora_s_own_command_line_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fedlora", "report", "runs/x"])
    assert shell_argv() == ["report", "runs/x"]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/pytest", "-q"])
    assert shell_argv() == []
