"""The report's evaluation additions (issue 13): McNemar against a hand computation, paired
predictions, time to a target eval_loss, the baseline table and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.errors import DataError
from fedlora.studies.predictions import mcnemar_p, paired_tests, read_predictions
from fedlora.studies.report import write_report
from fedlora.studies.runs import load_run, time_to_loss


def _line(rnd: int, t: float, acc: float | None, loss: float | None) -> dict:
    line = {"round": rnd, "sim_time_s": t, "train_loss": None if rnd == 0 else 1.0}
    if acc is not None:
        line.update(
            eval={"arc-e": acc},
            eval_accuracy=acc,
            eval_loss=loss,
            eval_losses={"arc-e": loss},
            eval_ci95={"arc-e": [max(0.0, acc - 0.1), min(1.0, acc + 0.1)]},
            eval_n={"arc-e": 10},
            eval_majority={"arc-e": 0.4},
            eval_chance={"arc-e": 0.25},
        )
    return line


def make_run(
    root: Path, name: str, points: list, correct: list[int] | None = None, seed: int = 0
) -> Path:
    d = root / name
    d.mkdir(parents=True)
    lines = [_line(i, *p) for i, p in enumerate(points)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "config.toml").write_text(f'[method]\nname = "fedavg"\n[training]\nseed = {seed}\n')
    (d / "summary.json").write_text(json.dumps({"method": "fedavg", "seed": seed}))
    if correct is not None:
        ids = [f"q{i}" for i in range(len(correct))]
        first = {"round": 0, "task": "arc-e", "ids": ids, "correct": [0] * len(ids)}
        last = {"round": len(points) - 1, "task": "arc-e", "ids": ids, "correct": correct}
        (d / "predictions.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(last) + "\n")
    return d


def test_mcnemar_exact_p_hand_computed() -> None:
    # b = 1, c = 6: n = 7, P(X <= 1) = (C(7,0) + C(7,1)) / 2^7 = 8/128; two-sided 0.125
    assert mcnemar_p(1, 6) == pytest.approx(0.125)
    assert mcnemar_p(6, 1) == pytest.approx(0.125)
    # b = 0, c = 5: 2 / 32
    assert mcnemar_p(0, 5) == pytest.approx(0.0625)
    # b = 10, c = 20: 2 * sum_{i<=10} C(30, i) / 2^30 = 0.09874 (binomial table)
    assert mcnemar_p(10, 20) == pytest.approx(0.098737, abs=1e-5)
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0
    for bad in (-1, 1.5, True):
        with pytest.raises(DataError, match=r"b = .* is invalid: a count >= 0"):
            mcnemar_p(bad, 1)


def test_paired_tests_match_questions_by_id(tmp_path: Path) -> None:
    pts = [(0.0, 0.3, 1.5), (10.0, 0.5, 1.2)]
    a = make_run(tmp_path, "a-seed0", pts, correct=[1, 1, 1, 0, 0, 1, 0, 1])
    b = make_run(tmp_path, "b-seed0", pts, correct=[1, 0, 0, 0, 1, 1, 0, 0])
    assert read_predictions(a)["arc-e"]["round"] == 1  # the last evaluation
    (t,) = paired_tests(a, b)
    # both: q0, q5; A only: q1, q2, q7; B only: q4; neither: q3, q6
    assert (t.task, t.n, t.both, t.a_only, t.b_only, t.neither) == ("arc-e", 8, 2, 3, 1, 2)
    assert t.accuracy_a == 5 / 8 and t.accuracy_b == 3 / 8
    assert t.p_value == pytest.approx(2 * (1 + 4) / 16)  # b = 3, c = 1: n = 4
    # B evaluated other questions too: only shared ids are paired
    line = json.loads((b / "predictions.jsonl").read_text().splitlines()[1])
    line["ids"][0] = "other"
    (b / "predictions.jsonl").write_text(json.dumps(line) + "\n")
    assert paired_tests(a, b)[0].n == 7
    c = make_run(tmp_path, "c-seed0", pts)
    with pytest.raises(DataError, match=r"has no predictions.jsonl"):
        paired_tests(a, c)


def test_time_to_target_loss(tmp_path: Path) -> None:
    run = load_run(
        make_run(tmp_path, "x-seed0", [(0.0, 0.3, 1.5), (5.0, None, None), (10.0, 0.4, 1.1)])
    )
    assert run.loss_points() == [(0.0, 1.5), (10.0, 1.1)]
    assert time_to_loss(run, 1.2) == (10.0, True)
    assert time_to_loss(run, 1.5) == (0.0, True)
    assert time_to_loss(run, 1.0) == (10.0, False)  # censored at the last clock


def test_report_sections_plots_and_cli(tmp_path: Path, capsys) -> None:
    pts = [(0.0, 0.3, 1.5), (10.0, 0.5, 1.2)]
    a = make_run(tmp_path / "s", "a-seed0", pts, correct=[1, 1, 1, 0, 0, 1, 0, 1])
    make_run(tmp_path / "s", "b-seed0", [(0.0, 0.3, 1.5), (20.0, 0.6, 1.3)], correct=[1] * 8)
    out = tmp_path / "out"
    runs = [load_run(p) for p in sorted((tmp_path / "s").iterdir())]
    path = write_report(runs, {"arc-e": 0.5}, out, target_loss=1.25, mcnemar=True)
    text = path.read_text()
    assert (out / "accuracy_vs_time.png").is_file() and (out / "eval_loss_vs_time.png").is_file()
    assert "## Last evaluation against the baselines" in text
    assert "| a | 0 | arc-e | 1 | 50.0% [40.0, 60.0] | 40.0% | 25.0% | - | 1.2000 | 10 |" in text
    assert "## Time to eval_loss <= 1.25 (s)" in text
    assert "| a | 10.0 | 1.2000 |" in text
    assert "| b | >= 20.0 (1/1 not reached) | 1.3000 |" in text
    # a right only on none, b right only on q3, q4, q6: p = 2 * 1/8
    assert "| a | b | arc-e | 8 | 5 | 0 | 3 | 0 | 62.5% | 100.0% | 0.25 |" in text
    code = main(
        ["report", str(tmp_path / "s" / "a-seed0"), str(tmp_path / "s" / "b-seed0"), "--target",
         "arc-e=0.5", "--mcnemar", "--target-loss", "1.25", "--out", str(tmp_path / "cli")]
    )  # fmt: skip
    assert code == 0
    assert "## Paired test (McNemar)" in (tmp_path / "cli" / "report.md").read_text()
    # two runs of the same label from different suites (and seeds) are still a pair
    other = make_run(tmp_path / "t", "a-seed1", pts, correct=[0] * 8, seed=1)
    write_report([load_run(a), load_run(other)], {"arc-e": 0.5}, tmp_path / "o2", mcnemar=True)
    text = (tmp_path / "o2" / "report.md").read_text()
    assert "| s/a-seed0 | t/a-seed1 | arc-e | 8 | 0 | 5 | 0 | 3 |" in text
    capsys.readouterr()
    code = main(["report", str(a), "--target", "arc-e=0.5", "--target-loss", "-1"])
    assert code == 2
    assert "--target-loss = -1.0 is invalid: an eval_loss > 0" in capsys.readouterr().err


def test_baseline_table_shows_mc_loss_with_its_interval(tmp_path: Path) -> None:
    d = make_run(tmp_path, "a-seed0", [(0.0, 0.3, 1.5), (10.0, 0.5, 1.2)])
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    lines[-1].update(
        eval_mc_losses={"arc-e": 1.25},
        eval_mc_loss_ci95={"arc-e": [1.2, 1.3]},
        eval_mc_chance={"arc-e": 1.3862943611198906},
    )
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = write_report([load_run(d)], {"arc-e": 0.5}, tmp_path / "out").read_text()
    assert "| 1.2500 [1.2000, 1.3000] (1.386) | 1.2000 | 10 |" in text


def test_paired_change_by_hand() -> None:
    from fedlora.llm.eval_stats import paired_change

    before = [1, 0, 0, 1, 0, 1, 0, 0]
    after = [1, 1, 1, 0, 1, 1, 0, 1]  # 4 gained (q2, q3, q5, q8), 1 lost (q4)
    pair = paired_change(before, after)
    assert (pair["gained"], pair["lost"]) == (4, 1)
    assert pair["gain"] == pytest.approx(3 / 8)
    # d = [0, 1, 1, -1, 1, 0, 0, 1]: sd (ddof 1) = sqrt((8 * 5/8 - 8 * (3/8) ** 2) / 7)
    sd = ((5 - 8 * (3 / 8) ** 2) / 7) ** 0.5
    lo, hi = pair["gain_ci95"]
    assert (lo, hi) == pytest.approx(
        (3 / 8 - 1.959964 * sd / 8**0.5, 3 / 8 + 1.959964 * sd / 8**0.5)
    )
    assert pair["mcnemar_p"] == pytest.approx(2 * (1 + 5) / 32)  # 2·P(X <= 1), X ~ Bin(5, 1/2)
    with pytest.raises(DataError, match="paired questions"):
        paired_change([1, 0], [1])
