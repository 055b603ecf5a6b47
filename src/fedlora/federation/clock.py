"""The simulated wireless clock: one round's time and bits from the exact payload of every
participant (`fedlora.system.network.round_time`, docs/paper.md, rows 4–6 and 15)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlora.config.sections import NetworkConfig
from fedlora.federation.methods.base import LayerShapes, Method, RoundPlan
from fedlora.system.client_profiles import ClientProfiles, rayleigh_gains, spectral_efficiency
from fedlora.system.network import round_time
from fedlora.system.seeding import derive_rng


@dataclass
class RoundCost:
    round_time_s: float
    uplink_bits: int
    downlink_bits: int
    bandwidth_hz: list[float]
    downlink_s: float = 0.0  # the broadcast's share of round_time_s (0 when the downlink is free)


def round_cost(
    profiles: ClientProfiles,
    plan: RoundPlan,
    method: Method,
    shapes: LayerShapes,
    round_index: int,
    *,
    net: NetworkConfig,
    gamma: int,
    seed: int,
    local_steps: int = 0,  # H: the steps τ_n^γ times (needed by tasks with their own steps)
) -> RoundCost:
    """Round time from the exact payload of every participant (docs/paper.md, rows 4–6 and 15).

    τ_n = tau_full_s · comp_factor(k_n). t_n = t_full · (payload bits / full-adapter bits)
    for comm_cost = exact (scaled by the faded spectral efficiency with Rayleigh fading), or
    t_full · comm_factor(k_n) for the paper's `quadratic` / the `linear` model. A task with
    its own step count s (`ClientTask.steps`) computes τ_n · s / `local_steps`; a task whose
    uplink payload is 0 takes no uplink time.
    """
    if not plan.tasks:
        return RoundCost(0.0, 0, 0, [])
    clients = np.array(plan.participants)
    ranks = np.array([t.rank_used for t in plan.tasks])
    # τ_n^γ is H local steps; a task of its own length (`centralized`) computes in proportion
    steps = np.array([t.steps / local_steps if t.steps else 1.0 for t in plan.tasks])
    payloads = [method.payload(t, shapes, plan) for t in plan.tasks]
    up_bits = np.array([p.uplink_params for p in payloads], dtype=float) * net.bits_per_param
    # a task that sends nothing needs no uplink time, whatever the cost model (the references)
    t_full = profiles.t_full[clients] * (up_bits > 0)
    down_bits = np.array([p.downlink_params for p in payloads], dtype=float) * net.bits_per_param
    full_bits = gamma * sum(o + i for o, i in shapes.values()) * net.bits_per_param
    efficiency = None
    if net.fading == "rayleigh" and profiles.has_channel:
        gains = rayleigh_gains(profiles.n, derive_rng(seed, "fading", round_index))
        gains = np.maximum(gains, net.fading_floor)  # the outage floor (0: none)
        faded = spectral_efficiency(profiles.snr_db, gains)[clients]
        efficiency = (profiles.spectral_efficiency[clients], faded)
    round_time_s, f = round_time(
        profiles.tau_full_s[clients] * steps,
        t_full,
        ranks,
        gamma,
        comm_cost=net.comm_cost,
        comp_cost=net.comp_cost,
        rho=net.rho,
        f_tot_hz=net.f_tot_hz,
        uplink_bits=up_bits,
        full_bits=full_bits,
        efficiency=efficiency,
    )
    downlink_s = 0.0
    if net.downlink_rate_bps > 0:  # a broadcast before local training: the largest download
        downlink_s = float(down_bits.max()) / net.downlink_rate_bps
    return RoundCost(
        round_time_s + downlink_s,
        int(up_bits.sum()),
        int(down_bits.sum()),
        f.tolist(),
        downlink_s,
    )
