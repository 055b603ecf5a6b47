"""Federated runs: the round loop (engine), the run directory (rundir), the methods'
aggregation rules (methods) and the Flower deployment (flower). See docs/architecture.md."""
