"""research/privacy_cohort/privacy_cohort.py (rule: research/privacy_cohort/privacy_cohort.md)
end to end on a tiny random-init model at 60 clients, 3 expected a round: stage 1 writes
stage1.json from its runs' predictions and update norms, the run stage runs the four DP arms
and the planner arm, the summary reads them; `--commit` commits each run's files. The rule's
σ checked against dp-accounting's own RDP accountant and the papers' formulas."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main as fedlora_main
from fedlora.system.privacy import epsilon, noise_multiplier_for_epsilon, sum_noise_multiplier
from rdp_reference import poisson_epsilon_reference
from tiny_runs import DATA, load_script

dp_accounting = pytest.importorskip("dp_accounting")
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
ROOT = Path(__file__).resolve().parents[1]

TINY_BASE = f"""
[model]
name = "tiny-llama"
dtype = "fp32"
threads = 1
[lora]
rank = 4
layers = 1
[data]
data_dir = "{DATA}"
tasks = ["arc-e"]
eval_tasks = ["arc-e"]
train_limit = 200
eval_limit = 6
max_seq_len = 96
n_clients = 60
min_client_examples = 2
[training]
rounds = 2
local_steps = 1
batch_size = 2
lr = 0.05
checkpoint_every = 100
[method]
name = "sketched"
q = "fixed"
q_fixed = 0.05
k = "uniform"
[planner]
probe_rounds = 1
[evaluation]
predictions = true
"""


@pytest.fixture(scope="module")
def bench():
    return load_script("research/privacy_cohort/privacy_cohort.py")


def _in_process(args: list[str]) -> None:
    assert fedlora_main(["run", "-q", *args]) == 0


def _git(cwd: Path, *argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout


@needs_data
def test_stage1_then_the_arms_then_the_summary(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "execute", _in_process)
    monkeypatch.setattr(bench, "STAGE1_ROUNDS", (1, 2))
    for e in (8.0, 2.0):  # the tiny cohort's 2 rounds at q = 0.05
        sigma = noise_multiplier_for_epsilon(e, "poisson", 0.05, 2, 1e-5)
        monkeypatch.setitem(bench.RULE_SIGMA, (2, e), sigma)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@t")
    _git(tmp_path, "config", "user.name", "t")
    base = tmp_path / "tiny.toml"
    base.write_text(TINY_BASE)
    out, runs = tmp_path / "results", tmp_path / "runs"
    where = ["--out", str(out), "--runs", str(runs), "--base", str(base), "--commit"]

    assert bench.main(["run", *where]) == 2  # no stage1.json yet
    assert bench.main(["stage1", *where, "--only", "fixed-eps8"]) == 2  # not a stage-1 run
    assert bench.main(["run", *where, "--only", "stage1-h1"]) == 2
    # one stage-1 run at a time (side by side on two cores): stage1.json waits for both
    assert bench.main(["stage1", *where, "--only", "stage1-h2"]) == 0
    assert (out / "stage1-h2/run_info.json").is_file() and not (out / "stage1-h1").exists()
    assert not (out / "stage1.json").exists()
    assert bench.main(["stage1", *where]) == 0
    doc = json.loads((out / "stage1.json").read_text())
    assert [(r["H"], r["R"]) for r in doc["table"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for row in doc["table"]:  # the gain over round 0, by hand from the predictions
        before, after = (
            _correct(out / f"stage1-h{row['H']}", 0),
            _correct(out / f"stage1-h{row['H']}", row["R"]),
        )
        assert row["gain"] == pytest.approx(np.mean(after) - np.mean(before))
        assert row["learns"] == (row["gain"] >= 0.02 - 1e-12 and row["gain_ci95"][0] > 0)
    if doc["chosen"] is None:  # a random-init model rarely learns: the study stops there
        assert bench.main(["run", *where]) == 2
        monkeypatch.setattr(bench, "choose", lambda table: table[1])  # (H, R) = (1, 2)
        (out / "stage1.json").unlink()
        assert bench.main(["stage1", *where]) == 0
        doc = json.loads((out / "stage1.json").read_text())
    assert doc["chosen"] == {"H": 1, "R": 2, "run": "stage1-h1"} and doc["server"] == []
    lines = [json.loads(x) for x in (out / "stage1-h1/metrics.jsonl").read_text().splitlines()]
    norms = [n for x in lines[1:] for n in x["dp_update_norms"]]
    assert doc["clip_norm"] == float(f"{np.median(norms):.2g}") and doc["n_norms"] == len(norms)
    assert doc["first_clip_norm"] == float(f"{np.median(lines[1]['dp_update_norms']):.2g}")

    # the no-DP arm is stage 1's run read at round R: an evaluation between changes nothing
    # (a run evaluated at round 2 only predicts as stage 1's, evaluated every round, does)
    _in_process(
        [
            "--out",
            str(runs / "check"),
            "--config",
            str(base),
            *bench.COMMON,
            *bench.NO_DP,
            "training.local_steps=1",
            "training.eval_every=2",
        ]
    )
    for field in ("correct", "mc_loss"):  # every question's loss, bit for bit
        assert _correct(runs / "check", 2, field) == _correct(out / "stage1-h1", 2, field)
    assert [
        json.loads(x)["round"] for x in (runs / "check/predictions.jsonl").read_text().splitlines()
    ] == [0, 2]

    monkeypatch.setattr(bench, "STAGE4_PROBE_Q", (0.3, 0.15))  # probes over the budget
    monkeypatch.setattr(bench, "STAGE4_PROBE_ROUNDS", 1)
    assert bench.main(["run", *where]) == 0
    for label, (clipping, eps) in bench.DP_ARMS.items():
        summary = json.loads((out / label / "summary.json").read_text())
        assert summary["privacy"]["noise_multiplier"] == bench.RULE_SIGMA[(2, eps)]
        assert summary["privacy"]["largest_epsilon"] <= eps
        assert summary["privacy"]["clipping"] == clipping
    # stage 4: the probes (every client at q = 0.3, then 0.15, 2 rounds each) spend more than
    # ε = 8 at the ε = 8 arm's σ: not run, and why
    note = json.loads((out / "planner.json").read_text())
    sigma8 = bench.RULE_SIGMA[(2, 8.0)]
    probes = [("poisson", 0.3, 2), ("poisson", 0.15, 2)]
    assert note["status"] == "not run" and note["probe_epsilon"] == epsilon(probes, sigma8, 1e-5)
    assert note["probe_epsilon"] > 8 and not (out / "planner-eps8").exists()
    # at a σ whose probes fit, the planner arm runs for the uniform arm's simulated time, with
    # the amendment's probe rates
    monkeypatch.setitem(bench.RULE_SIGMA, (2, 8.0), 5.0)
    monkeypatch.setattr(bench, "STAGE4_PROBE_Q", (0.02, 0.01))
    assert bench.main(["run", *where, "--only", "planner-eps8"]) == 0
    planner = json.loads((out / "planner-eps8/run_info.json").read_text())
    uniform = json.loads((out / "fixed-eps8/summary.json").read_text())
    assert planner["time_budget_s"] == uniform["sim_time_s"] and planner["sigma"] == 5.0
    assert planner["probe_epsilon"] == epsilon(
        [("poisson", 0.02, 2), ("poisson", 0.01, 2)], 5.0, 1e-5
    )
    assert "probe_q = [0.02, 0.01]" in (out / "planner-eps8/config.toml").read_text()
    p_summary = json.loads((out / "planner-eps8/summary.json").read_text())
    assert p_summary["privacy"]["largest_epsilon"] <= 8.0
    committed = _git(tmp_path, "log", "--name-only", "--format=")
    assert "results/planner.json" in committed
    monkeypatch.setitem(bench.RULE_SIGMA, (2, 8.0), sigma8)
    for label in [*bench.DP_ARMS, "planner-eps8", "stage1-h1"]:
        for f in ("config.toml", "metrics.jsonl", "predictions.jsonl", "summary.json"):
            assert f"results/{label}/{f}" in committed
    assert "results/stage1.json" in committed
    assert bench.main(["run", *where]) == 0  # every run landed: nothing reruns
    # a run stopped part way (its results not copied yet) goes on from its checkpoint
    seen: list[list[str]] = []
    monkeypatch.setattr(bench, "execute", lambda args: (seen.append(args), _in_process(args)))
    before = (out / "fixed-eps2/metrics.jsonl").read_text()
    (out / "fixed-eps2/run_info.json").unlink()
    assert bench.main(["run", *where, "--only", "fixed-eps2"]) == 0
    assert seen == [["--resume", str(runs / "fixed-eps2")]]
    assert (out / "fixed-eps2/metrics.jsonl").read_text() == before
    assert json.loads((out / "fixed-eps2/run_info.json").read_text())["resumed"] is True
    monkeypatch.setattr(bench, "execute", _in_process)

    capsys.readouterr()
    assert bench.main(["summary", "--out", str(out)]) == 0
    md, doc = (out / "summary.md").read_text(), json.loads((out / "summary.json").read_text())
    assert doc["runs"]["no-dp"]["round"] == 2 and doc["questions"] == 6
    for label in bench.DP_ARMS:
        c = doc["comparisons"][label]
        assert c["vs_no_dp"]["gain"] == pytest.approx(
            np.mean(_correct(out / label, 2)) - np.mean(_correct(out / "stage1-h1", 2))
        )
        assert f"| {label} | 2 |" in md
    assert "planner_vs_uniform" in doc["comparisons"] and "## Stage 4" in md
    for eps in (8, 2):  # adaptive − fixed, paired on the same questions, reported
        pair = doc["comparisons"][f"adaptive_vs_fixed_eps{eps}"]
        assert pair["gain"] == pytest.approx(
            np.mean(_correct(out / f"adaptive-eps{eps}", 2))
            - np.mean(_correct(out / f"fixed-eps{eps}", 2))
        )
        assert f"Adaptive − fixed clipping at ε = {eps}, paired: " in md
    share = doc["comparisons"]["fixed-eps8"]["share"]
    assert f"fixed clipping keeps {100 * share:.0f}% [" in md
    # amendment 2: the summary says whether the planner planned (its fits, from its metrics)
    lines = (out / "planner-eps8/metrics.jsonl").read_text().splitlines()
    entries = [json.loads(x)["planner"] for x in lines if '"planner"' in x]
    assert len(doc["planner_fits"]) == len(entries) >= 1
    for fit, entry in zip(doc["planner_fits"], entries, strict=True):
        assert fit["round"] == entry["round"] and f"after round {fit['round']} (" in md
        assert fit["adopted"] == entry["adopted"]
    cpu = [json.loads(p.read_text())["cpu_s"] for p in out.glob("*/run_info.json")]
    assert len(cpu) == 7 and doc["cpu_hours"] == round(sum(cpu) / 3600, 3)
    assert f"CPU-hours of every landed run (stage 1 included): {doc['cpu_hours']}" in md


@needs_data
def test_stage1b_when_stage1_learns_nothing(bench, tmp_path, monkeypatch, capsys):
    """Amendments 3 and 4: after stage 1 chose none, stage 1b runs the same grid with server
    momentum; after it chose none, stage 1c continues its runs to more rounds; the choice, C
    and server keys go into every DP arm; the summary shows every table and reads the no-DP
    arm from the chosen run."""
    monkeypatch.setattr(bench, "execute", _in_process)
    monkeypatch.setattr(bench, "STAGE1_ROUNDS", (1, 2))
    monkeypatch.setattr(bench, "STAGE1_H", (1,))  # one run per stage: cheaper, the same path
    for e in (8.0, 2.0):
        monkeypatch.setitem(bench.RULE_SIGMA, (2, e), 1.0)
    base = tmp_path / "tiny.toml"
    base.write_text(TINY_BASE)
    out, runs = tmp_path / "results", tmp_path / "runs"
    where = ["--out", str(out), "--runs", str(runs), "--base", str(base)]
    assert bench.main(["stage1b", *where]) == 2  # not before stage 1
    monkeypatch.setattr(bench, "choose", lambda table: None)
    assert bench.main(["stage1", *where]) == 0
    assert json.loads((out / "stage1.json").read_text())["chosen"] is None
    assert bench.main(["run", *where]) == 2  # no choice yet
    assert bench.main(["stage1b", *where, "--only", "stage1-h1"]) == 2  # not a run of 1b
    assert bench.main(["stage1c", *where]) == 2  # not before stage 1b
    assert bench.main(["stage1b", *where]) == 0
    doc = json.loads((out / "stage1b.json").read_text())
    assert doc["chosen"] is None and doc["server"] == bench.STAGE1B_SERVER
    config = (out / "stage1b-h1/config.toml").read_text()
    assert 'server_optimizer = "avgm"' in config and "server_momentum = 0.9" in config
    # amendment 4: stage 1b's run continued by a resume, its committed files untouched
    monkeypatch.setattr(bench, "STAGE1C_ROUNDS", (1, 2, 3, 4))
    kept = (out / "stage1b-h1/predictions.jsonl").read_text()
    monkeypatch.setattr(bench, "choose", lambda table: table[3])  # (H, R) = (1, 4)
    assert bench.main(["stage1c", *where]) == 0
    assert (out / "stage1b-h1/predictions.jsonl").read_text() == kept
    doc = json.loads((out / "stage1c.json").read_text())
    assert doc["chosen"] == {"H": 1, "R": 4, "run": "stage1c-h1"}
    assert [row["R"] for row in doc["table"]] == [1, 2, 3, 4]
    info = json.loads((out / "stage1c-h1/run_info.json").read_text())
    assert info["extends"] == "stage1b-h1"
    extended = (out / "stage1c-h1/predictions.jsonl").read_text().splitlines()
    assert extended[:3] == kept.splitlines() and len(extended) == 5  # rounds 0-2, then 3, 4
    lines = [json.loads(x) for x in (out / "stage1c-h1/metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1, 2, 3, 4]
    norms = [n for x in lines[1:] for n in x["dp_update_norms"]]
    assert doc["clip_norm"] == float(f"{np.median(norms):.2g}")

    for e in (8.0, 2.0):
        monkeypatch.setitem(bench.RULE_SIGMA, (4, e), 1.0)
    assert bench.main(["run", *where, "--only", "fixed-eps8"]) == 0
    config = (out / "fixed-eps8/config.toml").read_text()
    assert 'server_optimizer = "avgm"' in config and f"clip_norm = {doc['clip_norm']}" in config
    capsys.readouterr()
    assert bench.main(["summary", "--out", str(out)]) == 0
    md, summary = (out / "summary.md").read_text(), json.loads((out / "summary.json").read_text())
    assert "## Stage 1 (no DP, plain averaging)" in md and "## Stage 1b" in md
    assert "## Stage 1c" in md and summary["stage1c"]["chosen"]["run"] == "stage1c-h1"
    nodp = summary["comparisons"]["fixed-eps8"]["vs_no_dp"]["gain"]
    assert nodp == pytest.approx(
        np.mean(_correct(out / "fixed-eps8", 4)) - np.mean(_correct(out / "stage1c-h1", 4))
    )


def _correct(run_dir: Path, round_: int, field: str = "correct") -> list:
    for raw in (run_dir / "predictions.jsonl").read_text().splitlines():
        line = json.loads(raw)
        if line["round"] == round_:
            return line[field]
    raise AssertionError(f"{run_dir}: no predictions at round {round_}")


def _dp_accounting_epsilon(q: float, sigma: float, rounds: int) -> float:
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(event, rounds)
    return acc.get_epsilon(1e-5)


@pytest.mark.parametrize("rounds_eps", [(r, e) for r in (10, 20, 30, 40) for e in (8.0, 2.0)])
def test_the_rules_sigma_is_the_smallest_that_keeps_the_target(bench, rounds_eps):
    """dp-accounting's RDP accountant, called directly: the rule's σ keeps ε(1e-5) <= the
    target after R rounds at q = 0.05, σ − 0.001 does not; the papers' formulas agree."""
    rounds, target = rounds_eps
    sigma = bench.RULE_SIGMA[rounds_eps]
    assert _dp_accounting_epsilon(0.05, sigma, rounds) <= target
    assert _dp_accounting_epsilon(0.05, round(sigma - 0.001, 3), rounds) > target
    assert poisson_epsilon_reference(0.05, sigma, rounds, 1e-5) <= target * 1.003


def test_adaptive_clipping_spends_the_same_total_noise(bench):
    """The sum's σ_Δ and the count's σ_b = 2.5 (sensitivity 1/2) make one Gaussian at z:
    σ_Δ^-2 + (2σ_b)^-2 = z^-2, so the adaptive arm's ε is the fixed arm's at the same z."""
    for (rounds, eps), z in bench.RULE_SIGMA.items():
        s = sum_noise_multiplier(z, bench.COUNT_NOISE)
        assert s > z and s**-2 + (2 * bench.COUNT_NOISE) ** -2 == pytest.approx(z**-2)
        dp, extra = bench.dp_overrides("adaptive", eps, {"R": rounds, "first_clip_norm": 0.1})
        assert f"privacy.noise_multiplier={z}" in dp and extra["sum_noise_multiplier"] == s


def test_the_cheapest_learning_setting_and_the_verdicts(bench):
    from research.privacy_cohort import privacy_cohort_summary as s

    row = {"gain": 0.03, "gain_ci95": [0.01, 0.05]}
    table = [
        {**row, "H": 1, "R": 10, "client_steps": 10, "learns": False},
        {**row, "H": 1, "R": 20, "client_steps": 20, "learns": True},
        {**row, "H": 2, "R": 10, "client_steps": 20, "learns": True},
        {**row, "H": 2, "R": 20, "client_steps": 40, "learns": True},
    ]
    assert (bench.choose(table)["H"], bench.choose(table)["R"]) == (2, 10)  # a tie: fewer rounds
    assert bench.choose([{**r, "learns": False} for r in table]) is None
    lost = {"gain": -0.05, "mcnemar_p": 0.001}
    same = {"gain": -0.01, "mcnemar_p": 0.5}
    assert s.arm_verdict({"gain_ci95": [0.01, 0.05]}, same) == "keeps the no-DP gain"
    assert s.arm_verdict({"gain_ci95": [0.01, 0.05]}, lost) == "keeps part of the gain"
    assert s.arm_verdict({"gain_ci95": [-0.01, 0.05]}, same) == "loses the gain"
    assert s.planner_verdict({"gain": 0.04, "mcnemar_p": 0.01}) == "the planner is better"
    assert s.planner_verdict({"gain": -0.04, "mcnemar_p": 0.01}) == "uniform sampling is better"
    assert s.planner_verdict({"gain": 0.04, "mcnemar_p": 0.2}) == "no difference detected"
    # the kept share: no DP gains 4 of 10 questions, the arm 2 of them: one half
    base, nodp, arm = [0] * 10, [1] * 4 + [0] * 6, [1] * 2 + [0] * 8
    share = s.kept_share(base, nodp, arm)
    assert share["share"] == pytest.approx(0.5)
    assert 0 <= share["share_ci95"][0] <= 0.5 <= share["share_ci95"][1] <= 1
