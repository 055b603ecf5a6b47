"""Suites: several methods side by side on the same data partition, client profiles, eval
subset and seeds (the engine derives all of those from the seed), then a report.

    table1    proposed, fslora, heterolora, fedstacklora, flexlora        (Table I), and
              fedstacklora-free-downlink (its clock without the downlink)
    sampling  proposed q vs full, fixed 0.2, uniform 1/N, weighted; k = γ (Figure 2)
    ranks     proposed k vs full, normal, uniform; q = 0.2                 (Figure 3)
    methods   every method: proposed, the baselines, ffalora, fedsalora, fedexlora, rolora, fedsb
    references  the suite file's method ("federated") beside centralized and local training at
              its budget of client-steps (docs/methods.md, "References")

A suite file is an experiment TOML (the sections of `fedlora.config`) plus a `[suite]` table:

    [suite]
    targets = {arc-e = 0.5, arc-c = 0.35}   # target accuracy per eval task, fixed beforehand
    seeds = 1                               # seeds training.seed, +1, ... (or a list [1, 2, 3])
    methods = ["proposed", "fslora"]        # optional: a subset of the suite's labels
    target_losses = {arc-e = 1.2}           # optional: target eval_loss per task
    similar_margin = 0.02                   # optional: "similar final accuracy" margin

Targets by a rule from a pilot seed instead of `targets`:

    pilot_seed = 100                        # a seed none of the main runs uses
    target_rule = {budget_fraction = 0.6, floor_se = 4, text = "the level ..."}

`fedlora compare --pilot` runs every baseline label with the pilot seed in DIR/pilot/, applies the
rule (`fedlora.studies.target_rule.rule_targets`) and writes DIR/targets.toml (targets, target_losses and
the numbers behind them); the main runs then read their targets from it.

Its directory holds one run directory per (label, seed), `<label>-seed<s>/`, and suite.toml
(targets, labels, title, command) so `fedlora report DIR` rebuilds the report. Finished runs
(summary.json without "error") are skipped, partial ones resumed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig, config_from_dict
from fedlora.config.method_options import upgrade_renamed_keys
from fedlora.config.toml_io import parse_override, read_toml, set_override
from fedlora.errors import ConfigError, FedloraError, bad_value
from fedlora.federation.methods.registry import check_method_config
from fedlora.files import atomic_write, remove_own_file
from fedlora.studies.runs import SUITE_FILE, collect_runs
from fedlora.studies.suite_report import report_suite
from fedlora.studies.suites import SUITES, TITLES

SUITE_KEYS = (
    "targets",
    "seeds",
    "methods",
    "target_losses",
    "target_rule",
    "pilot_seed",
    "similar_margin",
)
TARGETS_FILE = "targets.toml"
PILOT_DIR = "pilot"


@dataclass(frozen=True)
class SuiteSpec:
    """A suite to run: its name, base raw config, targets, seeds and labels."""

    name: str
    raw: dict[str, Any]  # the experiment sections, before each label's overrides
    targets: dict[str, float]
    seeds: tuple[int, ...]
    labels: tuple[str, ...]
    tasks: tuple[str, ...] = ()
    target_losses: dict[str, float] = field(default_factory=dict)
    rule: dict[str, Any] | None = None  # suite.target_rule (targets from a pilot seed)
    pilot_seed: int | None = None
    similar_margin: float = 0.02

    def config_for(self, label: str, seed: int) -> ExperimentConfig:
        raw = {s: dict(v) for s, v in self.raw.items()}
        base = config_from_dict(self.raw, source=f"suite {self.name}")
        for text in (*SUITES[self.name][label], f"training.seed={seed}"):
            section, key, value = parse_override(text)
            if isinstance(value, str) and value.startswith("$"):  # the suite file's own value
                ref_section, ref_key = value[1:].split(".", 1)
                value = getattr(getattr(base, ref_section), ref_key)
            set_override(raw, section, key, value, source=f"suite {self.name}, {label}")
        cfg = config_from_dict(raw, source=f"suite {self.name}, {label}")
        check_method_config(cfg)  # method.name and its own fields (the methods' registry)
        return cfg


def load_suite(
    name: str,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    *,
    seeds: int | None = None,
    tasks: Sequence[str] | None = None,
    targets: dict[str, float] | None = None,
    methods: Sequence[str] | None = None,
) -> SuiteSpec:
    """Read a suite file (optional), apply overrides, --seeds, --tasks, --target and --methods
    (a subset of the suite's labels, e.g. to split a suite over two processes)."""
    if name not in SUITES:
        raise bad_value("--suite", name, f"allowed: {', '.join(SUITES)}")
    source = config_path or "suite"
    raw, suite = _read_suite_file(config_path, source, overrides)
    n_seeds = seeds if seeds is not None else suite.get("seeds", 1)
    seed_list = _checked_seeds(n_seeds)
    all_targets = _accuracy_targets(suite, targets)
    target_losses = _loss_targets(suite)
    rule = None
    if "target_rule" in suite:
        from fedlora.studies.target_rule import check_rule

        rule = check_rule(suite["target_rule"])
    margin = suite.get("similar_margin", 0.02)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin < 1:
        raise bad_value("suite.similar_margin", margin, "an accuracy difference in (0, 1)")
    base = config_from_dict(raw, source=source)  # validates the shared sections once
    eval_tasks = list(tasks) if tasks else list(base.data.eval_tasks)
    if rule is not None and not base.training.time_budget_s > 0:
        raise bad_value(
            "training.time_budget_s",
            base.training.time_budget_s,
            "> 0 with suite.target_rule (the rule is stated at a fraction of the budget)",
        )
    pilot_seed = suite.get("pilot_seed")
    if pilot_seed is not None and (
        isinstance(pilot_seed, bool) or not isinstance(pilot_seed, int) or pilot_seed < 0
    ):
        raise bad_value("suite.pilot_seed", pilot_seed, "an integer >= 0")
    if rule is None:  # with a rule: fixed later from the pilot (run_suite reads targets.toml)
        _check_targets_fixed(eval_tasks, all_targets)
    raw.setdefault("data", {})["eval_tasks"] = eval_tasks
    raw.setdefault("training", {})["target_accuracy"] = 0.0  # runs go on; targets are per task
    labels = tuple(methods or suite.get("methods", SUITES[name]))
    unknown = [lab for lab in labels if lab not in SUITES[name]]
    if unknown:
        raise bad_value("suite.methods", unknown, f"labels of {name}: {', '.join(SUITES[name])}")
    first = base.training.seed
    seed_tuple = tuple(seed_list) if seed_list else tuple(range(first, first + n_seeds))
    if pilot_seed is not None and pilot_seed in seed_tuple:
        raise bad_value(
            "suite.pilot_seed",
            pilot_seed,
            f"a seed that no main run uses (seeds {list(seed_tuple)})",
        )
    spec = SuiteSpec(
        name,
        raw,
        {t: float(all_targets[t]) for t in eval_tasks if t in all_targets},
        seed_tuple,
        labels,
        tuple(eval_tasks),
        {t: float(v) for t, v in target_losses.items()},
        rule,
        pilot_seed,
        float(margin),
    )
    for label in labels:  # every label's config must be valid before anything runs
        spec.config_for(label, first)
    return spec


def _read_suite_file(
    config_path: str | None, source: str, overrides: Sequence[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The experiment sections (the overrides applied) and the [suite] table, its keys checked."""
    raw: dict[str, Any] = read_toml(config_path) if config_path else {}
    # a renamed flat key moved to its table once here (one FutureWarning, not one per run)
    raw = upgrade_renamed_keys(raw, source=source)
    suite = raw.pop("suite", {})
    if not isinstance(suite, dict):
        raise ConfigError(f"{source}: [suite] must be a table")
    for key in suite:
        if key not in SUITE_KEYS:
            raise ConfigError(f"{source}: unknown key suite.{key} (valid: {', '.join(SUITE_KEYS)})")
    for text in overrides:
        section, key, value = parse_override(text)
        set_override(raw, section, key, value, source=source)
    return raw, suite


def _checked_seeds(n_seeds: Any) -> list[int] | None:
    """suite.seeds (or --seeds): a count >= 1 (None returned) or a list of distinct seeds."""
    seed_list = _seed_list(n_seeds) if isinstance(n_seeds, list) else None
    if seed_list is None and (
        isinstance(n_seeds, bool) or not isinstance(n_seeds, int) or n_seeds < 1
    ):
        raise bad_value(
            "--seeds (suite.seeds)", n_seeds, "an integer >= 1 or a list of distinct seeds >= 0"
        )
    return seed_list


def _accuracy_targets(suite: dict[str, Any], targets: dict[str, float] | None) -> dict[str, Any]:
    """suite.targets updated by --target: an accuracy in (0, 1] per task."""
    all_targets = dict(suite.get("targets", {}))
    all_targets.update(targets or {})
    for task, value in all_targets.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise bad_value(f"suite.targets.{task}", value, "an accuracy in (0, 1]")
    return all_targets


def _loss_targets(suite: dict[str, Any]) -> dict[str, Any]:
    """suite.target_losses: an eval_loss > 0 per task."""
    target_losses = suite.get("target_losses", {})
    if not isinstance(target_losses, dict):
        raise bad_value("suite.target_losses", target_losses, "a table {task = loss}")
    for task, value in target_losses.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise bad_value(f"suite.target_losses.{task}", value, "an eval_loss > 0")
    return target_losses


def _check_targets_fixed(eval_tasks: list[str], all_targets: dict[str, Any]) -> None:
    """Every evaluated task has its target accuracy before anything runs."""
    missing = [t for t in eval_tasks if t not in all_targets]
    if missing:
        raise ConfigError(
            f"no target accuracy for task(s) {', '.join(missing)}: set [suite] targets in the "
            f"config (e.g. targets = {{{missing[0]} = 0.5}}) or pass --target "
            f"{missing[0]}=0.5; it must be fixed before running"
        )


def _seed_list(values: list) -> list[int] | None:
    ok = values and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
    return list(values) if ok and len(set(values)) == len(values) else None


def _finished(run_dir: Path) -> bool:
    from fedlora.errors import DataError
    from fedlora.federation.runfiles import SUMMARY_FILE, read_summary

    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return False
    try:
        return "error" not in read_summary(path).fields
    except DataError:
        return False


def _write_suite_file(spec: SuiteSpec, out: Path, command: str) -> None:
    lines = [
        f'suite = "{spec.name}"',
        f'title = "{TITLES[spec.name]}"',
        f"command = {json.dumps(command)}",
        "labels = [" + ", ".join(json.dumps(x) for x in SUITES[spec.name]) + "]",  # order
        "seeds = [" + ", ".join(str(s) for s in spec.seeds) + "]",
        f"similar_margin = {spec.similar_margin!r}",
        *([f"target_rule = {json.dumps(spec.rule['text'])}"] if spec.rule else []),
        "",
        "[targets]",
        *(f"{json.dumps(t)} = {v!r}" for t, v in spec.targets.items()),
        "",
        "[target_losses]",
        *(f"{json.dumps(t)} = {v!r}" for t, v in spec.target_losses.items()),
        "",
    ]
    atomic_write(out / SUITE_FILE, "\n".join(lines).encode("utf-8"))


def pilot_targets(spec: SuiteSpec, out: Path, *, quiet: bool = True, log=None) -> Path:
    """Run every baseline label (not `proposed*`: the rule reads only baselines) with
    suite.pilot_seed in out/pilot/ (resumable), apply suite.target_rule and write
    out/targets.toml; returns its path."""
    from fedlora.studies.target_rule import rule_targets, targets_toml

    if spec.rule is None or spec.pilot_seed is None:
        raise ConfigError(
            "--pilot needs [suite] target_rule and pilot_seed in the suite file (the rule is "
            "written before the pilot runs)"
        )
    log = log or (lambda msg: print(msg, file=sys.stderr))
    pilot = out / PILOT_DIR
    pilot.mkdir(parents=True, exist_ok=True)
    # the rule reads only the baselines: `proposed` (and its calibration) is not run here
    baselines = tuple(lab for lab in spec.labels if not lab.startswith("proposed"))
    if not baselines:
        raise ConfigError(f"--pilot: suite.methods {list(spec.labels)} has no baseline label")
    pilot_spec = replace(spec, seeds=(spec.pilot_seed,), labels=baselines)
    _write_suite_file(pilot_spec, pilot, "fedlora compare --pilot")
    _run_jobs(pilot_spec, pilot, quiet=quiet, log=log)
    runs, _ = collect_runs([pilot])
    budget = spec.config_for(spec.labels[0], spec.pilot_seed).training.time_budget_s
    result = rule_targets(runs, spec.tasks, budget, spec.rule)
    path = out / TARGETS_FILE
    atomic_write(path, targets_toml(result, spec.rule, str(pilot)).encode("utf-8"))
    log(f"pilot targets: {result['accuracy']} (loss {result['loss']}) -> {path}")
    # the pilot's own report, at the targets it fixed (its numbers are committed with it)
    fixed = replace(pilot_spec, targets=result["accuracy"], target_losses=result["loss"])
    _write_suite_file(fixed, pilot, "fedlora compare --pilot")
    report_suite([pilot], pilot)
    return path


def with_pilot_targets(spec: SuiteSpec, out: Path) -> SuiteSpec:
    """Fill targets the suite file does not give from out/targets.toml (the pilot's)."""
    missing = [t for t in spec.tasks if t not in spec.targets]
    if not missing and spec.rule is None:
        return spec
    path = out / TARGETS_FILE
    if not path.is_file():
        if missing:
            raise ConfigError(
                f"no target for task(s) {', '.join(missing)} and no {path}: the suite fixes "
                "its targets by a rule from a pilot seed; run `fedlora compare ... --pilot` "
                "first"
            )
        return spec
    found = read_toml(str(path))
    acc = {t: float(v) for t, v in found.get("targets", {}).items()}
    loss = {t: float(v) for t, v in found.get("target_losses", {}).items()}
    targets = {t: spec.targets.get(t, acc.get(t)) for t in spec.tasks}
    still = [t for t, v in targets.items() if v is None]
    if still:
        raise ConfigError(f"{path} has no target for task(s) {', '.join(still)}")
    return replace(spec, targets=targets, target_losses={**loss, **spec.target_losses})


def run_suite(
    spec: SuiteSpec,
    out_dir: str | Path,
    *,
    report_dir: str | Path | None = None,
    command: str = "",
    quiet: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run every (label, seed) of the suite in `out_dir` (resumable), then write the report.

    A run that fails with a fedlora error is recorded (summary.json with "error") and the
    suite goes on; it is retried the next time. Returns the report's path.
    """

    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = with_pilot_targets(spec, out)
    command = command or "fedlora compare --suite " + spec.name
    _write_suite_file(spec, out, command)
    _run_jobs(spec, out, quiet=quiet, log=log)
    return report_suite([out], report_dir or out)


def _run_jobs(spec: SuiteSpec, out: Path, *, quiet: bool, log: Callable[[str], None]) -> None:
    """Every (label, seed) of the spec in `out`: finished runs skipped, partial ones resumed."""
    from fedlora.federation.run import run
    from fedlora.federation.rundir import RunDirInUse, config_changes, load_run_config
    from fedlora.federation.runfiles import write_summary

    jobs = [(label, seed) for seed in spec.seeds for label in spec.labels]
    start = time.perf_counter()
    for i, (label, seed) in enumerate(jobs, 1):
        run_dir = out / f"{label}-seed{seed}"
        head = f"[{i}/{len(jobs)}] {label} seed {seed}"
        if _finished(run_dir):
            log(f"{head}: finished earlier, skipped")
            continue
        cfg = spec.config_for(label, seed)
        resume = (run_dir / "config.toml").is_file()
        if resume:  # a partial run continues only with the config it started with
            _, differing = config_changes(load_run_config(run_dir), cfg)
            if differing:
                raise ConfigError(
                    f"{run_dir} is a partial run started with different {', '.join(differing)}; "
                    "restore the suite's config or delete that run directory"
                )
        else:  # a run that failed before it started left only its error: tried again
            remove_own_file(run_dir / "summary.json")
        log(f"{head}: {'resuming' if resume else 'starting'} in {run_dir}")
        t0 = time.perf_counter()
        try:
            summary = run(cfg, run_dir, resume=resume, quiet=quiet, log=log)
        except RunDirInUse as e:  # another compare runs it: neither its files nor an error
            log(f"{head}: skipped, another process runs it ({e})")
            continue
        except FedloraError as e:
            log(f"{head}: FAILED: {e}")
            error = {"error": str(e), "method": cfg.method.name, "seed": seed}
            run_dir.mkdir(parents=True, exist_ok=True)  # bad inputs fail before it is made
            write_summary(run_dir, error)
            continue
        elapsed = time.perf_counter() - start
        log(
            f"{head}: done in {time.perf_counter() - t0:.0f} s compute "
            f"({summary['rounds']} rounds, {summary['sim_time_s']:.0f} s simulated); "
            f"suite {elapsed / 60:.1f} min so far"
        )
