"""`study_planner.py status`: the study's state read from its files, checked by hand on a
tiny v2 study whose runs are written by a fake run function (no model)."""

from __future__ import annotations

import json

import pytest

from fedlora.federation.machine_log import record_stretch
from research.study_planner.study_runner import pilot_stage
from research.study_planner.study_status import (
    FINISHED,
    NOT_STARTED,
    PARTIAL,
    analysed_states,
    pilot_states,
    render_status,
)
from test_study_v2 import v2_spec

LEARNS = [(0, 0.50), (2, 0.54), (4, 0.55), (6, 0.56)]
FLAT = [(0, 0.50), (2, 0.50), (4, 0.49), (6, 0.51)]


def fake(cfg, run_dir, *, resume):
    """fixed-0.5 never learns (so its grid runs); every other job learns."""
    flat = run_dir.name.startswith("fixed-0.5")
    lines = [
        {
            "round": 10 * i,
            "sim_time_s": t,
            "eval": {"arc-e": v},
            "n_participants": 2 if i else 0,
            "train_loss": None if i == 0 else 4.0 - i,
            "compute_s": 1.5 * i,  # 0 + 1.5 + 3 + 4.5: 9 compute-s in all
        }
        for i, (t, v) in enumerate(FLAT if flat else LEARNS)
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "config.toml").write_text("[training]\nlocal_steps = 5\n")
    (run_dir / "summary.json").write_text(json.dumps({"sim_time_s": 6.0, "rounds": 30}))
    return {}


def test_status_before_any_run_lists_every_job_as_not_started(tmp_path):
    spec = v2_spec()
    rows, pending, others = pilot_states(spec, tmp_path)
    assert [r.name for r in rows] == [
        "pilot/fixed-full-seed5",
        "pilot/fixed-0.5-seed5",
        "pilot/fslora-seed5",
        "pilot/proposed-separate-seed5",
    ]
    assert all(r.state == NOT_STARTED and r.values == () for r in rows)
    assert pending == ["fixed-full", "fixed-0.5", "fslora", "proposed-separate"]
    assert others == [] and all(r.state == NOT_STARTED for r in analysed_states(spec, tmp_path))
    assert "may start their runs now (`run --arms LABEL`): none yet." in render_status(
        spec, tmp_path
    )
    assert "does not exist" not in render_status(spec, tmp_path)
    text = render_status(spec, tmp_path / "typo")  # a wrong --out says so
    assert f"{tmp_path / 'typo'} does not exist: nothing of this study has run there." in text


def test_status_reads_states_curves_criterion_and_leftovers_by_hand(tmp_path):
    spec = v2_spec()
    lr = spec.config([]).training.lr
    pilot_stage(spec, tmp_path, run_fn=fake, log=lambda _: None)
    # a grid run killed mid-way: its summary gone, its metrics cut after round 10
    cut = tmp_path / "pilot" / "fixed-0.5-x3-seed5"
    (cut / "summary.json").unlink()
    (cut / "metrics.jsonl").write_text(
        "".join(
            json.dumps(x) + "\n"
            for x in [
                {"round": 0, "sim_time_s": 0.0, "eval": {"arc-e": 0.5}},
                {"round": 10, "sim_time_s": 2.5, "n_participants": 3},
            ]
        )
    )
    (tmp_path / "pilot" / "gone-arm-seed5").mkdir()  # an arm an amendment took out
    rows, pending, others = pilot_states(spec, tmp_path)
    by = {r.name: r for r in rows}
    assert set(by) == {
        "pilot/fixed-full-seed5",
        "pilot/fixed-0.5-seed5",
        "pilot/fixed-0.5-x0.3-seed5",
        "pilot/fixed-0.5-x3-seed5",
        "pilot/fslora-seed5",
        "pilot/proposed-separate-seed5",
    }
    full = by["pilot/fixed-full-seed5"]
    assert (full.state, full.rounds, full.sim_time_s) == (FINISHED, 30, 6.0)
    assert full.client_steps == 5 * (0 + 2 + 2 + 2)  # H = 5 times the participants
    assert full.train_loss == (3.0, 1.0)  # losses 3, 2, 1: a tenth of 3 is one value
    assert full.values == (0.50, 0.54, 0.55, 0.56)
    assert full.criterion.learned and full.criterion.gain_at_budget == pytest.approx(0.06)
    flat = by["pilot/fixed-0.5-seed5"]
    assert not flat.criterion.learned
    assert flat.criterion.gain_at_budget == pytest.approx(0.01)
    assert flat.criterion.worst_drop == pytest.approx(0.01)
    part = by["pilot/fixed-0.5-x3-seed5"]
    assert (part.state, part.rounds, part.sim_time_s, part.values) == (PARTIAL, 10, 2.5, (0.5,))
    assert part.criterion is None and part.step == pytest.approx(3 * lr)
    assert by["pilot/fixed-0.5-x0.3-seed5"].step == pytest.approx(0.3 * lr)
    assert pending == [] and others == ["pilot/gone-arm-seed5"]
    text = render_status(spec, tmp_path)
    assert (
        f"| pilot/fixed-full-seed5 | {lr:g} | finished | 30 | 30 | 3.00 -> 1.00 | 6.0 | 50.0, 54.0, 55.0, 56.0 | yes (6.0 at B) | 9 |"
        in text
    )
    assert "| pilot/fixed-0.5-seed5 |" in text and "| no (1.0 at B) |" in text
    assert (
        "| pilot/fixed-0.5-x3-seed5 |" in text
        and "| partial | 10 | 15 | - | 2.5 | 50.0 | - | - |" in text  # no compute_s written
    )
    assert "5 of 6 known pilot jobs finished." in text
    assert "no job of this config: pilot/gone-arm-seed5." in text
    assert "0 of 6 analysed runs finished." in text  # the pilot wrote rule.json
    # Machines: the fake runs wrote no machine.jsonl; a run resumed at round 10 on another CPU
    assert "## Machines\n\n6 started run(s) have no machine.jsonl" in text
    record_stretch(cut, 0, {"cpu_model": "AMD EPYC", "simd": "avx2"}, fresh=True)
    record_stretch(cut, 10, {"cpu_model": "AMD EPYC", "simd": "avx512"}, fresh=False)
    text = render_status(spec, tmp_path)
    assert (
        "- pilot/fixed-0.5-x3-seed5: rounds 1-10 AMD EPYC (avx2); rounds 11- AMD EPYC (avx512)\n"
        "- 5 started run(s) have no machine.jsonl"
    ) in text


def test_status_lists_every_analysed_run_once_the_rule_exists(tmp_path):
    spec = v2_spec()
    (tmp_path / "rule.json").write_text("{}")
    fake(None, tmp_path / "fslora-seed1", resume=False)
    rows = analysed_states(spec, tmp_path)
    names = [r.name for r in rows]
    assert len(names) == len(spec.seeds) * len(spec.labels) == 6
    assert names[0] == "fslora-seed0" and names[-1] == "fixed-best-seed1"
    done = [r.name for r in rows if r.state == FINISHED]
    assert done == ["fslora-seed1"]
    assert "1 of 6 analysed runs finished." in render_status(spec, tmp_path)


def test_status_before_the_rule_names_the_arms_that_may_start_and_shows_their_runs(tmp_path):
    spec = v2_spec()
    fake(None, tmp_path / "pilot" / "fslora-seed5", resume=False)  # learns at its step
    fake(None, tmp_path / "pilot" / "fixed-0.5-seed5", resume=False)  # flat: its grid waits
    early = tmp_path / "fslora-seed0"  # started before rule.json, parked after round 10
    fake(None, early, resume=False)
    (early / "summary.json").unlink()
    text = render_status(spec, tmp_path)
    assert not (tmp_path / "rule.json").exists()
    assert "may start their runs now (`run --arms LABEL`): fslora (step x1)." in text
    assert "| fslora-seed0 | partial | 30 | 30 |" in text
    assert "| fslora-seed1 |" not in text and "| fixed-best-seed0 |" not in text
    assert "0 of 6 analysed runs finished." in text


def test_train_loss_tenths_by_hand():
    from research.study_planner.study_status import _tenths

    assert _tenths([]) is None
    assert _tenths([5.0]) == (5.0, 5.0)
    losses = [float(x) for x in range(20, 0, -1)]  # 20, 19, ..., 1: tenths of two values
    assert _tenths(losses) == (19.5, 1.5)


def test_compute_left_by_hand():
    # B = 6 s. fixed-full finished (21,600 compute-s over 6 simulated s: 3,600 a second);
    # fslora started (7,200 s over its first 2.5 s: 2,880 a second, 3.5 s of B left: 2.8 h);
    # its x3 grid run not started (its arm's rate times B: 4.8 h); proposed-separate has no
    # run with a rate yet
    from research.study_planner.study_status import (
        RunState,
        compute_rates,
        seconds_left,
        work_left_line,
    )

    spec = v2_spec()

    def row(name, label, state, clock=None, spent=None):
        return RunState(name, 1.0, state, None, clock, (), None, spent, label=label)

    # a run just started (0.3 s, under a tenth of B) is taken at its arm's rate: its first
    # rounds carry round 0's evaluation; with no arm's rate, at its own
    early = row("pilot/fixed-full-x3-seed5", "fixed-full", PARTIAL, 0.3, 3000.0)
    assert seconds_left(early, 6.0, {"fixed-full": 3600.0}) == pytest.approx(3600.0 * 5.7)
    assert seconds_left(early, 6.0, {}) == pytest.approx(10000.0 * 5.7)
    rows = [
        row("pilot/fixed-full-seed5", "fixed-full", FINISHED, 6.0, 21600.0),
        row("pilot/fslora-seed5", "fslora", PARTIAL, 2.5, 7200.0),
        row("pilot/fslora-x3-seed5", "fslora", NOT_STARTED),
        row("pilot/proposed-separate-seed5", "proposed-separate", NOT_STARTED),
    ]
    rates = compute_rates([*rows, early], 6.0)  # the early run's rate is left out
    assert rates == {"fixed-full": 3600.0, "fslora": 2880.0}
    assert [seconds_left(r, 6.0, rates) for r in rows] == [0.0, 10080.0, 17280.0, None]
    line = work_left_line(spec, rows, ["proposed-separate"], None)
    assert "pilot 7.6 h (2 runs)" in line  # 2.8 + 4.8
    # analysed, before rule.json: seeds 0 and 1 of fslora (4.8 h each), of fixed-best (the
    # dearest fixed rule with a rate: 6 h each) and of proposed-separate (no rate)
    assert "analysed runs 21.6 h (4 runs)" in line
    assert (
        "no rate yet for 3 runs (pilot/proposed-separate-seed5, proposed-separate-seed0, " in line
    )
    assert "step grids" not in line  # proposed-separate, the arm not yet judged, has no rate
    line = work_left_line(spec, rows, ["fslora"], None)
    assert "the step grids of arms not yet judged, if they fail: up to 9.6 h" in line  # 2 x 4.8


def test_pilot_figure_draws_each_arms_runs_by_step(tmp_path, monkeypatch):
    # one panel per arm that has a run, one line per step factor (a run still going is
    # dashed and says so), the values in percent; nothing to draw before any evaluation
    from research.study_planner import study_figures

    spec = v2_spec()
    assert study_figures.pilot_figure(spec, tmp_path, tmp_path / "f.png") is None
    pilot_stage(spec, tmp_path, run_fn=fake, log=lambda _: None)
    (tmp_path / "pilot" / "fixed-0.5-x3-seed5" / "summary.json").unlink()  # still going
    png = study_figures.pilot_figure(spec, tmp_path, tmp_path / "f.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = {}

    def keep(fig, path, *, axes=(), title=""):
        drawn.update(fig=fig, axes=list(axes), title=title)
        return path

    monkeypatch.setattr(study_figures, "save_figure", keep)
    assert study_figures.pilot_figure(spec, tmp_path, tmp_path / "f.png") == tmp_path / "f.png"
    shown = [ax for ax in drawn["fig"].axes if ax not in drawn["axes"]]
    assert [ax.get_title() for ax in shown] == list(spec.pilot_labels)
    lines = {
        ax.get_title(): [ln for ln in ax.get_lines() if ln.get_marker() == "."] for ax in shown
    }
    assert [ln.get_label() for ln in lines["fixed-0.5"]] == ["x0.3", "x1", "x3 (running)"]
    assert [ln.get_linestyle() for ln in lines["fixed-0.5"]] == ["-", "-", "--"]
    full = lines["fixed-full"][0]
    assert list(full.get_ydata()) == pytest.approx([50.0, 54.0, 55.0, 56.0])
    assert list(full.get_xdata()) == pytest.approx([0.0, 2 / 60, 4 / 60, 6 / 60])
    assert drawn["title"] == "pilot, seed 5: arc-e/acc at each evaluation"
    assert {ax.get_ylim() for ax in shown} == {shown[0].get_ylim()}  # one scale for all


def test_status_cli_refuses_a_figure_path_that_is_no_png_and_names_a_file_out(tmp_path, capsys):
    from tiny_runs import load_script

    runner = load_script("research/study_planner/study_planner.py")
    config = "research/study_planner/study_planner_v2.toml"
    for bad in (tmp_path, tmp_path / "curves.svg"):  # a directory; another format
        argv = ["status", "--config", config, "--out", str(tmp_path), "--figure", str(bad)]
        assert runner.main(argv) == 2
        captured = capsys.readouterr()
        assert f"--figure {str(bad)!r}: not a path to a .png file" in captured.err
        assert captured.out == ""  # refused before anything is read or printed
    assert not (tmp_path / "curves.svg").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    assert runner.main(["status", "--config", config, "--out", str(a_file)]) == 0
    assert f"{a_file} is not a directory: nothing of this study has run there." in (
        capsys.readouterr().out
    )
    assert a_file.read_text() == "mine\n"
    argv = [
        "status",
        "--config",
        config,
        "--out",
        str(tmp_path),
        "--figure",
        str(tmp_path / "f.png"),
    ]
    assert runner.main(argv) == 0
    assert "figure: none (no pilot run has an evaluation yet)" in capsys.readouterr().out
