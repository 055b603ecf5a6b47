"""The round engine end to end on a tiny random-init model and real commonsense data."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.methods.base import ClientTask, RoundPlan, sketch_payload_params
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.runstate import build_run
from fedlora.federation.trainer import TrainingDiverged, train_participants
from fedlora.llm.device import resolve_runtime
from fedlora.system.network import allocate_bandwidth, comp_factor
from fedlora.system.sketch import sample_participants, unbiased_aggregate

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

TINY = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "boolq"]',
    "data.train_limit=40",
    "data.eval_limit=12",
    "data.max_seq_len=96",
    "data.n_clients=4",
    "data.min_client_examples=4",
    "lora.rank=4",
    'lora.layers="all"',
    "training.rounds=3",
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=2",
    "training.eval_every=2",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    "method.q=[1.0, 0.5, 0.5, 1.0]",
    "method.k=[1, 2, 4, 3]",
    "output.progress=false",
]


def _cfg(*extra: str):
    return load_config(None, [*TINY, *extra])


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[Path, dict]:
    cfg = _cfg(*extra)
    run_dir = tmp_path / name
    prepare_run_dir(cfg, run_dir)
    return run_dir, run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_run_writes_everything_and_is_deterministic(tmp_path):
    run_a, summary = _run(tmp_path, "a")
    run_b, _ = _run(tmp_path, "b")

    for name in ("config.toml", "clients.csv", "metrics.jsonl", "summary.json"):
        assert (run_a / name).is_file(), name
    assert (run_a / "adapter" / "adapter_config.json").is_file()
    lines = _metrics(run_a)
    assert [m["round"] for m in lines] == [0, 1, 2, 3]
    for m in lines[1:]:
        for key in (
            "participants",
            "n_participants",
            "k",
            "round_time_s",
            "sim_time_s",
            "uplink_bits",
            "downlink_bits",
            "train_loss",
            "compute_s",
        ):
            assert key in m, key
    assert "eval_accuracy" in lines[2] and "eval_accuracy" in lines[3]  # E = 2 and the last
    assert "eval_accuracy" not in lines[1]
    assert summary["rounds"] == 3 and summary["sim_time_s"] == pytest.approx(
        lines[-1]["sim_time_s"]
    )

    # The same seed gives identical metrics (but compute_s) and an identical adapter.
    strip = [{k: v for k, v in m.items() if k != "compute_s"} for m in lines]
    assert strip == [{k: v for k, v in m.items() if k != "compute_s"} for m in _metrics(run_b)]
    a, b = _adapter(run_a), _adapter(run_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_time_recomputed_from_files_alone(tmp_path):
    run_dir, _ = _run(tmp_path, "r", "training.rounds=2", "network.comp_cost=affine")
    cfg = load_config(run_dir / "config.toml")
    with open(run_dir / "clients.csv") as f:
        clients = list(csv.DictReader(f))
    shapes_params = None
    for m in _metrics(run_dir)[1:]:
        if not m["participants"]:
            assert m["round_time_s"] == 0.0
            continue
        idx, k = np.array(m["participants"]), np.array(m["k"])
        # exact payload: k · Σ(out + in) parameters · bits_per_param, summed over participants
        per_rank = m["uplink_bits"] / cfg.network.bits_per_param / k.sum()
        assert per_rank == int(per_rank)
        shapes_params = shapes_params or per_rank
        assert per_rank == shapes_params
        tau_full = np.array([float(clients[i]["tau_full_s"]) for i in idx])
        t_full = np.array([float(clients[i]["t_full"]) for i in idx])
        tau = tau_full * comp_factor(k, cfg.lora.rank, "affine", cfg.network.rho)
        t = t_full * k / cfg.lora.rank  # exact bits of a k-of-γ sketch = k/γ of the adapter
        expected, _ = allocate_bandwidth(tau, t, cfg.network.f_tot_hz)
        assert m["round_time_s"] == pytest.approx(expected, rel=1e-9)


def test_payload_bits_equal_formula(tmp_path):
    cfg = _cfg("training.rounds=1")
    run_dir = tmp_path / "p"
    prepare_run_dir(cfg, run_dir)
    run = build_run(resolve_runtime(cfg), run_dir)
    shapes = run.lora.layer_shapes()
    expected_per_rank = sum(o + i for o, i in shapes.values())
    assert sketch_payload_params(1, shapes) == expected_per_rank
    # tiny-llama: q_proj and v_proj on every layer
    assert all(n.endswith(("q_proj", "v_proj")) for n in shapes)


def test_unbiased_aggregation_on_real_adapters(tmp_path):
    # Prepare: every client trains once from the same global adapter with a fixed sketch.
    cfg = _cfg()
    run_dir = tmp_path / "u"
    prepare_run_dir(cfg, run_dir)
    run = build_run(resolve_runtime(cfg), run_dir)
    n, gamma = cfg.data.n_clients, cfg.lora.rank
    rng = np.random.default_rng(0)
    scales = [np.where(rng.random(gamma) < 0.5, 2.0, 0.0) for _ in range(n)]
    plan = RoundPlan(0, tuple(ClientTask(c, scales[c], gamma, 1.0) for c in range(n)))
    states, _ = train_participants(run, plan)
    x = {k: v.numpy().astype(np.float64) for k, v in run.lora.global_state().items()}
    states = [{k: v.astype(np.float64) for k, v in s.items()} for s in states]
    a = run.fed.a
    q = np.array([0.9, 0.3, 0.6, 0.5])
    # Execute: Monte Carlo over independent sampling of who reports
    trials = 3000
    key = next(k for k in x if k.endswith("lora_B"))
    draws = np.empty((trials, *x[key].shape))
    for i in range(trials):
        who = sample_participants(q, rng)
        out = unbiased_aggregate(
            {key: x[key]}, [{key: states[c][key]} for c in who], a[who] / q[who]
        )
        draws[i] = out[key]
    # Assert: E[X⁺] = Σ a_n X_n within 4 standard errors, where the updates are non-zero
    target = sum(a[c] * states[c][key] for c in range(n))
    se = draws.std(axis=0) / np.sqrt(trials)
    moved = se > 0
    assert moved.any()
    assert np.all(np.abs(draws.mean(axis=0) - target)[moved] < 4 * se[moved] + 1e-12)


def test_empty_rounds_are_recorded_and_free(tmp_path):
    run_dir, summary = _run(tmp_path, "e", "method.q=[1e-9, 1e-9, 1e-9, 1e-9]", "training.rounds=2")
    lines = _metrics(run_dir)[1:]
    assert [m["n_participants"] for m in lines] == [0, 0]
    assert all(m["round_time_s"] == 0.0 and m["train_loss"] is None for m in lines)
    assert summary["empty_rounds"] == 2 and summary["sim_time_s"] == 0.0


def test_target_accuracy_and_time_budget_stop(tmp_path):
    _, summary = _run(tmp_path, "t", "training.target_accuracy=0.0001", "training.eval_every=1")
    assert summary["stop_reason"] == "target_accuracy"
    assert summary["rounds"] == 0  # round 0 already meets it
    _, summary = _run(tmp_path, "b", "training.time_budget_s=1e-9")
    assert summary["stop_reason"] == "time_budget" and summary["rounds"] == 1


def test_eval_schedule_is_laid_from_the_end_of_a_calibration(tmp_path):
    # Prepare: a planned run (q, k given as a Plan, every client every round) without, then
    # with c s of calibration on its clock; round times do not depend on either
    from dataclasses import replace

    from fedlora.federation.methods.proposed import Plan

    cfg = _cfg("method.name=proposed", "training.rounds=4", "training.eval_every=100")
    n, gamma = cfg.data.n_clients, cfg.lora.rank

    def run(name: str, calibration_s: float, every_s: float = 0.0) -> list[dict]:
        c = cfg.replace(training=replace(cfg.training, eval_every_s=every_s))
        run_dir = tmp_path / name
        prepare_run_dir(c, run_dir)
        plan = Plan((1.0,) * n, (gamma,) * n, calibration_s)
        run_experiment(c, run_dir, quiet=True, log=lambda m: None, plan=plan)
        return _metrics(run_dir)

    clock = [m["sim_time_s"] for m in run("ref", 0.0)]
    every = (clock[1] + clock[2]) / 2
    due = [math.floor(clock[r] / every) > math.floor(clock[r - 1] / every) for r in range(1, 5)]
    # a calibration time that moves the grid if the grid were laid in absolute time
    shifted = [
        c for c in (0.5 * every, 0.25 * every, 0.75 * every)
        if [math.floor((c + clock[r]) / every) > math.floor((c + clock[r - 1]) / every)
            for r in range(1, 5)] != due
    ]  # fmt: skip
    assert shifted, "no calibration time tells the two grids apart"
    # Execute
    lines = run("calibrated", shifted[0], every)
    # Assert: the clock starts at c; evaluations fall where they do without a calibration
    assert [m["sim_time_s"] for m in lines] == pytest.approx([shifted[0] + x for x in clock])
    assert [("eval" in m) for m in lines[1:]] == [d or r == 4 for r, d in enumerate(due, 1)]


def test_eval_schedule_in_simulated_time_and_at_the_budget(tmp_path):
    # Round times do not depend on evaluation: a reference run gives the clock c_1..c_4.
    ref, _ = _run(tmp_path, "ref", "training.rounds=4", "training.eval_every=100")
    clock = [m["sim_time_s"] for m in _metrics(ref)]
    assert [("eval" in m) for m in _metrics(ref)] == [True, False, False, False, True]
    # every_s between c_1 and c_2: evaluated where floor(c_r / every_s) grows (by hand)
    every = (clock[1] + clock[2]) / 2
    due = [math.floor(clock[r] / every) > math.floor(clock[r - 1] / every) for r in range(1, 5)]
    timed, _ = _run(tmp_path, "s", "training.rounds=4", "training.eval_every=100",
                    f"training.eval_every_s={every!r}")  # fmt: skip
    lines = _metrics(timed)
    assert [m["sim_time_s"] for m in lines] == clock
    assert [("eval" in m) for m in lines[1:]] == [d or r == 4 for r, d in enumerate(due, 1)]
    # a budget between c_2 and c_3: round 3 spends it, is evaluated and is the last
    budget = (clock[2] + clock[3]) / 2
    spent, summary = _run(tmp_path, "b", "training.rounds=4", "training.eval_every=100",
                          f"training.time_budget_s={budget!r}")  # fmt: skip
    assert summary["stop_reason"] == "time_budget" and summary["rounds"] == 3
    assert [("eval" in m) for m in _metrics(spent)] == [True, False, False, True]
    with pytest.raises(ConfigError, match="training.eval_every_s"):
        _cfg("training.eval_every_s=-1")


def test_nan_loss_stops_with_clear_message_and_keeps_checkpoint(tmp_path, monkeypatch):
    # Prepare: local training diverges in round 2 (train.py raises TrainingError on a
    # non-finite loss; tests/test_train.py covers that detection itself)
    import fedlora.llm.train
    from fedlora.llm.train import TrainingError

    real = fedlora.llm.train.local_train
    calls = {"n": 0}

    def diverging(model, lora, batches, lr, **kw):
        calls["n"] += 1
        if calls["n"] > 2:  # rounds have 2 chunks of 2 slots each
            raise TrainingError(
                f"non-finite training loss at local step 0: lower training.lr (now {lr})"
            )
        return real(model, lora, batches, lr, **kw)

    monkeypatch.setattr(fedlora.llm.train, "local_train", diverging)
    cfg = _cfg("training.rounds=3", "method.q=full")
    run_dir = tmp_path / "nan"
    prepare_run_dir(cfg, run_dir)
    # Execute / Assert: a clear message naming the round, the clients and the fix
    with pytest.raises(
        TrainingDiverged, match=r"round 2, clients \[0, 1\].*training.lr.*checkpoint"
    ):
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    state = load_checkpoint(run_dir)
    assert state is not None and state["round"] == 1  # the last good round
    assert [m["round"] for m in _metrics(run_dir)] == [0, 1]


def test_existing_output_dir_and_resume_config_checks(tmp_path, capsys):
    out = tmp_path / "dir"
    args = ["run", *TINY, "training.rounds=1", "--out", str(out), "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    # refuse an existing directory without --resume / --overwrite
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--resume" in err and "Traceback" not in err
    # resume with a differing config names the keys; --force accepts
    assert main(["run", "--resume", str(out), *TINY, "training.rounds=2", "training.lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert "training.lr" in err and "training.rounds" in err and "--force" in err
    assert main(["run", "--resume", str(out), *TINY, "training.rounds=2", "--force", "-q"]) == 0
    assert [m["round"] for m in _metrics(out)] == [0, 1, 2]
    # machine.jsonl: the first stretch from round 0, the resumed one from its checkpoint (1)
    machines = [json.loads(x) for x in (out / "machine.jsonl").read_text().splitlines()]
    assert [m["from_round"] for m in machines] == [0, 1]
    assert all(m["device"] == "cpu" and m["torch_threads"] == 1 for m in machines)
    assert all(m["torch"] == torch.__version__ and m["trains"] == "here" for m in machines)
    assert main([*args, "--overwrite"]) == 0
    assert [
        json.loads(x)["from_round"] for x in (out / "machine.jsonl").read_text().splitlines()
    ] == [0]


def test_damaged_checkpoint_falls_back_to_previous(tmp_path):
    run_dir, _ = _run(tmp_path, "d")
    newest = sorted((run_dir / "checkpoints").glob("round-*.safetensors"))[-1]
    newest.write_bytes(b"not a checkpoint")
    warnings = []
    state = load_checkpoint(run_dir, warn=warnings.append)
    assert state is not None and state["round"] < 3
    assert str(newest) in warnings[0]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedlora.cli", *args]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigkill_and_resume_is_bit_identical(tmp_path):
    # Prepare: the uninterrupted reference run
    extra = ["training.rounds=4", "training.eval_every=4"]
    reference, _ = _run(tmp_path, "ref", *extra)
    out = tmp_path / "killed"
    metrics = out / "metrics.jsonl"
    rng = np.random.default_rng(0)
    cmd = _cli("run", *TINY, *extra, "--out", str(out), "--quiet")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # Execute: SIGKILL at a random moment after the run has made progress, then resume
    kills = 0
    for _ in range(12):
        seen = _lines(metrics)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 120
        while proc.poll() is None and _lines(metrics) <= seen and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None and kills < 3:
            time.sleep(float(rng.uniform(0.0, 0.6)))
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=300)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
        cmd = _cli("run", "--resume", str(out), "--quiet")
    # Assert
    assert proc.returncode == 0 and kills >= 1
    rounds = [m["round"] for m in _metrics(out)]
    assert rounds == [0, 1, 2, 3, 4]  # no duplicate or missing round
    a, b = _adapter(reference), _adapter(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
