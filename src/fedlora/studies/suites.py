"""The suites of `fedlora compare`: each suite's labels and the overrides each label applies on
top of the suite file's config (`fedlora.studies.experiments` runs them). An override's value
``$section.key`` is the suite file's own value of that key (before the label's overrides)."""

from __future__ import annotations

# label -> overrides applied on top of the suite file's config
EXACT = "network.comm_cost=exact"
METHOD_SUITE = tuple(  # the `methods` suite's non-planned methods
    "fedavg fslora heterolora flexlora fedstacklora ffalora fedsalora fedexlora rolora fedsb".split()
)
Q_FIXED = ("method.q=fixed", "method.q_fixed=0.2")  # q = 0.2 (Figure 3, and Figure 2's fixed)
SUITES: dict[str, dict[str, tuple[str, ...]]] = {
    "table1": {
        # the paper's Algorithm 2: four separate calibration runs (not fedlora's in-run default)
        "proposed": ("method.name=proposed", "planner.optimize=qk", "planner.calibration=separate"),
        "fslora": ("method.name=fslora",),
        "heterolora": ("method.name=heterolora",),
        "fedstacklora": ("method.name=fedstacklora",),
        # the same training with the downlink free (the paper's clock): FedStackLoRA's
        # stacked download grows with the participants, so it is reported both ways
        "fedstacklora-free-downlink": ("method.name=fedstacklora", "network.downlink_rate_bps=0"),
        "flexlora": ("method.name=flexlora",),
    },
    "sampling": {
        "proposed-q": (
            "method.name=proposed",
            "planner.optimize=q",
            "method.k=full",
            "planner.calibration=separate",
        ),
        "full": ("method.name=sketched", "method.q=full", "method.k=full"),
        "fixed-0.2": ("method.name=sketched", *Q_FIXED, "method.k=full"),
        "uniform": ("method.name=sketched", "method.q=uniform", "method.k=full"),
        "weighted": ("method.name=sketched", "method.q=weighted", "method.k=full"),
    },
    "ranks": {
        "proposed-k": (
            "method.name=proposed",
            "planner.optimize=k",
            *Q_FIXED,
            "planner.calibration=separate",
        ),
        "full": ("method.name=sketched", "method.k=full", *Q_FIXED),
        "normal": ("method.name=sketched", "method.k=normal", *Q_FIXED),
        "uniform": ("method.name=sketched", "method.k=uniform", *Q_FIXED),
    },
    # every federated method on one setting: the paper's, its baselines and the
    # aggregation rules published after FSLoRA (docs/methods.md)
    # (on the exact clock: their savings are in the bits they send, and the rank-based cost
    # models charge every full-rank method the full adapter's time)
    "methods": {
        "proposed": ("method.name=proposed", "planner.optimize=qk", EXACT),
        **{name: (f"method.name={name}", EXACT) for name in METHOD_SUITE},
    },
}
# `references`: the suite file's own method beside the two references at its budget
# (docs/methods.md, "References"); BUDGET_OF_BASE takes the suite file's method.name
BUDGET_OF_BASE = "method.budget_of=$method.name"
SUITES["references"] = {
    "federated": (),
    "centralized": ("method.name=centralized", BUDGET_OF_BASE),
    "local": ("method.name=local", BUDGET_OF_BASE),
}
TITLES = {
    "table1": "Table I: time to target accuracy",
    "sampling": "Figure 2: sampling probabilities q (k = γ)",
    "ranks": "Figure 3: sketch sizes k (q = 0.2)",
    "methods": "Every method: time to target accuracy",
    "references": "The federated method beside centralized and local training at its budget",
}
