"""fedlora's ServerApp on Flower's Message API: the engine's round loop
(`fedlora.federation.engine.run_rounds`), with local training moved to the SuperNodes
(`FlowerTrainer`).

Per round r, exactly as in `fedlora.federation.engine.run_experiment`: the plan comes from
``method.plan_round(r, derive_rng(seed, "sampling", r), derive_rng(seed, "sketch", r))``;
each participant's node gets a ``train`` message (global adapter + task); the replies are
matched to tasks by ``reply.metadata.reply_to_message_id``; ``method.aggregate`` combines the
adapters that came back; `round_cost` advances the simulated clock; metrics.jsonl,
checkpoints, summary.json and the PEFT adapter are written in the engine's format, with one
extra key per round: ``dropouts`` (clients sampled whose update did not arrive). Each node's
measured training time and upload size per round go to ``node_times.csv``
(`append_node_times`; `fedlora profiles fit` reads them).

A dropout contributes nothing (X_n = X for that client). With independent sampling this
biases the aggregate towards reliable clients: E[X^{r+1}] = Σ a_n p_n X_n + (1 − Σ a_n p_n) X
for a node that answers with probability p_n. ``availability = "observed"`` divides each
received weight by the node's observed answer rate p̂_n (a running (s + 1)/(t + 1) estimate),
which restores E[·] = Σ a_n X_n when p̂_n → p_n (docs/flower.md).

With ``privacy.secure_aggregation`` a round goes through SecAgg+ instead
(`fedlora.federation.flower.secure_round`): the server never sees a node's own update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.engine import run_rounds
from fedlora.federation.flower.common import (
    TRAIN,
    FlowerOptions,
    apply_safe_env,
    check_flower_method,
    config_from_run_config,
    exchange,
    record_to_adapter,
    train_content,
)
from fedlora.federation.flower.discovery import discover_nodes, fedlora_record
from fedlora.federation.flower.measured import NODE_TIMES, append_node_times, measured_row
from fedlora.federation.flower.secure_round import SecureRounds
from fedlora.federation.methods.base import RoundPlan
from fedlora.federation.run import entered
from fedlora.federation.rundir import run_dir_for
from fedlora.federation.runstate import build_run
from fedlora.federation.trainer import Trained, Trainer, TrainingDiverged
from fedlora.files import atomic_write, remove_own_file
from fedlora.llm.device import Resolution

apply_safe_env()

from flwr.app import Context, Message  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- messaging


@dataclasses.dataclass
class Availability:
    """Per-client answer counts: p̂_n = (answered + 1) / (asked + 1)."""

    asked: np.ndarray
    answered: np.ndarray

    @classmethod
    def empty(cls, n: int) -> Availability:
        return cls(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))

    def rate(self) -> np.ndarray:
        return (self.answered + 1.0) / (self.asked + 1.0)


def train_remote(
    grid: Grid,
    cfg: ExperimentConfig,
    plan: RoundPlan,
    global_state: dict[str, np.ndarray],
    clients: dict[int, int],
    opts: FlowerOptions,
    log: Log = _stderr,
    measured: list[dict[str, Any]] | None = None,
    base_delta: dict[str, np.ndarray] | None = None,
) -> tuple[list[int], list[dict[str, np.ndarray]], list[float], list[int]]:
    """Send each task to its node; returns (task indices received, adapters, losses, dropouts).
    `measured` (if given) gets one `measured_row` per reply that arrived.

    `base_delta`: the run's sum of merges into the frozen base (FedEx-LoRA's residuals), sent
    as the ``base`` ArrayRecord so that every node trains on the server's base."""
    record = fedlora_record(cfg)
    sent: list[int] = []
    messages: list[Message] = []
    for i, t in enumerate(plan.tasks):
        if t.client not in clients:
            continue
        content = train_content(record, plan, i, global_state, base_delta)
        messages.append(
            Message(
                content,
                clients[t.client],
                TRAIN,
                group_id=str(plan.round + 1),
                ttl=opts.round_timeout_s + 60,
            )
        )
        sent.append(i)
    replies = exchange(grid, messages, opts.round_timeout_s, opts.poll_interval_s)
    got, states, losses = [], [], []
    for j, i in enumerate(sent):
        reply = replies.get(j)
        client = plan.tasks[i].client
        if reply is None:
            log(f"round {plan.round + 1}: client {client} did not answer in time; dropped")
            continue
        if reply.has_error():
            log(f"round {plan.round + 1}: client {client} failed: {reply.error.reason}; dropped")
            continue
        got.append(i)
        states.append(record_to_adapter(reply.content.array_records["adapter"]))
        metrics = reply.content.metric_records["metrics"]
        losses.append(float(metrics["train-loss"]))
        if measured is not None and "train-s" in metrics:
            measured.append(measured_row(cfg, plan, i, clients[client], metrics))
    dropouts = [t.client for i, t in enumerate(plan.tasks) if i not in set(got)]
    return got, states, losses, dropouts


# ----------------------------------------------------------------------------- the loop


def run_server(
    grid: Grid,
    cfg: ExperimentConfig,
    opts: FlowerOptions,
    *,
    resume: bool = False,
    log: Log = _stderr,
) -> dict[str, Any]:
    """The engine's loop over Flower: returns the summary (also written to summary.json).

    The run enters through the run's one entry (`fedlora.federation.run.entered`: check,
    Flower's own check, resolve, lock, delete with ``overwrite``, write), unless
    ``opts.entered`` is set: then a caller in this process (`fedlora flower simulate`)
    entered the run, holds its lock and hands its resolution. With `resume`, continue the run in the
    run directory from its newest readable checkpoint (the engine's resume, `run_rounds`):
    `cfg` must equal the run's saved config (ConfigError naming the differing fields
    otherwise); metrics.jsonl is cut back to the checkpoint's line count; the dropout counts
    of ``availability = "observed"`` are restored.
    """
    wall_start = time.perf_counter()
    run_dir = run_dir_for(cfg, opts.out_dir or None)
    with contextlib.ExitStack() as stack:
        runtime = opts.entered or stack.enter_context(
            entered(
                cfg,
                run_dir,
                resume=resume,
                overwrite=opts.overwrite,
                also_check=check_flower_method,
            )
        )
        if resume:
            remove_own_file(run_dir / "error.txt")
        try:
            return _run_server(grid, runtime, opts, run_dir, wall_start, log, resume=resume)
        except Exception as e:  # leave a trace in the run directory for whoever waits on it
            atomic_write(run_dir / "error.txt", f"{type(e).__name__}: {e}\n".encode())
            raise


def _run_server(
    grid: Grid,
    runtime: Resolution,
    opts: FlowerOptions,
    run_dir: Path,
    wall_start: float,
    log: Log,
    *,
    resume: bool = False,
) -> dict[str, Any]:
    cfg = runtime.cfg
    run = build_run(runtime, run_dir, log=log)
    clients = discover_nodes(grid, cfg, run.fed, opts, log=log)
    if not resume:
        remove_own_file(run_dir / NODE_TIMES)
    trainer = FlowerTrainer(grid, cfg, clients, opts, log, run_dir=run_dir)
    trainer.base_delta = lambda: run.base_delta  # the nodes train on the server's base
    if cfg.privacy.secure_aggregation:
        trainer.secure = SecureRounds(cfg, run, log)
    return run_rounds(
        run, trainer, resume=resume, log=log, wall_start=wall_start, calibration_s=None
    )


class FlowerTrainer(Trainer):
    """The round's tasks sent to the SuperNodes; their adapters aggregated as they arrive.

    A dropout (no answer within round-timeout-s, or an error) contributes nothing; with
    ``availability = "observed"`` each received weight is divided by the node's observed
    answer rate. The answer counts and the dropouts travel in checkpoints ("flower")."""

    trains_here = False  # the SuperNodes train; machine.jsonl records the server's machine

    def __init__(
        self,
        grid: Grid,
        cfg: ExperimentConfig,
        clients: dict[int, int],
        opts: FlowerOptions,
        log: Log,
        run_dir: Path | None = None,
    ) -> None:
        self.grid, self.cfg, self.clients, self.opts, self.log = grid, cfg, clients, opts, log
        self.run_dir = run_dir  # node_times.csv goes there
        self.avail = Availability.empty(cfg.data.n_clients)
        self.total_dropouts = 0
        self.base_delta: Callable[[], dict[str, np.ndarray]] = dict  # set by `_run_server`
        self.secure: SecureRounds | None = None  # set by `_run_server` (secure aggregation)

    def train(self, plan: RoundPlan, global_state: dict[str, np.ndarray]) -> Trained:
        cfg, r = self.cfg, plan.round
        measured: list[dict[str, Any]] = []
        if self.secure is not None:  # aggregated by SecAgg+ (the server sees only the sum)
            observed = self.opts.availability == "observed"  # the rates before this round
            trained = self.secure.train(
                self.grid,
                plan,
                global_state,
                self.clients,
                self.opts,
                fedlora_record(cfg),
                measured,
                base_delta=self.base_delta(),
                rate=self.avail.rate() if observed else None,
            )
            self._count(plan, trained.plan.participants, measured, asked=self.secure.asked)
            return trained
        got, states, losses, dropouts = train_remote(
            self.grid,
            cfg,
            plan,
            global_state,
            self.clients,
            self.opts,
            self.log,
            measured,
            base_delta=self.base_delta(),
        )
        self._count(plan, [plan.tasks[i].client for i in got], measured)
        if not np.all(np.isfinite(losses)):
            bad = [plan.tasks[i].client for i, x in zip(got, losses) if not np.isfinite(x)]
            raise TrainingDiverged(
                f"round {r + 1}: non-finite training loss on client(s) {bad}; "
                f"lower training.lr (now {cfg.training.lr})"
            )
        tasks = [plan.tasks[i] for i in got]
        if self.opts.availability == "observed":
            rate = self.avail.rate()
            tasks = [dataclasses.replace(t, weight=t.weight / rate[t.client]) for t in tasks]
        # the clock counts the updates that arrived (a dropout sends nothing on the uplink)
        return Trained(RoundPlan(r, tuple(tasks)), states, losses, dropouts)

    def _count(
        self, plan: RoundPlan, answered: list[int], measured: list[dict[str, Any]], asked=True
    ) -> None:
        """node_times.csv rows, and the answer counts of the clients asked (all or none)."""
        if self.run_dir is not None:
            append_node_times(self.run_dir, measured)
        if asked:
            np.add.at(self.avail.asked, np.array(plan.participants), 1)
        np.add.at(self.avail.answered, answered, 1)

    def line_fields(self, trained: Trained | None) -> dict[str, Any]:
        dropouts = [] if trained is None else trained.dropouts
        self.total_dropouts += len(dropouts)
        if self.secure is None:
            return {"dropouts": dropouts}
        fields = self.secure.line_fields() if trained is not None else {}
        if trained is not None and trained.losses:  # the engine saw no states: the loss here
            fields["train_loss"] = float(np.mean(trained.losses))
        return {"dropouts": dropouts, **fields}

    def report(self, line: dict[str, Any]) -> None:
        secure = ""
        if "secagg_skipped" in line:
            done = "skipped" if line["secagg_skipped"] else "summed"
            secure = f" secagg={done} (skipped so far: {line['secagg_skipped_rounds']})"
        self.log(
            f"round {line['round']}: n={line['n_participants']} dropouts={line['dropouts']} "
            f"loss={line['train_loss']}{secure}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "flower": {
                "asked": self.avail.asked.tolist(),
                "answered": self.avail.answered.tolist(),
                "total_dropouts": self.total_dropouts,
                **({"secagg_skipped_rounds": self.secure.skipped_rounds} if self.secure else {}),
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        flower = state.get("flower") or {}
        if "asked" in flower:
            self.avail = Availability(
                np.asarray(flower["asked"], dtype=np.int64),
                np.asarray(flower["answered"], dtype=np.int64),
            )
        self.total_dropouts = int(flower.get("total_dropouts", 0))
        if self.secure is not None:
            self.secure.skipped_rounds = int(flower.get("secagg_skipped_rounds", 0))

    def summary_fields(self) -> dict[str, Any]:
        return {
            "runtime": "flower",
            "total_dropouts": self.total_dropouts,
            "availability": self.opts.availability,
            **({"secagg_skipped_rounds": self.secure.skipped_rounds} if self.secure else {}),
        }


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``[tool.flwr.app.components] serverapp``."""
    apply_safe_env()
    cfg, opts = config_from_run_config(dict(context.run_config))
    run_dir = run_dir_for(cfg, opts.out_dir or None)
    _stderr(f"fedlora on Flower: run directory {Path(run_dir).resolve()}")
    summary = run_server(grid, cfg, opts)
    _stderr(json.dumps(summary))
