"""The run directory's schema (issue 23, item 4): fedlora.federation.runfiles reads and writes
metrics.jsonl (one torn-line rule), clients.csv, plan.json and summary.json; hand-made files."""

from __future__ import annotations

import json
import math
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import numpy as np
import pytest

from fedlora.errors import DataError
from fedlora.federation.metrics_file import read_metrics, read_metrics_lines
from fedlora.federation.runfiles import (
    CLIENT_COLUMNS,
    ClientRow,
    read_clients,
    read_plan,
    read_summary,
    write_clients,
    write_plan,
    write_summary,
)
from fedlora.system.network import ClientProfiles

L0 = '{"round": 0, "sim_time_s": 0.0}'
L1 = '{"round": 1, "sim_time_s": 2.5, "train_loss": 1.25}'


def _metrics(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- metrics.jsonl


def test_whole_lines_are_read_in_order_with_every_key(tmp_path):
    path = _metrics(tmp_path, f"{L0}\n{L1}\n")
    assert read_metrics(path) == [{"round": 0, "sim_time_s": 0.0},
                                  {"round": 1, "sim_time_s": 2.5, "train_loss": 1.25}]  # fmt: skip
    assert read_metrics_lines(path) == [L0, L1]


def test_a_torn_last_line_is_dropped_with_a_warning_naming_the_file_and_line(tmp_path):
    path = _metrics(tmp_path, f'{L0}\n{L1}\n{{"round": 2, "sim')
    warnings: list[str] = []
    assert [x["round"] for x in read_metrics(path, warn=warnings.append)] == [0, 1]
    assert len(warnings) == 1
    assert str(path) in warnings[0] and "last line 3" in warnings[0]
    assert "not JSON" in warnings[0]
    assert read_metrics_lines(path) == [L0, L1]  # the same rule, silent


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path):
    path = _metrics(tmp_path, f"{L0}\n{L1}")
    warnings: list[str] = []
    assert len(read_metrics(path, warn=warnings.append)) == 2
    assert warnings == []


@pytest.mark.parametrize(
    ("last", "why"),
    [("[1, 2]", "not a JSON object"), ('{"round": 2}', "no sim_time_s"),
     ('{"loss": 1}', "no round, sim_time_s")],
)  # fmt: skip
def test_a_foreign_last_line_is_dropped_naming_why(tmp_path, last, why):
    path = _metrics(tmp_path, f"{L0}\n{last}\n")
    warnings: list[str] = []
    assert read_metrics(path, warn=warnings.append) == [{"round": 0, "sim_time_s": 0.0}]
    assert why in warnings[0]


@pytest.mark.parametrize(
    ("middle", "why"),
    [('{"round": 1, "sim', "not JSON"), ("[1, 2]", "not a JSON object"),
     ('{"round": 1}', "no sim_time_s")],
)  # fmt: skip
def test_a_torn_or_foreign_middle_line_is_a_data_error_naming_file_and_line(tmp_path, middle, why):
    path = _metrics(tmp_path, f"{L0}\n{middle}\n{L1}\n")
    for read in (read_metrics, read_metrics_lines):
        with pytest.raises(DataError, match=rf"metrics.jsonl'?: line 2 .*{why}"):
            read(path)


def test_empty_blank_and_missing_files_hold_no_lines(tmp_path):
    assert read_metrics(_metrics(tmp_path, "")) == []
    assert read_metrics(_metrics(tmp_path, f"\n{L0}\n\n{L1}\n\n")) == [json.loads(L0),
                                                                      json.loads(L1)]  # fmt: skip
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_a_file_whose_only_line_is_torn_holds_no_lines_and_warns(tmp_path):
    warnings: list[str] = []
    assert read_metrics(_metrics(tmp_path, '{"round": 0, "sim_ti'), warn=warnings.append) == []
    assert "last line 1" in warnings[0]


def test_the_default_warning_goes_to_stderr(tmp_path, capsys):
    read_metrics(_metrics(tmp_path, f"{L0}\n{{"))
    captured = capsys.readouterr()
    assert captured.out == "" and "metrics.jsonl" in captured.err


def test_non_utf8_metrics_are_a_data_error_naming_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(L0.encode() + b"\n\xff\n")
    with pytest.raises(DataError, match="metrics.jsonl.*not UTF-8"):
        read_metrics(path)


# ----------------------------------------------------------------------------- clients.csv


def test_client_columns_are_the_profiles_after_client_n_examples_a():
    assert CLIENT_COLUMNS == ("client", "n_examples", "a",
                              *ClientProfiles.__dataclass_fields__)  # fmt: skip


def test_clients_round_trip_exactly_with_nan_channel_and_bytes_as_before(tmp_path):
    rows = [
        ClientRow(0, 12, 0.1 + 0.2, 1.5, 3e-7, 40.0, 101.25, 12.5, 4.0),
        ClientRow(1, 7, 1 / 3, 2.0, 1e-6),  # given profiles: no channel (NaN)
    ]
    write_clients(tmp_path, rows)
    text = (tmp_path / "clients.csv").read_text()
    assert text.splitlines()[0] == ",".join(CLIENT_COLUMNS)
    # the bytes federation.profiles wrote before issue 23: str(int), repr(float)
    assert text.splitlines()[2] == "1,7,0.3333333333333333,2.0,1e-06,nan,nan,nan,nan"
    back = read_clients(tmp_path / "clients.csv")
    assert back[0] == rows[0]  # exact floats (0.30000000000000004 survives)
    assert back[1].client == 1 and back[1].a == 1 / 3 and math.isnan(back[1].snr_db)
    with pytest.raises(FrozenInstanceError):
        back[0].a = 0.5  # type: ignore[misc]


def test_clients_without_channel_columns_read_as_nan(tmp_path):
    path = tmp_path / "clients.csv"
    path.write_text("client,n_examples,a,tau_full_s,t_full\n0,3,1.0,2.0,4.0\n")
    (row,) = read_clients(path)
    assert (row.a, row.tau_full_s, row.t_full) == (1.0, 2.0, 4.0)
    assert all(math.isnan(getattr(row, f.name)) for f in fields(ClientRow)[5:])


@pytest.mark.parametrize(
    ("text", "match"),
    [("client,n_examples,a,t_full\n0,3,1.0,4.0\n", "missing: tau_full_s"),
     ("client,n_examples,a,tau_full_s,t_full\n", "no client rows"),
     ("client,n_examples,a,tau_full_s,t_full\n0,3,x,2.0,4.0\n", r"row 1: a = 'x' is not a number"),
     ("client,n_examples,a,tau_full_s,t_full\n0,3.5,1,2.0,4.0\n", "n_examples .* not an integer")],
)  # fmt: skip
def test_damaged_clients_are_a_data_error_naming_the_file(tmp_path, text, match):
    path = tmp_path / "clients.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=match) as e:
        read_clients(path)
    assert "clients.csv" in str(e.value)
    with pytest.raises(DataError, match="clients.csv.*cannot be read"):
        read_clients(tmp_path / "missing" / "clients.csv")


# ----------------------------------------------------------------------------- plan.json


def test_plan_round_trip_keeps_every_field(tmp_path):
    plan = {"q": [0.5, 1.0], "k": [2, 4], "constants": {"A": 1.0, "B": 1.0},
            "calibration": {"loss_used": 2.0, "sim_time_s": 12.5, "runs": []}}  # fmt: skip
    path = write_plan(tmp_path, plan)
    assert path.read_text() == json.dumps(plan, indent=2) + "\n"  # the bytes as before
    back = read_plan(path)
    assert (back.q, back.k) == ((0.5, 1.0), (2, 4))
    assert back.calibration_mode == "calibration" and back.calibration_s == 12.5
    assert back.fields == plan
    in_run = read_plan(write_plan(tmp_path, {**plan, "calibration": {"mode": "in-run"}}))
    assert in_run.calibration_mode == "in-run" and in_run.calibration_s == 0.0


@pytest.mark.parametrize(
    ("text", "match"),
    [('{"q": [1], "k": [2]', "not valid JSON"), ("[1]", "not a JSON object"),
     ('{"k": [2], "calibration": {}}', "field q"),
     ('{"q": [1], "k": [2], "calibration": 3}', "field calibration"),
     ('{"q": ["x"], "k": [2], "calibration": {}}', "field q is missing or not")],
)  # fmt: skip
def test_damaged_plan_is_a_data_error_naming_the_file(tmp_path, text, match):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(DataError, match=match) as e:
        read_plan(path)
    assert "plan.json" in str(e.value)


# ----------------------------------------------------------------------------- summary.json


def test_summary_round_trip(tmp_path):
    summary = {"stop_reason": "max_rounds", "rounds": 4, "sim_time_s": 10.5, "wall_s": 1.0,
               "compute_s": 0.5, "total_uplink_bits": 8e6, "empty_rounds": 0,
               "method": "sketched", "seed": 3, "final_eval": {"arc-e": 0.5},
               "plan": {"loss_used": 1.0}}  # fmt: skip
    write_summary(tmp_path, summary)
    path = tmp_path / "summary.json"
    assert path.read_text() == json.dumps(summary, indent=2) + "\n"
    back = read_summary(path)
    assert (back.method, back.seed, back.rounds, back.stop_reason) == ("sketched", 3, 4,
                                                                       "max_rounds")  # fmt: skip
    assert (back.sim_time_s, back.total_uplink_bits, back.error) == (10.5, 8e6, None)
    assert back.plan == {"loss_used": 1.0} and back.fields == summary
    assert back.replace_fields(sim_time_s=2.0).sim_time_s == 2.0 and back.sim_time_s == 10.5


def test_a_failed_runs_summary_reads_with_its_error(tmp_path):
    write_summary(tmp_path, {"error": "boom", "method": "fslora", "seed": np.int64(0).item()})
    back = read_summary(tmp_path / "summary.json")
    assert (back.error, back.method, back.seed, back.rounds) == ("boom", "fslora", 0, None)


@pytest.mark.parametrize(
    ("text", "match"),
    [("{", "not valid JSON"), ("[]", "not a JSON object"),
     ('{"seed": "x"}', "seed = 'x'"), ('{"rounds": true}', "rounds = True")],
)  # fmt: skip
def test_damaged_summary_is_a_data_error_naming_the_file(tmp_path, text, match):
    path = tmp_path / "summary.json"
    path.write_text(text)
    with pytest.raises(DataError, match=match) as e:
        read_summary(path)
    assert "summary.json" in str(e.value)


def test_a_runs_clients_csv_has_the_bytes_of_the_writer_before_issue_23(tmp_path):
    from types import SimpleNamespace

    from fedlora.federation.profiles import write_clients_csv
    from fedlora.system.network import generate_profiles, profiles_to_rows

    profiles = generate_profiles(
        3, full_payload_bits=1e6, local_steps=2, f_tot_hz=1e7, rng=np.random.default_rng(0)
    )
    fed = SimpleNamespace(client_indices=[[0, 1], [2], [3, 4, 5]], a=np.array([2, 1, 3]) / 6)
    write_clients_csv(tmp_path, fed, profiles)
    rows = profiles_to_rows(profiles)  # the writer of 7db5b13, verbatim
    lines = [",".join(["client", "n_examples", "a", *rows[0].keys()])]
    for i, row in enumerate(rows):
        values = [i, len(fed.client_indices[i]), repr(float(fed.a[i])), *map(repr, row.values())]
        lines.append(",".join(str(v) for v in values))
    assert (tmp_path / "clients.csv").read_text() == "\n".join(lines) + "\n"
    back = read_clients(tmp_path / "clients.csv")
    assert [r.snr_db for r in back] == profiles.snr_db.tolist()


# ----------------------------------------------------------------------------- fedlora report


def _hand_made_run(root: Path, metrics: str) -> Path:
    run = root / "sketched-seed0"
    run.mkdir()
    (run / "metrics.jsonl").write_text(metrics)
    (run / "config.toml").write_text('[method]\nname = "sketched"\n[training]\nseed = 0\n')
    write_summary(run, {"method": "sketched", "seed": 0, "rounds": 2, "stop_reason": "max_rounds"})
    return run


def _eval_line(rnd: int, time_s: float, acc: float) -> str:
    line = {"round": rnd, "sim_time_s": time_s, "eval": {"arc-e": acc}, "eval_accuracy": acc}
    return json.dumps(line) + "\n"


def test_report_of_a_torn_metrics_file_warns_naming_it_and_reports_the_whole_rounds(
    tmp_path, capsys
):
    from fedlora.cli import main

    run = _hand_made_run(
        tmp_path, _eval_line(0, 0.0, 0.25) + _eval_line(1, 4.0, 0.5) + '{"round": 2, "sim_t'
    )
    assert main(["report", str(run), "--target", "arc-e=0.5"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {run / 'metrics.jsonl'}: dropped its last line 3" in err
    text = (run / "report.md").read_text()
    assert "| sketched | 0 | 1 | 4.0 |" in text  # last whole round 1, its clock


def test_report_of_a_metrics_file_without_a_whole_round_is_exit_2_naming_it(tmp_path, capsys):
    from fedlora.cli import main

    run = _hand_made_run(tmp_path, '{"round": 0, "sim_t')
    assert main(["report", str(run), "--target", "arc-e=0.5"]) == 2
    err = capsys.readouterr().err
    assert f"{str(run / 'metrics.jsonl')!r} holds no complete round" in err
    assert "Traceback" not in err and not (run / "report.md").exists()


def test_report_target_of_a_task_no_run_has_names_it_and_the_runs_tasks(tmp_path, capsys):
    from fedlora.cli import main

    run = _hand_made_run(tmp_path, _eval_line(0, 0.0, 0.25) + _eval_line(1, 4.0, 0.5))
    assert main(["report", str(run), "--target", "arc-c=0.5"]) == 2
    err = capsys.readouterr().err
    assert "no run evaluated task 'arc-c'; the runs' tasks: arc-e (or mean" in err
    assert main(["report", str(run), "--target", "mean=0.5"]) == 0  # the mean is a task too


def test_a_failed_runs_torn_metrics_still_reports_it_as_failed(tmp_path, capsys):
    from fedlora.cli import main

    ok = _hand_made_run(tmp_path, _eval_line(0, 0.0, 0.25) + _eval_line(1, 4.0, 0.5))
    failed = tmp_path / "fslora-seed0"
    failed.mkdir()
    (failed / "metrics.jsonl").write_text('{"round": 0, "sim')
    write_summary(failed, {"error": "out of memory", "method": "fslora", "seed": 0})
    assert main(["report", str(ok), str(failed), "--target", "arc-e=0.5",
                 "--out", str(tmp_path / "r")]) == 0  # fmt: skip
    assert "- fslora seed 0: out of memory" in (tmp_path / "r" / "report.md").read_text()
