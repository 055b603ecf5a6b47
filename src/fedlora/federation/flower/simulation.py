"""fedlora's ServerApp and ClientApp on Flower's simulation runtime (Ray), kept on loopback.

`run_simulation(cfg, opts)` runs `fedlora.federation.flower.server_app.run_server` against
`fedlora.federation.flower.client_app.app` on ``data.n_clients`` virtual SuperNodes (node_config
``partition-id`` / ``num-partitions`` set by Flower). Ray's actors live for the whole run, so
each keeps its model and tokenized data in memory (`fedlora.federation.flower.node`'s cache): no worker
processes are needed here.

Loopback: `ray.init` turns ``_node_ip_address="127.0.0.1"`` into the machine's routable
address (``resolve_ip_for_localhost``) unless Ray's cluster mode is off, which on Linux means
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment before ``ray`` is imported. With it
every Ray process (GCS, raylet, core workers, runtime-env agent) listens on 127.0.0.1 only;
`RAY_ENV` sets it together with no usage stats, and the dashboard is off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError, bad_value
from fedlora.federation.flower.common import SAFE_ENV, FlowerOptions
from fedlora.federation.flower.worker import LOOPBACK

RAY_ENV = {
    **SAFE_ENV,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node IP = 127.0.0.1, servers bind loopback
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def ray_backend_config(
    num_cpus: int | None = None, client_num_cpus: float = 1.0, object_store_mb: int = 256
) -> dict[str, Any]:
    """Flower's ``backend_config`` for Ray: loopback, no dashboard, bounded resources.

    `num_cpus` (default: all) is what Ray may schedule; each virtual node's ClientApp takes
    `client_num_cpus`, so at most num_cpus / client_num_cpus nodes train at once.
    """
    if num_cpus is not None and (
        isinstance(num_cpus, bool) or not isinstance(num_cpus, int) or num_cpus < 1
    ):
        raise bad_value("num_cpus", num_cpus, "an integer >= 1")
    if isinstance(client_num_cpus, bool) or not isinstance(client_num_cpus, (int, float)):
        raise bad_value("client_num_cpus", client_num_cpus, "a number > 0")
    if not client_num_cpus > 0 or (num_cpus is not None and client_num_cpus > num_cpus):
        raise bad_value("client_num_cpus", client_num_cpus, f"a number in (0, {num_cpus}]")
    if (
        isinstance(object_store_mb, bool)
        or not isinstance(object_store_mb, int)
        or (object_store_mb < 80)
    ):
        raise bad_value("object_store_mb", object_store_mb, "an integer >= 80 (Ray's minimum)")
    init_args: dict[str, Any] = {
        "_node_ip_address": LOOPBACK,
        "include_dashboard": False,
        "object_store_memory": object_store_mb * 1024 * 1024,
    }
    if num_cpus is not None:
        init_args["num_cpus"] = num_cpus
    return {
        "init_args": init_args,
        "client_resources": {"num_cpus": float(client_num_cpus), "num_gpus": 0.0},
    }


def apply_ray_env() -> None:
    """Put `RAY_ENV` into this process's environment (Ray's processes inherit it). Refuses if
    ``ray`` was already imported with cluster mode on, or a Ray instance is running: that
    instance may listen on other addresses than 127.0.0.1."""
    os.environ.update(RAY_ENV)
    if "ray" in sys.modules:
        import ray
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER or ray.is_initialized():
            raise ConfigError(
                "ray was imported (or started) before fedlora could keep it on loopback: "
                "run the simulation in a fresh process, or set "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray"
            )


def run_simulation(
    cfg: ExperimentConfig,
    opts: FlowerOptions,
    *,
    num_cpus: int | None = None,
    client_num_cpus: float = 1.0,
    resume: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run (or with `resume`, continue from its checkpoint) one experiment on Flower's Ray
    simulation runtime; returns the summary (also in <run dir>/summary.json, with
    ``"runtime": "flower"``)."""
    backend_config = ray_backend_config(num_cpus, client_num_cpus)
    apply_ray_env()
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation as flwr_run_simulation

    from fedlora.federation.flower import server_app as server_mod
    from fedlora.federation.flower.client_app import app as client_app

    result: dict[str, Any] = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        kwargs = {"log": log} if log is not None else {}
        result["summary"] = server_mod.run_server(grid, cfg, opts, resume=resume, **kwargs)

    try:
        flwr_run_simulation(
            server_app=app,
            client_app=client_app,
            num_supernodes=cfg.data.n_clients,
            backend_name="ray",
            backend_config=backend_config,
        )
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():  # Flower shuts Ray down on success
            ray.shutdown()
    if "summary" not in result:
        raise RuntimeError("the Flower simulation ended without a summary (see the log above)")
    return result["summary"]
