"""fedlora.federation.flower.common: the run config, env safety and the methods Flower refuses
(split from test_flower.py, issue 11; the process helpers are in test_flower_deploy.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.flower.common import (
    SAFE_ENV,
    FlowerOptions,
    config_from_run_config,
    safe_env,
)
from flower_cases import REPO, write_config

# ----------------------------------------------------------------------------- fast


def test_run_config_maps_to_fedlora_config(tmp_path: Path) -> None:
    # Prepare
    path = write_config(tmp_path, rounds=2, q='"full"')
    run_config = {
        "fedlora-config": str(path),
        "fedlora-overrides": "training.rounds=5 'method.q=[0.5, 0.25]'",
        "out-dir": str(tmp_path / "out"),
        "round-timeout-s": 30.0,
        "availability": "observed",
    }
    # Execute
    cfg, opts = config_from_run_config(run_config)
    # Assert
    expected = load_config(path, ["training.rounds=5", "method.q=[0.5, 0.25]"])
    assert cfg == expected
    assert cfg.method.q == (0.5, 0.25) and cfg.training.rounds == 5
    assert opts == FlowerOptions(
        out_dir=str(tmp_path / "out"), round_timeout_s=30.0, availability="observed"
    )


def test_run_config_defaults_are_fedlora_defaults() -> None:
    cfg, opts = config_from_run_config({})
    assert cfg == load_config()
    assert opts == FlowerOptions()


@pytest.mark.parametrize(
    ("run_config", "field"),
    [
        ({"round-timout-s": 3.0}, "round-timout-s"),
        ({"round-timeout-s": 0.0}, "round-timeout-s"),
        ({"poll-interval-s": -1.0}, "poll-interval-s"),
        ({"availability": "guess"}, "availability"),
        ({"fedlora-overrides": "training.rounds=0"}, "training.rounds"),
        ({"fedlora-overrides": "'unclosed"}, "fedlora-overrides"),
        ({"fedlora-overrides": 3}, "fedlora-overrides"),
    ],
)
def test_bad_run_config_names_the_field(run_config: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_run_config(run_config)


def test_pyproject_declares_the_flower_app_and_every_run_config_key() -> None:
    import tomllib

    from fedlora.federation.flower.common import RUN_CONFIG_KEYS

    app = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fedlora.federation.flower.server_app:app",
        "clientapp": "fedlora.federation.flower.client_app:app",
    }
    assert set(app["config"]) == set(RUN_CONFIG_KEYS)
    # the declared defaults are valid
    config_from_run_config({k: v for k, v in app["config"].items()})


def test_safe_env_turns_off_telemetry_update_check_and_ray_stats() -> None:
    env = safe_env({"PATH": "/bin", "FLWR_TELEMETRY_ENABLED": "1"})
    assert env["FLWR_TELEMETRY_ENABLED"] == "0"
    assert env["FLWR_DISABLE_UPDATE_CHECK"] == "1"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["PATH"] == "/bin"
    assert set(SAFE_ENV) <= set(env)


def test_importing_the_apps_sets_the_safe_env() -> None:
    import fedlora.federation.flower.client_app  # noqa: F401
    import fedlora.federation.flower.server_app  # noqa: F401

    for key, value in SAFE_ENV.items():
        assert os.environ[key] == value


def test_client_app_imports_only_light_modules() -> None:
    # Flower starts a fresh ClientApp process per message: its imports are paid every round
    code = (
        "import sys, fedlora.federation.flower.client_app; "
        "print(sorted(m for m in ('torch', 'transformers', 'fedlora.federation.engine', 'fedlora.llm.data', "
        "'fedlora.federation.methods', 'scipy') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=safe_env()
    )
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("overrides", "allowed"),
    [(["method.name=sketched"], True), (["method.name=fedavg"], True),
     (["method.name=fedstacklora"], False), (["method.name=proposed"], False),
     (["method.name=proposed", "method.q={plan}", "method.k={plan}"], True)],
)  # fmt: skip
def test_flower_refuses_methods_it_cannot_run_like_the_engine(
    tmp_path: Path, overrides: list[str], allowed: bool
) -> None:
    from fedlora.federation.flower.common import check_flower_method

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    cfg = load_config(None, [o.format(plan=f'"{plan}"') for o in overrides])
    if allowed:
        check_flower_method(cfg)
    else:
        with pytest.raises(ConfigError, match=f"method.name = '{cfg.method.name}'"):
            check_flower_method(cfg)


def test_cli_refuses_fedstacklora_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedlora.cli import main

    out = tmp_path / "run"
    for action in ("run-local", "simulate"):
        assert main(["flower", action, "--out", str(out), "method.name=fedstacklora"]) == 2
        assert "fedstacklora" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- node worker


def test_a_node_builds_a_new_adapter_when_the_method_changes() -> None:
    # Fed-SB's adapter has an R factor the others lack: a node process that ran one method
    # must not hand its cached adapter to a run of another (same model, lora and data)
    from fedlora.federation.flower.node import _cache_key

    keys = {_cache_key(load_config(None, [f"method.name={m}"])) for m in ("sketched", "fedsb")}
    assert len(keys) == 2
