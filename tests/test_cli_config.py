"""`fedlora config show`: the resolved TOML on stdout; bad input -> stderr, exit 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedlora.cli import main
from fedlora.config import ExperimentConfig, config_from_dict, dump_toml, load_config


def test_config_show_in_a_fresh_process_prints_the_defaults():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fedlora.cli", "config", "show"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout == dump_toml(ExperimentConfig())
    assert config_from_dict(tomllib.loads(proc.stdout)) == ExperimentConfig()


def test_config_show_applies_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "exp.toml"
    path.write_text("[data]\nn_clients = 2\n[training]\nrounds = 3\n", encoding="utf-8")
    code = main(["config", "show", "--config", str(path), "training.rounds=5", "method.q=[1, 0.5]"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    shown = tomllib.loads(out)
    assert shown["training"]["rounds"] == 5
    assert shown["data"]["n_clients"] == 2
    assert shown["method"]["q"] == [1.0, 0.5]
    # what is shown is the full config: it loads back to the same experiment
    assert config_from_dict(shown) == load_config(path, ["training.rounds=5", "method.q=[1, 0.5]"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["config", "show", "method.q=[0, 1]"], "method.q[0] = 0.0 is invalid"),
        (["config", "show", "lora.rank=0"], "lora.rank = 0 is invalid"),
        (["config", "show", "trainng.rounds=3"], "did you mean 'training'"),
        (["config", "show", "training.rounds"], "expected section.key=value"),
        (["config", "show", "--config", "/nonexistent/x.toml"], "cannot read config file"),
    ],
)
def test_config_show_bad_input_exits_2_with_the_message_on_stderr(argv, message, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("fedlora config: error: ")
    assert message in err
    assert "Traceback" not in err


def test_malformed_config_file_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nrounds = = 3\n", encoding="utf-8")
    assert main(["config", "show", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and "line 2" in err and "Traceback" not in err


def test_help_lists_the_config_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "config" in capsys.readouterr().out
    assert main([]) == 0  # no command: help, success
    assert "usage: fedlora" in capsys.readouterr().out


def test_config_without_an_action_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config"])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
