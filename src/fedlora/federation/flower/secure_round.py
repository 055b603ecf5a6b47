"""A round of the Flower runtime under ``privacy.secure_aggregation`` (docs/privacy.md):
the server learns the sum of the participants' weighted updates and nothing else of them.

`SecureRounds.train` sends each task with its aggregation weight w_n and the list of tensors
every participant sends (`fedlora.federation.flower.secagg_node`), runs SecAgg+
(`fedlora.federation.flower.secagg.secure_sum`) and applies the method's aggregate to the
unmasked sum S = Σ_n w_n Δ_n:

    X ← X + S        (the normalised means: X + S / Σ_{n sent} w_n, so that the weights of
                     the updates that arrived sum to 1, as the plain path renormalises)

through the method's own `server_step` (its aggregate of the single state X + S with weight
1, which every method whose aggregate is a sum of updates maps to X + S, then the server
optimizer). A round with fewer participants than ``privacy.secagg_threshold``, or whose
protocol stopped because too few nodes answered a stage, is skipped: the adapter is
unchanged and the round counted in ``secagg_skipped_rounds``.

Metrics line keys (only with secure aggregation): ``secagg_skipped`` (this round),
``secagg_skipped_rounds`` (so far), ``secagg_clipped`` (entries of this round's weighted
updates beyond ±``privacy.secagg_clipping_range``, which the quantizer clips: each node
counts its own; a warning asks to raise the range) and ``secagg_padding_bits``: the bits the zero padding
adds to this round's uplink (every participant sends every rank component of the round's
factors, at network.bits_per_param each, instead of its own payload; the simulated clock
still charges the payload alone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.flower.common import FlowerOptions, train_content
from fedlora.federation.flower.measured import measured_row
from fedlora.federation.flower.secagg import (
    SecAggSettings,
    padding_params,
    secure_sum,
    secure_weights,
    update_keys,
)
from fedlora.federation.flower.secagg_node import CLIP, KEYS, MASK, WEIGHT
from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.round_steps import apply_aggregate
from fedlora.federation.trainer import Trained

Log = Callable[[str], None]


def sum_plan(plan: RoundPlan, factors: str, gamma: int) -> RoundPlan:
    """The one-task plan whose aggregate of [X + S] is X + S for every method whose
    aggregate is a sum of updates: weight 1, every rank component, the round's factors."""
    client = plan.tasks[0].client if plan.tasks else 0
    return RoundPlan(plan.round, (ClientTask(client, np.ones(gamma), gamma, 1.0, factors),))


def aggregate_sum(
    method: Any,
    global_state: dict[str, np.ndarray],
    plan: RoundPlan,
    keys: list[str],
    total: list[np.ndarray],
    gamma: int,
) -> tuple[RoundPlan, dict[str, np.ndarray]]:
    """(the plan, the state) that `method.server_step` turns into X + S."""
    state = dict(global_state)
    for k, s in zip(keys, total):
        x = global_state[k]
        state[k] = (x.astype(np.float64) + s).astype(x.dtype)
    factors = "".join(sorted({f for t in plan.tasks for f in t.trains})) or "AB"
    return sum_plan(plan, factors, gamma), state


class SecureRounds:
    """The secure rounds of one Flower run (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig, run: Any, log: Log) -> None:
        p = cfg.privacy
        self.cfg, self.run, self.log = cfg, run, log
        self.settings = SecAggSettings(p.secagg_threshold, float(p.secagg_clipping_range))
        self.skipped_rounds = 0
        self.skipped = False
        self.asked = True  # whether the last round asked its nodes
        self.padding_bits = 0
        self.clipped = 0  # entries clipped by the quantizer in the last round

    def train(
        self,
        grid: Any,
        plan: RoundPlan,
        global_state: dict[str, np.ndarray],
        clients: dict[int, int],
        opts: FlowerOptions,
        record: Any,
        measured: list[dict[str, Any]],
        base_delta: dict[str, np.ndarray] | None = None,
        rate: np.ndarray | None = None,
    ) -> Trained:
        """Train and securely aggregate round `plan`; the aggregate is applied here (the
        returned `Trained` has no states; its plan: the tasks whose update was summed).
        `rate` (N,): ``availability = "observed"``'s answer rates, each weight divided by
        its client's (the rates counted before this round: a node needs its weight first)."""
        cfg, method, r = self.cfg, self.run.method, plan.round
        if rate is not None:
            plan = RoundPlan(
                r, tuple(replace(t, weight=t.weight / rate[t.client]) for t in plan.tasks)
            )
        weights = secure_weights(method, [t.weight for t in plan.tasks])
        factors = "".join(sorted({f for t in plan.tasks for f in t.trains})) or "AB"
        keys = update_keys(global_state, factors)
        contents, task_of = {}, {}
        for i, t in enumerate(plan.tasks):
            if t.client not in clients:
                continue
            content = train_content(record, plan, i, global_state, base_delta)
            task = content.config_records["task"]
            task[WEIGHT], task[KEYS] = float(weights[i]), keys
            task[MASK] = bool(method.secagg_masked)  # zero-padded to its ranks
            task[CLIP] = self.settings.clipping_range
            contents[clients[t.client]], task_of[clients[t.client]] = content, i
        out = secure_sum(
            grid, contents, self.settings, str(r + 1), opts.round_timeout_s, opts.poll_interval_s
        )
        got = sorted(task_of[n] for n in out.summed)
        losses, self.clipped = [], 0
        for n in sorted(out.replies, key=lambda n: task_of[n]):
            metrics = out.replies[n].content.metric_records["metrics"]
            losses.append(float(metrics["train-loss"]))
            self.clipped += int(metrics.get("secagg-clipped", 0))
            if "train-s" in metrics:
                measured.append(measured_row(cfg, plan, task_of[n], n, metrics))
        sent = RoundPlan(r, tuple(plan.tasks[i] for i in got))
        # who did not answer (a round with too few participants asks no one)
        asked = set(task_of.values()) if out.asked else set()
        dropouts = [
            t.client
            for i, t in enumerate(plan.tasks)
            if i not in got and (i in asked or t.client not in clients)
        ]
        self.skipped, self.asked = out.total is None, out.asked
        if self.clipped:
            self.log(
                f"round {r + 1}: {self.clipped} entries of the weighted updates were beyond "
                f"privacy.secagg_clipping_range = {self.settings.clipping_range} and clipped; "
                "raise it (docs/privacy.md)"
            )
        vector = sum(int(np.prod(global_state[k].shape)) for k in keys)
        uplinks = [method.payload(t, self.run.shapes, sent).uplink_params for t in sent.tasks]
        self.padding_bits = round(padding_params(vector, uplinks) * cfg.network.bits_per_param)
        if out.total is None:
            self.skipped_rounds += 1
            self.log(f"round {r + 1}: secure aggregation skipped ({out.reason}); adapter unchanged")
            return Trained(sent, [], losses, dropouts)
        total = out.total
        if method.normalised_weights:  # the weights of the updates that arrived sum to 1
            total = [s / float(np.sum(weights[got])) for s in total]
        sum_p, state = aggregate_sum(method, global_state, sent, keys, total, cfg.lora.rank)
        apply_aggregate(self.run, sum_p, global_state, [state])
        return Trained(sent, [], losses, dropouts)

    def line_fields(self) -> dict[str, Any]:
        return {
            "secagg_skipped": self.skipped,
            "secagg_skipped_rounds": self.skipped_rounds,
            "secagg_padding_bits": self.padding_bits,
            "secagg_clipped": self.clipped,
        }
