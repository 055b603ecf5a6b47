"""Replay the in-run planner of a `proposed` run from its run directory (no model, no torch).

An in-run `proposed` run (``planner.calibration = "in-run"``,
`fedlora.federation.methods.proposed_replan`) fits Theorem 1's constants from its own rounds'
training losses after its probes and every ``planner.replan_every`` rounds, and plans from
them. Every input of those fits is in the run directory: config.toml (the planner settings),
clients.csv (a_n, τ_n, t_n, SNR), metrics.jsonl (each round's train_loss and, at a fit, the
``planner`` entry it logged). This script redoes each fit and plan with the library's own
functions (`progress_rates`, `constrained_fit`, `PlanProblem`, `PlanOptions.from_config`,
`plan_for`, `p2_objective`) and compares each entry with the logged one, field for field.

With ``--set section.key=value`` (e.g. ``planner.q_lower_bound=none``,
``planner.fit_floor_share=0.3``, ``planner.max_weight=0``, ``planner.replan_every=4``) or
``--window W`` (each re-fit from the last W rounds only) it answers what the planner would
have fitted and planned from the same rounds. The rounds are the ones the run ran: a replayed
plan is reported, never put in force (what it would have trained is not in the log).

Beside each entry it reports what the log does not hold: the fit even when the plan failed,
the standard errors of the progress rates (the residual scatter of log L_r around the model
of `progress_rates`), the per-setting variance share C·Y_j + D·Z_j of B, and the per-client
lower bounds lo_n = a_n²·N·c_n/B at k = γ (docs/paper.md, row 9).

    .venv/bin/python research/study_planner/replay_inrun.py RUN_DIR [--check]
    .venv/bin/python research/study_planner/replay_inrun.py RUN_DIR \\
        --set planner.q_lower_bound=none [--window 64] [--json OUT.json]

``--check`` exits 1 unless every replayed entry equals the logged one (without overrides).

Runs made with ``planner.probe_cycles`` > 1 (the probes ran again after a failed fit: the
logged ``reprobe``) and ``planner.fit_client_offsets = true`` (rates from each round's
``client_losses``, `progress_rates_by_client`) are replayed as they ran;
``--set planner.fit_client_offsets=true`` needs a run that logged ``client_losses``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `research`

from research.study_planner.replay_rates import (  # noqa: E402 (after the path)
    client_rates,
    pad,
    rate_errors,
    yz_of,
)


@dataclass
class RunLog:
    """What the planner of one in-run run saw: config, clients, every round's loss and the
    logged planner entries (by round)."""

    cfg: Any  # the config with the overrides: the replayed planner's
    ran_cfg: Any  # the config as logged: the probes and rounds that ran
    a: np.ndarray  # normalised a_n
    tau: np.ndarray
    t_full: np.ndarray  # the planner's t_full (`planning_t_full`)
    losses: list[float | None]  # train_loss of rounds 1..R
    client_losses: list[list | None]  # client_losses of rounds 1..R (fit_client_offsets)
    ks: list[tuple[list[int], list[int]]]  # (participants, their k) of rounds 1..R
    logged: dict[int, dict[str, Any]] = field(default_factory=dict)


def load_run(run_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunLog:
    """A run directory's config (with `overrides`), clients and metrics lines."""
    from fedlora.config import load_config
    from fedlora.errors import ConfigError
    from fedlora.federation.methods.proposed_plan import planning_t_full
    from fedlora.federation.metrics_file import read_metrics
    from fedlora.federation.runfiles import read_clients

    with warnings.catch_warnings():  # an older run's config.toml: its renamed keys still load
        warnings.simplefilter("ignore", FutureWarning)
        cfg = load_config(run_dir / "config.toml", overrides)
        ran_cfg = load_config(run_dir / "config.toml")
    if cfg.method.name != "proposed" or cfg.planner.calibration != "in-run":
        raise ConfigError(
            f"{run_dir}: method.name = {cfg.method.name!r}, planner.calibration = "
            f"{cfg.planner.calibration!r}; the replay needs an in-run `proposed` run"
        )
    rows = read_clients(run_dir / "clients.csv")
    a = np.array([r.a for r in rows], dtype=float)
    snr = np.array([getattr(r, "snr_db", math.nan) for r in rows], dtype=float)
    t_full = np.array([r.t_full for r in rows], dtype=float)
    lines = [m for m in read_metrics(run_dir / "metrics.jsonl") if m.get("round", 0) >= 1]
    if [m["round"] for m in lines] != list(range(1, len(lines) + 1)):
        raise ConfigError(f"{run_dir}/metrics.jsonl: rounds are not 1, 2, ... in order")
    return RunLog(
        cfg=cfg,
        ran_cfg=ran_cfg,
        a=a / a.sum(),
        tau=np.array([r.tau_full_s for r in rows], dtype=float),
        t_full=planning_t_full(cfg, {"t_full": t_full, "snr_db": snr}),
        losses=[m.get("train_loss") for m in lines],
        client_losses=[m.get("client_losses") for m in lines],
        ks=[(list(m.get("participants", [])), list(m.get("k", []))) for m in lines],
        logged={m["round"]: m["planner"] for m in lines if "planner" in m},
    )


def ran_course(run: RunLog) -> tuple[list[dict[str, Any]], list[int]]:
    """The settings the run put in force (the four probes, then each adopted logged plan) and
    the setting of every round, from the logged entries; checked against each round's k."""
    from fedlora.errors import ConfigError
    from fedlora.federation.methods.proposed_replan import probe_schedule, probe_settings

    cfg, n = run.ran_cfg, run.a.size  # what ran: the logged config, not the overrides
    settings = [
        {"q": [q] * n, "k": [k] * n} for q, k in probe_settings(cfg.lora.rank, cfg.planner.probe_q)
    ]
    schedule = probe_schedule(cfg.planner.probe_rounds)
    current, of_round, cycle = 0, [], list(schedule)
    for i, (who, ks) in enumerate(run.ks):
        idx = schedule[i] if i < len(schedule) else current
        of_round.append(idx)
        want = [settings[idx]["k"][c] for c in who]
        if want != ks:
            raise ConfigError(f"round {i + 1}: k {ks} of clients {who}, setting {idx} has {want}")
        entry = run.logged.get(i + 1)
        if entry and entry.get("reprobe"):  # planner.probe_cycles: the probes ran again
            schedule = schedule + cycle
        if entry and entry.get("adopted"):
            if "plan" in entry:
                settings.append({"q": entry["plan"]["q"], "k": entry["plan"]["k"]})
            current = entry["setting"]
    return settings, of_round


def refit(
    run: RunLog,
    settings: list[dict[str, Any]],
    of_round: list[int],
    current: int,
    *,
    initial: bool,
    window: int = 0,
    cycle: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(entry, diagnostics): `_refit` of `proposed_replan` from the rounds `of_round` (their
    losses in `run`), the entry as the run logs it; `window` > 0: the last `window` rounds;
    `cycle`: the probe cycle a calibration fit ends (planner.probe_cycles > 1)."""
    from fedlora.errors import ConfigError
    from fedlora.system.planner.fit import constrained_fit, progress_rates
    from fedlora.system.planner.problem import PlanOptions

    cfg, gamma = run.cfg, run.cfg.lora.rank
    logs = [math.log(x) if x is not None and x > 0 else None for x in run.losses[: len(of_round)]]
    start = max(0, len(of_round) - window) if window and not initial else 0
    sigma, se = rate_errors(logs[start:], of_round[start:])
    if cfg.planner.fit_client_offsets:
        rates, counts, se = client_rates(run.client_losses, of_round, start)
        sigma = math.nan
    else:
        rates, counts = progress_rates(logs[start:], of_round[start:])
    rates, counts = pad(rates, math.nan, len(settings)), pad(counts, 0.0, len(settings))
    arrays = [(np.asarray(s["q"], float), np.asarray(s["k"], np.int64)) for s in settings]
    yz = np.array([yz_of(run.a, q, k, gamma) for q, k in arrays])
    options = PlanOptions.from_config(cfg.planner, cfg.network, cfg.privacy)
    entry: dict[str, Any] = {
        "kind": "calibration" if initial else "replan",
        "rates": [None if not math.isfinite(x) else float(x) for x in rates],
        "rounds_per_setting": [int(c) for c in counts],
    }
    if cfg.planner.fit_client_offsets:
        entry["rate_se"] = [
            None if not math.isfinite(x) else float(x) for x in pad(se, math.nan, len(settings))
        ]
        entry["rates_from"] = "client losses, per-client intercepts"
    if cycle is not None:
        entry["cycle"] = cycle
    diag: dict[str, Any] = {
        "window_start": start,
        "sigma_log_loss": sigma,
        "rate_se": [float(x) for x in pad(se, math.nan, len(settings))],
        "Y": [float(v) for v in yz[:, 0]],
        "Z": [float(v) for v in yz[:, 1]],
    }
    fit = problem = None
    try:
        fit = constrained_fit(
            rates, yz[:, 0], yz[:, 1], weights=counts, floor_share=cfg.planner.fit_floor_share
        )
        diag.update(_fit_diag(run, fit, yz))
        problem = _problem(run, fit.constants)
        from fedlora.federation.methods.proposed_plan import plan_for

        q, k, _ = plan_for(cfg, problem, fit.constants, options, run.a)
    except ConfigError as e:
        entry["error"] = str(e)
        if cycle is not None and cycle < cfg.planner.probe_cycles:
            entry["adopted"] = False
            entry["reprobe"] = f"probe cycle {cycle + 1} of {cfg.planner.probe_cycles}"
        elif initial:
            best = _best_probe(run, settings, rates, options)
            entry.update(adopted=True, setting=best)
            entry["fallback"] = f"probe {best + 1} (least time per progress)"
        else:
            entry["adopted"] = False
        return entry, diag
    _add_plan(run, entry, fit, problem, options, (q, k), arrays[current], initial)
    if entry["adopted"]:  # the run appends the plan to its settings and puts it in force
        entry["setting"] = len(settings)
    return entry, diag


def _add_plan(run, entry, fit, problem, options, plan, cur, initial) -> None:
    """The plan's fields of the entry, and whether it would be adopted (as `_refit`)."""
    from fedlora.federation.methods.proposed_replan import plan_entry
    from fedlora.system.planner.objective import p2_objective

    q, k = plan
    new = p2_objective(problem, fit.constants, q, k, options)
    current = math.inf if initial else p2_objective(problem, fit.constants, *cur, options)
    gain = 1.0 - new / current if math.isfinite(current) and current > 0 else 1.0
    entry.update(
        fit=fit.to_dict(),
        plan=plan_entry(problem, fit.constants, q, k, options, new, {}),
        current_objective=None if not math.isfinite(current) else float(current),
        predicted_gain=float(gain),
        margin=float(run.cfg.planner.replan_margin),
        adopted=bool(initial or gain > run.cfg.planner.replan_margin),
    )


def _problem(run: RunLog, constants: Any) -> Any:
    from fedlora.system.planner.problem import PlanProblem

    cfg = run.cfg
    return PlanProblem(
        gamma=cfg.lora.rank,
        f_tot=cfg.network.f_tot_hz,
        a=run.a,
        tau_full_s=run.tau,
        t_full=run.t_full,
        constants=constants,
    )


def _fit_diag(run: RunLog, fit: Any, yz: np.ndarray) -> dict[str, Any]:
    """The fit's constants, the variance share C·Y_j + D·Z_j of each setting and the
    per-client lower bounds lo_n at k = γ (docs/paper.md, row 9)."""
    from fedlora.system.planner.objective import q_lower_bounds

    c = fit.constants
    lo = q_lower_bounds(_problem(run, c), c, np.full(run.a.size, run.cfg.lora.rank), "per_client")
    return {
        "fit": fit.to_dict(),
        "variance_share": [float(c.C * y + c.D * z) for y, z in yz],
        "lower_bound_full_rank": [float(x) for x in lo],
    }


def _best_probe(run: RunLog, settings, rates, options) -> int:
    """`_best_probe` of `proposed_replan`: the probe with the least round time per progress."""
    from fedlora.system.planner.objective import sketched_round_weights
    from fedlora.system.planner.problem import Constants

    problem = _problem(run, Constants(1.0, 1.0, 1.0, 1.0))
    best, best_j = math.inf, 0
    for j in range(4):
        rho = rates[j] if j < len(rates) else math.nan
        if not (math.isfinite(rho) and rho > 0):
            continue
        k = np.asarray(settings[j]["k"], np.int64)
        t = float(np.dot(settings[j]["q"], sketched_round_weights(problem, k, options)))
        if t / rho < best:
            best, best_j = t / rho, j
    return best_j


def replay(run: RunLog, window: int = 0) -> list[dict[str, Any]]:
    """Every fit point of the (possibly overridden) planner over the rounds the run ran: round,
    replayed entry, diagnostics, the logged entry there (None if the run logged none)."""
    from fedlora.federation.methods.proposed_replan import probe_schedule

    settings, of_round = ran_course(run)
    cycle_len = len(probe_schedule(run.ran_cfg.planner.probe_rounds))
    n_probe = cycle_len * (1 + sum(bool(e.get("reprobe")) for e in run.logged.values()))
    every = run.cfg.planner.replan_every
    out = []
    for done in range(cycle_len, len(of_round) + 1):
        initial = done <= n_probe and done % cycle_len == 0  # the end of a probe cycle
        if not (initial or (done > n_probe and every and (done - n_probe) % every == 0)):
            continue
        multi = initial and run.cfg.planner.probe_cycles > 1
        # the settings known then: the probes and the plans adopted before (each ran at once)
        known = settings[: max(3, max(of_round[:done])) + 1]
        cur = 0 if initial else of_round[done - 1]
        entry, diag = refit(run, known, of_round[:done], cur, initial=initial, window=window,
                            cycle=done // cycle_len if multi else None)  # fmt: skip
        entry["round"] = done
        out.append({"round": done, "entry": entry, "diag": diag, "logged": run.logged.get(done)})
    return out


# "Equal to the log" up to round-off: a fit replayed on another kind of CPU (another BLAS
# path) differs in its last digits (measured on proposed-exact-seed7, logged on AVX2 and
# replayed on AVX-512: rates 2e-11, constants 2e-14 relative, every decision the same);
# quantities at round-off level (a fit's residual, about 1e-16) compare by an absolute floor.
REL_TOL = 1e-9
ABS_TOL = 1e-12


def _close(a: Any, b: Any) -> bool:
    """`a` equals `b` with numbers within REL_TOL (relative) or ABS_TOL (absolute); every
    other value (names, flags, errors, k) exactly."""
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return a == b or abs(a - b) <= max(REL_TOL * max(abs(a), abs(b)), ABS_TOL)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b  # True is not 1 here


def matches(record: dict[str, Any]) -> bool | None:
    """Whether the replayed entry equals the logged one up to round-off (`_close`; None: the
    run logged none there)."""
    if record["logged"] is None:
        return None
    return _close(json.loads(json.dumps(record["entry"])), record["logged"])


def exactly(record: dict[str, Any]) -> bool:
    """Whether the replayed entry equals the logged one bit for bit."""
    return json.loads(json.dumps(record["entry"])) == record["logged"]


def describe(record: dict[str, Any]) -> str:
    """One line of a fit: rates ± SE, the raw fit, floors, max lo_n, the plan or the error."""
    e, d = record["entry"], record["diag"]
    rates = " ".join(
        "-" if r is None else f"{r:+.3g}±{s:.2g}" for r, s in zip(e["rates"], d["rate_se"])
    )
    text = f"{record['round']:>4} {e['kind'][:5]} σ={d['sigma_log_loss']:.3g} ρ=[{rates}]"
    if "fit" in d:
        raw, c = d["fit"]["raw"], d["fit"]["constants"]
        text += f" raw A={raw['A']:.3g} C={raw['C']:.3g} D={raw['D']:.3g}"
        text += f" -> C={c['C']:.3g} D={c['D']:.3g}"
        if d["fit"]["floors"]:
            text += " floored " + ",".join(d["fit"]["floors"])
        lo = d["lower_bound_full_rank"]
        text += f" max lo_n(k=γ)={max(lo):.3g} (client {int(np.argmax(lo))})"
    if "error" in e:
        text += " | " + e["error"].split(";")[0][:90]
    else:
        q, k = np.asarray(e["plan"]["q"]), e["plan"]["k"]
        text += f" | plan q {q.min():.3g}..{q.max():.3g} (mean {q.mean():.3g}) k {k}"
        text += f" R={e['plan']['expected_rounds']:.3g} adopted={e['adopted']}"
    same = matches(record)
    if same is None:
        return text
    if not same:
        return text + " [DIFFERS from log]"
    return text + (" [= logged]" if exactly(record) else " [= logged up to round-off]")


def main(argv: list[str] | None = None) -> int:
    from fedlora.errors import FedloraError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="a planner setting for the replay")  # fmt: skip
    ap.add_argument("--window", type=int, default=0, help="re-fit from the last W rounds only")
    ap.add_argument("--json", type=Path, help="write every replayed entry here")
    ap.add_argument(
        "--check", action="store_true", help="exit 1 unless every entry = logged (up to round-off)"
    )
    args = ap.parse_args(argv)
    try:
        records = replay(load_run(args.run_dir, args.overrides), window=args.window)
    except FedloraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in records:
        print(describe(r))
    same = [matches(r) for r in records]
    planned = sum("plan" in r["entry"] for r in records)
    bits = sum(r["logged"] is not None and exactly(r) for r in records)
    print(f"{len(records)} fits, {planned} with a plan; {same.count(True)} equal to the log "
          f"({bits} bit for bit, {same.count(True) - bits} up to round-off), "
          f"{same.count(False)} differ, {same.count(None)} not logged")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 1 if args.check and (False in same or None in same) else 0


if __name__ == "__main__":
    sys.exit(main())
