"""The one registration idiom (issue 38): a privacy mechanism, a clipping rule, a tracker is one
class registered by name (`fedlora.config.registry.Registry`), from fedlora or from outside it
(here: this file, and an installed package's entry point). No name of a mechanism is known to
the config layer or to `fedlora.federation.privacy`."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.config.registry import Registry
from fedlora.errors import ConfigError
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.methods.registry import check_method_config
from fedlora.federation.privacy_mechanisms.base import PrivacyMechanism
from fedlora.federation.privacy_mechanisms.central import CentralPrivacy
from fedlora.federation.privacy_mechanisms.registry import (
    CLIPPINGS,
    MECHANISMS,
    PRIVACY_GROUP,
    privacy_class,
    privacy_names,
    register_privacy,
)
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.tracking import TRACKER_REGISTRY, Tracker
from fedlora.system.privacy import UNPROTECTED
from fedlora.system.privacy_ledger import RoundSetting
from tiny_runs import DATA, TINY_FOUR_CLIENTS

SRC = Path(__file__).resolve().parents[1] / "src" / "fedlora"
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
TINY = [*TINY_FOUR_CLIENTS, "training.rounds=2", "training.eval_every=2", "training.lr=0.05",
        "method.q=[0.5, 0.5, 0.3, 0.9]", "method.k=[2, 4, 1, 3]"]  # fmt: skip
CLIP = "privacy.clip_norm=0.01"  # below the tiny run's update norms: every update is clipped


class ClipOnly(PrivacyMechanism):
    """A mechanism from outside fedlora, in one class: the base's clipping of each weighted
    update, no noise; its rounds are accounted as released without a guarantee, and it logs
    the round's largest norm before clipping."""

    log_fields = (*PrivacyMechanism.log_fields, "dp_largest_norm")

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.privacy.noise_multiplier != 0:
            raise ConfigError(
                f"privacy.noise_multiplier = {cfg.privacy.noise_multiplier!r} is invalid with "
                "privacy.mode = 'clip_only': allowed: 0 (it adds no noise)"
            )

    def account(self, ledger, method, sent) -> None:
        setting = RoundSetting(self.name, 0.0, self.clip_norm, UNPROTECTED)
        ledger.record(setting, UNPROTECTED, np.ones(self.n_clients))

    def round_fields(self, ledger, method, norms) -> dict[str, Any]:
        return {
            **super().round_fields(ledger, method, norms),
            "dp_largest_norm": max(norms, default=None),
        }


class Recorder(Tracker):
    """A tracker from outside fedlora: it keeps every step's scalars."""

    steps: ClassVar[list[tuple[int, dict]]] = []

    def open(self, cfg, run_dir, *, resume, next_step) -> None:
        self.steps.clear()

    def log_metrics(self, step, values) -> None:
        self.steps.append((step, values))

    def close(self, *, failed) -> None:
        pass


@pytest.fixture
def clip_only():
    with MECHANISMS.registered("clip_only", ClipOnly):
        yield ClipOnly
    assert "clip_only" not in privacy_names()


def _run(run_dir: Path, *extra: str) -> list[dict]:
    cfg = load_config(None, [*TINY, *extra])
    check_method_config(cfg)  # the boundary a config passes to become a run
    prepare_run_dir(cfg, run_dir)
    run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir)["global"]


def test_the_registry_names_the_field_and_every_allowed_name():
    reg: Registry[int] = Registry("section.thing", "fedlora.no_such_group", kind="thing")
    assert reg.register("one")(1) == 1 and reg.add("two", 2) == 2 and reg.add("one", 1) == 1
    assert reg.names() == ("one", "two") and reg.get("two") == 2 and reg.find("three") is None
    with pytest.raises(
        ConfigError, match=r"^section.thing = 'three' is invalid: allowed: one, two$"
    ):
        reg.get("three")
    with pytest.raises(ConfigError, match=r"^other.field = 'three' is invalid"):
        reg.get("three", "other.field")
    with pytest.raises(ValueError, match="thing 'one' is already registered"):
        reg.add("one", 3)
    with reg.registered("three", 3):
        assert reg.get("three") == 3
    reg.unregister("one")
    assert reg.names() == ("two",)


def test_an_outside_mechanism_is_one_registered_class(clip_only):
    assert privacy_names() == ("none", "central", "clip_only", "local")
    assert privacy_class("clip_only") is ClipOnly and ClipOnly.name == "clip_only"
    with pytest.raises(ConfigError, match="privacy.noise_multiplier = 1.0 is invalid with"):
        check_method_config(load_config(None, ['privacy.mode="clip_only"']))
    with pytest.raises(ConfigError, match=r"planner.max_epsilon = 3.0 is invalid: .* 'central'"):
        check_method_config(
            load_config(None, ['privacy.mode="clip_only"', "planner.max_epsilon=3"])
        )
    with pytest.raises(ValueError, match="already registered"):
        register_privacy("central")(ClipOnly)
    with pytest.raises(TypeError, match="PrivacyMechanism subclass"):
        register_privacy("not_one")(int)


def test_an_unknown_mechanism_is_refused_where_a_config_becomes_a_run():
    cfg = load_config(None, ['privacy.mode="clip_only"'])  # the config layer: an identifier
    with pytest.raises(ConfigError, match=r"privacy.mode = 'clip_only' is invalid: allowed: none"):
        check_method_config(cfg)
    with pytest.raises(ConfigError, match=r"privacy.clipping = 'auto' is invalid: allowed: "):
        check_method_config(load_config(None, ['privacy.clipping="auto"']))
    with pytest.raises(ConfigError, match="privacy.mode = 'no mode' is invalid"):
        load_config(None, ["privacy.mode='no mode'"])


def _strings(path: Path) -> list[ast.Constant]:
    """The string constants of a module that are not docstrings nor a config field's default
    (``clipping: str = "fixed"`` is the config's choice, not a fact about the rule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))
        if isinstance(node, ast.ClassDef):
            skip.update(id(s.value) for s in node.body if isinstance(s, ast.AnnAssign))
    return [
        n for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
    ]  # fmt: skip


def test_no_mechanism_name_is_in_the_config_layer_or_the_privacy_steps():
    # "fixed" is also a value of planner.estimation_matrix and method.q_strategy
    names = {*privacy_names(), *CLIPPINGS.names()} - {"none", "fixed"}
    files = [*sorted((SRC / "config").glob("*.py")), SRC / "federation" / "privacy.py"]
    files += sorted((SRC / "federation" / "flower").glob("*.py"))
    found = [
        f"{p.name}:{n.lineno}: {n.value!r}"
        for p in files
        for n in _strings(p)
        if n.value in names or any(f"'{name}'" in n.value for name in names)
    ]
    assert found == []


THIRD_PARTY = """
from fedlora.federation.privacy_mechanisms.central import CentralPrivacy


class Twice(CentralPrivacy):
    pass
"""


def test_a_mechanism_comes_from_its_entry_point(tmp_path, monkeypatch):
    (tmp_path / "fake_privacy.py").write_text(THIRD_PARTY, encoding="utf-8")
    info = tmp_path / "fake_privacy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-privacy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{PRIVACY_GROUP}]\ntwice = fake_privacy:Twice\nbroken = fake_privacy:Missing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert {"twice", "broken"} <= set(privacy_names())  # listed without being imported
        cls = privacy_class("twice")
        assert issubclass(cls, CentralPrivacy) and cls.name == "twice"
        check_method_config(load_config(None, ['privacy.mode="twice"']))
        with pytest.raises(ConfigError, match="broken.*fake_privacy:Missing.*failed to load"):
            check_method_config(load_config(None, ['privacy.mode="broken"']))
    finally:
        MECHANISMS.unregister("twice")


@needs_data
def test_a_tiny_run_with_an_outside_mechanism_and_tracker(tmp_path, clip_only):
    with TRACKER_REGISTRY.registered("recorder", Recorder):
        lines = _run(tmp_path / "clip", 'privacy.mode="clip_only"', "privacy.noise_multiplier=0",
                     CLIP, 'output.trackers=["recorder"]')  # fmt: skip
    plain = _run(tmp_path / "plain")
    # its effect: the central mechanism's clipping without noise, bit for bit, not the plain run
    _run(tmp_path / "central0", 'privacy.mode="central"', "privacy.noise_multiplier=0", CLIP)
    clip, central0 = _adapter(tmp_path / "clip"), _adapter(tmp_path / "central0")
    assert all(torch.equal(clip[k], central0[k]) for k in clip)
    assert not all(torch.equal(clip[k], _adapter(tmp_path / "plain")[k]) for k in clip)
    # its log fields: the mechanism's, each round, and nothing else beside the plain run's
    for line, bare in zip(lines[1:], plain[1:]):
        assert set(line) - set(bare) == set(ClipOnly.log_fields)
        assert line["epsilon"] == [None] * 4  # no noise: no guarantee
        if line["n_participants"]:
            assert line["dp_largest_norm"] == max(line["dp_update_norms"]) > 0.01
    summary = json.loads((tmp_path / "clip" / "summary.json").read_text())["privacy"]
    assert summary["mode"] == "clip_only" and summary["largest_epsilon"] is None
    assert [s["mode"] for s in summary["history"]] == ["clip_only"]
    # the tracker registered through the same helper got every line, its field among them
    assert [step for step, _ in Recorder.steps] == [0, 1, 2]
    assert [v["dp_largest_norm"] for _, v in Recorder.steps[1:]] == [
        x["dp_largest_norm"] for x in lines[1:]
    ]
