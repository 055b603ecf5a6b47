"""Adaptive clipping (Andrew et al. 2021, issue 40 item 1): the clip follows a target quantile of
the participants' weighted update norms by a geometric step, the count of unclipped updates is
released with its own noise, and the accounting covers that release: the sum's noise
multiplier is what the count leaves of the configured z, σ_Δ = (z^-2 − (2σ_b)^-2)^-1/2, so the
pair is one Gaussian mechanism at z. Checked against RDP computed from the paper
(tests/rdp_reference.py): composing the two releases' RDP by hand gives z's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import rdp_reference as ref
from fedlora.cli import main
from fedlora.config import load_config
from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.methods.registry import method_class
from fedlora.federation.privacy import make_privacy
from fedlora.federation.privacy_mechanisms.base import PrivacyMechanism
from fedlora.system.privacy import next_clip, sum_noise_multiplier
from fedlora.system.seeding import derive_rng
from tiny_runs import DATA, TINY_FOUR_CLIENTS

pytest.importorskip("dp_accounting")
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

Q = [0.5, 0.5, 0.3, 0.9]
ADAPTIVE = [
    'privacy.mode="central"',
    'privacy.clipping="adaptive"',
    "privacy.clip_norm=0.01",
    "privacy.clip_count_noise=1.0",
    "privacy.target_quantile=0.5",
    "privacy.clip_learning_rate=0.2",
]
TINY = [
    *TINY_FOUR_CLIENTS,
    "training.eval_every=100",
    "training.lr=0.05",
    f"method.q={Q}",
    "method.k=[2, 4, 1, 3]",
]


def test_the_sums_noise_multiplier_leaves_the_pair_one_gaussian_at_z():
    # z = 1, σ_b = 1: σ_Δ^-2 = 1 − 1/4, σ_Δ = 2/√3
    assert sum_noise_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3))
    assert sum_noise_multiplier(0.0, 1.0) == 0.0  # no noise at all
    z, sb = 1.3, 2.0
    s_sum = sum_noise_multiplier(z, sb)
    for alpha in (1.5, 2, 8, 32):  # RDP of the sum (sensitivity 1) + of the count (1/2)
        both = ref.gaussian_rdp(s_sum, alpha) + ref.gaussian_rdp(2 * sb, alpha)
        assert both == pytest.approx(ref.gaussian_rdp(z, alpha), rel=1e-12)
    # and over the rounds, in (ε, δ): the composition is the Gaussian at z, not at σ_Δ
    composed = {
        a: 10 * (ref.gaussian_rdp(s_sum, a) + ref.gaussian_rdp(2 * sb, a)) for a in ref.ORDERS
    }
    assert ref.epsilon_from_rdp(composed, 1e-5) == pytest.approx(
        ref.gaussian_epsilon_reference(z, 10, 1e-5), rel=1e-12
    )
    assert ref.gaussian_epsilon_reference(s_sum, 10, 1e-5) < ref.gaussian_epsilon_reference(
        z, 10, 1e-5
    )


def test_the_geometric_step_by_hand():
    assert next_clip(0.5, 0.9, 0.5, 0.2) == pytest.approx(0.5 * math.exp(-0.08))  # shrinks
    assert next_clip(0.5, 0.1, 0.5, 0.2) == pytest.approx(0.5 * math.exp(0.08))  # grows
    assert next_clip(0.5, 0.5, 0.5, 0.2) == 0.5


def _privacy(*extra: str) -> PrivacyMechanism:
    cfg = load_config(None, ["data.n_clients=4", f"method.q={Q}", *ADAPTIVE, *extra])
    return make_privacy(cfg, method_class(cfg.method.name))


class _Method:
    q = np.array(Q)


def test_a_round_releases_the_noised_count_and_moves_the_clip():
    dp = _privacy()
    g = {"m.lora_A": np.zeros((2, 3)), "m.lora_B": np.zeros((3, 2))}
    small = {"m.lora_A": np.full((2, 3), 1e-3), "m.lora_B": np.zeros((3, 2))}
    big = {"m.lora_A": np.full((2, 3), 1.0), "m.lora_B": np.zeros((3, 2))}
    plan = RoundPlan(5, tuple(ClientTask(i, np.ones(2), 2, 1.0) for i in range(3)))
    dp.clip(g, plan, [small, small, big])  # two within C = 0.01, one above
    dp.noise(g, dict(g), plan)
    noise = derive_rng(0, "privacy_count", 5).normal(0.0, 1.0)
    fraction = (2 * 0.5 - 0.5 + noise) / sum(Q) + 0.5  # Σ(b_n − 1/2) + N(0, σ_b²), over E[m]
    fields = dp.adapt(_Method())
    assert fields == {"dp_clip": 0.01, "dp_unclipped_fraction": pytest.approx(fraction)}
    assert dp.clip_norm == pytest.approx(0.01 * math.exp(-0.2 * (fraction - 0.5)))
    assert dp.adapt(_Method())["dp_unclipped_fraction"] is None  # nothing released since


def test_the_noise_has_the_adjusted_deviations_on_the_sum_and_the_count():
    dp = _privacy("privacy.noise_multiplier=1.5", "privacy.clip_count_noise=3.0")
    s_sum = (1.5**-2 - 6.0**-2) ** -0.5
    g = {"m.lora_A": np.zeros((64, 256)), "m.lora_B": np.zeros((256, 64))}
    out = dp.noise(g, dict(g), RoundPlan(0, (ClientTask(0, np.ones(64), 64, 1.0),)))
    assert float(np.std(out["m.lora_A"])) == pytest.approx(s_sum * 0.01, rel=0.02)
    counts = []
    for r in range(2000):  # empty rounds of independent sampling release the count too
        dp.clip(g, RoundPlan(r, ()), [])
        dp.noise(g, g, RoundPlan(r, ()))
        counts.append(dp.count)
    assert float(np.std(counts)) == pytest.approx(3.0, rel=0.05)


def test_local_adaptive_clipping_noises_each_bit_and_accounts_the_gaussian_at_half_z():
    dp = _privacy('privacy.mode="local"')
    g = {"m.lora_A": np.zeros((2, 3)), "m.lora_B": np.zeros((3, 2))}
    small = {"m.lora_A": np.full((2, 3), 1e-3), "m.lora_B": np.zeros((3, 2))}
    plan = RoundPlan(2, (ClientTask(1, np.ones(2), 2, 1.0), ClientTask(3, np.ones(2), 2, 1.0)))
    dp.clip(g, plan, [small, small])
    noises = [derive_rng(0, "privacy_count", 2, n + 1).normal(0.0, 1.0) for n in (1, 3)]
    assert dp.count == pytest.approx(2 * 0.5 + sum(noises))
    # the pair (u + N(0, σ_Δ²C²), b − 1/2 + N(0, σ_b²)), any two data sets 2C and 1 apart:
    # RDP α·(2/σ_Δ)²/2 + α·(1/σ_b)²/2 = that of the Gaussian at z/2
    s_sum = sum_noise_multiplier(1.0, 1.0)
    for alpha in (2, 10):
        pair = ref.gaussian_rdp(s_sum / 2, alpha) + ref.gaussian_rdp(1.0, alpha)
        assert pair == pytest.approx(ref.gaussian_rdp(0.5, alpha), rel=1e-12)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@needs_data
def test_a_tiny_adaptive_run_moves_its_clip_and_accounts_the_counts_release(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["run", "-q", "--out", str(full), *TINY, *ADAPTIVE, "training.rounds=4"]) == 0
    lines = _lines(full)[1:]
    clips = [x["dp_clip"] for x in lines]
    assert clips[0] == 0.01 and len(set(clips)) == len(clips)  # a new C every round
    for line, after in zip(lines, clips[1:] + [None]):  # C' = C·exp(−η(b̃ − γ)), as logged
        fraction = line["dp_unclipped_fraction"]
        if after is not None:
            assert after == pytest.approx(line["dp_clip"] * math.exp(-0.2 * (fraction - 0.5)))
        norms = line["dp_update_norms"]  # the clipped share is at the round's own C
        if norms:
            assert line["dp_clipped_fraction"] == sum(n > line["dp_clip"] for n in norms) / len(
                norms
            )
    s_sum = 2 / math.sqrt(3)  # z = 1, σ_b = 1
    for eps, q in zip(lines[-1]["epsilon"], Q):  # the Poisson-subsampled Gaussian at z
        lo, hi = ref.poisson_bounds(q, 1.0, 4, 1e-5)
        assert lo * (1 - 1e-9) <= eps <= hi * (1 + 1e-9)
        assert eps > ref.poisson_bounds(q, s_sum, 4, 1e-5)[1]  # more than the sum alone
    summary = json.loads((full / "summary.json").read_text())["privacy"]
    assert summary["clipping"] == "adaptive"
    assert summary["sum_noise_multiplier"] == pytest.approx(s_sum)
    assert [s["clip_norm"] for s in summary["history"]] == clips
    # a resumed run goes on from the clip the last round left
    assert main(["run", "-q", "--out", str(part), *TINY, *ADAPTIVE, "training.rounds=2"]) == 0
    assert main(["run", "-q", "--resume", str(part), "--force", "training.rounds=4"]) == 0
    assert [x["dp_clip"] for x in _lines(part)[1:]] == clips


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("privacy.target_quantile=0", "privacy.target_quantile"),
        ("privacy.target_quantile=1", "privacy.target_quantile"),
        ("privacy.target_quantile=1.5", "privacy.target_quantile"),
        ("privacy.clip_learning_rate=0", "privacy.clip_learning_rate"),
        ("privacy.clip_learning_rate=-0.1", "privacy.clip_learning_rate"),
        ("privacy.clip_count_noise=0.5", "privacy.clip_count_noise"),  # 2σ_b = z: none left
        ("privacy.clip_count_noise=0", "privacy.clip_count_noise"),
        ('privacy.clipping="auto"', "privacy.clipping"),
        ('privacy.mode="none"', "privacy.clipping"),
    ],
)
def test_bad_adaptive_settings_exit_2_naming_the_field(capsys, override, field):
    assert main(["config", "show", *ADAPTIVE, override]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
