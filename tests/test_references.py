"""The references `centralized` and `local` (docs/methods.md, "References"): their budgets and
schedules by hand, their clock, the pooled data, clients that never mix, and resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.clock import round_cost
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import RoundPlan
from fedlora.federation.methods.references import Centralized, Local, spread
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.runstate import build_run, to_numpy
from fedlora.federation.trainer import SlotTrainer, train_clients
from fedlora.llm.data import FederatedData, client_batches
from fedlora.llm.device import resolve_runtime
from fedlora.llm.prompts import TokenizedSet
from fedlora.system.client_profiles import ClientProfiles

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

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
    "training.eval_every=3",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    "method.q=[1.0, 0.5, 0.5, 1.0]",
    "method.k=[1, 2, 4, 3]",
    "output.progress=false",
]
A4 = np.full(4, 0.25)


def _cfg(*extra: str):
    return load_config(None, [*TINY, *extra])


def _method(*extra: str, tau=(3.0, 2.0, 1.0, 4.0)):
    cfg = _cfg(*extra)
    return make_method(cfg, A4, np.random.default_rng(0), tau_full_s=np.array(tau))


# ----------------------------------------------------------------------------- budgets


def test_spread_gives_every_round_its_share_and_the_total():
    assert [spread(18, 3, r) for r in range(3)] == [6, 6, 6]
    assert [spread(7, 3, r) for r in range(3)] == [2, 2, 3]
    assert [spread(2, 5, r) for r in range(5)] == [0, 0, 1, 0, 1]  # ≤ 1 each, last one trains
    assert sum(spread(1000, 100, r) for r in range(100)) == 1000


def test_centralized_gets_rounds_times_h_times_expected_participants():
    # sketched with q = [1, .5, .5, 1]: E[m] = 3, so 3 rounds × 2 steps × 3 = 18 steps
    c = _method("method.name=centralized")
    assert isinstance(c, Centralized) and c.steps == 18
    plans = [c.plan_round(r, None, None) for r in range(3)]
    assert [t.steps for p in plans for t in p.tasks] == [6, 6, 6]
    task = plans[0].tasks[0]
    assert task.client == 2 and task.pooled  # the fastest device: τ = 1.0
    assert np.array_equal(task.scale, np.ones(4)) and task.rank_used == 4
    # fedavg with 2 of 4 clients a round: E[m] = 2 -> 12; an explicit budget wins
    assert _method("method.name=centralized", "method.budget_of=fedavg",
                   "method.clients_per_round=2").steps == 12  # fmt: skip
    assert _method("method.name=centralized", "training.centralized_steps=7").steps == 7


def test_local_gives_each_client_its_expected_participations():
    local = _method("method.name=local")
    assert isinstance(local, Local)
    # 3 rounds × q = [1, .5, .5, 1] = [3, 1.5, 1.5, 3], rounded half up
    assert local.participations.tolist() == [3, 2, 2, 3]
    rounds = [local.plan_round(r, None, None).participants for r in range(3)]
    assert rounds == [[0, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert all(t.steps == 0 and not t.pooled for r in range(3) for t in
               local.plan_round(r, None, None).tasks)  # fmt: skip
    # nothing combines: the global adapter comes back unchanged
    g = {"m.lora_A": np.ones((4, 3))}
    assert np.array_equal(
        local.aggregate(g, RoundPlan(0, ()), [{}]).global_state["m.lora_A"], g["m.lora_A"]
    )
    assert local.is_local("m.lora_B") and local.is_local("m.lora_A")


def test_a_budget_that_is_not_fixed_in_advance_is_refused():
    cfg = _cfg("method.name=centralized", "method.budget_of=proposed")
    with pytest.raises(ConfigError, match="method.budget_of = 'proposed' is invalid"):
        Centralized.check_run(cfg)
    Centralized.check_run(_cfg("method.name=centralized", "method.budget_of=proposed",
                               "training.centralized_steps=5"))  # fmt: skip
    with pytest.raises(ConfigError, match="method.budget_of = 'local' is invalid"):
        make_method(_cfg("method.name=local", "method.budget_of=local"), A4, None)


# ----------------------------------------------------------------------------- clock


@pytest.mark.parametrize("comm_cost", ["exact", "quadratic"])
def test_the_references_clock_is_compute_alone(comm_cost):
    """Centralized: its steps on the fastest device (τ_n^γ times H = 2 steps); nothing sent,
    so no uplink time even under a rank-based cost model."""
    cfg = _cfg("method.name=centralized", f"network.comm_cost={comm_cost}")
    method = Centralized(steps=18, rounds=3, device=2, gamma=4)
    nan = np.full(4, np.nan)  # no channel: the profiles were given
    profiles = ClientProfiles(np.array([3.0, 2.0, 1.0, 4.0]), np.full(4, 5.0), nan, nan, nan, nan)
    shapes = {"l.q": (8, 8)}
    fields = dict(net=cfg.network, gamma=4, seed=0, local_steps=2)
    cost = round_cost(profiles, method.plan_round(0, None, None), method, shapes, 0, **fields)
    assert cost.round_time_s == pytest.approx(1.0 * 6 / 2)  # τ_2 × 6 steps / H
    assert cost.uplink_bits == cost.downlink_bits == 0
    local = Local(participations=np.array([3, 2, 2, 3]), rounds=3, gamma=4)
    cost = round_cost(profiles, local.plan_round(1, None, None), local, shapes, 1, **fields)
    assert cost.round_time_s == pytest.approx(4.0)  # the slowest learner's H steps


# ----------------------------------------------------------------------------- data


def test_pooled_batches_draw_from_every_clients_records():
    rows = [np.array([i + 1]) for i in range(10)]  # token id = record index + 1
    fed = FederatedData(
        TokenizedSet(rows, rows),
        [],
        [np.array([0, 1, 2]), np.array([3, 4, 5, 6]), np.array([7, 8, 9])],
        np.array([0.3, 0.4, 0.3]),
        {},
    )

    def seen(pooled: bool) -> set[int]:
        rng = np.random.default_rng(0)
        batches = client_batches(fed, 1, 5, 2, rng, pad_id=0, pooled=pooled)
        return {int(x) - 1 for b in batches for x in b["input_ids"].flatten()}

    assert seen(False) <= {3, 4, 5, 6}
    assert seen(True) == set(range(10))  # 10 draws of 10 records: one epoch of the union


# ----------------------------------------------------------------------------- runs


def _built(tmp_path: Path, name: str, *extra: str):
    cfg = _cfg(*extra)
    run_dir = tmp_path / name
    prepare_run_dir(cfg, run_dir)
    return build_run(resolve_runtime(cfg), run_dir, log=lambda m: None)


def _run_local(run) -> None:
    from fedlora.federation.engine import run_rounds

    run_rounds(run, SlotTrainer(run), resume=False, log=lambda m: None, wall_start=0.0)


@needs_data
def test_local_clients_never_mix(tmp_path):
    """Client 0's adapter is the same whatever the other clients do (the others train other
    numbers of rounds in the second run), and equals its own chain of local training from the
    initial adapter on its own data."""
    one = _built(tmp_path, "a", "method.name=local", "training.slots=1")
    init = to_numpy(one.lora.global_state())
    _run_local(one)
    two = _built(tmp_path, "b", "method.name=local", "training.slots=1",
                 "method.q=[1.0, 1.0, 0.2, 0.2]")  # fmt: skip
    _run_local(two)
    mine, theirs = one.memory.restore(0), two.memory.restore(0)
    assert all(np.array_equal(mine[k], theirs[k]) for k in mine)
    assert any(not np.array_equal(mine[k], init[k]) for k in mine)  # it trained
    assert not all(np.array_equal(one.memory.restore(1)[k], two.memory.restore(1)[k]) for k in mine)
    # the independent chain: client 0 alone, 3 rounds of H steps from the initial adapter
    state = init  # (the first run's model and slots, reused: slot 0 starts from `state`)
    for r in range(3):
        train_clients(one, r, [0], np.ones((1, 4)), 0, overlays=[state])
        state = to_numpy(one.lora.slot_state(0))
    assert all(np.array_equal(state[k], mine[k]) for k in mine)


@needs_data
def test_local_reports_the_mean_and_spread_over_its_clients(tmp_path):
    cfg = _cfg("method.name=local")
    run_dir = tmp_path / "l"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    accs = last["eval_clients"]["arc-e"]
    assert len(accs) == 4 and last["eval"]["arc-e"] == pytest.approx(np.mean(accs))
    s = last["eval_clients_spread"]["arc-e"]
    assert s["max"] == accs[s["best_client"]] == max(accs)
    assert s["min"] == accs[s["worst_client"]] == min(accs)
    assert summary["clients"]["spread"] == last["eval_clients_spread"]
    assert all(x["uplink_bits"] == 0 for x in lines)
    assert not (run_dir / "predictions.jsonl").exists()  # the mean has no per-question answer


@needs_data
def test_centralized_steps_and_clock_in_its_metrics(tmp_path):
    cfg = _cfg("method.name=centralized", "training.centralized_steps=7")
    run_dir = tmp_path / "c"
    prepare_run_dir(cfg, run_dir)
    run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [x["steps"] for x in lines] == [[2], [2], [3]]
    import csv

    rows = list(csv.DictReader((run_dir / "clients.csv").open()))
    tau = [float(r["tau_full_s"]) for r in rows]
    fastest = int(np.argmin(tau))
    assert all(x["participants"] == [fastest] for x in lines)
    for x in lines:  # τ of the fastest device × its steps / H, nothing sent
        assert x["round_time_s"] == pytest.approx(tau[fastest] * x["steps"][0] / 2)
        assert x["uplink_bits"] == x["downlink_bits"] == 0
    # re-clocked (`fedlora report --comm-cost`): the same clock under the run's own model,
    # and under a rank-based uplink model too, since nothing is sent
    from fedlora.studies.reclock import reclock
    from fedlora.studies.runs import load_run

    record = load_run(run_dir)
    for comm in ("exact", "quadratic"):
        again = reclock(record, comm, "affine").lines
        assert [x["sim_time_s"] for x in again] == pytest.approx(
            [x["sim_time_s"] for x in record.lines]
        )


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


RESUMED = ("training.rounds=4", "training.checkpoint_every=2", "training.eval_every=2",
           "training.optimizer=adamw", "training.lr=0.001")  # fmt: skip


def _metrics(d: Path) -> list[dict]:
    out = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k != "compute_s"} for x in out]


def _same_run(a: Path, b: Path) -> None:
    x, y = _adapter(a), _adapter(b)
    assert all(torch.equal(x[k], y[k]) for k in x)
    assert _metrics(a) == _metrics(b)


@needs_data
def test_centralized_resumed_after_lost_rounds_is_bit_identical(tmp_path):
    """A run cut back to its round-2 checkpoint (the later checkpoint, adapter and summary gone,
    as a kill leaves it) and resumed ends with the uninterrupted run's adapter and metrics;
    AdamW, so that the learner's kept optimizer state is what the checkpoint must carry."""
    cfg = _cfg("method.name=centralized", *RESUMED)
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    prepare_run_dir(cfg, ref)
    run_experiment(cfg, ref, quiet=True, log=lambda m: None)
    state = load_checkpoint(ref)
    assert state is not None and state["client_optim"]  # the learner's AdamW state is kept
    shutil.copytree(ref, cut)
    (cut / "checkpoints" / "round-000004.safetensors").unlink()
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["round-000002.safetensors"]
    shutil.rmtree(cut / "adapter")
    (cut / "summary.json").unlink()
    run_experiment(cfg, cut, resume=True, quiet=True, log=lambda m: None)
    _same_run(ref, cut)


@needs_data
@pytest.mark.slow
def test_local_after_sigkill_and_resume_is_bit_identical(tmp_path):
    """`local` killed by SIGKILL once it has made progress, then resumed from the command
    line: the uninterrupted run's adapter and metrics (its clients' adapters and AdamW states
    come back from the checkpoint)."""
    import signal
    import subprocess
    import sys
    import time

    args = [*TINY, "method.name=local", *RESUMED]
    ref = tmp_path / "ref"
    cfg = _cfg(*args[len(TINY) :])
    prepare_run_dir(cfg, ref)
    run_experiment(cfg, ref, quiet=True, log=lambda m: None)
    out = tmp_path / "killed"
    cli = [sys.executable, "-m", "fedlora.cli", "run"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([*cli, *args, "--out", str(out), "-q"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    ckpt = out / "checkpoints" / "round-000002.safetensors"
    while proc.poll() is None and not ckpt.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL  # killed before it finished
    done = subprocess.run([*cli, "--resume", str(out), "-q"], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    _same_run(ref, out)


def test_the_references_refuse_flower_with_the_reason():
    from fedlora.federation.flower.common import check_flower_method

    with pytest.raises(ConfigError, match="'centralized' is not supported on Flower: it trains"):
        check_flower_method(_cfg("method.name=centralized"))
    with pytest.raises(ConfigError, match="'local' is not supported on Flower: nothing is sent"):
        check_flower_method(_cfg("method.name=local"))


# ----------------------------------------------------------------------------- suite, report


@needs_data
def test_references_suite_runs_the_suite_files_method_beside_both(tmp_path):
    from fedlora.cli import main

    suite = tmp_path / "suite.toml"
    suite.write_text('[method]\nname = "fedavg"\nclients_per_round = 2\n', encoding="utf-8")
    out = tmp_path / "refs"
    argv = ["compare", "--suite", "references", "-c", str(suite), "--out", str(out), "-q",
            "--target", "arc-e=0.5", *TINY, "training.rounds=2", "training.eval_every=2"]  # fmt: skip
    assert main(argv) == 0
    labels = {"federated": "fedavg", "centralized": "centralized", "local": "local"}
    for label, method in labels.items():
        summary = json.loads((out / f"{label}-seed0" / "summary.json").read_text())
        assert summary["method"] == method and summary["rounds"] == 2
    cfg = load_config(str(out / "centralized-seed0" / "config.toml"), [])
    assert cfg.method.budget_of == "fedavg"  # the suite file's method
    steps = [json.loads(x).get("steps") for x in
             (out / "centralized-seed0" / "metrics.jsonl").read_text().splitlines()[1:]]  # fmt: skip
    assert steps == [[4], [4]]  # 2 rounds × H = 2 × 2 of 4 clients a round, over 2 rounds
    text = (out / "report.md").read_text()
    assert all(f"| {label} | " in text for label in labels)
    assert (out / "accuracy_vs_time.png").exists()


def test_a_run_another_compare_holds_is_skipped_not_marked_failed(tmp_path, capsys):
    from fedlora.cli import main
    from fedlora.federation.rundir import run_dir_lock

    suite = tmp_path / "suite.toml"
    suite.write_text('[method]\nname = "fedavg"\nclients_per_round = 2\n', encoding="utf-8")
    out = tmp_path / "refs"
    argv = ["compare", "--suite", "references", "-c", str(suite), "--out", str(out), "-q",
            "--target", "arc-e=0.5", *TINY, "training.rounds=2", "training.eval_every=2"]  # fmt: skip
    held = out / "centralized-seed0"
    with run_dir_lock(held):  # as a second `compare --methods centralized` would hold it
        assert main(argv) == 0
    assert "centralized seed 0: skipped, another process runs it" in capsys.readouterr().err
    assert not (held / "summary.json").exists()  # no error written into a run going on
    for label in ("federated", "local"):
        assert json.loads((out / f"{label}-seed0" / "summary.json").read_text())["rounds"] == 2
    assert main(argv) == 0  # once free, the next compare runs it
    assert json.loads((held / "summary.json").read_text())["method"] == "centralized"


def _record(label: str, method: str, seed: int, accs: list[float]):
    from fedlora.studies.runs import RunRecord

    lines = [
        {"round": i, "sim_time_s": 10.0 * i, "eval": {"arc-e": a}, "eval_accuracy": a}
        for i, a in enumerate(accs)
    ]
    return RunRecord(Path(label), label, method, seed, lines)


@pytest.mark.parametrize("figure", ["curves", "bands"])
def test_report_draws_the_references_as_lines_at_their_final_accuracy(monkeypatch, figure):
    from fedlora.studies import plots

    drawn = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: drawn.setdefault("f", fig))
    runs = [
        _record("fed", "sketched", 0, [0.3, 0.4, 0.5]),
        _record("fed", "sketched", 1, [0.3, 0.45, 0.55]),
        _record("centralized", "centralized", 0, [0.3, 0.6]),
        _record("centralized", "centralized", 1, [0.3, 0.7]),
        _record("local", "local", 0, [0.3, 0.35]),
        _record("local", "local", 1, [0.3, 0.25]),
    ]
    if figure == "curves":
        plots.plot_runs(runs, {"arc-e": 0.5}, Path("x.png"))
    else:
        plots.plot_bands(runs, {"arc-e": 0.5}, "accuracy", Path("x.png"))
    ax = drawn["f"].axes[0]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    refs = {k.split(" ")[0]: v for k, v in lines.items() if "reference" in k}
    assert refs == {"centralized": [pytest.approx(65.0)] * 2, "local": [pytest.approx(30.0)] * 2}
    # the federated runs stay curves on the clock; the references draw none
    assert not any(k.startswith(("centralized", "local")) and "reference" not in k for k in lines)
