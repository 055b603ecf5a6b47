"""The paper's mathematics, numpy only, no torch and no I/O: sketching and aggregation
(sketch), the wireless network and the round time (network), the q/k planner (planner).
See docs/architecture.md."""
