"""fedlora on Flower: a ServerApp and a ClientApp that move fedlora's method objects and local
training across Flower's Message API (no algorithm code here; see docs/flower.md).

Components (``[tool.flwr.app.components]`` in pyproject.toml):
``fedlora.federation.flower.server_app:app`` and ``fedlora.federation.flower.client_app:app``.
"""

from fedlora.federation.flower.common import (
    SAFE_ENV,
    FlowerOptions,
    apply_safe_env,
    config_from_run_config,
    safe_env,
)
from fedlora.federation.flower.deploy import LocalDeployment
from fedlora.federation.flower.worker import LOOPBACK

__all__ = [
    "LOOPBACK",
    "SAFE_ENV",
    "FlowerOptions",
    "LocalDeployment",
    "apply_safe_env",
    "config_from_run_config",
    "safe_env",
]
