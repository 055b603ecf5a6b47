"""Issue 38: a method owns its facts. Whether its aggregate is a sum (and how it samples),
whether its weights are normalised, whether SecAgg+ masks its updates and whether it runs on
Flower are class attributes of the method (`Method.dp_sampling`, `dp_refusal`,
`normalised_weights`, `secagg_masked`, `flower_refusal`, and the hooks `check_privacy` and
`check_flower`): a method from outside the package gets differential privacy by declaring
them, and no method name is left in the config layer, the Flower runtime or the privacy
module."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import (
    Aggregation,
    ClientTask,
    Method,
    MethodContext,
    RoundPlan,
)
from fedlora.federation.methods.registry import check_method_config, method_class
from fedlora.federation.privacy_mechanisms.registry import privacy_names
from fedlora.system.sketch import unbiased_aggregate
from tiny_runs import DATA, TINY_FOUR_CLIENTS

SRC = Path(__file__).resolve().parents[1] / "src" / "fedlora"

# the facts as the lists of names held them before issue 38 (config/privacy_section.py,
# federation/privacy.py, federation/flower/secagg.py and common.py)
SAMPLING = {
    "sketched": "independent",
    "proposed": "independent",
    "fedavg": "uniform",
    "fslora": "uniform",
    "ffalora": "uniform",
    "heterolora": "uniform",
    "rolora": "uniform",
    "fedsb": "uniform",
}
REFUSES_DP = ("flexlora", "fedstacklora", "fedexlora", "fedsalora", "centralized", "local")
NORMALISED = ("fedavg", "ffalora", "heterolora", "rolora", "fedsb")
MASKED = ("heterolora",)
NOT_ON_FLOWER = ("centralized", "local", "fedstacklora", "fedsalora")


class EveryClientMean(Method):
    """A method from outside the package: every client every round, the data-weighted mean
    of their updates, X + Σ (a_n / Σ a) (X_n − X). It declares its facts and nothing else."""

    delta_aggregate = True
    dp_sampling = "uniform"  # m = N of N: every client, every round
    normalised_weights = True

    @classmethod
    def from_config(cls, ctx: MethodContext) -> EveryClientMean:
        return cls(ctx.a, ctx.gamma)

    def __init__(self, a: np.ndarray, gamma: int) -> None:
        self.a, self.gamma = np.asarray(a, dtype=float), gamma

    def plan_round(self, round_index, rng_sampling, rng_sketch) -> RoundPlan:
        full = np.ones(self.gamma)
        tasks = (ClientTask(n, full, self.gamma, float(w)) for n, w in enumerate(self.a))
        return RoundPlan(round_index, tuple(tasks))

    def aggregate(self, global_state, plan, client_states) -> Aggregation:
        w = np.array([t.weight for t in plan.tasks])
        return Aggregation(unbiased_aggregate(global_state, client_states, w / w.sum()))


class Undeclared(EveryClientMean):
    """The same method, declaring nothing about privacy (the base's defaults)."""

    dp_sampling = None
    normalised_weights = False


class SaysWhyNot(Undeclared):
    dp_refusal = "its aggregate is a median, which clipping does not bound"


@pytest.fixture
def outside(method_registry):
    """The three methods registered for the test only (conftest's `method_registry`)."""
    method_registry(
        every_client_mean=EveryClientMean, undeclared=Undeclared, says_why_not=SaysWhyNot
    )


def test_the_built_in_methods_declare_the_facts_the_lists_of_names_held():
    for name, sampling in SAMPLING.items():
        assert method_class(name).dp_sampling == sampling, name
    for name in REFUSES_DP:
        cls = method_class(name)
        assert cls.dp_sampling is None and cls.dp_refusal, name
    builtin = set(SAMPLING) | set(REFUSES_DP)
    assert {n for n in builtin if method_class(n).normalised_weights} == set(NORMALISED)
    assert {n for n in builtin if method_class(n).secagg_masked} == set(MASKED)
    assert {n for n in builtin if method_class(n).flower_refusal} == set(NOT_ON_FLOWER)


def test_a_method_that_declares_nothing_refuses_privacy_naming_the_trait(outside, capsys):
    for extra in (['privacy.mode="central"'], ["privacy.secure_aggregation=true"]):
        with pytest.raises(ConfigError) as info:
            check_method_config(load_config(None, ["method.name=undeclared", *extra]))
        msg = str(info.value)
        assert "method.name = 'undeclared'" in msg
        assert "Undeclared.dp_sampling is None" in msg and "'uniform'" in msg
        assert "every_client_mean" in msg  # the methods that accept it, the new one among them
    assert main(["config", "show", "method.name=undeclared", 'privacy.mode="local"']) == 2
    err = capsys.readouterr().err
    assert "privacy.mode = 'local' is invalid with method.name = 'undeclared'" in err
    assert "dp_sampling" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="its aggregate is a median, which clipping"):
        check_method_config(load_config(None, ["method.name=says_why_not", "privacy.mode=local"]))
    check_method_config(load_config(None, ["method.name=undeclared"]))  # without privacy: fine


def test_a_bad_sampling_trait_is_refused_naming_the_class(outside, monkeypatch):
    monkeypatch.setattr(EveryClientMean, "dp_sampling", "poisson")
    cfg = load_config(None, ["method.name=every_client_mean", "privacy.mode=central"])
    with pytest.raises(ConfigError, match=r"EveryClientMean.dp_sampling = 'poisson' is invalid"):
        check_method_config(cfg)


def test_built_in_refusals_keep_their_messages():
    cfg = load_config(None, ["method.name=flexlora", "privacy.mode=central"])
    with pytest.raises(ConfigError) as info:
        check_method_config(cfg)
    assert str(info.value).startswith(
        "privacy.mode = 'central' is invalid with method.name = 'flexlora': its aggregate is "
        "a truncated SVD of the clients' products, not a sum of their adapter updates; "
        "differential privacy needs one of "
    )
    cfg = load_config(None, ["method.name=heterolora", "method.heterolora.pruning=0.5",
                             "privacy.mode=central"])  # fmt: skip
    with pytest.raises(ConfigError, match="the self-pruning schedule is decided from the"):
        check_method_config(cfg)
    cfg = load_config(None, ["method.name=heterolora", "method.heterolora.pruning=0.5",
                             "privacy.secure_aggregation=true"])  # fmt: skip
    with pytest.raises(ConfigError, match="the self-pruning schedule needs each client's own"):
        check_method_config(cfg)
    with pytest.raises(ConfigError, match="use one of the two"):  # the config layer's own
        load_config(None, ["privacy.mode=central", "privacy.secure_aggregation=true"])


def test_flower_asks_the_class(outside):
    from fedlora.federation.flower.common import check_flower_method

    for name, why in [
        ("fedstacklora", "its merged base update is not sent to the nodes; use `fedlora run`"),
        ("fedsalora", "each client's own B is kept by the engine's client memory, and "),
    ]:
        with pytest.raises(ConfigError) as info:
            check_flower_method(load_config(None, [f"method.name={name}"]))
        assert str(info.value).startswith(
            f"method.name = {name!r} is not supported on Flower: {why}"
        )
    with pytest.raises(ConfigError, match=r"method.name = 'proposed' with method.q = 'fixed'"):
        check_flower_method(load_config(None, ["method.name=proposed", 'method.q="fixed"']))
    check_flower_method(load_config(None, ["method.name=every_client_mean"]))  # the default
    masked = load_config(None, ["method.name=heterolora", "privacy.secure_aggregation=true"])
    assert check_flower_method(masked) is None and method_class("heterolora").secagg_masked


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_a_method_from_outside_the_package_runs_with_central_privacy(outside, tmp_path):
    pytest.importorskip("dp_accounting")
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(
        None,
        [*TINY_FOUR_CLIENTS, "training.rounds=2", "training.eval_every=2", "lora.layers=1",
         "training.lr=0.05", "method.name=every_client_mean", 'privacy.mode="central"',
         "privacy.noise_multiplier=1.0", "privacy.clip_norm=0.05"],
    )  # fmt: skip
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2]
    assert [m["participants"] for m in lines[1:]] == [[0, 1, 2, 3]] * 2
    eps = [m["epsilon"] for m in lines[1:]]
    # every client takes part every round (rate 1): the same ε for all, growing by round
    assert all(len(set(e)) == 1 and math.isfinite(e[0]) and e[0] > 0 for e in eps)
    assert eps[1][0] > eps[0][0]
    assert summary["privacy"]["epsilon"] == eps[-1]


def _constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of `tree` that are neither a docstring nor a default value of
    `MethodConfig`'s fields (``method.name``'s default is the config's choice, not a fact
    about a method)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))  # a docstring (or a bare string statement)
        if isinstance(node, ast.ClassDef) and node.name == "MethodConfig":
            skip.update(id(s.value) for s in node.body if isinstance(s, ast.AnnAssign))
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
    ]


def test_no_method_name_is_left_below_the_methods():
    # 'local' is also a value of privacy.mode, which is not a method's name
    names = (set(SAMPLING) | set(REFUSES_DP)) - set(privacy_names())
    files = [
        *sorted((SRC / "config").rglob("*.py")),
        *sorted((SRC / "federation" / "flower").rglob("*.py")),
        SRC / "federation" / "privacy.py",
    ]
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _constants(tree):
            if node.value in names:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert found == []
