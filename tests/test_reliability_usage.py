"""Issue 24: argparse's errors are one line, ``fedlora <command>: error: ...``, exit 2, without
the usage block above them (``--help`` still shows it)."""

from __future__ import annotations

import pytest

from fedlora.cli import main


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "--resume"], "argument --resume: expected one argument"),
        (["flower", "run-local", "--timeout-s", "abc"], "invalid float value: 'abc'"),
        (["flower", "nope"], "invalid choice: 'nope'"),
        (["plan"], "the following arguments are required: PROBLEM.json"),
        (["report"], "the following arguments are required: RUN_DIR"),
        (["eval", "--task"], "argument --task: expected one argument"),
        (["config", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_usage_errors_are_one_line(argv, expect, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith("fedlora") and ": error: " in err and expect in err, err


def test_help_still_shows_usage(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0 and "usage: fedlora" in capsys.readouterr().out
