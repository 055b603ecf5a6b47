"""Suites (`fedlora compare`): labels, targets from a pilot, quick suites with every method
(`proposed`'s calibration → plan → training included), the powered pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.studies.experiments import load_suite, pilot_targets, with_pilot_targets
from fedlora.studies.suites import SUITES

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


# ----------------------------------------------------------------------------- suites


def _suite_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return str(path)


def test_suite_labels_build_the_paper_configs(tmp_path):
    cfg_path = _suite_file(tmp_path, "[suite]\ntargets = {arc-e = 0.5}\nseeds = 2\n")
    table1 = load_suite("table1", cfg_path)
    assert table1.labels == tuple(SUITES["table1"]) and table1.seeds == (0, 1)
    assert table1.targets == {"arc-e": 0.5}
    assert table1.config_for("fslora", 1).method.name == "fslora"
    assert table1.config_for("fslora", 1).training.seed == 1
    sampling = load_suite("sampling", cfg_path)
    q_only = sampling.config_for("proposed-q", 0)
    assert (q_only.method.name, q_only.planner.optimize, q_only.method.k) == (
        "proposed", "q", "full",
    )  # fmt: skip
    assert sampling.config_for("uniform", 0).method.q == "uniform"
    assert sampling.config_for("weighted", 0).method.k == "full"
    ranks = load_suite("ranks", cfg_path, seeds=1)
    k_only = ranks.config_for("proposed-k", 0)
    assert (k_only.planner.optimize, k_only.method.q, k_only.method.q_fixed) == ("k", "fixed", 0.2)
    assert ranks.config_for("normal", 0).method.k == "normal" and ranks.seeds == (0,)
    # --tasks sets data.eval_tasks; the engine's own target stop is off
    two = load_suite("table1", cfg_path, tasks=["arc-e", "arc-c"], targets={"arc-c": 0.3})
    c = two.config_for("proposed", 0)
    assert c.data.eval_tasks == ("arc-e", "arc-c") and c.training.target_accuracy == 0.0


RULE = "target_rule = {budget_fraction = 0.6, floor_se = 4, text = 'slowest at 60%'}"


@pytest.mark.parametrize(
    ("suite", "text", "kwargs", "message"),
    [
        ("table2", "", {}, "--suite = 'table2' is invalid: allowed: table1, sampling, ranks, methods"),
        ("table1", "", {}, "no target accuracy for task(s) arc-e"),
        ("table1", "[suite]\ntargets = {arc-e = 1.5}\n", {}, "suite.targets.arc-e = 1.5"),
        ("table1", "[suite]\ntarget = 1\n", {}, "unknown key suite.target"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\nmethods = ['fedavg']\n", {},
         "suite.methods = ['fedavg'] is invalid"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\n", {"seeds": 0}, "--seeds (suite.seeds) = 0"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\n[training]\nrounds = 0\n", {},
         "training.rounds = 0 is invalid"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\nseeds = [1, 1]\n", {},
         "--seeds (suite.seeds) = [1, 1] is invalid"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\nseeds = [1, -2]\n", {},
         "--seeds (suite.seeds) = [1, -2]"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\ntarget_losses = {arc-e = 0}\n", {},
         "suite.target_losses.arc-e = 0"),
        ("table1", "[suite]\ntargets = {arc-e = 0.5}\nsimilar_margin = 2\n", {},
         "suite.similar_margin = 2"),
        ("table1", f"[suite]\n{RULE}\n", {},
         "training.time_budget_s = 0.0 is invalid: > 0 with suite.target_rule"),
        ("table1", f"[suite]\n{RULE}\npilot_seed = 1\nseeds = [1, 2]\n[training]\n"
         "time_budget_s = 60\n", {}, "suite.pilot_seed = 1 is invalid: a seed that no main"),
        ("table1", f"[suite]\n{RULE}\npilot_seed = -1\n[training]\ntime_budget_s = 60\n", {},
         "suite.pilot_seed = -1"),
        ("table1", "[suite]\ntarget_rule = {budget_fraction = 2, text = 'x'}\n", {},
         "suite.target_rule.budget_fraction = 2"),
    ],
)  # fmt: skip
def test_load_suite_bad_input(tmp_path, suite, text, kwargs, message):
    with pytest.raises(ConfigError) as e:
        load_suite(suite, _suite_file(tmp_path, text), **kwargs)
    assert message in str(e.value)


def test_suite_with_a_rule_reads_its_targets_from_the_pilot(tmp_path):
    text = f"[suite]\n{RULE}\npilot_seed = 9\nseeds = [3, 5]\n[training]\ntime_budget_s = 60\n"
    spec = load_suite("table1", _suite_file(tmp_path, text))
    assert spec.seeds == (3, 5) and spec.pilot_seed == 9 and spec.targets == {}
    assert spec.rule["budget_fraction"] == 0.6 and spec.tasks == ("arc-e",)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigError, match=r"run `fedlora compare \.\.\. --pilot` first"):
        with_pilot_targets(spec, out)
    (out / "targets.toml").write_text('[targets]\n"arc-e" = 0.41\n[target_losses]\n"arc-e" = 1.1\n')
    filled = with_pilot_targets(spec, out)
    assert filled.targets == {"arc-e": 0.41} and filled.target_losses == {"arc-e": 1.1}
    # a target given in the suite file wins over the pilot's
    given = load_suite("table1", _suite_file(tmp_path, text.replace(
        "pilot_seed", "targets = {arc-e = 0.5}\ntarget_losses = {arc-e = 0.9}\npilot_seed")))  # fmt: skip
    assert with_pilot_targets(given, out).targets == {"arc-e": 0.5}
    assert with_pilot_targets(given, out).target_losses == {"arc-e": 0.9}
    # --pilot without a pilot seed is refused
    no_pilot = load_suite("table1", _suite_file(tmp_path, text.replace("pilot_seed = 9\n", "")))
    with pytest.raises(ConfigError, match="--pilot needs"):
        pilot_targets(no_pilot, out)


def test_compare_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["compare", "--suite", "table1", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no target accuracy for task(s) arc-e" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- quick suites (CI)

TINY = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "arc-c"]',
    "data.train_limit=24",
    "data.eval_limit=8",
    "data.max_seq_len=64",
    "data.n_clients=10",
    "data.min_client_examples=2",
    "lora.rank=4",
    'lora.layers="all"',
    "training.rounds=2",
    "training.local_steps=1",
    "training.batch_size=2",
    "training.slots=4",
    "training.eval_every=1",
    "training.checkpoint_every=1",
    "training.lr=0.5",
    "method.clients_per_round=2",
    "planner.calibration_rounds=3",
]
QUICK = {"table1": ["proposed", "fslora"], "sampling": ["proposed-q", "fixed-0.2"],
         "ranks": ["proposed-k", "uniform"]}  # fmt: skip


@needs_data
@pytest.mark.parametrize("suite", list(QUICK))
def test_quick_suite_writes_a_report_with_every_method(tmp_path, suite, capsys, monkeypatch):
    # Prepare: a tiny model, two methods of the suite, two eval tasks. A random-init model's
    # loss barely moves, so its calibration rounds are noise that the planner rightly refuses;
    # the estimate alone is replaced by known constants (tested above with known R_i): the
    # calibration runs, the plan and the training with it are real.
    from fedlora.system import planner
    from fedlora.system.planner import estimate

    known = planner.Constants(105.0, 1.0, 0.05, 0.0125)
    monkeypatch.setattr(estimate, "estimate_constants", lambda *a, **k: known)
    methods = ", ".join(f'"{m}"' for m in QUICK[suite])
    cfg = _suite_file(tmp_path, f"[suite]\nmethods = [{methods}]\n")
    out = tmp_path / suite
    argv = ["compare", "--suite", suite, "-c", cfg, "--out", str(out), "-q",
            "--tasks", "arc-e", "arc-c", "--target", "arc-e=0.25", "--target", "arc-c=25%",
            *TINY]  # fmt: skip
    # Execute
    assert main(argv) == 0
    # Assert: one run dir per method, each finished or recorded as failed, and a report
    text = (out / "report.md").read_text()
    for heading in ("## Time to target accuracy (s)", "## Final accuracy", "## Runs"):
        assert heading in text
    assert "| method | arc-e (>= 25%) | arc-c (>= 25%) |" in text
    assert "## Failed runs" not in text
    for label in QUICK[suite]:
        summary = json.loads((out / f"{label}-seed0" / "summary.json").read_text())
        method = "proposed" if label.startswith("proposed") else label
        assert summary["rounds"] == 2
        assert summary["method"] == (
            method if suite == "table1" or method == "proposed" else "sketched"
        )
        assert f"| {label} | " in text
    proposed = out / f"{QUICK[suite][0]}-seed0"
    assert len(list((proposed / "calibration").iterdir())) == 4
    plan = json.loads((proposed / "plan.json").read_text())
    assert plan["constants"] == known.to_dict()
    outcome = json.loads((proposed / "summary.json").read_text())["plan"]
    assert outcome["predicted_rounds"] == plan["expected_rounds"]
    assert outcome["rounds_run"] == 2 and outcome["degenerate"] == plan["degeneracy"]["degenerate"]
    assert plan["optimize"] == {"table1": "qk", "sampling": "q", "ranks": "k"}[suite]
    if suite == "sampling":  # k fixed at γ, q planned
        assert plan["k"] == [4] * 10
    if suite == "ranks":  # q fixed at 0.2, k planned
        assert plan["q"] == [0.2] * 10
    lines = [json.loads(x) for x in (proposed / "metrics.jsonl").read_text().splitlines()]
    assert (
        lines[0]["sim_time_s"]
        == lines[0]["calibration_sim_time_s"]
        == pytest.approx(plan["calibration"]["sim_time_s"])
    )
    assert lines[0]["sim_time_s"] > 0
    assert (out / "accuracy_vs_time.png").exists()
    # Execute again: everything finished is skipped
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("finished earlier, skipped") >= 1


def test_run_suite_refuses_to_resume_a_partial_run_with_another_config(tmp_path):
    from fedlora.config import dump_toml
    from fedlora.studies.experiments import run_suite

    spec = load_suite("table1", _suite_file(tmp_path, "[suite]\ntargets = {arc-e = 0.5}\n"),
                      methods=["fslora"])  # fmt: skip
    partial = tmp_path / "out" / "fslora-seed0"
    partial.mkdir(parents=True)
    other = load_config(None, ["method.name=fslora", "training.rounds=7"])
    (partial / "config.toml").write_text(dump_toml(other))
    with pytest.raises(ConfigError, match="partial run started with different training.rounds"):
        run_suite(spec, tmp_path / "out", log=lambda m: None)


@needs_data
def test_run_suite_resumes_a_partial_run_whose_saved_config_resolved_auto(tmp_path):
    # Prepare: the suite says model.device/dtype = "auto"; the partial run's config.toml holds
    # what auto resolved to (prepare_run_dir saves the resolved values), as on a real machine
    from dataclasses import replace

    from fedlora.config import dump_toml
    from fedlora.studies.experiments import run_suite

    tiny = [x for x in TINY if not x.startswith("model.dtype")] + ["training.rounds=1"]
    spec = load_suite("table1", _suite_file(tmp_path, "[suite]\ntargets = {arc-e = 0.5}\n"),
                      overrides=tiny, methods=["fslora"])  # fmt: skip
    cfg = spec.config_for("fslora", 0)
    assert cfg.model.dtype == "auto" and cfg.model.device == "auto"
    partial = tmp_path / "out" / "fslora-seed0"
    partial.mkdir(parents=True)
    resolved = cfg.replace(model=replace(cfg.model, dtype="fp32", device="cpu"))
    (partial / "config.toml").write_text(dump_toml(resolved))
    # Execute: the run resumes (no checkpoint: from round 0) instead of being refused
    lines: list[str] = []
    run_suite(spec, tmp_path / "out", log=lines.append)
    # Assert
    assert any("resuming in" in x for x in lines), lines
    assert (partial / "summary.json").is_file()
    assert "error" not in json.loads((partial / "summary.json").read_text())


# ----------------------------------------------------------------------------- powered pipeline


@needs_data
def test_powered_pipeline_pilot_then_two_seeds_then_report(tmp_path, monkeypatch):
    # Prepare: a tiny suite with targets fixed by a rule from a pilot seed, two main seeds and
    # a common simulated-time budget. As in the quick suites, the random-init model's
    # calibration is noise, so the estimate alone is replaced by known constants.
    from fedlora.system import planner
    from fedlora.system.planner import estimate

    known = planner.Constants(105.0, 1.0, 0.05, 0.0125)
    monkeypatch.setattr(estimate, "estimate_constants", lambda *a, **k: known)
    cfg = _suite_file(
        tmp_path,
        '[suite]\nmethods = ["proposed", "fslora"]\nseeds = [0, 1]\npilot_seed = 7\n'
        "target_rule = {budget_fraction = 0.6, floor_se = 0, text = 'slowest baseline at 60%'}"
        "\n[training]\ntime_budget_s = 3.0\neval_every_s = 0.5\n",
    )
    out = tmp_path / "suite"
    argv = ["compare", "--suite", "table1", "-c", cfg, "--out", str(out), "-q",
            *TINY, "training.rounds=3", "planner.calibration_rounds=2", "--tasks", "arc-e"]  # fmt: skip
    # Execute: the main runs refuse to start before the pilot fixed the targets
    assert main(argv) == 2
    assert main([*argv, "--pilot"]) == 0
    # Assert: the pilot ran the baseline only, with its own seed, and wrote the targets
    assert sorted(p.name for p in (out / "pilot").iterdir() if p.is_dir()) == ["fslora-seed7"]
    import tomllib

    fixed = tomllib.loads((out / "targets.toml").read_text())
    assert fixed["rule"] == "slowest baseline at 60%" and 0 < fixed["targets"]["arc-e"] <= 1
    assert fixed["target_losses"]["arc-e"] > 0  # eval_loss target by the same rule
    assert "## Over seeds (powered report)" in (out / "pilot" / "report.md").read_text()
    # Execute: the main runs, then a report rebuilt from the files alone
    assert main(argv) == 0
    runs = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name != "pilot")
    assert runs == ["fslora-seed0", "fslora-seed1", "proposed-seed0", "proposed-seed1"]
    suite = tomllib.loads((out / "suite.toml").read_text())
    assert suite["targets"] == fixed["targets"] and suite["seeds"] == [0, 1]
    first = (out / "report.md").read_text()
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert text == first
    assert "## Over seeds (powered report)" in text and "## Claims of the paper" in text
    assert "Targets fixed before the main runs by the rule: slowest baseline at 60%" in text
    assert "| proposed | 2 | " in text and "| fslora | 2 | " in text
    assert f"time to loss <= {fixed['target_losses']['arc-e']:.4g} (s)" in text
    assert "McNemar, pooled over seeds" in text
    assert "## Algorithm 2: does Theorem 1's model predict the rounds?" in text
    assert (out / "accuracy_bands.png").stat().st_size > 1000
    # the exact cost model clocked from the same runs (issue 14 item 4), same sections
    exact = tmp_path / "exact"
    argv_exact = [
        "report",
        str(out),
        "--comm-cost",
        "exact",
        "--comp-cost",
        "affine",
        "-o",
        str(exact),
    ]
    assert main(argv_exact) == 0
    text_exact = (exact / "report.md").read_text()
    assert (
        "Re-clocked under comm_cost = exact" in text_exact
        and "## Claims of the paper" in text_exact
    )
    for seed in (0, 1):  # every run stops at the common budget (or the round cap) ...
        s = json.loads((out / f"fslora-seed{seed}" / "summary.json").read_text())
        assert s["stop_reason"] in ("time_budget", "max_rounds")
        lines = [json.loads(x) for x in (out / f"fslora-seed{seed}" / "metrics.jsonl").open()]
        assert "eval" in lines[-1]  # ... and is evaluated there
        plan = json.loads((out / f"proposed-seed{seed}" / "summary.json").read_text())["plan"]
        assert plan["predicted_rounds"] is not None and "degenerate" in plan


def test_powered_suite_files_load_and_share_runs_where_they_say():
    # Prepare / Execute: the three drafted protocol files of issue 14
    root = Path(__file__).parents[1] / "research" / "powered_suites"
    specs = {s: load_suite(s, str(root / f"powered_{name}.toml"))
             for s, name in (("table1", "table1"), ("sampling", "sampling"), ("ranks", "ranks"))}  # fmt: skip
    # Assert: >= 3 seeds, a separate pilot seed, a rule, a common budget with a time schedule
    for spec in specs.values():
        assert spec.seeds == (1, 2, 3) and spec.pilot_seed == 100 and spec.rule is not None
        assert spec.targets == {}  # fixed by the pilot, not by hand
        cfg = spec.config_for(spec.labels[0], 1)
        assert cfg.data.n_clients >= 20 and cfg.data.dirichlet_alpha == 0.1
        assert cfg.training.time_budget_s > 0 and cfg.training.eval_every_s > 0
        assert set(cfg.data.tasks) == {"arc-e", "arc-c", "obqa"}
    # ranks' "full" is sampling's "fixed-0.2": the same config, so its runs can be copied
    for seed in (1, 100):
        assert specs["ranks"].config_for("full", seed) == specs["sampling"].config_for(
            "fixed-0.2", seed
        )
