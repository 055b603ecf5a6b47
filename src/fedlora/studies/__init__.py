"""Studies built on runs: experiment suites (experiments) and their reports (report).
See docs/architecture.md."""
