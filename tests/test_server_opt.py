"""Server optimizers (Reddi et al. 2021): one step by hand for each, torch's AdamW as the
reference of `adam` with bias correction and decay, `avg` as the identity, the methods they
apply to, and a resumed run that continues bit-identically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.methods.registry import check_method_config
from fedlora.federation.methods.server_opt import ServerOptimizer

ETA, TAU = 0.1, 1e-3


def _step(opt: ServerOptimizer, x: float, delta: float) -> float:
    """One server step on a 1-element adapter at X = x with the aggregate X + delta."""
    out = opt.step({"w": np.array([x])}, {"w": np.array([x + delta])})
    return float(out["w"][0])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # Δ = 0.5 at X = 1; η = 0.1, μ = 0.9, β = (0.9, 0.99), τ = 1e-3
        ("avg", 1 + 0.1 * 0.5),
        ("avgm", 1 + 0.1 * 0.5),  # m = Δ
        ("adam", 1 + 0.1 * 0.05 / (np.sqrt(0.01 * 0.25) + TAU)),  # m = 0.1Δ, v = 0.01Δ²
        ("yogi", 1 + 0.1 * 0.05 / (np.sqrt(0.01 * 0.25) + TAU)),  # v = 0 + 0.01Δ² (sign −1)
        ("adagrad", 1 + 0.1 * 0.05 / (np.sqrt(0.25) + TAU)),  # v = Δ²
    ],
)
def test_one_step_by_hand(kind, expected):
    opt = ServerOptimizer(kind=kind, lr=ETA, momentum=0.9, beta1=0.9, beta2=0.99, eps=TAU)
    assert _step(opt, 1.0, 0.5) == pytest.approx(expected, rel=1e-12)
    assert opt.step_count == 1


def test_second_steps_by_hand_tell_the_optimizers_apart():
    x1 = 1.05
    avgm = ServerOptimizer(kind="avgm", lr=ETA, momentum=0.9)
    _step(avgm, 1.0, 0.5)
    assert _step(avgm, x1, 0.5) == pytest.approx(x1 + 0.1 * (0.9 * 0.5 + 0.5), rel=1e-12)
    m2 = 0.9 * 0.05 + 0.1 * 0.5  # the same m for adam and yogi
    adam_v2 = 0.99 * 0.0025 + 0.01 * 0.25
    yogi_v2 = 0.0025 - 0.01 * 0.25 * np.sign(0.0025 - 0.25)  # = 0.005 (adam: 0.004975)
    for kind, v2 in (("adam", adam_v2), ("yogi", yogi_v2)):
        opt = ServerOptimizer(kind=kind, lr=ETA, beta1=0.9, beta2=0.99, eps=TAU)
        _step(opt, 1.0, 0.5)
        assert _step(opt, x1, 0.5) == pytest.approx(x1 + 0.1 * m2 / (np.sqrt(v2) + TAU), 1e-12)
    ada = ServerOptimizer(kind="adagrad", lr=ETA, beta1=0.9, eps=TAU)
    _step(ada, 1.0, 0.5)
    assert _step(ada, x1, 0.5) == pytest.approx(x1 + 0.1 * m2 / (np.sqrt(0.5) + TAU), 1e-12)


def test_bias_correction_and_weight_decay_by_hand():
    opt = ServerOptimizer(kind="adam", lr=ETA, beta2=0.99, eps=TAU, bias_correction=True)
    # m̂ = Δ, v̂ = Δ²: the first step moves η·Δ/(|Δ| + τ)
    assert _step(opt, 1.0, 0.5) == pytest.approx(1 + 0.1 * 0.5 / (0.5 + TAU), rel=1e-12)
    decay = ServerOptimizer(kind="avg", lr=ETA, weight_decay=0.2)
    assert _step(decay, 1.0, 0.5) == pytest.approx(1 * (1 - 0.1 * 0.2) + 0.1 * 0.5, rel=1e-12)


def test_adam_with_bias_correction_and_decay_is_torch_adamw_on_the_pseudo_gradient():
    """FSLoRA's server: torch.optim.AdamW stepping on grad = −Δ (the authors' code)."""
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(3, 5)), "b": rng.normal(size=(4, 3))}
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in x.items()}
    adamw = torch.optim.AdamW(params.values(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8)
    ours = ServerOptimizer(
        kind="adam", lr=3e-4, beta1=0.9, beta2=0.999, eps=1e-8,
        bias_correction=True, weight_decay=0.01,
    )  # fmt: skip
    state = {k: v.copy() for k, v in x.items()}
    for _ in range(4):
        deltas = {k: rng.normal(scale=0.01, size=v.shape) for k, v in x.items()}
        for k, p in params.items():
            p.grad = torch.tensor(-deltas[k])
        adamw.step()
        state = ours.step(state, {k: state[k] + deltas[k] for k in state})
    for k, p in params.items():
        np.testing.assert_allclose(state[k], p.detach().numpy(), rtol=1e-10, atol=1e-15)


def test_avg_is_the_methods_own_aggregate_bit_for_bit():
    cfg = load_config(None, ["method.name=fslora", "data.n_clients=2", "lora.rank=4"])
    method = make_method(cfg, np.full(2, 0.5), np.random.default_rng(0))
    assert method.server_opt is None  # the default: avg, η = 1, no decay
    x = {"m.lora_A": np.ones((4, 3), np.float32), "m.lora_B": np.zeros((2, 4), np.float32)}
    clients = [{k: v + i + 0.25 for k, v in x.items()} for i in range(2)]
    plan = RoundPlan(0, tuple(ClientTask(i, np.ones(4), 4, 0.5) for i in range(2)))
    plain, stepped = method.aggregate(x, plan, clients), method.server_step(x, plan, clients)
    assert all(np.array_equal(plain.global_state[k], stepped.global_state[k]) for k in x)
    assert all(plain.global_state[k].dtype == np.float32 for k in x)
    ident = ServerOptimizer()
    assert ident.is_identity and ident.step(x, plain.global_state) is plain.global_state


def test_make_method_attaches_the_configured_optimizer_and_skips_empty_rounds():
    cfg = load_config(
        None,
        ["method.name=sketched", "data.n_clients=2", "lora.rank=4", "method.q=[0.5, 0.5]",
         "method.server_optimizer=yogi", "method.server_lr=0.01", "method.server_betas=[0.5, 0.9]",
         "method.server_eps=1e-6", "method.server_bias_correction=true"],
    )  # fmt: skip
    method = make_method(cfg, np.full(2, 0.5), np.random.default_rng(0))
    opt = method.server_opt
    assert (opt.kind, opt.lr, opt.beta1, opt.beta2, opt.eps) == ("yogi", 0.01, 0.5, 0.9, 1e-6)
    x = {"w": np.ones(3)}
    assert method.server_step(x, RoundPlan(0, ()), [])  # no participant: no optimizer step
    assert opt.step_count == 0


@pytest.mark.parametrize("name", ["flexlora", "fedstacklora"])
def test_methods_that_refactorise_refuse_a_server_optimizer(name):
    with pytest.raises(ConfigError, match=rf"method.server_optimizer = 'adam'.*'{name}'"):
        check_method_config(
            load_config(None, [f"method.name={name}", "method.server_optimizer=adam"])
        )
    with pytest.raises(ConfigError, match="server_lr = 0.5"):
        check_method_config(load_config(None, [f"method.name={name}", "method.server_lr=0.5"]))
    check_method_config(load_config(None, [f"method.name={name}"]))  # avg, η = 1: fine


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.server_optimizer=sgd", "method.server_optimizer = 'sgd' is invalid: allowed: avg"),
        ("method.server_lr=0", "method.server_lr = 0.0 is invalid"),
        ("method.server_betas=[0.9]", "method.server_betas = (0.9,) is invalid: two numbers"),
        ("method.server_betas=[0.9, 1.0]", "method.server_betas[1] = 1.0 is invalid"),
        ("method.server_eps=0", "method.server_eps = 0.0 is invalid"),
        ("method.server_momentum=1", "method.server_momentum = 1.0 is invalid"),
        ("method.server_bias_correction=1", "method.server_bias_correction = 1 is invalid"),
        ("method.server_weight_decay=-1", "method.server_weight_decay = -1.0 is invalid"),
    ],
)
def test_bad_server_optimizer_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
TINY = [
    "model.name=tiny-llama", "model.dtype=fp32", "model.threads=1", f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]', "data.train_limit=24", "data.eval_limit=4", "data.max_seq_len=64",
    "evaluation.format=llm-adapters",
    "data.n_clients=3", "data.min_client_examples=4", "lora.rank=4", "lora.layers=1",
    "training.local_steps=1", "training.batch_size=2", "training.slots=3",
    "training.eval_every=8", "training.checkpoint_every=1", "training.lr=0.05",
    "method.name=fslora", "method.clients_per_round=2", "method.server_optimizer=adam",
    "method.server_lr=0.01", "method.server_bias_correction=true",
    "method.server_weight_decay=0.01", "output.progress=false",
]  # fmt: skip


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_a_resumed_run_with_adam_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    def adapter(run: Path) -> dict:
        return load_file(str(run / "adapter" / "adapter_model.safetensors"))

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main(["run", *TINY, "training.rounds=4", "--out", str(ref), "-q"]) == 0
    assert main(["run", *TINY, "training.rounds=2", "--out", str(cut), "-q"]) == 0
    assert main(["run", "--resume", str(cut), "training.rounds=4", "--force", "-q"]) == 0
    a, b = adapter(ref), adapter(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the optimizer did move the adapter away from plain averaging
    avg = tmp_path / "avg"
    plain = [o for o in TINY if not o.startswith("method.server")]
    assert main(["run", *plain, "training.rounds=4", "--out", str(avg), "-q"]) == 0
    c = adapter(avg)
    assert not all(torch.equal(a[k], c[k]) for k in a)
