"""The planner study (README.md here): its spec, rule, runner, statistics and report."""
