"""Client-level DP end to end on a tiny random-init model: `fedlora run privacy.mode=central
privacy.noise_multiplier=1.0` records every client's ε per round; σ = 0 with a bound no update
reaches is the run without DP bit for bit; a resumed DP run draws the same noise."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import rdp_reference as ref
from fedlora.cli import main
from fedlora.config import load_config
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.run import prepare_run_dir, run_experiment
from tiny_runs import TINY_FOUR_CLIENTS

pytest.importorskip("dp_accounting")
DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

Q = [0.5, 0.5, 0.3, 0.9]
TINY = [
    *TINY_FOUR_CLIENTS,
    "training.rounds=3",
    "training.eval_every=3",
    "training.lr=0.05",
    f"method.q={Q}",
    "method.k=[2, 4, 1, 3]",
]
PRIVACY_FIELDS = ("epsilon", "dp_update_norms", "dp_update_norm_median", "dp_clipped_fraction")
DP = ['privacy.mode="central"', "privacy.noise_multiplier=1.0", "privacy.clip_norm=0.01"]


def _run(run_dir: Path, *extra: str, resume: bool = False) -> dict:
    cfg = load_config(None, [*TINY, *extra])
    if not resume:
        prepare_run_dir(cfg, run_dir)
    return run_experiment(cfg, run_dir, resume=resume, quiet=True, log=lambda m: None)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir)["global"]


def _same_adapter(a: Path, b: Path) -> bool:
    x, y = _adapter(a), _adapter(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _without_times(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "compute_s"} for line in lines]


@needs_data
def test_fedlora_run_with_central_privacy_records_every_clients_epsilon(tmp_path, capsys):
    out = tmp_path / "dp"
    assert main(["run", "-q", "--out", str(out), *TINY, *DP]) == 0
    captured = capsys.readouterr()
    terminal = captured.out
    lines = _lines(out)
    assert "epsilon" not in lines[0]  # round 0: nothing released yet
    for r, line in enumerate(lines[1:], start=1):  # every client at its own q_n, r rounds
        for eps, q in zip(line["epsilon"], Q):  # against RDP computed from the paper
            lo, hi = ref.poisson_bounds(q, 1.0, r, 1e-5)
            assert lo * (1 - 1e-9) <= eps <= hi * (1 + 1e-9) and eps == pytest.approx(lo, rel=3e-3)
        assert len(line["dp_update_norms"]) == line["n_participants"]  # one per participant
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == lines[-1]["epsilon"]
    assert summary["privacy"]["largest_epsilon"] == max(lines[-1]["epsilon"])
    assert summary["privacy"]["epsilon_budget"] is None
    segment = {"mode": "central", "noise_multiplier": 1.0, "clip_norm": 0.01, "sampling": "poisson"}
    assert summary["privacy"]["history"] == [{"rounds": [1, 3], **segment}]
    assert f"ε max {max(lines[-1]['epsilon']):.3g} (client 3)" in terminal
    adapter = _adapter(out)  # the final checkpoint holds the adapter
    # the noise's line: d = every entry of A and B (the rounds train both), m = Σ q_n = 2.2
    d = sum(v.numel() for k, v in adapter.items() if k.endswith((".lora_A", ".lora_B")))
    expected = f"z·√d/m = 1·√{d:,}/2.2 = {math.sqrt(d) / 2.2:.3g} (above 1: the noise outweighs"
    assert d > 0 and captured.err.count(expected) == 1  # once, after the first noised round


@needs_data
def test_zero_noise_with_a_bound_no_update_reaches_is_the_run_without_privacy(tmp_path):
    _run(tmp_path / "plain")
    _run(tmp_path / "dp0", 'privacy.mode="central"', "privacy.noise_multiplier=0",
         "privacy.clip_norm=1e9")  # fmt: skip
    assert _same_adapter(tmp_path / "plain", tmp_path / "dp0")
    plain, dp0 = _lines(tmp_path / "plain"), _lines(tmp_path / "dp0")
    assert all(e is None for e in dp0[-1]["epsilon"])  # σ = 0: no finite ε
    assert all(x["dp_clipped_fraction"] in (0, None) for x in dp0[1:])  # none reaches 1e9
    assert all(x["dp_update_norm_median"] > 0 for x in dp0[1:] if x["n_participants"])
    assert _without_times(plain) == [
        {k: v for k, v in line.items() if k not in PRIVACY_FIELDS} for line in _without_times(dp0)
    ]
    _run(tmp_path / "dp", *DP)  # and the noise does change the adapter
    assert not _same_adapter(tmp_path / "plain", tmp_path / "dp")


@needs_data
def test_a_resumed_private_run_draws_the_same_noise(tmp_path):
    _run(tmp_path / "full", *DP)
    _run(tmp_path / "part", *DP, "training.rounds=1")
    _run(tmp_path / "part", *DP, resume=True)
    assert _same_adapter(tmp_path / "full", tmp_path / "part")
    keys = ("round", "participants", "k", "train_loss", "epsilon", "eval_accuracy")
    full, part = _lines(tmp_path / "full"), _lines(tmp_path / "part")
    # the part run also evaluated its last round, 1: the lines agree on what both record
    assert [[x.get(k) for k in keys] for x in full[2:]] == [
        [x.get(k) for k in keys] for x in part[2:]
    ]
    assert [x["epsilon"] for x in full[1:]] == [x["epsilon"] for x in part[1:]]


@needs_data
@pytest.mark.parametrize(("name", "mode"), [("fedavg", "central"), ("rolora", "local")])
def test_m_of_n_methods_account_without_replacement_or_per_participation(tmp_path, name, mode):
    extra = [f'method.name="{name}"', f'privacy.mode="{mode}"', "method.clients_per_round=2"]
    _run(tmp_path / name, *extra, "privacy.clip_norm=0.05", "training.rounds=2")
    lines = _lines(tmp_path / name)
    for r, line in enumerate(lines[1:], start=1):
        if mode == "central":  # 2 of 4 without replacement at σ/2, every client alike
            want = ref.wor_upper_epsilon(0.5, 0.5, r, 1e-5)
            assert line["epsilon"] == pytest.approx([want] * 4, rel=1e-6)
        else:  # each client: the rounds it took part in, the Gaussian at σ/2, no amplification
            took_part = [sum(n in x["participants"] for x in lines[1 : r + 1]) for n in range(4)]
            want = [ref.gaussian_epsilon_reference(0.5, c, 1e-5) if c else 0.0 for c in took_part]
            assert line["epsilon"] == pytest.approx(want, rel=1e-9)
