"""Secure aggregation on Flower (SecAgg+): the protocol driven by fedlora's server against
Flower's own `secaggplus_mod`, the sum it yields, the methods' aggregates of that sum, and the
settings' checks. Flower's runtime is replaced by an in-process grid here (the end-to-end
simulation is in test_secagg_flower.py)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.flower.common import train_content
from fedlora.federation.flower.secagg import (
    SecAggSettings,
    secure_sum,
    secure_weights,
    update_keys,
)
from fedlora.federation.flower.secagg_node import (
    KEYS,
    MASK,
    WEIGHT,
    secagg_mod,
    secure_content,
    weighted_update,
)
from fedlora.federation.flower.secure_round import aggregate_sum
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import RoundPlan
from fedlora.federation.methods.registry import check_method_config, method_class, method_names

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict  # isort: skip
from flwr.common import bytes_to_ndarray  # isort: skip
from flwr.common.secure_aggregation.secaggplus_constants import Stage  # isort: skip

GAMMA = 4


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """What Flower's runtime sets in a ServerApp's process before it makes messages."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _adapter(rng: np.random.Generator, factors: str = "AB") -> dict[str, np.ndarray]:
    shapes = {"A": (GAMMA, 6), "B": (5, GAMMA), "R": (GAMMA, GAMMA)}
    return {
        f"m{j}.lora_{f}": rng.normal(size=shapes[f]).astype(np.float32)
        for j in range(2)
        for f in factors
    }


class LoopGrid:
    """A Grid whose nodes answer at once in this process, each with its own Context (so
    Flower's SecAgg+ state persists across stages as a SuperNode keeps it): `handle(message,
    context)` gives the reply. A node in `drop` gives no answer from that SecAgg+ stage on."""

    def __init__(self, contexts: dict[int, Context], handle, drop=None) -> None:
        self.contexts, self.handle, self.drop = contexts, handle, dict(drop or {})
        self.replies: list[Message] = []
        self.pushed = 0
        self.masked: dict[int, list[bytes]] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(msg.metadata.message_id)
            self.pushed += 1
            node = msg.metadata.dst_node_id
            configs = msg.content.config_records.get("secaggplus_configs", {})
            stage = configs.get("stage")
            stages = list(Stage.all())
            if node in self.drop and stages.index(stage) >= stages.index(self.drop[node]):
                continue
            reply = self.handle(msg, self.contexts[node])
            if stage == Stage.COLLECT_MASKED_VECTORS:
                self.masked[node] = reply.content.config_records["secaggplus_configs"][
                    "masked_params"
                ]
            self.replies.append(reply)
        return ids

    def pull_messages(self, ids):
        ids = set(ids)
        out = [r for r in self.replies if r.metadata.reply_to_message_id in ids]
        self.replies = [r for r in self.replies if r not in out]
        return out


def _node_grid(adapters: dict[int, dict[str, np.ndarray]], drop=None) -> LoopGrid:
    """Nodes that run Flower's SecAgg+ mod around a "training" that returns a fixed adapter."""

    def train(msg: Message, ctx: Context) -> Message:
        task = dict(msg.content.config_records["task"])
        glob = {k: v.numpy() for k, v in msg.content.array_records["adapter"].items()}
        metrics = MetricRecord({"train-loss": 1.0})
        content = secure_content(task, glob, adapters[ctx.node_id], metrics)
        return Message(content, reply_to=msg)

    contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in adapters}
    return LoopGrid(contexts, lambda msg, ctx: secagg_mod(msg, ctx, train), drop)


def _round(global_state, adapters, weights, settings, drop=None, method="sketched"):
    """SecAgg+ over nodes 11, 12, ... holding `adapters`; returns (the sum, the grid)."""
    from fedlora.federation.methods.base import ClientTask

    keys = update_keys(global_state, "AB")
    plan = RoundPlan(
        0, tuple(ClientTask(i, np.ones(GAMMA), GAMMA, w) for i, w in enumerate(weights))
    )
    contents = {}
    for i, _ in enumerate(adapters):
        content = train_content(ConfigRecord({"config-toml": ""}), plan, i, global_state)
        task = content.config_records["task"]
        task[WEIGHT], task[KEYS], task[MASK] = float(weights[i]), keys, False
        contents[11 + i] = content
    grid = _node_grid({11 + i: a for i, a in enumerate(adapters)}, drop)
    return secure_sum(grid, contents, settings, "1", timeout_s=0.3, poll_s=0.01), grid, keys


def test_the_secure_sum_is_the_weighted_sum_within_the_quantization_error() -> None:
    # Prepare: three nodes, updates of a few 0.1s, weights as a sketched round's a_n/q_n
    rng = np.random.default_rng(0)
    glob = _adapter(rng)
    adapters = [
        {k: v + 0.1 * rng.normal(size=v.shape).astype(np.float32) for k, v in glob.items()}
        for _ in range(3)
    ]
    weights = [0.5, 1.5, 2.0]
    settings = SecAggSettings(threshold=2, clipping_range=2.0)
    # Execute
    out, grid, keys = _round(glob, adapters, weights, settings)
    # Assert: Σ w_n Δ_n, each entry within K grid steps (stochastic rounding: < 1 step each)
    want = [
        sum(w * (a[k].astype(np.float64) - glob[k]) for w, a in zip(weights, adapters))
        for k in keys
    ]
    assert out.total is not None and out.summed == [11, 12, 13]
    for got, ref in zip(out.total, want):
        assert np.max(np.abs(got - ref)) < 3 * settings.step
        assert np.max(np.abs(ref)) > 1000 * settings.step  # the test is not vacuous
    # Assert: what a node sent is masked (uniform over 2^32, not its quantized update)
    sent = bytes_to_ndarray(grid.masked[11][1])  # the first tensor (after the weight)
    assert sent.shape == glob[keys[0]].shape and sent.max() > 2**30 and sent.min() >= 0


def test_a_node_dropping_after_sharing_its_keys_is_unmasked_out_of_the_sum() -> None:
    rng = np.random.default_rng(1)
    glob = _adapter(rng)
    adapters = [
        {k: v + 0.05 * rng.normal(size=v.shape).astype(np.float32) for k, v in glob.items()}
        for _ in range(4)
    ]
    weights = [1.0, 1.0, 1.0, 1.0]
    settings = SecAggSettings(threshold=2, clipping_range=1.0)
    out, _, keys = _round(
        glob, adapters, weights, settings, drop={13: Stage.COLLECT_MASKED_VECTORS}
    )
    assert out.total is not None and out.summed == [11, 12, 14]
    want = [
        sum(a[k].astype(np.float64) - glob[k] for j, a in enumerate(adapters) if j != 2)
        for k in keys
    ]
    for got, ref in zip(out.total, want):
        assert np.max(np.abs(got - ref)) < 3 * settings.step


@pytest.mark.parametrize(
    ("n_nodes", "threshold", "drop", "pushed"),
    [(2, 3, None, 0), (3, 3, {13: Stage.COLLECT_MASKED_VECTORS}, 3 + 3 + 3)],
)
def test_too_few_participants_stop_the_protocol_before_any_sum(n_nodes, threshold, drop, pushed):
    rng = np.random.default_rng(2)
    glob = _adapter(rng)
    adapters = [dict(glob) for _ in range(n_nodes)]
    out, grid, _ = _round(glob, adapters, [1.0] * n_nodes, SecAggSettings(threshold, 1.0), drop)
    assert out.total is None and "threshold" in out.reason
    assert grid.pushed == pushed  # fewer than the threshold at the start: nothing is sent


def test_the_weighted_update_is_zero_outside_the_trained_components() -> None:
    glob = {
        "m.lora_A": np.zeros((3, 2)),
        "m.lora_B": np.zeros((2, 3)),
        "m.lora_R": np.zeros((3, 3)),
    }
    new = {k: np.ones_like(v) for k, v in glob.items()}
    a, b, r = weighted_update(glob, new, ["m.lora_A", "m.lora_B", "m.lora_R"], 2.0, [1, 0, 3])
    assert a.tolist() == [[2, 2], [0, 0], [2, 2]]
    assert b.tolist() == [[2, 0, 2], [2, 0, 2]]
    assert r.tolist() == [[2, 0, 2], [0, 0, 0], [2, 0, 2]]


@pytest.mark.parametrize("name", [n for n in method_names() if method_class(n).dp_sampling])
def test_every_sum_method_aggregates_the_sum_as_its_own_aggregate(name: str) -> None:
    # Prepare: the method, a round's plan, clients that moved the factors they train
    overrides = [
        f'method.name="{name}"',
        "data.n_clients=3",
        f"lora.rank={GAMMA}",
        "privacy.secure_aggregation=true",
    ]
    if name in ("sketched", "fslora"):
        overrides += ["method.q=[0.9, 0.8, 0.7]", "method.k=[1, 2, 3]"]
    if name == "heterolora":
        overrides += ["method.ranks=[1, 2, 4]"]
    if name == "proposed":
        pytest.skip("proposed is sketched with a plan's q and k (covered by sketched)")
    cfg = load_config(None, overrides)
    rng = np.random.default_rng(3)
    method = make_method(cfg, np.array([0.2, 0.3, 0.5]), rng)
    glob = method.initial_state(_adapter(rng, "AB"))
    if name == "fedsb":
        glob = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in glob.items()}
    plan = method.plan_round(1, np.random.default_rng(4), np.random.default_rng(5))
    assert plan.tasks
    states = []
    for t in plan.tasks:
        moved = update_keys(glob, t.trains)
        states.append(
            {
                k: v + (0.1 * rng.normal(size=v.shape)).astype(v.dtype) if k in moved else v
                for k, v in glob.items()
            }
        )
    # Execute: the plain aggregate, and the one from the sum of the weighted updates
    plain = method.server_step(glob, plan, states).global_state
    factors = "".join(sorted({f for t in plan.tasks for f in t.trains}))
    keys = update_keys(glob, factors)
    weights = secure_weights(method, [t.weight for t in plan.tasks])
    masked = method.secagg_masked
    total = [
        sum(
            weighted_update(glob, s, [k], w, t.scale if masked else None)[0]
            for s, w, t in zip(states, weights, plan.tasks)
        )
        for k in keys
    ]
    sum_plan, state = aggregate_sum(method, glob, plan, keys, total, GAMMA)
    secure = method.server_step(glob, sum_plan, [state]).global_state
    # Assert
    assert set(secure) == set(plain)
    for k in plain:
        np.testing.assert_allclose(secure[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.allclose(plain[k], glob[k]) for k in keys)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("privacy.secure_aggregation=1", "privacy.secure_aggregation"),
        ("privacy.secagg_threshold=1", "privacy.secagg_threshold"),
        ("privacy.secagg_threshold=1024", "privacy.secagg_threshold"),
        ("privacy.secagg_clipping_range=0", "privacy.secagg_clipping_range"),
        ('privacy.mode="central"', "privacy.mode"),
    ],
)
def test_bad_secure_aggregation_settings_exit_2_naming_the_field(capsys, override, field):
    assert main(["config", "show", "privacy.secure_aggregation=true", override]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["flexlora", "fedstacklora", "fedexlora", "fedsalora"])
def test_a_method_whose_aggregate_is_not_a_sum_refuses_secure_aggregation(capsys, name):
    assert main(["config", "show", "privacy.secure_aggregation=true", f'method.name="{name}"']) == 2
    err = capsys.readouterr().err
    assert "privacy.secure_aggregation" in err and name in err and "a sum" in err
    with pytest.raises(ConfigError, match=r"method\.heterolora\.pruning"):
        check_method_config(
            load_config(
                None,
                [
                    "privacy.secure_aggregation=true",
                    'method.name="heterolora"',
                    "method.heterolora.pruning=0.5",
                ],
            )
        )


def test_an_in_process_run_refuses_secure_aggregation_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "privacy.secure_aggregation=true"]) == 2
    err = capsys.readouterr().err
    assert "privacy.secure_aggregation" in err and "flower" in err.lower()
    assert not out.exists()


def test_a_node_counts_the_entries_its_quantizer_will_clip() -> None:
    from fedlora.federation.flower.secagg_node import CLIP

    glob = {"m.lora_A": np.zeros((2, 3)), "m.lora_B": np.zeros((3, 2))}
    new = {
        "m.lora_A": np.array([[0.1, -0.3, 0.2], [0.0, 0.5, -0.05]]),
        "m.lora_B": np.zeros((3, 2)),
    }
    task = {KEYS: ["m.lora_A", "m.lora_B"], WEIGHT: 2.0, MASK: False, CLIP: 0.5, "scale": [1, 1]}
    content = secure_content(task, glob, new, MetricRecord({"train-loss": 1.0}))
    # 2·Δ beyond ±0.5: -0.6 and 1.0
    assert content.metric_records["metrics"]["secagg-clipped"] == 2
    assert content.metric_records["fitres.num_examples"]["num_examples"] == 1


def test_flower_refuses_a_threshold_no_round_can_reach() -> None:
    from fedlora.federation.flower.common import check_flower_method

    cfg = load_config(None, ["privacy.secure_aggregation=true", "data.n_clients=3"])
    check_flower_method(cfg)  # the default threshold 2: fine
    bad = load_config(
        None, ["privacy.secure_aggregation=true", "privacy.secagg_threshold=4", "data.n_clients=3"]
    )
    with pytest.raises(ConfigError, match="privacy.secagg_threshold = 4"):
        check_flower_method(bad)
