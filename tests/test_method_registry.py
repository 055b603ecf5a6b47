"""The method registry (issue 22): a method is one file that registers itself; third-party
methods come from the ``fedlora.methods`` entry-point group; `make_method` looks the name up;
a method checks its own ``method.*`` fields. No torch needed."""

from __future__ import annotations

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods import make_method, registry
from fedlora.federation.methods.base import Method
from fedlora.federation.methods.fedavg import FedAvg
from fedlora.federation.methods.fedstacklora import FedStackLoRA
from fedlora.federation.methods.flexlora import FlexLoRA
from fedlora.federation.methods.fslora import FSLoRA
from fedlora.federation.methods.heterolora import HeteroLoRA
from fedlora.federation.methods.proposed import Proposed
from fedlora.federation.methods.ranks import resolve_ranks
from fedlora.federation.methods.registry import (
    ENTRY_POINT_GROUP,
    check_method_config,
    method_class,
    method_names,
    register_method,
)
from fedlora.federation.methods.sketched import Sketched
from fedlora.federation.methods.strategies import resolve_k, resolve_q

BUILTIN = {
    "fedavg": FedAvg,
    "fedstacklora": FedStackLoRA,
    "flexlora": FlexLoRA,
    "fslora": FSLoRA,
    "heterolora": HeteroLoRA,
    "proposed": Proposed,
    "sketched": Sketched,
}


@pytest.fixture
def clean_registry():
    """Methods a test registers are gone after it."""
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_every_builtin_method_registers_itself():
    assert set(BUILTIN) <= set(method_names())
    for name, cls in BUILTIN.items():
        assert method_class(name) is cls and cls.name == name


def test_an_unknown_name_names_the_field_the_value_and_the_methods():
    cfg = load_config(None, ["method.name=fedprox"])  # the config layer checks the type only
    with pytest.raises(ConfigError) as info:
        check_method_config(cfg)
    msg = str(info.value)
    assert "method.name = 'fedprox' is invalid: allowed: " in msg
    assert all(name in msg for name in BUILTIN)
    with pytest.raises(ConfigError, match="method.name = 'fedprox'"):
        make_method(cfg, np.full(20, 0.05), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="method.name = 'fed prox' is invalid"):
        load_config(None, ["method.name='fed prox'"])


def test_cli_rejects_an_unknown_method_with_exit_code_2(capsys):
    assert main(["config", "show", "method.name=fedprox"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "method.name = 'fedprox' is invalid" in err
    assert "Traceback" not in err


def test_each_method_checks_its_own_options_whatever_the_method_name():
    with pytest.raises(ConfigError, match=r"method.fslora.k = 'paper' is invalid: allowed: "):
        check_method_config(load_config(None, ['method.fslora.k="paper"']))
    with pytest.raises(ConfigError, match="method.heterolora.pruning = 1.5"):
        check_method_config(
            load_config(None, ["method.name=fedavg", "method.heterolora.pruning=1.5"])
        )


def _ctx_args(n: int = 4):
    return np.full(n, 1.0 / n), np.random.default_rng(7)


@pytest.mark.parametrize("ranks", ["uniform", "capability"])
def test_make_method_builds_what_the_old_if_ladder_built(ranks):
    """Bit-identical to the constructors with the same draws from the same generator."""
    common = ["data.n_clients=4", "lora.rank=8", f"method.ranks={ranks!r}", "method.k=normal"]
    tau = np.array([1.0, 2.0, 3.0, 4.0])
    for name in ("fslora", "heterolora", "flexlora", "fedstacklora", "sketched", "fedavg"):
        for fslora_k in ("reference", "ranks"):
            cfg = load_config(None, [*common, f"method.name={name}", f"method.fslora.k={fslora_k}"])
            a, rng = _ctx_args()
            got = make_method(cfg, a, rng, tau_full_s=tau)
            a, rng = _ctx_args()
            r = resolve_ranks(ranks, n=4, gamma=8, rng=rng, tau_full_s=tau)
            if name == "fslora":
                k = rng.integers(4, 9, size=4) if fslora_k == "reference" else r
                assert got.k.tolist() == k.tolist()
            elif name == "sketched":
                q = resolve_q("fixed", a=a, q_fixed=0.2)
                k = resolve_k("normal", n=4, gamma=8, rng=np.random.default_rng(7))
                assert got.q.tolist() == q.tolist() and got.k.tolist() == k.tolist()
            elif name == "fedavg":
                assert got.ranks.tolist() == [8] * 4
            else:
                assert got.ranks.tolist() == r.tolist()
            assert type(got) is BUILTIN[name]


class Halves(Method):
    """A toy method: every client, weight 1/2 each, the mean of two."""

    delta_aggregate = True

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.method.clients_per_round == 3:
            raise ConfigError("method.clients_per_round = 3 is invalid: not for halves")

    @classmethod
    def from_config(cls, ctx):
        inst = cls()
        inst.n = ctx.a.size
        return inst


def test_the_decorator_registers_a_method_make_method_builds(clean_registry):
    register_method("halves")(Halves)
    assert "halves" in method_names() and Halves.name == "halves"
    cfg = load_config(None, ["method.name=halves", "data.n_clients=3"])
    method = make_method(cfg, np.full(3, 1 / 3), np.random.default_rng(0))
    assert isinstance(method, Halves) and method.n == 3
    # its own check runs for every config, whatever method.name is
    with pytest.raises(ConfigError, match="not for halves"):
        check_method_config(load_config(None, ["method.clients_per_round=3"]))
    with pytest.raises(ValueError, match="already registered"):
        register_method("fedavg")(Halves)
    with pytest.raises(TypeError, match="Method subclass"):
        register_method("notamethod")(int)


def _fake_distribution(tmp_path, monkeypatch, value: str, module_text: str) -> None:
    """An installed package `fake_methods` whose entry point ``halves2`` is `value`."""
    (tmp_path / "fake_methods.py").write_text(module_text, encoding="utf-8")
    info = tmp_path / "fake_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nhalves2 = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


THIRD_PARTY = """
from fedlora.federation.methods.base import Method


class Third(Method):
    @classmethod
    def from_config(cls, ctx):
        return cls()
"""


def test_a_third_party_method_comes_from_its_entry_point(tmp_path, monkeypatch, clean_registry):
    _fake_distribution(tmp_path, monkeypatch, "fake_methods:Third", THIRD_PARTY)
    assert "halves2" in method_names()  # listed without being imported
    cfg = load_config(None, ["method.name=halves2"])
    method = make_method(cfg, np.full(20, 0.05), np.random.default_rng(0))
    assert type(method).__name__ == "Third" and method.name == "halves2"


def test_a_broken_entry_point_is_a_config_error(tmp_path, monkeypatch, clean_registry):
    _fake_distribution(tmp_path, monkeypatch, "fake_methods:Missing", THIRD_PARTY)
    with pytest.raises(ConfigError, match="halves2.*fake_methods:Missing.*failed to load"):
        check_method_config(load_config(None, ["method.name=halves2"]))
