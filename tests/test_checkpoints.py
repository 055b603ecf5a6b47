"""fedlora.federation.checkpoints: a checkpoint round-trips exactly through safetensors, an old
pickle checkpoint is still read, and one that would run code is refused for the previous one
(split from test_rundir.py, issue 11)."""

from __future__ import annotations

import os

import numpy as np
import torch

from fedlora.federation.checkpoints import checkpoint_paths, load_checkpoint, save_checkpoint


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _tiny_state(round_index: int) -> dict:
    return {
        "round": round_index,
        "progress": {"round": round_index, "metrics_lines": 0},
        "global": {"l.A": torch.ones(2, 3)},
    }


def test_a_malicious_checkpoint_is_not_executed_and_the_previous_one_is_used(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run, _tiny_state(2))
    marker = tmp_path / "pwned"
    torch.save({"round": 99, "global": _Evil(str(marker))}, run / "checkpoints/round-000099.pt")
    warnings: list[str] = []
    state = load_checkpoint(run, warn=warnings.append)
    assert not marker.exists()
    assert state is not None and state["round"] == 2
    assert "round-000099.pt" in warnings[0] and "run code" in warnings[0]


def test_checkpoint_is_safetensors_and_round_trips_exactly(tmp_path):
    lines = ['{"round": 0, "sim_time_s": 0.1}', '{"round": 1, "sim_time_s": 1e-300}']
    (tmp_path / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    state = {
        "round": 1,
        "progress": {"round": 1, "metrics_lines": 2, "sim_time_s": 0.1 + 0.2},
        "global": {"l.A": torch.randn(2, 3), "l.B": torch.randn(3, 2).to(torch.bfloat16)},
        "base_delta": {"l": np.random.default_rng(0).normal(size=(3, 3)).astype(np.float32)},
        "method": {"counts": np.arange(3)},
        "flower": {"asked": [1, 2]},
    }
    path = save_checkpoint(tmp_path, state)
    assert path.name == "round-000001.safetensors"
    back = load_checkpoint(tmp_path)
    assert back["progress"] == state["progress"] and back["method"] == {"counts": [0, 1, 2]}
    assert all(torch.equal(back["global"][k], v) for k, v in state["global"].items())
    assert back["global"]["l.B"].dtype == torch.bfloat16
    np.testing.assert_array_equal(back["base_delta"]["l"], state["base_delta"]["l"])
    assert back["metrics"] == lines


def test_an_old_pickle_checkpoint_is_still_readable(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    delta = np.arange(6, dtype=np.float32).reshape(2, 3)
    old = {"round": 3, "progress": {"round": 3, "metrics_lines": 4}, "global": {"a": torch.ones(2)},
           "base_delta": {"l": delta}, "method": {}, "seed": 0, "rng": "derived"}  # fmt: skip
    torch.save(old, tmp_path / "checkpoints/round-000003.pt")
    state = load_checkpoint(tmp_path)
    assert state["round"] == 3 and torch.equal(state["global"]["a"], torch.ones(2))
    np.testing.assert_array_equal(state["base_delta"]["l"], delta)


def test_only_the_newest_checkpoints_are_kept_newest_first(tmp_path):
    for r in (1, 2, 3):
        save_checkpoint(tmp_path, _tiny_state(r), keep=2)
    names = [p.name for p in checkpoint_paths(tmp_path)]
    assert names == ["round-000003.safetensors", "round-000002.safetensors"]
    assert load_checkpoint(tmp_path)["round"] == 3


def test_a_run_without_checkpoints_loads_none(tmp_path):
    assert load_checkpoint(tmp_path) is None
