"""The clients' profiles of a run: generated from the config's [network] (seeded by the run),
or read from `network.profiles_file`; written to the run directory as clients.csv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError
from fedlora.federation.runfiles import ClientRow, write_clients
from fedlora.files import load_profiles
from fedlora.system.client_profiles import ClientProfiles, generate_profiles, profiles_to_rows
from fedlora.system.seeding import derive_rng


def build_profiles(cfg: ExperimentConfig, full_payload_bits: float) -> ClientProfiles:
    """The run's client profiles (`full_payload_bits`: the full-rank adapter's upload)."""
    net, n = cfg.network, cfg.data.n_clients
    if net.profiles_file:
        profiles = load_profiles(net.profiles_file)
        if profiles.n != n:
            raise ConfigError(
                f"network.profiles_file = {net.profiles_file!r} has {profiles.n} clients, "
                f"but data.n_clients = {n}"
            )
        return profiles
    return generate_profiles(
        n,
        full_payload_bits=full_payload_bits,
        local_steps=cfg.training.local_steps,
        f_tot_hz=net.f_tot_hz,
        step_time_median_s=net.step_time_median_s,
        step_time_sigma=net.step_time_sigma,
        distance_min_m=net.distance_min_m,
        distance_max_m=net.distance_max_m,
        path_loss_exponent=net.path_loss_exponent,
        path_loss_ref_db=net.path_loss_ref_db,
        tx_power_dbm=net.tx_power_dbm,
        noise_psd_dbm_hz=net.noise_psd_dbm_hz,
        rng=derive_rng(cfg.training.seed, "profiles"),
    )


def client_rows(fed: Any, profiles: ClientProfiles) -> list[ClientRow]:
    """clients.csv's rows: per client its example count, data weight a_n and profile."""
    return [
        ClientRow(i, len(fed.client_indices[i]), float(fed.a[i]), **row)
        for i, row in enumerate(profiles_to_rows(profiles))
    ]


def write_clients_csv(run_dir: Path, fed: Any, profiles: ClientProfiles) -> None:
    """clients.csv (`fedlora.federation.runfiles.write_clients`)."""
    write_clients(run_dir, client_rows(fed, profiles))
