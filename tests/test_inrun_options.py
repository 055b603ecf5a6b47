"""The in-run planner's opt-in options (docs/planner.md): `planner.probe_cycles` (the probes
run again when the fit after them fails) and `planner.fit_client_offsets` (the progress rates
from each participant's own loss, with a per-client intercept). Model-free runs driven by
Theorem 1 (`planner_cases.model_free_proposed`), and a tiny model end to end with a bit-identical resume.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.calibration import prepare_proposed
from fedlora.federation.methods.proposed_replan import probe_schedule
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.run import run as run_entry
from test_replan import DATA, TINY, _adapter, _fake_run, _metrics

TRUE = (40.0, 0.02, 0.002)  # A, C, D of the fake runs' world (B = 1)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("planner.probe_cycles=0", "planner.probe_cycles = 0 is invalid"),
        ("planner.probe_cycles=1.5", "planner.probe_cycles"),
        ('planner.fit_client_offsets="yes"', "planner.fit_client_offsets = 'yes' is invalid"),
    ],
)
def test_new_keys_are_validated(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["planner.probe_cycles=2", "planner.fit_client_offsets=true"])
def test_new_keys_need_in_run_calibration(override):
    with pytest.raises(ConfigError, match="needs planner.calibration = 'in-run'"):
        load_config(None, ["planner.calibration=separate", override])


def _rate(q, k, constants):
    A, C, D = constants
    y = float(np.sum(0.01 / q))
    z = float(np.sum(0.01 / q * 64 / k.astype(float) ** 2))
    return (1.0 - C * y - D * z) / A


def _drive_world(run, rounds, rate_of, start=0):
    """Rounds `start`.. `rounds` − 1 whose log-loss falls by `rate_of(r, q, k)` (q, k: the
    setting in force), from log 2 at round 0 (a resumed drive replays the levels before)."""
    level, lines = math.log(2.0), []
    for r in range(start):
        level -= rate_of(r, *_setting_of(run, r))
    for r in range(start, rounds):
        run.method.before_round(run.ctx, r)
        q, k = run.method.q.copy(), run.method.k.copy()
        line = {"round": r + 1, "train_loss": math.exp(level)}
        run.method.after_round(run.ctx, r, line)
        lines.append((line, q, k))
        level -= rate_of(r, q, k)
    return lines


def _setting_of(run, r):
    """(q, k) in force in a past round `r` of a (resumed) fake run, from the planner's state."""
    st = run.method.replanner.state
    s = st["settings"][st["of_round"][r]]
    return np.asarray(s["q"]), np.asarray(s["k"])


def _stalls_at_low_q_first(r, q, k):
    # cycle 1 (rounds 0-7): the q = 0.15 probes' loss rises (their rates come out negative,
    # the two kept rows share one Y: not identified); after: Theorem 1's world
    if r < 8 and q[0] < 0.2:
        return -0.01
    return _rate(q, k, TRUE)


def test_second_probe_cycle_identifies_and_the_plan_is_adopted_after_it(tmp_path):
    run = _fake_run(tmp_path, "planner.probe_cycles=2")
    lines = _drive_world(run, 20, _stalls_at_low_q_first)
    first = lines[7][0]["planner"]
    # Assert: after cycle 1 the fit is refused (one sampling rate) and the probes run again
    assert first["kind"] == "calibration" and first["cycle"] == 1
    assert "share one sampling rate" in first["error"]
    assert first["reprobe"] == "probe cycle 2 of 2" and not first["adopted"]
    assert "fallback" not in first and "setting" not in first
    probes = run.method.replanner.state["settings"][:4]
    for r, j in zip(range(8, 16), probe_schedule(2)):  # rounds 9-16: the same schedule again
        line, q, k = lines[r]
        assert "planner" not in line or r == 15
        assert q.tolist() == probes[j]["q"] and k.tolist() == probes[j]["k"]
    second = lines[15][0]["planner"]
    # Assert: after cycle 2 (rounds 1-16, four rounds per setting) a plan is fitted and adopted
    assert second["kind"] == "calibration" and second["cycle"] == 2 and second["round"] == 16
    assert "error" not in second and second["adopted"] and second["setting"] == 4
    assert second["rounds_per_setting"] == [4, 4, 4, 4]
    assert all(x > 0 for x in second["rates"])
    _, q, k = lines[16]
    assert q.tolist() == second["plan"]["q"] and k.tolist() == second["plan"]["k"]
    assert [h["round"] for h in run.method.replanner.state["history"]] == [8, 16]


def test_one_probe_cycle_falls_back_at_once_and_the_last_cycle_falls_back(tmp_path):
    # probe_cycles = 1 (default): today's fallback after round 8, no `cycle` key
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    once = _drive_world(_fake_run(tmp_path / "a"), 10, _stalls_at_low_q_first)
    entry = once[7][0]["planner"]
    assert "cycle" not in entry and "reprobe" not in entry
    assert entry["adopted"] and entry["fallback"].startswith("probe ")
    # a world that never identifies (the low-q probes always stall): 2 cycles, then fallback
    run = _fake_run(tmp_path / "b", "planner.probe_cycles=2")
    never = _drive_world(run, 18, lambda r, q, k: -0.01 if q[0] < 0.2 else _rate(q, k, TRUE))
    last = never[15][0]["planner"]
    assert never[7][0]["planner"]["reprobe"] == "probe cycle 2 of 2"
    assert last["cycle"] == 2 and "reprobe" not in last
    assert (
        last["adopted"]
        and last["fallback"] == f"probe {last['setting'] + 1} (least time per progress)"
    )
    assert last["setting"] in (0, 2)  # a q = 0.3 probe: the only ones that progressed
    _, q, _ = never[17]
    assert q.tolist() == run.method.replanner.state["settings"][last["setting"]]["q"]


def test_client_offsets_in_the_planner_recover_the_constants(tmp_path):
    # Theorem 1's world seen through a random participant mix of clients with different loss
    # levels: with planner.fit_client_offsets the fit after the probes is exact; the
    # round-mean loss gives other constants (or no fit)
    offsets = np.linspace(-0.38, 0.43, 10)

    def drive(run, seed):
        rng, level, out = np.random.default_rng(seed), math.log(2.0), []
        for r in range(8):
            run.method.before_round(run.ctx, r)
            who = np.flatnonzero(rng.random(10) < 0.3)
            who = who if who.size > 1 else np.array([0, 9])
            losses = np.exp(level + offsets[who])
            line = {"round": r + 1, "train_loss": float(np.mean(losses)),
                    "client_losses": [[int(c), float(x)] for c, x in zip(who, losses)]}  # fmt: skip
            run.method.after_round(run.ctx, r, line)
            out.append(line)
            level -= _rate(run.method.q, run.method.k, TRUE)
        return out[7]["planner"]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    on = _fake_run(tmp_path / "a", "planner.fit_client_offsets=true")
    entry = drive(on, 1)
    assert entry["rates_from"] == "client losses, per-client intercepts"
    assert len(entry["rate_se"]) == 4
    c = entry["fit"]["constants"]
    assert [c["A"], c["C"], c["D"]] == pytest.approx(list(TRUE), rel=1e-6)
    assert len(on.method.replanner.state["client_log_loss"]) == 8
    plain = _fake_run(tmp_path / "b")
    off = drive(plain, 1)
    assert "rate_se" not in off and "client_log_loss" not in plain.method.replanner.state
    got = off.get("fit", {}).get("constants", {"A": 0.0})
    assert "error" in off or abs(got["A"] - TRUE[0]) > 0.1 * TRUE[0]


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_tiny_run_logs_client_losses_and_resumes_bit_identical(tmp_path):
    cfg = load_config(None, [*TINY, "planner.fit_client_offsets=true", "planner.probe_cycles=2"])
    ref = tmp_path / "ref"
    run_entry(cfg, ref, quiet=True, log=lambda m: None)
    lines = _metrics(ref)
    # Assert: every round with a participant logs each one's loss; their mean is train_loss
    for m in lines[1:]:
        if m["train_loss"] is None:
            assert "client_losses" not in m
            continue
        pairs = m["client_losses"]
        assert [c for c, _ in pairs] == m["participants"]
        assert m["train_loss"] == pytest.approx(float(np.mean([x for _, x in pairs])), rel=1e-12)
    entries = [m["planner"] for m in lines if "planner" in m]
    assert entries[0]["rates_from"] == "client losses, per-client intercepts"
    assert entries[0]["cycle"] == 1 and entries[0]["round"] == 8
    # Execute: stopped after round 9, resumed from its checkpoint
    cut = tmp_path / "cut"
    prepare_run_dir(cfg, cut)
    cfg2, plan_value = prepare_proposed(cfg, cut, run_one=None, log=lambda m: None)
    run_experiment(cfg2, cut, quiet=True, log=lambda m: None, plan=plan_value,
                   stop=lambda line: line["round"] == 9)  # fmt: skip
    run_entry(cfg, cut, resume=True, quiet=True, log=lambda m: None)
    # Assert: bit-identical metrics (client losses and fits), plan.json and adapter
    assert _metrics(cut) == lines
    assert json.loads((cut / "plan.json").read_text()) == json.loads(
        (ref / "plan.json").read_text()
    )
    a, b = _adapter(ref), _adapter(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_inside_the_second_probe_cycle_replays_the_same_fits(tmp_path):
    # the planner's state (with the extended probe schedule) through a JSON checkpoint after
    # round 10 (inside cycle 2), into a new method: the same entries and plans as uninterrupted
    for d in ("ref", "cut", "resumed"):
        (tmp_path / d).mkdir()
    extra = ("planner.probe_cycles=2", "planner.replan_every=2")
    ref = _drive_world(_fake_run(tmp_path / "ref", *extra), 20, _stalls_at_low_q_first)
    cut = _fake_run(tmp_path / "cut", *extra)
    _drive_world(cut, 10, _stalls_at_low_q_first)
    saved = json.loads(json.dumps(cut.method.state_dict()))
    resumed = _fake_run(tmp_path / "resumed", *extra)
    resumed.method.load_state_dict(saved)
    rest = _drive_world(resumed, 20, _stalls_at_low_q_first, start=10)
    assert [x[0] for x in rest] == [x[0] for x in ref[10:]]
    assert [x[1].tolist() for x in rest] == [x[1].tolist() for x in ref[10:]]
    assert [x[0]["planner"]["round"] for x in ref if "planner" in x[0]] == [8, 16, 18, 20]
