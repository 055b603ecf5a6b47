"""training.sketch_step ("paper" | "scaled") and training.momentum: the step-size rule, the
first-step ΔW property it is derived from, per-slot step sizes == separate runs, momentum ==
torch.optim.SGD, bad input."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import LoraConfig, TrainingConfig
from fedlora.errors import ConfigError
from fedlora.llm.lora import inject_lora
from fedlora.llm.models import load_model
from fedlora.llm.step_sizes import SKETCH_STEP_POWER, client_step_sizes, step_sizes_for
from fedlora.llm.train import collate_clients, local_train, target_token_loss
from train_cases import make_batch

RANK = 4  # γ
PAIRS = [
    ("Question: which tool measures mass? Answer:", " a balance"),
    ("What do plants need to make food?", " light and water"),
    ("Heat moves from", " warmer to colder objects"),
]


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-llama")


def fresh(base, slots, *, trained=False):
    model = copy.deepcopy(base[0])
    lora = inject_lora(model, LoraConfig(rank=RANK, alpha=8.0, layers="all"), slots=slots, seed=3)
    if trained:  # a non-zero B, as after some rounds
        gen = torch.Generator().manual_seed(11)
        lora.load_global(
            {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in lora.global_state().items()}
        )
    return model, lora


# ----------------------------------------------------------------------------- the rule


def test_step_sizes_hand_computed():
    # γ = 16: a k = 1 sketch has scale 16, k = 4 scale 4, k = 16 (full) scale 1
    scales = np.zeros((4, 16))
    scales[0, 3] = 16.0
    scales[1, [0, 5, 9, 12]] = 4.0
    scales[2, :] = 1.0
    scales[3, :2] = 1.0  # a rank truncation (r_n = 2): no sketch scale
    assert SKETCH_STEP_POWER == 1.5
    # a client with no active component trains nothing; it keeps η
    np.testing.assert_allclose(client_step_sizes(0.2, np.zeros((1, 16)), "scaled"), [0.2])
    np.testing.assert_allclose(client_step_sizes(0.2, scales, "paper"), [0.2] * 4)
    # η·(k/γ)^1.5: 0.2/64, 0.2/8, 0.2, 0.2
    np.testing.assert_allclose(
        client_step_sizes(0.2, scales, "scaled"), [0.003125, 0.025, 0.2, 0.2], rtol=1e-12
    )
    # the config path: "paper" hands local_train the scalar η (the unchanged plain-SGD path)
    assert step_sizes_for(0.2, "paper", scales) == 0.2
    np.testing.assert_allclose(
        step_sizes_for(0.2, "scaled", scales),
        [0.003125, 0.025, 0.2, 0.2],
    )


@pytest.mark.parametrize(
    "lr, scales, mode, match",
    [
        (0.1, np.ones((1, 4)), "sqrt", r"training\.sketch_step = 'sqrt'.*paper, scaled"),
        (0.0, np.ones((1, 4)), "scaled", r"training\.lr = 0\.0"),
        (float("nan"), np.ones((1, 4)), "scaled", r"training\.lr = nan"),
        (True, np.ones((1, 4)), "scaled", r"training\.lr = True"),
        (0.1, np.ones(4), "scaled", r"scales must be \(c, γ\)"),
        (0.1, -np.ones((2, 4)), "scaled", "finite and >= 0"),
        (0.1, np.full((1, 4), np.inf), "scaled", "finite and >= 0"),
    ],
)
def test_step_sizes_bad_input(lr, scales, mode, match):
    with pytest.raises(ConfigError, match=match):
        client_step_sizes(lr, scales, mode)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("sketch_step", "adaptive", r"training\.sketch_step = 'adaptive'.*paper, scaled"),
        ("momentum", 1.0, r"training\.momentum = 1\.0.*< 1"),
        ("momentum", -0.1, r"training\.momentum = -0\.1.*>= 0"),
        ("momentum", float("nan"), r"training\.momentum = nan"),
        ("momentum", True, r"training\.momentum = True"),
    ],
)
def test_config_rejects_bad_values(field, value, match):
    with pytest.raises(ConfigError, match=match):
        TrainingConfig(**{field: value})


def test_config_defaults_are_the_cpu_protocol():
    cfg = TrainingConfig()
    assert (cfg.sketch_step, cfg.momentum) == ("scaled", 0.0)


# ----------------------------------------------------------------------------- the property


def _first_step_delta_w_sq(base, mode: str) -> tuple[float, float]:
    """E‖ΔW‖² of the local model after one step from B = 0, for k = 1 (exact mean over the γ
    possible sketches) and for k = γ, summed over the adapted layers."""
    tok = base[1]
    batch = make_batch(tok, PAIRS)
    c = RANK + 1
    scales = torch.zeros(c, RANK)
    for j in range(RANK):
        scales[j, j] = RANK  # k = 1 on index j: scale γ/k = γ
    scales[RANK] = 1.0  # k = γ
    model, lora = fresh(base, slots=c)
    lora.set_clients(scales)
    lrs = client_step_sizes(0.05, scales.numpy(), mode)
    local_train(model, lora, [[batch]] * c, lrs)
    sq = np.zeros(c)
    for i in range(c):
        state = lora.slot_state(i)
        for name in lora.names:
            a, b = state[f"{name}.lora_A"], state[f"{name}.lora_B"]
            dw = lora.scaling * b @ torch.diag(scales[i]) @ a  # global B = 0: ΔW = W_local
            sq[i] += float((dw.double() ** 2).sum())
    return float(sq[:RANK].mean()), float(sq[RANK])


def test_scaled_step_equalises_first_step_update_size(base):
    # Paper step: the k = 1 client's ΔW is ~γ^1.5 = 8 times the k = γ client's (RMS)
    k1, kg = _first_step_delta_w_sq(base, "paper")
    assert 6.0 < np.sqrt(k1 / kg) < 10.0
    # Scaled step: equal in expectation over the sketch. The residual is the k = γ client's
    # cross terms between rank components, O/D ≈ (γ-1)/(in_features+2) = 3/66 here.
    k1, kg = _first_step_delta_w_sq(base, "scaled")
    assert 0.85 < np.sqrt(k1 / kg) < 1.15


# ----------------------------------------------------------------------------- local_train


def test_per_slot_step_sizes_equal_separate_runs(base):
    tok = base[1]
    batches = [[make_batch(tok, PAIRS[c : c + 2]) for _ in range(2)] for c in range(2)]
    scales = torch.tensor([[2.0, 0, 2.0, 0], [1.0, 1, 1, 1]])
    lrs = np.array([0.07, 0.3])
    model, lora = fresh(base, slots=2, trained=True)
    lora.set_clients(scales)
    together = local_train(model, lora, batches, lrs)
    for c in range(2):
        m1, l1 = fresh(base, slots=1, trained=True)
        l1.set_clients(scales[c : c + 1])
        alone = local_train(m1, l1, [batches[c]], float(lrs[c]))
        np.testing.assert_allclose(together[c], alone[0], rtol=0, atol=1e-5)
        for k, v in l1.slot_state(0).items():
            torch.testing.assert_close(lora.slot_state(c)[k], v, rtol=0, atol=1e-6)


def test_momentum_equals_torch_sgd(base):
    # Prepare: H = 3 steps of one client with μ = 0.9, and a reference with torch.optim.SGD
    tok = base[1]
    steps = [make_batch(tok, PAIRS[h : h + 1]) for h in range(3)]
    scales = torch.tensor([[2.0, 2.0, 0, 0]])
    model, lora = fresh(base, slots=1, trained=True)
    lora.set_clients(scales)
    losses = local_train(model, lora, [steps], 0.1, momentum=0.9)
    ref_model, ref_lora = fresh(base, slots=1, trained=True)
    ref_lora.set_clients(scales)
    opt = torch.optim.SGD(ref_lora.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    ref_lora.train(True)
    for batch in steps:
        opt.zero_grad()
        loss, _ = target_token_loss(ref_model, collate_clients([batch])[0], 1)
        ref_losses.append(float(loss[0].detach()))
        loss.sum().backward()
        opt.step()
    # Assert: same losses and adapter; and momentum changed the trajectory
    np.testing.assert_allclose(losses[0], ref_losses, rtol=0, atol=1e-5)
    for k, v in ref_lora.slot_state(0).items():
        torch.testing.assert_close(lora.slot_state(0)[k], v, rtol=0, atol=1e-6)
    plain_model, plain = fresh(base, slots=1, trained=True)
    plain.set_clients(scales)
    plain_losses = local_train(plain_model, plain, [steps], 0.1)
    assert abs(plain_losses[0, 2] - losses[0, 2]) > 1e-4


def test_momentum_zero_is_plain_sgd_bit_for_bit(base):
    tok = base[1]
    steps = [make_batch(tok, PAIRS[h : h + 1]) for h in range(2)]
    out = []
    for kw in ({}, {"momentum": 0.0}):
        model, lora = fresh(base, slots=1, trained=True)
        lora.set_clients(torch.ones(1, RANK))
        out.append((local_train(model, lora, [steps], 0.2, **kw), lora.slot_state(0)))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k])


@pytest.mark.parametrize(
    "lr, momentum, match",
    [
        ([0.1, 0.1], 0.0, r"need 1 finite numbers > 0"),
        ([-0.1], 0.0, r"need 1 finite numbers > 0"),
        (0.1, 1.0, r"training\.momentum = 1\.0"),
        (0.1, -0.5, r"training\.momentum = -0\.5"),
    ],
)
def test_local_train_bad_step_sizes_and_momentum(base, lr, momentum, match):
    model, lora = fresh(base, slots=1)
    batch = make_batch(base[1], PAIRS[:1])
    with pytest.raises(ConfigError, match=match):
        local_train(model, lora, [[batch]], lr, momentum=momentum)


# ----------------------------------------------------------------------------- the engine

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_engine_passes_each_clients_step_size_and_momentum(tmp_path, monkeypatch):
    # Prepare: a tiny run with k = [1, 2, 4, 3] of γ = 4; record what local_train receives
    import fedlora.llm.train
    from fedlora.config import load_config
    from fedlora.federation.run import prepare_run_dir
    from fedlora.federation.runstate import build_run
    from fedlora.federation.trainer import train_participants
    from fedlora.llm.device import resolve_runtime

    cfg = load_config(
        None,
        [
            "model.name=tiny-llama",
            "model.threads=1",
            f'data.data_dir="{DATA}"',
            'data.tasks=["arc-e"]',
            "data.train_limit=24",
            "data.eval_limit=4",
            "data.n_clients=4",
            "data.min_client_examples=4",
            "lora.rank=4",
            'lora.layers="all"',
            "training.local_steps=1",
            "training.batch_size=2",
            "training.slots=4",
            "training.lr=0.4",
            "training.sketch_step=scaled",
            "training.momentum=0.5",
            "method.q=full",
            "method.k=[1, 2, 4, 3]",
            "output.progress=false",
        ],
    )
    prepare_run_dir(cfg, tmp_path / "run")
    run = build_run(resolve_runtime(cfg), tmp_path / "run", log=lambda m: None)
    seen = []
    real = fedlora.llm.train.local_train

    def spy(model, lora, batches, lr, **kw):
        seen.append((np.asarray(lr), kw["momentum"]))
        return real(model, lora, batches, lr, **kw)

    monkeypatch.setattr(fedlora.llm.train, "local_train", spy)
    plan = run.method.plan_round(0, np.random.default_rng(0), np.random.default_rng(1))
    # Execute
    train_participants(run, plan)
    # Assert: η·(k_n/γ)^1.5 per participant, in plan order, and μ passed through
    k = np.array([t.rank_used for t in plan.tasks])
    np.testing.assert_allclose(seen[0][0], 0.4 * (k / 4) ** 1.5)
    assert seen[0][1] == 0.5


def test_run_dirs_written_before_the_protocol_change_resume_with_their_old_values(tmp_path):
    # Prepare: a config.toml as written before data.response, evaluation.scoring and
    # training.sketch_step existed (the defaults changed to the CPU protocol since)
    from fedlora.config import ExperimentConfig, dump_toml
    from fedlora.federation.rundir import load_run_config

    text = dump_toml(ExperimentConfig())
    old = "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(("response =", "scoring =", "sketch_step ="))
    )
    (tmp_path / "config.toml").write_text(old)
    # Execute
    cfg = load_run_config(tmp_path)
    # Assert: the old behaviour, while a fresh config gets the new defaults
    assert (cfg.data.response, cfg.evaluation.scoring, cfg.training.sketch_step) == (
        "label",
        "label",
        "paper",
    )
    new = ExperimentConfig()
    assert (new.data.response, new.evaluation.scoring, new.training.sketch_step) == (
        "option",
        "option_norm",
        "scaled",
    )
