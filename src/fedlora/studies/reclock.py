"""Re-clocking (`fedlora report --comm-cost/--comp-cost`): a recorded run's simulated clock
under another cost model (docs/paper.md, rows 4–5), recomputed round by round from its metrics lines
(participants and k), its clients.csv and config.toml through the one round-time formula,
`system.network.round_time`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlora.config.sections import LoraConfig, NetworkConfig
from fedlora.config.training_section import TrainingConfig
from fedlora.errors import ConfigError, bad_value
from fedlora.federation.methods.references import REFERENCES
from fedlora.federation.metrics_file import METRICS_FILE, read_metrics
from fedlora.federation.runfiles import CLIENTS_FILE, read_clients
from fedlora.studies.runs import RunRecord, read_toml


def _reclock_lines(
    lines: list[dict[str, Any]],
    config: dict[str, Any],
    clients: Path,
    cost: tuple[str, str, float],
    start_s: float,
    sends: bool = True,
) -> list[dict[str, Any]]:
    """Round times recomputed from each line's participants and k (and `steps`, the local
    steps of tasks of their own length) under another cost model; `sends` False: the tasks
    send nothing (the references), no uplink time under any model."""
    import numpy as np

    from fedlora.system.network import round_time

    net = config.get("network", {})
    # the downlink's broadcast time does not depend on the cost model: runs record it per
    # round (`downlink_s`); runs from before that record cannot be re-clocked with a downlink
    paid_downlink = float(net.get("downlink_rate_bps", 0.0)) > 0
    unrecorded = paid_downlink and any(
        x.get("round", 0) >= 1 and x.get("participants") and "downlink_s" not in x for x in lines
    )
    if net.get("fading", "none") != "none" or unrecorded:
        raise ConfigError(
            f"{clients.parent}: re-clocking needs network.fading = none and a free downlink "
            f"or one recorded per round (got fading = {net.get('fading')!r}, "
            f"downlink_rate_bps = {net.get('downlink_rate_bps')!r})"
        )
    # a key missing from an old run's config.toml had the config's default
    gamma = int(config.get("lora", {}).get("rank", LoraConfig.rank))
    f_tot = float(net.get("f_tot_hz", NetworkConfig.f_tot_hz))
    comm, comp, rho = cost
    rows = read_clients(clients)
    tau_full = np.asarray([r.tau_full_s for r in rows])
    t_full = np.asarray([r.t_full for r in rows]) * float(sends)
    local_steps = int(config.get("training", {}).get("local_steps", TrainingConfig.local_steps))
    out, clock = [], start_s
    for line in lines:
        line = dict(line)
        who = np.asarray(line.get("participants") or [], dtype=int)
        if line.get("round", 0) >= 1 and who.size:
            k = np.asarray(line["k"], dtype=float)
            steps = np.asarray(line.get("steps") or [local_steps] * who.size, dtype=float)
            # no payload bits recorded: exact = linear (a sketch's uplink ∝ k)
            line["round_time_s"] = round_time(
                tau_full[who] * steps / local_steps,
                t_full[who],
                k,
                gamma,
                comm_cost=comm,
                comp_cost=comp,
                rho=rho,
                f_tot_hz=f_tot,
            )[0]
            line["round_time_s"] += float(line.get("downlink_s", 0.0)) if paid_downlink else 0.0
        elif line.get("round", 0) >= 1:
            line["round_time_s"] = 0.0
        clock += line.get("round_time_s", 0.0) if line.get("round", 0) >= 1 else 0.0
        line["sim_time_s"] = clock
        out.append(line)
    return out


def reclock(run: RunRecord, comm_cost: str, comp_cost: str, rho: float | None = None) -> RunRecord:
    """The run's clock under another cost model (docs/paper.md, rows 4–5), from its metrics lines
    (participants and k per round), its clients.csv (τ_n^γ, t_n^γ) and config.toml.

    Exact for every method whose training does not depend on the cost model: all baselines
    and fixed-q/k methods (their uplink is k_n(m+n) parameters, so `exact` = linear). For
    `proposed` the plan itself depends on the cost model, so a re-clocked `proposed` run is
    *its plan* timed under the other model (its calibration runs are re-clocked too), not
    what it would have planned there.
    """
    if comm_cost not in ("exact", "linear", "quadratic"):
        raise bad_value("--comm-cost", comm_cost, "allowed: exact, linear, quadratic")
    if comp_cost not in ("affine", "linear", "quadratic"):
        raise bad_value("--comp-cost", comp_cost, "allowed: affine, linear, quadratic")
    net = run.config.get("network", {})
    cost = (comm_cost, comp_cost, float(net.get("rho", NetworkConfig.rho) if rho is None else rho))
    start = 0.0
    calib = run.path / "calibration"
    if run.calibration_time_s > 0 and calib.is_dir():
        for sub in sorted(d for d in calib.iterdir() if (d / METRICS_FILE).is_file()):
            sub_cfg = read_toml(sub / "config.toml")
            lines = _reclock_lines(
                read_metrics(sub / METRICS_FILE), sub_cfg, sub / CLIENTS_FILE, cost, 0.0
            )
            start += lines[-1]["sim_time_s"] if lines else 0.0
    sends = run.method not in REFERENCES  # the references send nothing
    lines = _reclock_lines(run.lines, run.config, run.path / CLIENTS_FILE, cost, start, sends)
    if lines:
        lines[0]["calibration_sim_time_s"] = start
    summary = run.summary.replace_fields(sim_time_s=lines[-1]["sim_time_s"] if lines else 0.0)
    return RunRecord(run.path, run.label, run.method, run.seed, lines, summary, run.config)
