"""research/study_planner/replay_inrun.py: the replay of an in-run `proposed` run's planner
reproduces every logged fit and plan from the run directory alone (a model-free run driven by
Theorem 1's model, and a tiny random-init model's run), and sees a changed log or an
overridden planner setting."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fedlora.config import dump_toml, load_config
from research.study_planner import replay_inrun
from tiny_runs import DATA, TINY_FOUR_CLIENTS


def _model_run(run_dir: Path, rounds: int = 16, extra: tuple[str, ...] = (),
               stall: bool = False, offsets: bool = False) -> list[dict]:  # fmt: skip
    """A run directory written by a real `InRunPlanner` whose losses follow Theorem 1's model
    for the (q, k) in force (A = 40, D = 0.002; C 0.02, then 0.3 from round 9: the re-plan
    after round 12 is adopted), every client taking part every round. `stall`: in rounds 1-8
    the q = 0.15 probes' loss rises; `offsets`: a random half of the clients take part, each
    with its own loss level (logged as client_losses)."""
    from fedlora.federation.methods.base import RoundContext
    from fedlora.federation.methods.proposed import Proposed
    from fedlora.federation.runfiles import ClientRow, write_clients

    cfg = load_config(None, ["method.name=proposed", "data.n_clients=10", "lora.rank=8",
                             "planner.probe_rounds=2", "planner.replan_every=4",
                             *extra])  # fmt: skip
    rng = np.random.default_rng(0)
    a = np.full(10, 0.1)
    tau, t_full = rng.uniform(0.5, 3, 10), rng.uniform(1e6, 1e7, 10)
    write_clients(run_dir, [ClientRow(i, 10, 0.1, tau[i], t_full[i]) for i in range(10)])
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    profiles = SimpleNamespace(tau_full_s=tau, t_full=t_full, snr_db=np.full(10, np.nan))
    ctx = RoundContext(cfg, a, profiles, run_dir, log=lambda msg: None)
    method = Proposed(a=a, q=np.full(10, 0.3), k=np.full(10, 8), gamma=8)
    method.in_run = True
    level, lines = math.log(2.0), [{"round": 0, "train_loss": None, "sim_time_s": 0.0}]
    for r in range(rounds):
        method.before_round(ctx, r)
        q, k = method.q, method.k
        c = 0.02 if r < 8 else 0.3
        who = sorted(rng.permutation(10)[:5].tolist()) if offsets else list(range(10))
        line = {"round": r + 1, "sim_time_s": float(r), "train_loss": math.exp(level),
                "participants": who, "k": [int(k[i]) for i in who]}  # fmt: skip
        if offsets:
            losses = [math.exp(level + 0.08 * i - 0.4) for i in who]
            line["train_loss"] = float(np.mean(losses))
            line["client_losses"] = [[i, x] for i, x in zip(who, losses)]
        method.after_round(ctx, r, line)
        lines.append(line)
        rate = (1.0 - c * float(np.sum(0.01 / q)) - 0.002 * float(np.sum(0.64 / q / k**2))) / 40
        level -= -0.01 if stall and r < 8 and q[0] < 0.2 else rate  # stalled: rises by 0.01
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def test_replay_reproduces_every_logged_fit_and_plan(tmp_path):
    lines = _model_run(tmp_path)
    records = replay_inrun.replay(replay_inrun.load_run(tmp_path))
    assert [r["round"] for r in records] == [8, 12, 16]
    assert [replay_inrun.matches(r) for r in records] == [True, True, True]
    # the fit after the probes is Theorem 1's constants; the re-plan after round 12 adopted
    c = records[0]["entry"]["fit"]["constants"]
    assert [c["A"], c["C"], c["D"]] == pytest.approx([40.0, 0.02, 0.002], rel=1e-6)
    assert records[1]["entry"]["adopted"] and records[1]["entry"]["setting"] == 5
    assert records[1]["entry"] == lines[12]["planner"]
    # the diagnostics: Y = Σ a²/q of each probe, the exact fit leaves no scatter
    assert records[0]["diag"]["Y"][:2] == pytest.approx([0.1 / 0.3, 0.1 / 0.15])
    assert records[0]["diag"]["sigma_log_loss"] == pytest.approx(0.0, abs=1e-9)
    assert replay_inrun.main([str(tmp_path), "--check"]) == 0


def test_replay_sees_a_changed_log(tmp_path):
    lines = _model_run(tmp_path)
    lines[3]["train_loss"] *= 1.5  # a probe round's loss, as if logged differently
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = replay_inrun.replay(replay_inrun.load_run(tmp_path))
    assert replay_inrun.matches(records[0]) is False
    assert replay_inrun.main([str(tmp_path), "--check"]) == 1


def test_a_log_written_on_another_cpu_matches_up_to_round_off(tmp_path, capsys):
    lines = _model_run(tmp_path)
    fit = lines[8]["planner"]["fit"]
    fit["constants"]["A"] *= 1 + 3e-14  # another BLAS path: the last digits of the fit
    fit["residual"] = 2.7e-16  # a round-off-sized number, 100% apart in relative terms
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = replay_inrun.replay(replay_inrun.load_run(tmp_path))
    assert replay_inrun.matches(records[0]) is True and not replay_inrun.exactly(records[0])
    assert replay_inrun.main([str(tmp_path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "[= logged up to round-off]" in out
    assert "3 equal to the log (2 bit for bit, 1 up to round-off), 0 differ" in out
    # a difference beyond round-off, and any decision, still differ
    fit["constants"]["A"] *= 1 + 1e-6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert replay_inrun.matches(replay_inrun.replay(replay_inrun.load_run(tmp_path))[0]) is False
    assert replay_inrun._close({"adopted": True}, {"adopted": 1}) is False
    assert replay_inrun._close({"k": [3, 4]}, {"k": [3, 5]}) is False


def test_overrides_and_window_change_the_replayed_planner_not_the_rounds(tmp_path):
    _model_run(tmp_path)
    run = replay_inrun.load_run(tmp_path, ["planner.replan_every=2"])
    records = replay_inrun.replay(run)
    # fits after 8, 10, ..., 16 over the same rounds: 10 and 14 were never logged
    assert [r["round"] for r in records] == [8, 10, 12, 14, 16]
    assert [replay_inrun.matches(r) for r in records] == [True, None, True, None, True]
    windowed = replay_inrun.replay(replay_inrun.load_run(tmp_path), window=4)
    assert sum(windowed[1]["entry"]["rounds_per_setting"]) == 4  # the re-fit after round 12
    assert sum(windowed[0]["entry"]["rounds_per_setting"]) == 8  # the calibration: all probes


def test_replay_follows_probe_cycles_and_client_offsets(tmp_path):
    # a second probe cycle (the first one's fit is refused: one sampling rate) and rates from
    # per-client losses: every logged entry reproduced, the re-probe included
    extra = ("planner.probe_cycles=2", "planner.fit_client_offsets=true")
    lines = _model_run(tmp_path, 24, extra, stall=True, offsets=True)
    logged = {m["round"]: m["planner"] for m in lines if "planner" in m}
    assert sorted(logged) == [8, 16, 20, 24] and logged[8]["reprobe"] == "probe cycle 2 of 2"
    assert logged[16]["cycle"] == 2 and "plan" in logged[16]
    records = replay_inrun.replay(replay_inrun.load_run(tmp_path))
    assert [r["round"] for r in records] == [8, 16, 20, 24]
    assert [replay_inrun.matches(r) for r in records] == [True] * 4
    assert replay_inrun.main([str(tmp_path), "--check"]) == 0
    # the same rounds with the mean-loss rates: other rates (the participant mix is read as
    # progress); a run without client_losses cannot be replayed with the offsets
    plain = replay_inrun.replay(
        replay_inrun.load_run(tmp_path, ["planner.fit_client_offsets=false"])
    )
    assert plain[1]["entry"]["rates"] != records[1]["entry"]["rates"]
    (tmp_path / "b").mkdir()
    _model_run(tmp_path / "b")
    assert replay_inrun.main([str(tmp_path / "b"), "--set", "planner.fit_client_offsets=true"]) == 2


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_replay_reproduces_a_tiny_in_run_run(tmp_path):
    from fedlora.federation.run import run as run_entry

    cfg = load_config(None, [*TINY_FOUR_CLIENTS, "training.rounds=8", "training.lr=0.05",
                             "training.checkpoint_every=8", "method.name=proposed",
                             "planner.probe_rounds=1", "planner.replan_every=2",
                             "planner.replan_margin=0"])  # fmt: skip
    run_entry(cfg, tmp_path, quiet=True, log=lambda m: None)
    records = replay_inrun.replay(replay_inrun.load_run(tmp_path))
    assert [r["round"] for r in records] == [4, 6, 8]
    assert all(r["logged"] is not None for r in records)
    assert [replay_inrun.matches(r) for r in records] == [True, True, True]
