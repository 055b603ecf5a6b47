"""In-run calibration and re-planning of a `proposed` run (docs/planner.md).

With ``planner.calibration = "in-run"`` the run's own first rounds are Algorithm 2's probes:
the four settings (q, k) ∈ {0.3, 0.15} × {γ, ⌈γ/4⌉} (the separate calibration's, every client
alike), applied to the global adapter itself, `planner.probe_rounds` rounds each, in the
palindromic order 1 2 3 4 4 3 2 1 (half the rounds in each half) so that a loss curve that
slows down linearly does not favour the early probes. After the last probe round the
constants are fitted from the run's rounds so far (`fedlora.system.planner.progress_rates`:
log L_r = α − Σ_j ρ_j·n_j(r); `constrained_fit`: A, C, D >= 0, floors where not identified)
and the run goes on with the plan for the adapter it has. The probes are ordinary rounds:
their simulated time is on the run's clock. If that fit fails (a ConfigError: e.g. the
settings with positive progress share one sampling rate) and ``planner.probe_cycles`` allows,
the probe schedule repeats (another full palindromic cycle) and the fit is retried after it;
after the last cycle, the probe with the least time per progress is the fallback. With
``planner.fit_client_offsets`` the rates come from each participant's own loss (the metrics
line's ``client_losses``) with a per-client intercept (`progress_rates_by_client`).

With ``planner.replan_every = R`` the fit is redone every R rounds after the probes from every
round so far (each round's (q, k) is a setting of the fit), the plan is recomputed, and it
replaces the current one only when its predicted time to target (P2 under the new fit) is
lower by more than ``planner.replan_margin`` (a share: 0.05 = 5%).

Every fit and plan goes into that round's metrics line (key ``planner``) and into
plan.json. All state is plain data in the method's checkpoint (`InRunPlanner.state`), so a
resumed run replays the same fits and plans bit for bit.

`Proposed`'s round hooks (`Method.before_round`, `Method.after_round`, called by the round
loop for every method) drive an `InRunPlanner` when its plan says it calibrates in-run:
`before_round` gives the round's q and k, `after_round` records the round and fits and plans
when due. The separate calibration (`fedlora.federation.calibration`) shares `probe_settings`;
both plan with `fedlora.federation.methods.proposed_plan` (`plan_for`, within
planner.max_epsilon after what the run has already spent: `RoundContext.privacy_rdp`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import RoundContext
from fedlora.federation.methods.proposed_plan import plan_for, planning_t_full
from fedlora.federation.runfiles import write_plan

PROBE_Q = (0.3, 0.15)  # planner.probe_q's default
PLAN_FILE = "plan.json"


def probe_settings(gamma: int, probe_q: tuple[float, ...] = PROBE_Q) -> list[tuple[float, int]]:
    """(q, k) of the four probes: planner.probe_q ({0.3, 0.15} by default) × {γ, ⌈γ/4⌉}
    (⌈γ/4⌉ = γ − 1 when equal)."""
    if gamma < 2:
        raise ConfigError(rank_message(gamma))
    k_small = max(1, math.ceil(gamma / 4))
    if k_small == gamma:
        k_small = gamma - 1
    return [(q, k) for k in (gamma, k_small) for q in probe_q]


def check_probe_budget(cfg: ExperimentConfig, method_cls: Any) -> None:
    """With planner.max_epsilon: refuse a run whose probe rounds alone (4 × probe_rounds
    rounds at planner.probe_q, × planner.probe_cycles: every cycle it may run) take some
    client's ε(privacy.delta) past its budget, as the run's own accounting counts them
    (`fedlora.federation.privacy.rounds_epsilons`)."""
    from fedlora.federation.privacy import rounds_epsilons

    p = cfg.planner
    if not p.max_epsilon:
        return
    n = cfg.data.n_clients
    rates = [q for q, _ in probe_settings(max(cfg.lora.rank, 2), p.probe_q)]
    schedule = probe_schedule(p.probe_rounds) * p.probe_cycles  # every cycle it may run
    eps = rounds_epsilons(cfg, method_cls, [rates[j] for j in schedule])
    if eps is None:
        return
    budgets = np.broadcast_to(np.asarray(p.max_epsilon, dtype=float), (n,))
    over = [i for i in range(n) if not eps[i] <= budgets[i]]
    if not over:
        return
    i = max(over, key=lambda j: eps[j] - budgets[j])
    raise ConfigError(
        f"planner.probe_q = {list(p.probe_q)} with planner.probe_rounds = {p.probe_rounds} "
        + (f"and planner.probe_cycles = {p.probe_cycles} " if p.probe_cycles > 1 else "")
        + f"spends ε = {eps[i]:.3g} on client {i} before the plan (privacy.noise_multiplier = "
        f"{cfg.privacy.noise_multiplier:g}, privacy.delta = {cfg.privacy.delta:g}), over "
        f"planner.max_epsilon = {budgets[i]:g}: lower the probe rates or rounds, or raise the "
        "noise"
    )


def rank_message(gamma: object) -> str:
    """Why `proposed` with a calibration refuses lora.rank = `gamma` < 2."""
    return (
        f"lora.rank = {gamma!r} is invalid for method.name = 'proposed' with Algorithm 2's "
        "calibration: it needs two different sketch sizes k to tell the constants C and D "
        "apart, so lora.rank must be >= 2 (or set method.q and method.k to one plan JSON file)"
    )


def probe_schedule(probe_rounds: int) -> list[int]:
    """Setting index of each probe round: blocks 0 1 2 3 3 2 1 0, each setting's rounds split
    in two halves (the first half rounded up)."""
    first = (probe_rounds + 1) // 2
    second = probe_rounds - first
    order = [j for j in range(4) for _ in range(first)]
    order += [j for j in reversed(range(4)) for _ in range(second)]
    return order


class InRunPlanner:
    """The in-run calibration and re-planning of one `proposed` run. Its `state` is plain
    data (the probes, every round's setting and log-loss, the fits and plans), carried by the
    method's checkpoint, so a resumed run replays the same fits and plans bit for bit."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state: dict[str, Any] = state or {}

    def _started(self, ctx: RoundContext) -> dict[str, Any]:
        if not self.state:
            self.state = _initial_state(ctx)
        return self.state

    def before_round(self, ctx: RoundContext, round_index: int) -> tuple[list[float], list[int]]:
        """q and k for round `round_index`: a probe's, or the current plan's."""
        st = self._started(ctx)
        sched = st["schedule"]
        idx = sched[round_index] if round_index < len(sched) else st["current"]
        st["in_force"] = idx
        setting = st["settings"][idx]
        return setting["q"], setting["k"]

    def after_round(self, ctx: RoundContext, round_index: int, line: dict[str, Any]) -> None:
        """Record round `round_index`; fit and plan at the end of the probes and every
        planner.replan_every rounds after; the fit and plan go into `line["planner"]`."""
        st = self._started(ctx)
        loss = line.get("train_loss")
        st["of_round"].append(int(st["in_force"]))
        st["log_loss"].append(math.log(loss) if loss is not None and loss > 0 else None)
        if "client_log_loss" in st:  # planner.fit_client_offsets: each participant's log-loss
            pairs = line.get("client_losses") or []
            st["client_log_loss"].append([[int(c), math.log(x)] for c, x in pairs if x > 0])
        done, n_probe = round_index + 1, len(st["schedule"])
        every = ctx.cfg.planner.replan_every
        if done == n_probe:
            entry = _refit(ctx, st, initial=True)
        elif every and done > n_probe and (done - n_probe) % every == 0:
            entry = _refit(ctx, st, initial=False)
        else:
            return
        entry["round"] = done
        st["history"].append(entry)
        line["planner"] = entry
        _write_plan_file(ctx, st)
        ctx.log(_describe(entry))


def _initial_state(ctx: RoundContext) -> dict[str, Any]:
    n, gamma = len(ctx.a), ctx.cfg.lora.rank
    settings = [
        {"q": [q] * n, "k": [k] * n, "source": f"probe {i + 1}"}
        for i, (q, k) in enumerate(probe_settings(gamma, ctx.cfg.planner.probe_q))
    ]
    state = {
        "settings": settings,
        "schedule": probe_schedule(ctx.cfg.planner.probe_rounds),
        "of_round": [],  # setting index of every finished round
        "log_loss": [],  # log of its training loss (None: no participant / no loss)
        "current": 0,  # the setting in force after the probes
        "history": [],  # every fit and plan (also in metrics.jsonl)
    }
    if ctx.cfg.planner.fit_client_offsets:  # every round's [[client, log-loss], ...]
        state["client_log_loss"] = []
    return state


def _problem_inputs(ctx: RoundContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.asarray(ctx.a, dtype=float)
    a = a / a.sum()
    clients = {"t_full": ctx.profiles.t_full, "snr_db": ctx.profiles.snr_db}
    return a, np.asarray(ctx.profiles.tau_full_s, dtype=float), planning_t_full(ctx.cfg, clients)


def _yz(a: np.ndarray, q: np.ndarray, k: np.ndarray, gamma: int) -> tuple[float, float]:
    a2 = a**2
    return float(np.sum(a2 / q)), float(np.sum(a2 / q * gamma**2 / k.astype(float) ** 2))


def _refit(ctx: RoundContext, st: dict[str, Any], *, initial: bool) -> dict[str, Any]:
    """Fit from every round so far, plan, and adopt the plan (always after the probes; after
    a re-plan only if its predicted time gain exceeds planner.replan_margin)."""
    from fedlora.system.planner.fit import constrained_fit
    from fedlora.system.planner.objective import (
        p2_objective,
    )
    from fedlora.system.planner.problem import PlanOptions, PlanProblem

    cfg, gamma = ctx.cfg, ctx.cfg.lora.rank
    a, tau, t_full = _problem_inputs(ctx)
    settings = [(np.asarray(s["q"], float), np.asarray(s["k"], np.int64)) for s in st["settings"]]
    yz = np.array([_yz(a, q, k, gamma) for q, k in settings])
    options = PlanOptions.from_config(cfg.planner, cfg.network, cfg.privacy)
    entry: dict[str, Any] = {"kind": "calibration" if initial else "replan"}
    rates, counts = _rates(st, entry)
    if initial and cfg.planner.probe_cycles > 1:
        entry["cycle"] = len(st["schedule"]) // len(probe_schedule(cfg.planner.probe_rounds))
    try:
        fit = constrained_fit(
            rates, yz[:, 0], yz[:, 1], weights=counts, floor_share=cfg.planner.fit_floor_share
        )
        problem = PlanProblem(
            gamma=gamma,
            f_tot=cfg.network.f_tot_hz,
            a=a,
            tau_full_s=tau,
            t_full=t_full,
            constants=fit.constants,
        )
        spent = ctx.privacy_rdp() if ctx.privacy_rdp is not None else None
        q, k, details = plan_for(cfg, problem, fit.constants, options, a, spent)
    except ConfigError as e:
        entry["error"] = str(e)
        if initial and entry.get("cycle", 1) < cfg.planner.probe_cycles:  # probe once more
            st["schedule"] = st["schedule"] + probe_schedule(cfg.planner.probe_rounds)
            entry["adopted"] = False
            entry["reprobe"] = f"probe cycle {entry['cycle'] + 1} of {cfg.planner.probe_cycles}"
        elif initial:  # no usable fit: the probe with the least time per unit of progress
            _fall_back(st, entry, _best_probe(ctx, st, rates, a, tau, t_full, options))
        else:
            entry["adopted"] = False
        return entry
    new = p2_objective(problem, fit.constants, q, k, options)
    cur_q, cur_k = settings[st["current"]]
    current = math.inf if initial else p2_objective(problem, fit.constants, cur_q, cur_k, options)
    gain = 1.0 - new / current if math.isfinite(current) and current > 0 else 1.0
    adopt = initial or gain > cfg.planner.replan_margin
    entry.update(
        fit=fit.to_dict(),
        plan=plan_entry(problem, fit.constants, q, k, options, new, details),
        current_objective=None if not math.isfinite(current) else float(current),
        predicted_gain=float(gain),
        margin=float(cfg.planner.replan_margin),
        adopted=bool(adopt),
    )
    if adopt:
        st["settings"].append(
            {
                "q": [float(x) for x in q],
                "k": [int(x) for x in k],
                "source": f"plan after round {len(st['of_round'])}",
            }
        )
        st["current"] = len(st["settings"]) - 1
        entry["setting"] = st["current"]
    return entry


def _fall_back(st: dict[str, Any], entry: dict[str, Any], probe: int) -> None:
    """No usable fit after the last probe cycle: probe `probe` goes into force."""
    st["current"] = probe
    entry["adopted"] = True
    entry["setting"] = probe
    entry["fallback"] = f"probe {probe + 1} (least time per progress)"


def _rates(st: dict[str, Any], entry: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each setting's progress rate and rounds from the run's rounds so far, into `entry`:
    from the rounds' mean loss, or (planner.fit_client_offsets) from each participant's own
    loss with a per-client intercept, with the rates' standard errors."""
    from fedlora.system.planner.fit import progress_rates, progress_rates_by_client

    if "client_log_loss" in st:
        rates, counts, se = progress_rates_by_client(st["client_log_loss"], st["of_round"])
    else:
        (rates, counts), se = progress_rates(st["log_loss"], st["of_round"]), None
    entry["rates"] = [None if not math.isfinite(x) else float(x) for x in rates]
    entry["rounds_per_setting"] = [int(c) for c in counts]
    if se is not None:
        entry["rate_se"] = [None if not math.isfinite(x) else float(x) for x in se]
        entry["rates_from"] = "client losses, per-client intercepts"
    return rates, counts


def plan_entry(
    problem: Any, constants: Any, q: Any, k: Any, options: Any, objective: float, details: dict
) -> dict[str, Any]:
    """A plan as the `planner` entry records it: q, k, P2, expected rounds and round time (and
    the budget's `privacy` when `plan_for` gave one). Shared with the replay tool."""
    from fedlora.system.planner.objective import expected_rounds, sketched_round_weights

    return {
        "q": [float(x) for x in q],
        "k": [int(x) for x in k],
        "objective": float(objective),
        "expected_rounds": float(expected_rounds(problem, constants, q, k)),
        "expected_round_time_s": float(
            np.dot(q, sketched_round_weights(problem, np.asarray(k), options))
        ),
        **({"privacy": details["privacy"]} if "privacy" in details else {}),
    }


def _best_probe(ctx: RoundContext, st, rates, a, tau, t_full, options) -> int:
    """The probe with the lowest expected round time / progress rate (0 if none progressed)."""
    from fedlora.system.planner.objective import sketched_round_weights
    from fedlora.system.planner.problem import Constants, PlanProblem

    problem = PlanProblem(
        gamma=ctx.cfg.lora.rank,
        f_tot=ctx.cfg.network.f_tot_hz,
        a=a,
        tau_full_s=tau,
        t_full=t_full,
        constants=Constants(1.0, 1.0, 1.0, 1.0),
    )
    best, best_j = math.inf, 0
    for j in range(4):
        rho = rates[j] if j < len(rates) else math.nan
        if not (math.isfinite(rho) and rho > 0):
            continue
        s = st["settings"][j]
        k = np.asarray(s["k"], np.int64)
        t = float(np.dot(s["q"], sketched_round_weights(problem, k, options)))
        if t / rho < best:
            best, best_j = t / rho, j
    return best_j


def _write_plan_file(ctx: RoundContext, st: dict[str, Any]) -> None:
    """plan.json: the plan in force (q, k: what `fedlora plan` and Flower read) and every fit."""
    current = st["settings"][st["current"]]
    last_fit = next((h for h in reversed(st["history"]) if "fit" in h), None)
    saved = {
        "q": current["q"],
        "k": current["k"],
        "source": current["source"],
        "calibration": {
            "mode": "in-run",
            "probe_rounds": len(st["schedule"]),
            "sim_time_s": 0.0,
            "probes": st["settings"][:4],
        },
        "constants": last_fit["fit"]["constants"] if last_fit else None,
        "floors": last_fit["fit"]["floors"] if last_fit else None,
        "history": st["history"],
    }
    write_plan(Path(ctx.run_dir), saved)


def _describe(entry: dict[str, Any]) -> str:
    head = f"planner ({entry['kind']}, after round {entry['round']}): "
    if "error" in entry:
        tail = entry.get("fallback") or entry.get("reprobe") or "plan kept"
        return head + f"no fit ({entry['error']}); {tail}"
    c = entry["fit"]["constants"]
    floors = entry["fit"]["floors"]
    text = f"A={c['A']:.4g} C={c['C']:.4g} D={c['D']:.4g} (B = 1)"
    if floors:
        text += "; floored " + ", ".join(f"{k}: {v}" for k, v in floors.items())
    p = entry["plan"]
    text += f"; plan mean q {np.mean(p['q']):.3f}, mean k {np.mean(p['k']):.1f}"
    if entry["kind"] == "replan":
        text += f"; predicted gain {entry['predicted_gain']:+.1%} -> "
        text += "adopted" if entry["adopted"] else f"kept (margin {entry['margin']:.0%})"
    return head + text


def outcome(saved: dict[str, Any], rounds_run: int) -> dict[str, Any]:
    """summary.json's `plan` of an in-run run: every fit (adopted or not), the last floors and
    the final plan; no separate `calibration` runs (the probes are the run's own rounds)."""
    history = saved.get("history", [])
    adopted = [h for h in history if h.get("adopted") and "plan" in h]
    out = {
        "calibration_mode": "in-run",
        "probe_rounds": saved["calibration"]["probe_rounds"],
        "calibration_sim_time_s": 0.0,
        "calibration": [],
        "observed_rounds": None,
        "rounds_run": rounds_run,
        "fits": [
            {
                "round": h["round"],
                "kind": h["kind"],
                "adopted": h.get("adopted"),
                "constants": h.get("fit", {}).get("constants"),
                "floors": h.get("fit", {}).get("floors"),
                "predicted_gain": h.get("predicted_gain"),
                "error": h.get("error"),
            }
            for h in history
        ],
        "final_plan": {"q": saved["q"], "k": saved["k"], "source": saved["source"]},
        "floors": saved.get("floors"),
    }
    if adopted:  # the rounds Theorem 1's fit predicted for the last adopted plan
        out["predicted_rounds"] = adopted[-1]["plan"]["expected_rounds"]
    return out
