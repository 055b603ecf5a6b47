"""FSLoRA at its reference (issue 22): the authors' rank distributions (`generate_ranks`),
and configs/fslora_reference.toml holding the authors' settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods import make_method
from fedlora.federation.methods.fslora import FSLoRA
from fedlora.federation.methods.ranks import reference_ranks, resolve_ranks
from fedlora.federation.methods.registry import check_method_config

REFERENCE = Path(__file__).parents[1] / "configs" / "fslora_reference.toml"


class Draws:
    """A generator stand-in that returns fixed draws, to check the transforms by hand."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=float)
        self.calls = []

    def uniform(self, lo, hi, n):
        self.calls.append(("uniform", lo, hi, n))
        return self.values

    def normal(self, mu, sigma, n):
        self.calls.append(("normal", mu, sigma, n))
        return self.values

    def lognormal(self, mu, sigma, n):
        self.calls.append(("lognormal", mu, sigma, n))
        return self.values


def test_heavy_tail_low_by_hand():
    # lognormal draws 1, 2, 4 -> 1/x = 1, 0.5, 0.25 -> min-max onto [1, 32]:
    # 1 + (x − 0.25)/0.75 · 31 = 32, 11.33, 1 -> rounded 32, 11, 1
    rng = Draws([1.0, 2.0, 4.0])
    assert reference_ranks(3, 1, 32, "heavy_tail_low", rng).tolist() == [32, 11, 1]
    assert rng.calls == [("lognormal", np.log(33 / 4), 1.0, 3)]  # μ = ln((a + b)/4), σ = 1
    # one client (or equal draws): the authors' formula is 0/0; fedlora gives a
    assert reference_ranks(1, 3, 9, "heavy_tail_low", Draws([2.0])).tolist() == [3]


def test_normal_and_uniform_by_hand():
    rng = Draws([-5.0, 2.5, 3.5, 16.4, 40.0])
    # clip to [1, 32], round half to even (numpy): 1, 2, 4, 16, 32
    assert reference_ranks(5, 1, 32, "normal", rng).tolist() == [1, 2, 4, 16, 32]
    assert rng.calls == [("normal", 16.5, 31 / 6, 5)]  # mean (a + b)/2, σ = (b − a)/6
    rng = Draws([1.49, 31.5])
    assert reference_ranks(2, 1, 32, "uniform", rng).tolist() == [1, 32]
    assert rng.calls == [("uniform", 1, 32, 2)]


@pytest.mark.parametrize("dist", ["uniform", "normal", "heavy_tail_low"])
def test_reference_ranks_stay_in_range_and_heavy_tail_is_low(dist):
    r = reference_ranks(5000, 1, 32, dist, np.random.default_rng(0))
    assert r.min() >= 1 and r.max() <= 32 and r.dtype == np.int64
    if dist == "heavy_tail_low":
        assert r.min() == 1 and r.max() == 32 and np.median(r) <= 6
    if dist == "normal":
        assert abs(r.mean() - 16.5) < 0.3 and abs(r.std() - 31 / 6) < 0.3
    if dist == "uniform":
        assert abs(r.mean() - 16.5) < 0.5


def test_method_ranks_strategy_and_range():
    rng = np.random.default_rng(1)
    r = resolve_ranks("fslora_normal", n=8, gamma=64, rng=rng, rank_range=(1, 32))
    assert r.tolist() == reference_ranks(8, 1, 32, "normal", np.random.default_rng(1)).tolist()
    full = resolve_ranks("fslora_uniform", n=8, gamma=8, rng=np.random.default_rng(1))
    assert full.min() >= 1 and full.max() <= 8  # [] = [1, γ]
    with pytest.raises(ConfigError, match=r"method.rank_range = \(1, 32\).*lora.rank = 16"):
        load_config(None, ["method.rank_range=[1, 32]"])
    with pytest.raises(ConfigError, match=r"method.rank_range\[1\] = 2 is invalid"):
        load_config(None, ["method.rank_range=[4, 2]"])
    with pytest.raises(ConfigError, match="method.rank_range = \\(3,\\) is invalid"):
        load_config(None, ["method.rank_range=[3]"])


def test_fslora_with_the_authors_budgets():
    cfg = load_config(
        None,
        ["method.name=fslora", "lora.rank=64", "data.n_clients=50", "method.fslora.k=ranks",
         "method.ranks=fslora_heavy_tail_low", "method.rank_range=[1, 32]"],
    )  # fmt: skip
    method = make_method(cfg, np.full(50, 0.02), np.random.default_rng(0))
    expected = reference_ranks(50, 1, 32, "heavy_tail_low", np.random.default_rng(0))
    assert method.k.tolist() == expected.tolist()
    assert method.k.min() == 1 and method.k.max() == 32


def test_the_reference_config_holds_the_authors_settings():
    cfg = load_config(str(REFERENCE))
    assert check_method_config(cfg).name == "fslora"
    # src/models.py:30-38, src/arg.py:21, src/run_main.sh:12
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.rslora, cfg.lora.dropout) == (
        64,
        1.0,
        True,
        0.1,
    )
    assert cfg.lora.scaling == 0.125
    assert cfg.lora.target_modules == ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
    m = cfg.method
    # src/arg.py:10-12, LoRA_Sketching.py:50-51 (torch.optim.AdamW's defaults)
    assert (m.server_optimizer, m.server_lr, m.server_betas, m.server_eps) == (
        "adam", 3e-4, (0.9, 0.999), 1e-8,
    )  # fmt: skip
    assert m.server_bias_correction and m.server_weight_decay == 0.01
    # src/run_main.sh:5, 13-15; src/main.py:51
    assert (m.ranks, m.rank_range, FSLoRA.read_options(cfg).k, m.clients_per_round) == (
        "fslora_heavy_tail_low", (1, 32), "ranks", 10,
    )  # fmt: skip
    t = cfg.training
    assert (t.rounds, t.local_steps, t.batch_size, t.lr, t.momentum, t.seed) == (
        500, 20, 4, 3e-4, 0.9, 42,
    )  # fmt: skip
    assert (cfg.data.n_clients, cfg.data.dirichlet_alpha, cfg.data.max_seq_len) == (50, 0.1, 256)
