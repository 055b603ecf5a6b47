"""planner.probe_q: the in-run probes' two sampling rates (default 0.3, 0.15), validated,
and used by `proposed`'s probe rounds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods.proposed_replan import probe_settings

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))


def test_default_is_the_papers_rates():
    cfg = load_config(None, [])
    assert cfg.planner.probe_q == (0.3, 0.15)
    assert probe_settings(8, cfg.planner.probe_q) == [(0.3, 8), (0.15, 8), (0.3, 2), (0.15, 2)]


def test_custom_rates_are_the_probe_settings():
    cfg = load_config(None, ["planner.probe_q=[0.05, 0.02]"])
    assert cfg.planner.probe_q == (0.05, 0.02)
    assert probe_settings(4, cfg.planner.probe_q) == [(0.05, 4), (0.02, 4), (0.05, 1), (0.02, 1)]


@pytest.mark.parametrize(
    "value",
    ["[0.15, 0.3]", "[0.3, 0.3]", "[0.3]", "[0.3, 0.15, 0.1]", "[1.5, 0.1]", "[0.3, 0]",
     "[0.3, -0.1]"],
)  # fmt: skip
def test_bad_rates_are_refused_naming_the_field(value, capsys):
    with pytest.raises(ConfigError, match=r"planner\.probe_q.*two sampling rates in \(0, 1\]"):
        load_config(None, [f"planner.probe_q={value}"])
    assert main(["config", "show", f"planner.probe_q={value}"]) == 2
    err = capsys.readouterr().err
    assert "planner.probe_q" in err and "Traceback" not in err


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_probe_rounds_run_at_the_configured_rates(tmp_path):
    from fedlora.federation.run import run as run_entry

    cfg = load_config(
        None,
        [
            "model.name=tiny-llama", "model.dtype=fp32", "model.threads=1",
            f'data.data_dir="{DATA}"', 'data.tasks=["arc-e", "boolq"]', "data.train_limit=64",
            "data.eval_limit=8", "data.max_seq_len=96", "data.n_clients=8",
            "data.min_client_examples=4", "lora.rank=4", 'lora.layers="all"',
            "training.rounds=5", "training.local_steps=1", "training.batch_size=2",
            "training.slots=2", "training.eval_every=5", "training.lr=0.05",
            "method.name=proposed", "planner.probe_rounds=1", "planner.probe_q=[1.0, 0.5]",
            "output.progress=false",
        ],
    )  # fmt: skip
    run_entry(cfg, tmp_path / "run", quiet=True, log=lambda m: None)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    probes = plan["calibration"]["probes"]
    assert [p["q"][0] for p in probes] == [1.0, 0.5, 1.0, 0.5]
    assert [p["k"][0] for p in probes] == [4, 4, 1, 1]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sampled = {m["round"]: m["n_participants"] for m in lines if m.get("round", 0) >= 1}
    # q = 1: every one of the 8 clients is sampled in probe rounds 1 and 3
    assert sampled[1] == 8 and sampled[3] == 8


DP = [
    "method.name=proposed",
    "data.n_clients=1000",
    "lora.rank=8",
    "privacy.mode=central",
    "privacy.noise_multiplier=0.604",
    "privacy.delta=1e-5",
    "planner.max_epsilon=8",
]


def _ledger_eps(rounds: list[tuple[float, int]]) -> float:
    """Client 0's ε(1e-5) by the ledger itself: `count` rounds at each q, σ = 0.604."""
    from fedlora.system.privacy_ledger import PrivacyLedger, RoundSetting

    ledger = PrivacyLedger(1000)
    for q, count in rounds:
        for _ in range(count):
            ledger.record(RoundSetting("central", 0.604, 1.0, "poisson"), "poisson", [q] * 1000)
    return ledger.epsilons(1e-5)[0]


def test_probes_over_the_budget_are_refused_before_the_run(tmp_path, capsys):
    from fedlora.federation.methods.proposed import Proposed

    # 4 probe rounds per setting: 8 rounds at q = 0.3 and 8 at q = 0.15 (k does not count)
    expect = _ledger_eps([(0.3, 8), (0.15, 8)])
    assert 19.0 < expect < 19.2  # research/privacy_cohort's N = 1,000, ε = 8 setting
    assert _ledger_eps([(0.3, 1)]) > 6.8  # one probe round alone is most of the budget
    cfg = load_config(None, DP)
    with pytest.raises(ConfigError) as e:
        Proposed.check_run(cfg)
    msg = str(e.value)
    assert "planner.probe_q = [0.3, 0.15] with planner.probe_rounds = 4" in msg
    assert f"spends ε = {expect:.3g} on client 0" in msg and "planner.max_epsilon = 8" in msg
    # the CLI: exit 2, one message, no traceback, before any model or data is loaded
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *DP]) == 2
    err = capsys.readouterr().err
    assert "planner.probe_q" in err and "Traceback" not in err


def test_probes_within_the_budget_run():
    from fedlora.federation.methods.proposed import Proposed

    # 1 round per setting at q = 0.02, 0.01: 2 rounds each
    assert _ledger_eps([(0.02, 2), (0.01, 2)]) <= 8
    Proposed.check_run(load_config(None, [*DP, "planner.probe_q=[0.02, 0.01]",
                                          "planner.probe_rounds=1"]))  # fmt: skip
    # the same probes, spent past a budget just under their ε: refused
    eps = _ledger_eps([(0.02, 2), (0.01, 2)])
    with pytest.raises(ConfigError, match="planner.probe_rounds = 1 spends"):
        Proposed.check_run(load_config(None, [*DP, "planner.probe_q=[0.02, 0.01]",
                                              "planner.probe_rounds=1",
                                              f"planner.max_epsilon={eps * 0.99}"]))  # fmt: skip


def test_probe_cycles_count_in_the_budget_check():
    from fedlora.federation.methods.proposed import Proposed

    # 1 round per setting at q = 0.02, 0.01: within ε = 8 for one cycle; a budget between
    # one cycle's ε and three cycles' is refused with planner.probe_cycles = 3 (every cycle
    # the run may probe), naming the key and the three cycles' ε
    one, three = _ledger_eps([(0.02, 2), (0.01, 2)]), _ledger_eps([(0.02, 6), (0.01, 6)])
    assert one < three
    budget = (one + three) / 2
    base = [*DP, "planner.probe_q=[0.02, 0.01]", "planner.probe_rounds=1",
            f"planner.max_epsilon={budget}"]  # fmt: skip
    Proposed.check_run(load_config(None, base))
    with pytest.raises(ConfigError) as e:
        Proposed.check_run(load_config(None, [*base, "planner.probe_cycles=3"]))
    msg = str(e.value)
    assert "planner.probe_rounds = 1 and planner.probe_cycles = 3 spends" in msg
    assert f"ε = {three:.3g} on client 0" in msg
