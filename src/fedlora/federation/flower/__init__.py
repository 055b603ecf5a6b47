"""fedlora on Flower: a ServerApp and a ClientApp that move fedlora's method objects and local
training across Flower's Message API (no algorithm code here; see docs/flower.md).

Components (``[tool.flwr.app.components]`` in pyproject.toml):
``fedlora.federation.flower.server_app:app`` and ``fedlora.federation.flower.client_app:app``.
"""
