"""Shared by the Flower tests (test_flower_*.py): the tiny experiment and where the data is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config

REPO = Path(__file__).resolve().parents[1]
DATA = os.environ.get("FEDLORA_DATA", str(REPO.parent / "shared" / "data" / "commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason=f"no data at {DATA}")

TINY = """
[model]
name = "tiny-llama"
dtype = "fp32"
threads = 1
[lora]
rank = 4
layers = "all"
[data]
data_dir = "{data}"
n_clients = 2
train_limit = 40
eval_limit = 8
tasks = ["arc-e"]
max_seq_len = 64
[training]
rounds = {rounds}
local_steps = 2
batch_size = 2
slots = 1
eval_every = 1
checkpoint_every = 1
seed = 3
[method]
q = {q}
k = "uniform"
"""


def write_config(tmp_path: Path, rounds: int, q: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(TINY.format(data=Path(DATA).resolve(), rounds=rounds, q=q), encoding="utf-8")
    return path


def final_global(run_dir: Path) -> dict[str, np.ndarray]:
    from fedlora.federation.checkpoints import load_checkpoint

    state = load_checkpoint(run_dir)
    return {k: np.asarray(v) for k, v in state["global"].items()}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def engine_run(config_path: Path, tmp_path: Path) -> Path:
    """fedlora's own engine on the same config (run once per test)."""
    from fedlora.federation.run import prepare_run_dir, run_experiment

    ref = tmp_path / "engine-run"
    if not (ref / "summary.json").exists():
        cfg = load_config(config_path)
        prepare_run_dir(cfg, ref)
        run_experiment(cfg, ref, quiet=True)
    return ref


def assert_matches_engine(out: Path, config_path: Path, tmp_path: Path) -> None:
    """Same sampled sets, ranks and final adapter as the engine on the same config."""
    ref = engine_run(config_path, tmp_path)
    flower_lines, engine_lines = read_metrics(out), read_metrics(ref)
    assert [x["participants"] for x in flower_lines] == [x["participants"] for x in engine_lines]
    assert [x["k"] for x in flower_lines] == [x["k"] for x in engine_lines]
    assert all(x["dropouts"] == [] for x in flower_lines)
    got, want = final_global(out), final_global(ref)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(not np.allclose(v, 0) for k, v in got.items() if k.endswith("lora_B"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == len(engine_lines) - 1 and summary["runtime"] == "flower"
    assert (out / "adapter").is_dir()
