"""In-run calibration and re-planning of `proposed` (its round hooks, methods/proposed_replan):
a tiny random-init model end to end; the probes are the run's own rounds; a resumed run
replays the same fits and plans bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation import engine
from fedlora.federation.calibration import prepare_proposed
from fedlora.federation.methods.proposed_replan import probe_schedule
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.run import run as run_entry
from planner_cases import drive_theorem1, model_free_proposed

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

TINY = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "boolq"]',
    "data.train_limit=64",
    "data.eval_limit=8",
    "data.max_seq_len=96",
    "data.n_clients=8",
    "data.min_client_examples=4",
    "lora.rank=4",
    'lora.layers="all"',
    "training.rounds=12",
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=2",
    "training.eval_every=12",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    "method.name=proposed",
    "planner.probe_rounds=2",
    "planner.replan_every=2",
    "planner.replan_margin=0",
    "output.progress=false",
]


def _metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k != "compute_s"} for m in lines]


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_probe_schedule_is_palindromic():
    assert probe_schedule(1) == [0, 1, 2, 3]
    assert probe_schedule(2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert probe_schedule(3) == [0, 0, 1, 1, 2, 2, 3, 3, 3, 2, 1, 0]


def test_replan_needs_in_run_calibration():
    with pytest.raises(ConfigError, match="planner.replan_every = 2 needs"):
        load_config(None, ["planner.calibration=separate", "planner.replan_every=2"])


def test_in_run_probes_fit_replan_and_bit_identical_resume(tmp_path):
    cfg = load_config(None, TINY)
    # Execute: the uninterrupted run
    ref = tmp_path / "ref"
    summary = run_entry(cfg, ref, quiet=True, log=lambda m: None)
    lines = _metrics(ref)
    # Assert: rounds 1-8 are the probes (every client alike at (0.3, 4), (0.15, 4), (0.3, 1),
    # (0.15, 1), then back) on the run's own clock, the fit after round 8, re-plans after 10, 12
    assert not (ref / "calibration").exists()  # no separate runs
    assert summary["calibration_sim_time_s"] == 0.0
    assert lines[0]["sim_time_s"] == 0.0 and lines[4]["sim_time_s"] > 0
    for r, k in zip(range(1, 9), (4, 4, 1, 1, 1, 1, 4, 4)):
        assert all(x == k for x in lines[r]["k"]), (r, lines[r]["k"])
    fits = [(m["round"], m["planner"]["kind"]) for m in lines if "planner" in m]
    assert fits == [(8, "calibration"), (10, "replan"), (12, "replan")]
    plan = json.loads((ref / "plan.json").read_text())
    assert plan["calibration"]["mode"] == "in-run" and len(plan["history"]) == 3
    first = lines[8]["planner"]
    if "error" not in first:  # the tiny model's loss may not fall: then the documented fallback
        assert set(first["fit"]["constants"]) == {"A", "B", "C", "D"}
        a = [float(r.split(",")[2]) for r in (ref / "clients.csv").read_text().splitlines()[1:]]
        assert all(x / q <= 1 + 1e-9 for x, q in zip(a, first["plan"]["q"]))  # max_weight = 1
    else:
        assert first["fallback"].startswith("probe")
    assert summary["plan"]["calibration_mode"] == "in-run" and len(summary["plan"]["fits"]) == 3
    assert summary["plan"]["rounds_run"] == 12
    # Execute: the same run stopped after round 9 (between the fit and the first re-plan),
    # then resumed from its checkpoint
    cut = tmp_path / "cut"
    prepare_run_dir(cfg, cut)
    cfg2, plan_value = prepare_proposed(cfg, cut, run_one=None, log=lambda m: None)  # in-run
    run_experiment(cfg2, cut, quiet=True, log=lambda m: None, plan=plan_value,
                          stop=lambda line: line["round"] == 9)  # fmt: skip
    assert len(_metrics(cut)) == 10
    run_entry(cfg, cut, resume=True, quiet=True, log=lambda m: None)
    # Assert: bit-identical metrics, fits, plans and adapter
    assert _metrics(cut) == lines
    assert json.loads((cut / "plan.json").read_text()) == plan
    a, b = _adapter(ref), _adapter(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fake_run(tmp_path, *extra):
    """A `proposed` method and what its round hooks see of a run, without a model: 10
    clients (tests/planner_cases.py)."""
    method, ctx = model_free_proposed(tmp_path, *extra)
    return SimpleNamespace(ctx=ctx, method=method)


def _drive(run, rounds, constants_at):
    """Rounds whose loss follows Theorem 1's model for the q, k in force (no noise)."""
    return drive_theorem1(run.method, run.ctx, rounds, constants_at)


def test_in_run_fit_is_exact_and_a_consistent_world_keeps_the_plan(tmp_path):
    run = _fake_run(tmp_path, "planner.replan_every=4")
    lines = _drive(run, 16, lambda r: (40.0, 0.02, 0.002))
    first = lines[7]["planner"]
    assert first["kind"] == "calibration" and first["adopted"] and first["fit"]["floors"] == {}
    c = first["fit"]["constants"]
    assert [c["A"], c["C"], c["D"]] == pytest.approx([40.0, 0.02, 0.002], rel=1e-6)
    # the plan's own rounds confirm the model: the refit is the same, predicted gain ~ 0, kept
    for r in (11, 15):
        entry = lines[r]["planner"]
        assert entry["kind"] == "replan" and not entry["adopted"]
        assert abs(entry["predicted_gain"]) < 1e-6
    assert all(x >= 0.1 - 1e-12 for x in run.method.q)  # max_weight = 1: q_n >= a_n


def test_replan_adopts_a_plan_only_past_the_margin(tmp_path):
    # after the probes the world gets noisier (true C 0.02 -> 0.3): the plan's rounds progress
    # slower than predicted, the refit raises C, and the new plan is adopted when its predicted
    # gain exceeds the margin (5%), kept when the margin is 99%
    def world(r):
        return (40.0, 0.02 if r < 8 else 0.3, 0.002)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = _fake_run(tmp_path / "a", "planner.replan_every=4")
    lines = _drive(run, 12, world)
    entry = lines[11]["planner"]
    assert entry["fit"]["constants"]["C"] > 0.02 * 1.5
    assert entry["predicted_gain"] > 0.05 and entry["adopted"]
    strict = _fake_run(tmp_path / "b", "planner.replan_every=4", "planner.replan_margin=0.99")
    kept = _drive(strict, 12, world)[11]["planner"]
    assert kept["predicted_gain"] == pytest.approx(entry["predicted_gain"])
    assert not kept["adopted"]


def test_proposed_rank_rule_is_its_own_preflight_check(tmp_path):
    # lora.rank = 1 cannot tell C from D: refused by preflight (Proposed.check_run), before a
    # run directory exists; with a plan file (no calibration) rank 1 is the plan's business
    from fedlora.federation.preflight import check_inputs

    cfg = load_config(None, [*TINY, "lora.rank=1"])
    with pytest.raises(
        ConfigError, match=r"lora\.rank = 1 is invalid for method.name = 'proposed'"
    ):
        check_inputs(cfg)
    with pytest.raises(ConfigError, match="lora.rank = 1"):
        run_entry(cfg, tmp_path / "r", quiet=True, log=lambda m: None)
    assert not (tmp_path / "r").exists()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"q": [0.5] * 8, "k": [1] * 8}))
    check_inputs(
        load_config(None, [*TINY, "lora.rank=1", f'method.q="{plan}"', f'method.k="{plan}"'])
    )


def test_round_loop_names_no_method():
    # the round loop calls every method's hooks; it names none
    import inspect

    from fedlora.federation.methods.registry import method_names

    loop = (engine.run_rounds, engine._round_loop, engine._one_round)
    for fn in (*loop, engine.close_round, engine.apply_aggregate):
        text = inspect.getsource(fn)
        assert "replan" not in text
        assert not [name for name in method_names() if f"{name!r}" in text or f'"{name}"' in text]
