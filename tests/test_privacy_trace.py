"""What a DP user sees (issue 40, item 4): `fedlora plan` prints the cohort's z/m, and
`fedlora report` draws each private run's ε and clip trace (privacy_trace.png)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.commands.plan import budget_lines, cohort_noise_line, cohort_signal_line
from fedlora.studies.privacy_trace import (
    TRACE_FILE,
    PrivacyTrace,
    largest_epsilon,
    plot_privacy,
    privacy_trace,
)
from fedlora.studies.runs import RunRecord
from test_privacy_adaptive import ADAPTIVE, Q  # the adaptive settings, one list (review D1)
from test_privacy_history import TWO_CLIENT_PROBLEM
from tiny_runs import TINY_FOUR_CLIENTS

PNG = b"\x89PNG\r\n\x1a\n"


def test_largest_epsilon_is_infinite_when_any_client_is():
    assert largest_epsilon([0.5, 2.0, 0.0]) == 2.0
    assert largest_epsilon([0.5, None]) is None  # null in metrics.jsonl: not finite
    assert largest_epsilon([]) == 0.0


def _record(lines: list[dict], config: dict | None = None, label: str = "a") -> RunRecord:
    return RunRecord(Path("/nowhere"), label, "fedavg", 0, lines, config=config or {})


def test_the_trace_reads_adaptive_and_fixed_clips_by_hand():
    round0 = {"round": 0, "sim_time_s": 0.0}
    adaptive = _record(
        [
            round0,
            {"round": 1, "epsilon": [0.1, 0.3], "dp_clip": 0.01, "dp_update_norm_median": 0.2},
            {"round": 2, "epsilon": [0.2, None], "dp_clip": 0.012, "dp_update_norm_median": None},
        ]
    )
    assert privacy_trace(adaptive) == PrivacyTrace(
        rounds=[1, 2], largest_epsilon=[0.3, None], clip=[0.01, 0.012], median_norm=[0.2, None]
    )
    fixed = _record(
        [round0, {"round": 1, "epsilon": [1.5], "dp_update_norm_median": 3.0}],
        config={"privacy": {"mode": "central", "clip_norm": 0.5}},
    )
    assert privacy_trace(fixed) == PrivacyTrace([1], [1.5], [0.5], [3.0])
    plain = _record([round0, {"round": 1, "train_loss": 1.0}])
    assert privacy_trace(plain) is None


def test_plot_privacy_writes_only_with_a_private_run(tmp_path):
    plain = _record([{"round": 0}, {"round": 1}])
    assert plot_privacy([plain], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    private = _record([{"round": 0}, {"round": 1, "epsilon": [0.4], "dp_clip": 0.01}], label="b")
    path = plot_privacy([plain, private], tmp_path / TRACE_FILE)
    assert path == tmp_path / TRACE_FILE and path.read_bytes().startswith(PNG)


def test_the_cohort_line_is_sigma_over_the_expected_participants():
    # m = 1.0 + 0.5 + 0.51 = 2.01; z/m = 1.5 / 2.01 = 0.7462... (docs/privacy.md's example)
    assert cohort_noise_line(1.5, [1.0, 0.5, 0.51]) == (
        "cohort: m = Σ q_n = 2.01 expected participants a round; "
        "z/m = 1.5 / 2.01 = 0.746 of the clip on the averaged update"
    )
    assert "z/m = 2 / 0 = inf" in cohort_noise_line(2.0, [0.0, 0.0])
    privacy = {
        "noise_multiplier": 1.0,
        "delta": 1e-5,
        "rounds": 10,
        "bound_rounds": 10,
        "q_max": [0.5, 0.5],
        "epsilon": [1.0, 1.0],
        "max_epsilon": [8.0, 8.0],
    }
    lines = budget_lines(privacy, [0.25, 0.25])
    assert lines[1] == cohort_noise_line(1.0, [0.25, 0.25])  # before the clients' lines
    assert "z/m = 1 / 0.5 = 2 " in lines[1]
    assert lines[2].startswith("  client 0: q = 0.25")
    # with the adapter's entries, z·√d/m follows the cohort line: 1·√10,000/0.5 = 200
    with_d = budget_lines(privacy, [0.25, 0.25], 10_000)
    assert with_d[2] == cohort_signal_line(1.0, 10_000, [0.25, 0.25])
    assert "= 200 (above 1:" in with_d[2] and with_d[3].startswith("  client 0:")


TINY = [
    *TINY_FOUR_CLIENTS,
    "training.rounds=3",
    "training.eval_every=3",
    "training.lr=0.05",
    f"method.q={Q}",
    "method.k=[2, 4, 1, 3]",
]


def test_fedlora_report_draws_the_trace_of_a_private_run_only(tmp_path):
    pytest.importorskip("dp_accounting")
    private, plain = tmp_path / "private", tmp_path / "plain"
    assert main(["run", "-q", "--out", str(private), *TINY, *ADAPTIVE]) == 0
    assert main(["run", "-q", "--out", str(plain), *TINY]) == 0
    lines = [json.loads(x) for x in (private / "metrics.jsonl").read_text().splitlines()]
    clips = [x["dp_clip"] for x in lines[1:]]
    from fedlora.studies.runs import load_run

    assert privacy_trace(load_run(private)).clip == clips  # the logged C, round by round
    assert main(["report", str(private), str(plain), "--out", str(tmp_path / "both")]) == 0
    assert (tmp_path / "both" / TRACE_FILE).read_bytes().startswith(PNG)
    assert f"]({TRACE_FILE})" in (tmp_path / "both" / "report.md").read_text()
    assert main(["report", str(plain), "--out", str(tmp_path / "plain-only")]) == 0
    assert not (tmp_path / "plain-only" / TRACE_FILE).exists()
    assert TRACE_FILE not in (tmp_path / "plain-only" / "report.md").read_text()


def test_the_signal_line_is_z_sqrt_d_over_m_by_hand():
    # m = 2.01; z·√d = 1.5·100 = 150; 150 / 2.01 = 74.63
    line = cohort_signal_line(1.5, 10_000, [1.0, 0.5, 0.51])
    assert line.startswith("noise against signal: z·√d/m = 1.5·√10,000/2.01 = 74.6 (above 1:")
    assert "needs m >= z·√d = 150 expected participants a round" in line
    # z = 0.5, d = 4, m = 2: 0.5·2/2 = 0.5
    assert cohort_signal_line(0.5, 4, [1.0, 1.0]).endswith(
        "= 0.5 (at or below 1: necessary for the signal to show, not sufficient)"
    )


def test_plan_prints_the_signal_line_with_adapter_entries_and_refuses_it_without_a_budget(
    tmp_path, capsys
):
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(TWO_CLIENT_PROBLEM))
    out = tmp_path / "plan.json"
    budget = ["--max-epsilon", "8", "--noise-multiplier", "1.0", "--delta", "1e-5"]
    assert main(["plan", str(path), *budget, "--adapter-entries", "0", "-o", str(out)]) == 2
    assert "--adapter-entries = 0 is invalid: must be an integer >= 1" in capsys.readouterr().err
    assert main(["plan", str(path), "--adapter-entries", "100", "-o", str(out)]) == 2
    assert "--adapter-entries needs a privacy budget" in capsys.readouterr().err
    assert not out.exists()
    # one plan (planning under a budget is the slow part): without -o the JSON stays alone
    # on stdout and the line goes to stderr; with -o, budget_lines prints it (checked below)
    assert main(["plan", str(path), *budget, "--adapter-entries", "10000"]) == 0
    captured = capsys.readouterr()
    q = json.loads(captured.out)["q"]
    m = sum(q)
    assert captured.err.strip() == cohort_signal_line(1.0, 10_000, q)
    assert f"z·√d/m = 1·√10,000/{m:.4g} = {100 / m:.3g}" in captured.err
