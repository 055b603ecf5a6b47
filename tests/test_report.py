"""report.md and `fedlora report` (fedlora.studies.report, runs, tables) on hand-made metrics
files with known answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError, DataError
from fedlora.federation.metrics_file import read_metrics
from fedlora.studies.report import render_markdown, write_report
from fedlora.studies.runs import collect_runs, load_run, time_to_target
from fedlora.studies.suite_report import report_suite
from fedlora.studies.tables import speedup, summarize


def _line(rnd: int, time_s: float, acc: dict[str, float] | None = None, **extra) -> dict:
    line = {"round": rnd, "sim_time_s": time_s, "train_loss": None if rnd == 0 else 1.0}
    if acc is not None:
        line["eval"] = acc
        line["eval_accuracy"] = sum(acc.values()) / len(acc)
    line.update(extra)
    return line


def make_run(
    root: Path, name: str, points: list[tuple[float, dict | None]], method: str, seed: int = 0,
    **summary,
) -> Path:  # fmt: skip
    """A run directory with one metrics line per point (round = index)."""
    d = root / name
    d.mkdir(parents=True)
    lines = [_line(i, t, acc) for i, (t, acc) in enumerate(points)]
    if summary.get("calibration_sim_time_s"):
        lines[0]["calibration_sim_time_s"] = summary["calibration_sim_time_s"]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "config.toml").write_text(f'[method]\nname = "{method}"\n[training]\nseed = {seed}\n')
    (d / "summary.json").write_text(json.dumps({"method": method, "seed": seed, **summary}))
    return d


# ARC-e reaches 50% at t = 20; ARC-c never reaches 40% (last clock 35 s).
CURVE = [
    (0.0, {"arc-e": 0.30, "arc-c": 0.20}),
    (10.0, {"arc-e": 0.45, "arc-c": 0.25}),
    (15.0, None),
    (20.0, {"arc-e": 0.55, "arc-c": 0.30}),
    (30.0, {"arc-e": 0.60, "arc-c": 0.35}),
    (35.0, None),
]


def test_time_to_target_is_first_eval_at_or_above_target(tmp_path):
    # Prepare
    run = load_run(make_run(tmp_path, "fslora-seed0", CURVE, "fslora"))
    # Execute / Assert: 0.45 < 0.5 <= 0.55 at t = 20; exactly equal counts as reached
    assert time_to_target(run, "arc-e", 0.50) == (20.0, True)
    assert time_to_target(run, "arc-e", 0.55) == (20.0, True)
    assert time_to_target(run, "arc-e", 0.30) == (0.0, True)  # the untrained adapter, line 0
    # never reached: censored at the last simulated time, not the last eval's
    assert time_to_target(run, "arc-c", 0.40) == (35.0, False)
    # the mean over eval tasks (eval_accuracy): (0.55 + 0.30)/2 = 0.425 at t = 20
    assert time_to_target(run, "mean", 0.42) == (20.0, True)


def test_label_seed_and_method_come_from_the_directory_and_summary(tmp_path):
    run = load_run(make_run(tmp_path, "fixed-0.2-seed3", CURVE, "sketched", seed=3))
    assert (run.label, run.method, run.seed) == ("fixed-0.2", "sketched", 3)
    assert run.total_time_s == 35.0
    assert run.final_accuracy("arc-e") == 0.60
    assert run.tasks() == ["arc-e", "arc-c"]


def test_summary_speedup_and_censoring(tmp_path):
    # Prepare: fslora reaches 50% at 40 and 60 s; proposed at 10 and 15 s -> 50/12.5 = 4x
    def curve(t_hit: float, end: float) -> list:
        return [(0.0, {"arc-e": 0.3}), (t_hit, {"arc-e": 0.5}), (end, {"arc-e": 0.52})]

    runs = [
        load_run(make_run(tmp_path, "fslora-seed0", curve(40, 80), "fslora", 0)),
        load_run(make_run(tmp_path, "fslora-seed1", curve(60, 80), "fslora", 1)),
        load_run(make_run(tmp_path, "proposed-seed0", curve(10, 30), "proposed", 0)),
        load_run(make_run(tmp_path, "proposed-seed1", curve(15, 30), "proposed", 1)),
        # heterolora: seed 0 at 100 s, seed 1 never (censored at 120 s)
        load_run(make_run(tmp_path, "heterolora-seed0", curve(100, 120), "heterolora", 0)),
        load_run(
            make_run(
                tmp_path,
                "heterolora-seed1",
                [(0.0, {"arc-e": 0.3}), (120.0, {"arc-e": 0.4})],
                "heterolora",
                1,
            )
        ),  # fmt: skip
    ]
    # Execute
    cells = {c.label: c for c in summarize(runs, {"arc-e": 0.5})}
    # Assert
    assert cells["fslora"].mean_s == 50.0
    assert cells["fslora"].ci_s == pytest.approx(
        12.7062047361747 * math.sqrt(200) / math.sqrt(2)
    )  # sd = √200
    assert cells["proposed"].mean_s == 12.5
    assert speedup(cells["proposed"], cells["fslora"]) == "4.00x"
    assert speedup(cells["fslora"], cells["fslora"]) == "1.00x"
    assert cells["heterolora"].censored == 1
    assert cells["heterolora"].mean_s == 110.0  # (100 + 120)/2, a lower bound
    assert cells["heterolora"].ci_s is None
    assert speedup(cells["heterolora"], cells["fslora"]) == "<= 0.45x"
    assert speedup(cells["fslora"], cells["heterolora"]) == ">= 2.20x"
    assert speedup(cells["proposed"], None) == "n/a"

    text = render_markdown(runs, {"arc-e": 0.5}, order=["proposed", "fslora", "heterolora"])
    assert "| proposed | 12.5 ± 31.8 |" in text  # 12.706 · sd 3.536 / √2 = 31.76
    assert "| heterolora | >= 110.0 (1/2 not reached) |" in text
    assert "| proposed | 4.00x |" in text
    assert text.index("| proposed |") < text.index("| fslora |")  # the suite's order


def test_calibration_time_is_reported_separately(tmp_path):
    d = make_run(tmp_path, "proposed-seed0", [(12.0, {"arc-e": 0.3}), (20.0, {"arc-e": 0.6})],
                 "proposed", calibration_sim_time_s=12.0)  # fmt: skip
    run = load_run(d)
    assert run.calibration_time_s == 12.0
    assert time_to_target(run, "arc-e", 0.5) == (20.0, True)  # the clock includes calibration
    text = render_markdown([run], {"arc-e": 0.5})
    assert "| proposed | 0 | 1 | 20.0 | 12.0 |" in text


def test_torn_last_line_is_dropped_and_a_bad_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_line(0, 0.0, {"arc-e": 0.3})) + "\n" + '{"round": 1, "sim')
    assert len(read_metrics(path)) == 1
    path.write_text("not json\n" + json.dumps(_line(0, 0.0)) + "\n")
    with pytest.raises(DataError, match="line 1 is not JSON"):
        read_metrics(path)
    path.write_text(json.dumps({"round": 0}) + "\n" + json.dumps(_line(1, 1.0)) + "\n")
    with pytest.raises(DataError, match="line 1 is not a fedlora metrics line .no sim_time_s"):
        read_metrics(path)


def test_write_report_files_and_failed_runs(tmp_path):
    suite = tmp_path / "suite"
    make_run(suite, "fslora-seed0", CURVE, "fslora")
    failed = suite / "proposed-seed0"
    failed.mkdir()
    (failed / "summary.json").write_text(
        json.dumps(
            {
                "error": "calibration: estimate contradicts the model",
                "method": "proposed",
                "seed": 0,
            }
        )  # fmt: skip
    )
    from fedlora.federation.machine_log import record_stretch

    record_stretch(suite / "fslora-seed0", 0, {"cpu_model": "AMD EPYC", "simd": "avx2"}, fresh=True)
    runs, _ = collect_runs([suite])
    report = write_report(runs, {"arc-e": 0.5, "arc-c": 0.4}, tmp_path / "out", title="T")
    text = report.read_text()
    # the runs table names the machine that computed the run (its compute s depend on it)
    assert "| stop | compute (s) | machine |" in text
    row = next(x for x in text.splitlines() if x.startswith("| fslora | 0 |"))
    assert row.endswith("| AMD EPYC (avx2) |")
    assert text.startswith("# T\n")
    for heading in ("## Time to target accuracy (s)", "## Speed-up over fslora",
                    "## Final accuracy", "## Runs", "## Failed runs"):  # fmt: skip
        assert heading in text
    assert "| fslora | 20.0 | >= 35.0 (1/1 not reached) |" in text
    assert "- proposed seed 0: calibration: estimate contradicts the model" in text
    assert (tmp_path / "out" / "accuracy_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a run resumed on another kind of machine says which rounds ran where
    record_stretch(
        suite / "fslora-seed0", 7, {"cpu_model": "AMD EPYC", "simd": "avx512"}, fresh=False
    )
    runs, _ = collect_runs([suite])
    text = write_report(runs, {"arc-e": 0.5}, tmp_path / "out2", title="T").read_text()
    row = next(x for x in text.splitlines() if x.startswith("| fslora | 0 |"))
    assert row.endswith("| rounds 1-7 AMD EPYC (avx2); rounds 8- AMD EPYC (avx512) |")


def test_write_report_bad_input(tmp_path):
    run = load_run(make_run(tmp_path, "fslora-seed0", CURVE, "fslora"))
    with pytest.raises(
        ConfigError, match=r"target arc-e = 1.5 is invalid: an accuracy in \(0, 1\]"
    ):
        write_report([run], {"arc-e": 1.5}, tmp_path / "o")
    with pytest.raises(DataError, match="no runs"):
        write_report([], {"arc-e": 0.5}, tmp_path / "o")


def test_report_cli_rebuilds_from_a_suite_directory(tmp_path, capsys):
    # Prepare: a suite dir as `fedlora compare` leaves it (suite.toml gives targets and order)
    suite = tmp_path / "table1"
    make_run(suite, "fslora-seed0", CURVE, "fslora")
    make_run(suite, "proposed-seed0", [(5.0, {"arc-e": 0.3, "arc-c": 0.2}),
                                       (10.0, {"arc-e": 0.5, "arc-c": 0.4})], "proposed",
             calibration_sim_time_s=5.0)  # fmt: skip
    (suite / "suite.toml").write_text(
        'title = "Table I"\ncommand = "fedlora compare --suite table1"\n'
        'labels = ["proposed", "fslora"]\n[targets]\n"arc-e" = 0.5\n"arc-c" = 0.4\n'
    )
    # Execute
    assert main(["report", str(suite)]) == 0
    # Assert: proposed 10 s vs fslora 20 s on ARC-e -> 2x; ARC-c fslora censored -> >= 3.5x
    text = (suite / "report.md").read_text()
    assert "fedlora compare --suite table1" in text
    assert "| proposed | 10.0 | 10.0 |" in text
    assert "| proposed | 2.00x | >= 3.50x |" in text
    assert (suite / "accuracy_vs_time.png").exists()
    # --target overrides suite.toml, --out elsewhere
    assert main(["report", str(suite), "--target", "arc-e=60%", "-o", str(tmp_path / "r")]) == 0
    assert "arc-e (>= 60%)" in (tmp_path / "r" / "report.md").read_text()
    assert report_suite([suite / "fslora-seed0"], tmp_path / "r2", targets={"arc-e": 0.5})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "/nonexistent/run"], "'/nonexistent/run': no such directory"),
        (
            ["report", "{d}", "--target", "arc-e=0.5", "--target", "arc-e=0.6"],
            "--target = 'arc-e=0.5 and arc-e=0.6' is invalid: one --target per task",
        ),
        (["report", "{d}", "--target", "arc-e"], "--target = 'arc-e' is invalid: TASK=ACCURACY"),
        (["report", "{d}", "--target", "arc-e=x"], "with a number"),
        (["report", "{d}", "--target", "arc-e=1.2"], "an accuracy in (0, 1]"),
        (["report", "{e}"], "holds no run"),
    ],
)
def test_report_cli_bad_input_exits_2_without_traceback(tmp_path, capsys, argv, message):
    d = make_run(tmp_path, "fslora-seed0", CURVE, "fslora")
    (tmp_path / "empty").mkdir()
    argv = [a.format(d=d, e=tmp_path / "empty") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_time_without_calibration(tmp_path):
    # proposed: calibration 12 s, target at 20 s -> 8 s without it; fslora at 16 s -> 2x
    make_run(tmp_path, "proposed-seed0", [(12.0, {"arc-e": 0.3}), (20.0, {"arc-e": 0.6})],
             "proposed", calibration_sim_time_s=12.0)  # fmt: skip
    make_run(tmp_path, "fslora-seed0", [(0.0, {"arc-e": 0.3}), (16.0, {"arc-e": 0.6})], "fslora")
    runs, _ = collect_runs([tmp_path])
    text = render_markdown(runs, {"arc-e": 0.5})
    assert "| proposed | 20.0 |" in text and "| proposed | 0.80x |" in text
    assert "## Time to target without the calibration runs (s)" in text
    assert "| proposed | 8.0 [2.00x] |" in text


def test_report_without_a_target_has_curves_table_and_html_but_no_times(tmp_path, capsys):
    d = make_run(tmp_path / "s", "fslora-seed0", CURVE, "fslora")
    assert main(["report", str(d), "-o", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o" / "report.md").read_text()
    assert "## Final accuracy" in text and "| fslora | 60.0% | 35.0% |" in text
    assert "Time to target" not in text and "Speed-up" not in text
    assert "No target given" in text
    assert (tmp_path / "o" / "accuracy_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    assert "data:image/png;base64" in (tmp_path / "o" / "report.html").read_text()
    # with a target, the time columns come back
    assert main(["report", str(d), "-o", str(tmp_path / "t"), "--target", "arc-e=0.5"]) == 0
    assert "## Time to target accuracy (s)" in (tmp_path / "t" / "report.md").read_text()


def _config(run_dir, n_clients, seed):
    (run_dir / "config.toml").write_text(
        f"[data]\nn_clients = {n_clients}\n[training]\nseed = {seed}\n"
        f'[output]\ndir = "{run_dir.name}"\n'
    )


def test_report_refuses_runs_of_different_configs_as_seeds_of_one_method(tmp_path, capsys):
    a = make_run(tmp_path / "x", "fslora-seed0", CURVE, "fslora")
    b = make_run(tmp_path / "y", "fslora-seed1", CURVE, "fslora", seed=1)
    _config(a, 10, 0)
    _config(b, 20, 1)
    assert main(["report", str(a), str(b), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "both reported as 'fslora', but their configs differ in data.n_clients (10 vs 20)" in err
    assert not (tmp_path / "o").exists()
    # the same config but for the seed and [output]: seeds of one method
    _config(b, 10, 1)
    assert main(["report", str(a), str(b), "-o", str(tmp_path / "o")]) == 0
    # the same label and seed twice
    c = make_run(tmp_path / "z", "fslora-seed0", CURVE, "fslora")
    _config(c, 10, 0)
    assert main(["report", str(a), str(c), "-o", str(tmp_path / "o2")]) == 2
    assert "are both 'fslora' seed 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("suite_toml", "metrics", "message"),
    [
        (b"title = '\xff'\n", None, "suite.toml: not UTF-8 text"),
        (b"targets = 3\n", None, "targets = 3 is invalid: a table of task = accuracy"),
        (b"[targets]\narc-e = 2\n", None, "targets = {'arc-e': 2} is invalid"),
        (b"labels = 'x'\n", None, "labels = x is invalid: a list of strings"),
        (
            None,
            '{"round": 0, "sim_time_s": "abc", "eval": {"arc-e": 0.3}}\n',
            "line 1: sim_time_s = 'abc' is invalid: a finite number",
        ),
        (
            None,
            '{"round": 0, "sim_time_s": 0, "eval": {"arc-e": "x"}}\n',
            "line 1: eval.arc-e = 'x' is invalid: a number",
        ),
        (
            None,
            '{"round": 0, "sim_time_s": 0, "eval": 3}\n',
            "eval = '3' is invalid: a table {task: number}",
        ),
    ],
)
def test_report_bad_suite_or_metrics_values_exit_2(tmp_path, capsys, suite_toml, metrics, message):
    suite = tmp_path / "s"
    d = make_run(suite, "fslora-seed0", CURVE, "fslora")
    if suite_toml is not None:
        (suite / "suite.toml").write_bytes(suite_toml)
    if metrics is not None:
        (d / "metrics.jsonl").write_text(metrics)
    assert main(["report", str(suite), "--target", "arc-e=0.5", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_two_settings_of_one_method_are_labelled_by_their_directories(tmp_path, capsys):
    # lora-inf and lora-eps8: the same method and seed in two settings, no -seed suffix
    a = make_run(tmp_path, "lora-inf", CURVE, "sketched")
    b = make_run(tmp_path, "lora-eps8", CURVE, "sketched")
    one = make_run(tmp_path / "solo", "exp1", CURVE, "fslora")
    runs, _ = collect_runs([a, b, one])
    assert [r.label for r in runs] == ["lora-inf", "lora-eps8", "fslora"]
    assert main(["report", str(a), str(b), "-o", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o" / "report.md").read_text()
    assert "lora-inf" in text and "lora-eps8" in text


def test_flat_config_keys_nested_tables_by_dots():
    from fedlora.studies.runs import flat_config

    cfg = {"data": {"n_clients": 10, "mc": {"task": "a", "files": []}}, "seed": 0}
    assert flat_config(cfg) == {
        "data.n_clients": 10,
        "data.mc.task": "a",
        "data.mc.files": [],
        "seed": 0,
    }
    assert flat_config({}) == {} and flat_config({"a": {}}) == {}  # an empty table: no key
