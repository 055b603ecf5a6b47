"""The Trainer interface of the one round loop (`fedlora.federation.engine.run_rounds`): a
trainer that loses a participant every round is aggregated, clocked and recorded by the same
loop as the in-process one (the Flower ServerApp's trainer relies on this)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from fedlora.config import load_config
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.engine import run_rounds
from fedlora.federation.methods.base import RoundPlan
from fedlora.federation.run import prepare_run_dir
from fedlora.federation.runstate import build_run
from fedlora.federation.trainer import SlotTrainer, Trained
from fedlora.llm.device import resolve_runtime

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
TINY = [
    "model.name=tiny-llama", "model.dtype=fp32", "model.threads=1", f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]', "data.train_limit=24", "data.eval_limit=8", "data.max_seq_len=64",
    "data.n_clients=4", "data.min_client_examples=2", "lora.rank=4", 'lora.layers="all"',
    "training.rounds=2", "training.local_steps=1", "training.batch_size=2", "training.slots=2",
    "training.eval_every=1", "training.checkpoint_every=1", "training.lr=0.05",
    "method.name=sketched", "method.q=full", "method.k=[1, 2, 4, 3]", "output.progress=false",
]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


class LosesTheLast(SlotTrainer):
    """Trains everyone, then loses the last participant's update (a dropout)."""

    def __init__(self, run) -> None:
        super().__init__(run)
        self.lost: list[int] = []

    def train(self, plan, global_state) -> Trained:
        trained = super().train(plan, global_state)
        kept = RoundPlan(plan.round, plan.tasks[:-1])
        self.lost.append(plan.tasks[-1].client)
        n = len(kept.tasks)
        return dataclasses.replace(
            trained, plan=kept, states=trained.states[:n], losses=trained.losses[:n],
            dropouts=[plan.tasks[-1].client],
        )  # fmt: skip

    def line_fields(self, trained):
        return {"lost": [] if trained is None else trained.dropouts}

    def state_dict(self):
        return {"lost": list(self.lost)}

    def load_state_dict(self, state):
        self.lost = list(state["lost"])

    def summary_fields(self):
        return {"lost_total": len(self.lost)}


def test_a_trainer_with_dropouts_runs_through_the_same_loop(tmp_path):
    # Prepare: every client takes part (q = 1), so each round has 4 tasks and loses one
    cfg = load_config(None, TINY)
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    run = build_run(resolve_runtime(cfg), run_dir, log=lambda m: None)
    trainer = LosesTheLast(run)
    # Execute
    summary = run_rounds(run, trainer, resume=False, log=lambda m: None,
                         wall_start=time.perf_counter())  # fmt: skip
    # Assert: the trainer's fields on every line, its state in the checkpoint, its summary key
    lines = _metrics(run_dir)
    assert [x["lost"] for x in lines] == [[], [3], [3]]
    assert all(x["n_participants"] == 4 for x in lines[1:])
    assert summary["lost_total"] == 2 and summary["calibration_sim_time_s"] == 0.0
    assert json.loads((run_dir / "summary.json").read_text())["lost_total"] == 2
    assert load_checkpoint(run_dir)["lost"] == [3, 3]
    # the clock charges the three senders only: less than a round where all four send
    prepare_run_dir(cfg, tmp_path / "other")
    full = build_run(resolve_runtime(cfg), tmp_path / "other", log=lambda m: None)
    everyone = run_rounds(full, SlotTrainer(full), resume=False, log=lambda m: None,
                          wall_start=time.perf_counter())  # fmt: skip
    assert summary["total_uplink_bits"] < everyone["total_uplink_bits"]
    # Execute again, resumed: the trainer's state comes back from the checkpoint
    again = LosesTheLast(build_run(resolve_runtime(cfg), run_dir, log=lambda m: None))
    run_rounds(again.run, again, resume=True, log=lambda m: None, wall_start=time.perf_counter())
    assert again.lost == [3, 3]
