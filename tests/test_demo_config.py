"""configs/demo.toml is the demo `make demo` runs: it holds every key `fedlora config show`
prints (so a reader sees the whole setting), and its protocol is the CPU protocol's."""

from __future__ import annotations

from pathlib import Path

import tomllib

from fedlora.config import load_config
from fedlora.config.toml_io import dump_toml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"


def _keys(tree: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
        else:
            out.add(prefix + k)
    return out


def test_demo_toml_holds_every_key_config_show_prints() -> None:
    written = _keys(tomllib.loads(DEMO.read_text()))
    shown = _keys(tomllib.loads(dump_toml(load_config(str(DEMO), []))))
    assert written == shown, (
        f"missing from demo.toml: {sorted(shown - written)}; unknown: {sorted(written - shown)}"
    )


def test_the_demo_is_the_cpu_protocols_setting_on_fresh_questions() -> None:
    cfg = load_config(str(DEMO), [])
    assert cfg.model.dtype == "fp32"  # one config for every CPU kind: no run-time choice
    assert cfg.method.name == "sketched" and cfg.data.n_clients == 10
    assert cfg.data.eval_seed == 1 and cfg.data.eval_exclude == ("arc-e:0",)
    assert cfg.evaluation.format == "harness" and cfg.data.eval_tasks == ("arc-e",)
    assert cfg.training.eval_every == cfg.training.rounds  # before and after only


def test_make_demo_runs_the_demo_config() -> None:
    make = (ROOT / "Makefile").read_text()
    assert "fedlora run --config configs/demo.toml" in make


def test_the_demo_follows_protocol_v2() -> None:
    # research/cpu_protocol/protocol_v2.md: client AdamW at lr 1e-3, a fresh optimizer per client and round
    cfg = load_config(str(DEMO), [])
    assert cfg.training.optimizer == "adamw" and cfg.training.lr == 1e-3
    assert cfg.training.optimizer_state == "reset" and cfg.training.weight_decay == 0.0
    assert cfg.training.rounds == 100 and cfg.training.local_steps == 5


def test_a_run_without_config_says_it_is_a_smoke_run_and_names_the_demo(tmp_path, capsys):
    from fedlora.cli import main
    from tiny_runs import TINY_EVAL_RUN

    rc = main(["run", "--out", str(tmp_path / "r"), *TINY_EVAL_RUN, "training.rounds=1"])
    err = capsys.readouterr().err
    assert rc in (0, None)
    assert "no --config: the built-in defaults (1 rounds) are a smoke run" in err
    assert "fedlora run --config configs/demo.toml" in err
    # a refusal stays one line: the note comes only after a run
    assert main(["run", "--out", str(tmp_path / "x"), "training.rounds=0"]) == 2
    assert "no --config" not in capsys.readouterr().err
    # with a config the note is not printed
    conf = tmp_path / "c.toml"
    conf.write_text("[training]\nrounds = 1\n")
    main(["run", "--config", str(conf), "--out", str(tmp_path / "s"), *TINY_EVAL_RUN[:-3]])
    assert "no --config" not in capsys.readouterr().err
