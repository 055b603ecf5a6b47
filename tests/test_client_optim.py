"""The clients' AdamW (training.optimizer = "adamw"): one slot's step equals torch.optim.AdamW
on that client's sketched slice alone; components outside the sketch keep their weights and
moments; c slots at once equal c clients alone; "scaled" sketch steps under AdamW; the cosine
schedule; kept states through a resume; every method and the Flower node train with it; bad
values are ConfigErrors naming the field."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.cli import main
from fedlora.config import TrainingConfig, dump_toml, load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods.proposed import Plan
from fedlora.federation.methods.registry import method_names
from fedlora.llm.client_optim import SlotAdamW
from fedlora.llm.models import load_model
from fedlora.llm.step_sizes import client_step_sizes, round_lr, step_sizes_for
from fedlora.llm.train import collate_clients, local_train, target_token_loss
from tiny_runs import TINY_FOUR_CLIENTS
from train_cases import PROMPTS, RANK, fresh, make_batch

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
HYPER = {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}  # not the defaults


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-qwen2")


def _batches(tok, client: int, steps: int) -> list[dict[str, torch.Tensor]]:
    return [
        make_batch(tok, [PROMPTS[(client + h) % 6], PROMPTS[(client + 2 * h + 1) % 6]])
        for h in range(steps)
    ]


def _slices(lora, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """key -> slot 0's sketched slice of that tensor (A: rows, B: columns), as a leaf."""
    out = {}
    for name, layer in lora.layers.items():
        out[f"{name}.lora_A"] = layer.lora_A[0, idx].detach().clone().requires_grad_()
        out[f"{name}.lora_B"] = layer.lora_B[0][:, idx].detach().clone().requires_grad_()
    return out


def _reference_adamw(base, scale: torch.Tensor, batches, lr: float):
    """torch.optim.AdamW on the client's sketched slice alone (A's rows, B's columns)."""
    model, lora = fresh(base, slots=1)
    lora.set_clients(scale[None])
    idx = torch.nonzero(scale > 0)[:, 0]
    slices = _slices(lora, idx)
    opt = torch.optim.AdamW(list(slices.values()), lr=lr, **HYPER)
    for batch in batches:
        with torch.no_grad():  # the slot holds the slice's current values
            for name, layer in lora.layers.items():
                layer.lora_A[0, idx] = slices[f"{name}.lora_A"]
                layer.lora_B[0][:, idx] = slices[f"{name}.lora_B"]
        loss, _ = target_token_loss(model, collate_clients([batch])[0], 1)
        loss.sum().backward()
        for name, layer in lora.layers.items():
            slices[f"{name}.lora_A"].grad = layer.lora_A.grad[0, idx].clone()
            slices[f"{name}.lora_B"].grad = layer.lora_B.grad[0][:, idx].clone()
            layer.lora_A.grad = layer.lora_B.grad = None
        opt.step()
    return slices, opt


def test_adamw_steps_of_a_slot_equal_torch_adamw_on_its_sketched_slice(base):
    # Prepare: k = 2 of γ = 4 (scale 2 on components 0 and 2), H = 3 steps
    scale = torch.tensor([2.0, 0.0, 2.0, 0.0])
    batches = _batches(base[1], 0, 3)
    model, lora = fresh(base, slots=1)
    lora.set_clients(scale[None])
    before = lora.slot_state(0)
    adamw = SlotAdamW(lora, **HYPER)
    # Execute
    local_train(model, lora, [batches], 3e-3, optimizer=adamw)
    slices, opt = _reference_adamw(base, scale, batches, 3e-3)
    # Assert: the sketched rows/columns equal the reference, moments and steps too
    after, idx, out = lora.slot_state(0), torch.tensor([0, 2]), torch.tensor([1, 3])
    for key, ref in slices.items():
        part = (lambda t: t[idx]) if key.endswith("lora_A") else (lambda t: t[:, idx])
        rest = (lambda t: t[out]) if key.endswith("lora_A") else (lambda t: t[:, out])
        torch.testing.assert_close(part(after[key]), ref.detach(), rtol=1e-5, atol=1e-6)
        state = adamw.slot_state(0)
        for moment in ("exp_avg", "exp_avg_sq"):
            want = opt.state[ref][moment]
            tol = 1e-5 * float(want.abs().max())  # float noise on the smallest gradients
            torch.testing.assert_close(part(state[f"{key}.{moment}"]), want, rtol=1e-4, atol=tol)
            assert not rest(state[f"{key}.{moment}"]).any()  # never trained: still 0
        # outside the sketch: the weights exactly as before (no decay), no step counted
        assert torch.equal(rest(after[key]), rest(before[key]))
        assert state[f"{key}.step"].tolist() == [3.0, 0.0, 3.0, 0.0]
        assert not torch.equal(part(after[key]), part(before[key]))


def test_components_outside_the_sketch_keep_weights_moments_and_steps(base):
    # Prepare: a first round on components {0, 1}, then a second on {1, 2} from its state
    tok = base[1]
    model, lora = fresh(base, slots=1)
    lora.set_clients(torch.tensor([[2.0, 2.0, 0.0, 0.0]]))
    first = SlotAdamW(lora, **HYPER)
    local_train(model, lora, [_batches(tok, 1, 2)], 1e-2, optimizer=first)
    kept = first.slot_state(0)
    lora.load_global(lora.slot_state(0))
    lora.set_clients(torch.tensor([[0.0, 2.0, 2.0, 0.0]]))
    before = lora.slot_state(0)
    second = SlotAdamW(lora, states=[kept], **HYPER)
    # Execute
    local_train(model, lora, [_batches(tok, 2, 2)], 1e-2, optimizer=second)
    # Assert: components 0 and 3 bit for bit unchanged; 1 continued, 2 started
    after, state = lora.slot_state(0), second.slot_state(0)
    for key in before:
        pick = (lambda t, j: t[j]) if key.endswith("lora_A") else (lambda t, j: t[:, j])
        for j in (0, 3):
            assert torch.equal(pick(after[key], j), pick(before[key], j)), (key, j)
            for part in ("exp_avg", "exp_avg_sq"):
                k = f"{key}.{part}"
                assert torch.equal(pick(state[k], j), pick(kept[k], j)), (k, j)
        assert state[f"{key}.step"].tolist() == [2.0, 4.0, 2.0, 0.0]
        assert pick(kept[f"{key}.exp_avg_sq"], 0).abs().sum() > 0  # component 0 has moments


def test_several_slots_at_once_equal_each_slot_alone(base):
    # Prepare: 3 clients with different sketches, per-client step sizes, one with a state
    tok = base[1]
    scales = torch.tensor([[2.0, 0, 2.0, 0], [1.0, 1, 1, 1], [4.0, 0, 0, 0]])
    lrs = client_step_sizes(1e-2, scales.numpy(), "scaled", "adamw")
    batches = [_batches(tok, c, 2) for c in range(3)]
    m0, l0 = fresh(base, slots=1)
    l0.set_clients(torch.ones(1, RANK))
    warm = SlotAdamW(l0, **HYPER)
    local_train(m0, l0, [batches[2]], 1e-2, optimizer=warm)
    states = [None, warm.slot_state(0), None]
    model, lora = fresh(base, slots=3)
    lora.set_clients(scales)
    together = SlotAdamW(lora, states=states, **HYPER)
    # Execute
    losses = local_train(model, lora, batches, lrs, optimizer=together)
    # Assert
    for c in range(3):
        m1, l1 = fresh(base, slots=1)
        l1.set_clients(scales[c : c + 1])
        alone = SlotAdamW(l1, states=[states[c]], **HYPER)
        alone_losses = local_train(m1, l1, [batches[c]], lrs[c : c + 1], optimizer=alone)
        np.testing.assert_allclose(losses[c], alone_losses[0], rtol=0, atol=1e-5)
        want, got = l1.slot_state(0), lora.slot_state(c)
        for k in want:  # AdamW divides by √v: float noise in a tiny gradient moves ~1e-3·η
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
        for k, v in alone.slot_state(0).items():
            tol = 1e-5 * float(v.abs().max())
            torch.testing.assert_close(together.slot_state(c)[k], v, rtol=1e-3, atol=tol)


def _first_step_size_ratio(base, lrs_for) -> float:
    """RMS ‖ΔW‖ after one AdamW step from B = 0 of a k = 1 client (mean over the γ sketches)
    over that of a k = γ client."""
    batch = make_batch(base[1], PROMPTS[:2])
    scales = torch.zeros(RANK + 1, RANK)
    for j in range(RANK):
        scales[j, j] = RANK
    scales[RANK] = 1.0
    model, lora = fresh(base, slots=RANK + 1)
    lora.load_global(
        {k: v * 0 if k.endswith("lora_B") else v for k, v in lora.global_state().items()}
    )
    lora.set_clients(scales)
    adamw = SlotAdamW(lora)
    local_train(model, lora, [[batch]] * (RANK + 1), lrs_for(scales.numpy()), optimizer=adamw)
    sq = np.zeros(RANK + 1)
    for i in range(RANK + 1):
        state = lora.slot_state(i)
        for name in lora.names:
            dw = lora.scaling * state[f"{name}.lora_B"] @ torch.diag(scales[i])
            sq[i] += float(((dw @ state[f"{name}.lora_A"]).double() ** 2).sum())
    return float(np.sqrt(sq[:RANK].mean() / sq[RANK]))


def test_scaled_sketch_step_under_adamw_equalises_the_first_step(base):
    # Under AdamW the update is ~η per element whatever the gradient's scale, so ΔW keeps one
    # factor s = γ/k: RMS ‖ΔW‖ ∝ η·s·√k. Unscaled: k = 1 moves √γ = 2 times k = γ; SGD's
    # power 3/2 would over-correct to 1/γ; AdamW's power 1/2 equalises them.
    paper = _first_step_size_ratio(base, lambda s: client_step_sizes(1e-3, s, "paper"))
    sgd_power = _first_step_size_ratio(base, lambda s: client_step_sizes(1e-3, s, "scaled"))
    adamw = _first_step_size_ratio(base, lambda s: client_step_sizes(1e-3, s, "scaled", "adamw"))
    assert 1.6 < paper < 2.5
    assert 0.2 < sgd_power < 0.32
    assert 0.8 < adamw < 1.25
    scales = np.array([[4.0, 0, 0, 0], [2.0, 2.0, 0, 0], [1.0, 1, 1, 1]])
    np.testing.assert_allclose(
        client_step_sizes(0.2, scales, "scaled", "adamw"), [0.1, 0.2 / np.sqrt(2), 0.2]
    )
    # the run's path: the optimizer object built from training.optimizer (None = SGD)
    _, lora = fresh(base, slots=len(scales))
    lora.set_clients(torch.from_numpy(scales).float())
    np.testing.assert_array_equal(
        step_sizes_for(0.2, "scaled", scales, SlotAdamW(lora)),
        client_step_sizes(0.2, scales, "scaled", "adamw"),
    )
    np.testing.assert_array_equal(
        step_sizes_for(0.2, "scaled", scales, None), client_step_sizes(0.2, scales, "scaled")
    )


def test_cosine_schedule_values():
    assert round_lr(0.2, 0.0, "constant", 5, 8) == 0.2
    got = [round_lr(0.1, 0.02, "cosine", r, 4) for r in range(4)]
    np.testing.assert_allclose(
        got, [0.1, 0.02 + 0.08 * (1 + np.sqrt(0.5)) / 2, 0.06, 0.02 + 0.08 * (1 - np.sqrt(0.5)) / 2]
    )
    assert round_lr(0.1, 0.02, "cosine", 4, 4) == pytest.approx(0.02)
    assert round_lr(0.1, 0.0, "cosine", 0, 1) == 0.1


# ----------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"optimizer": "adam"}, r"training\.optimizer = 'adam'.*sgd, adamw"),
        ({"optimizer": "adamw", "adam_betas": (0.9, 1.0)}, r"training\.adam_betas\[1\] = 1\.0"),
        ({"optimizer": "adamw", "adam_betas": (-0.1, 0.9)}, r"training\.adam_betas\[0\] = -0\.1"),
        ({"optimizer": "adamw", "adam_betas": (0.9,)}, r"training\.adam_betas = \(0\.9,\)"),
        ({"optimizer": "adamw", "adam_eps": 0.0}, r"training\.adam_eps = 0\.0.*> 0"),
        ({"optimizer": "adamw", "adam_eps": -1e-8}, r"training\.adam_eps = -1e-08"),
        ({"optimizer": "adamw", "weight_decay": -0.01}, r"training\.weight_decay = -0\.01"),
        ({"weight_decay": 0.01}, r"training\.weight_decay = 0\.01.*'sgd'"),
        ({"optimizer": "adamw", "momentum": 0.9}, r"training\.momentum = 0\.9.*'adamw'"),
        ({"optimizer_state": "kept"}, r"training\.optimizer_state = 'kept'.*reset, keep"),
        ({"optimizer_state": "keep"}, r"training\.optimizer_state = 'keep'.*'sgd'"),
        ({"lr_schedule": "linear"}, r"training\.lr_schedule = 'linear'.*constant, cosine"),
        ({"lr": 0.1, "lr_min": 0.2}, r"training\.lr_min = 0\.2.*<= training\.lr = 0\.1"),
        ({"lr_min": -0.1}, r"training\.lr_min = -0\.1.*>= 0"),
    ],
)
def test_bad_optimizer_values_name_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        TrainingConfig(**fields)


def test_the_defaults_are_plain_sgd_and_the_cli_exits_2_on_a_bad_value(capsys):
    t = TrainingConfig()
    assert (t.optimizer, t.optimizer_state, t.lr_schedule, t.weight_decay) == (
        "sgd",
        "reset",
        "constant",
        0.0,
    )
    assert main(["config", "show", "training.optimizer=adam"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.optimizer = 'adam'" in err[0]
    assert main(["run", "training.adam_eps=0", "--out", "/nonexistent/x"]) == 2
    assert "training.adam_eps" in capsys.readouterr().err


# ----------------------------------------------------------------------------- runs

TINY = [
    *TINY_FOUR_CLIENTS,
    "training.rounds=2",
    "training.slots=4",
    "training.eval_every=2",
    "training.optimizer=adamw",
    "training.lr=3e-4",
    "method.q=full",
]


def _run(tmp_path: Path, name: str, *extra: str, stop=None, plan=None):
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(None, [*TINY, *extra])
    run_dir = tmp_path / name
    prepare_run_dir(cfg, run_dir)
    log = lambda m: None  # noqa: E731
    run_experiment(cfg, run_dir, quiet=True, log=log, stop=stop, plan=plan)
    return run_dir


def _checkpoint_globals(run_dir: Path) -> list[dict[str, np.ndarray]]:
    """The global adapters of the run's checkpoints, newest first."""
    from safetensors.numpy import load_file

    from fedlora.federation.checkpoints import checkpoint_paths

    out = []
    for path in checkpoint_paths(run_dir):
        tensors = load_file(str(path))
        out.append({k: v for k, v in tensors.items() if k.startswith("global/")})
    return out


@needs_data
@pytest.mark.parametrize("name", method_names())
def test_every_method_trains_with_adamw(tmp_path, name):
    # Prepare: proposed gets its plan as a value (no calibration runs)
    plan = Plan(q=(1.0, 0.5, 0.5, 1.0), k=(1, 2, 4, 3)) if name == "proposed" else None
    # Execute: 2 rounds of `training.optimizer=adamw training.lr=3e-4`
    run_dir = _run(tmp_path, name, f"method.name={name}", plan=plan)
    # Assert: round 2 moved the global adapter, every value finite
    newest, older = _checkpoint_globals(run_dir)[:2]
    assert set(newest) == set(older)
    assert any(not np.array_equal(newest[k], older[k]) for k in newest)
    assert all(np.isfinite(v).all() for v in newest.values())


class _Crash(Exception):
    pass


@needs_data
def test_kept_adamw_states_are_checkpointed_and_a_resume_is_bit_identical(tmp_path):
    # Prepare: clients skip rounds (q < 1) and their sketches change (k < γ)
    extra = ["training.rounds=3", "method.q=[1.0, 0.5, 0.5, 1.0]", "method.k=[1, 2, 4, 3]"]
    keep = [*extra, "training.optimizer_state=keep"]
    reference = _run(tmp_path, "ref", *keep)

    def crash(line):
        if line["round"] == 2:  # after round 1's checkpoint and round 2's metrics line
            raise _Crash

    with pytest.raises(_Crash):
        _run(tmp_path, "cut", *keep, stop=crash)
    # Execute: `fedlora run --resume` (the config comes back from the run's config.toml)
    resumed = tmp_path / "cut"
    assert main(["run", "--resume", str(resumed), "--quiet"]) == 0
    reset = _run(tmp_path, "reset", *extra)
    # Assert: the same adapter bit for bit and the same losses; reset differs
    ref, got, other = (_checkpoint_globals(d)[0] for d in (reference, resumed, reset))
    assert all(np.array_equal(ref[k], got[k]) for k in ref)
    assert any(not np.array_equal(ref[k], other[k]) for k in ref)

    def losses(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["train_loss"] for x in lines]

    assert losses(resumed) == losses(reference) and len(losses(reference)) == 4
    from safetensors.numpy import load_file

    from fedlora.federation.checkpoints import checkpoint_paths

    kept = [k for k in load_file(str(checkpoint_paths(resumed)[0])) if "client_optim/" in k]
    assert kept and any(k.endswith(".exp_avg_sq") for k in kept)


@needs_data
def test_the_cosine_schedule_reaches_local_training(tmp_path, monkeypatch):
    import fedlora.llm.train

    seen = []
    real = fedlora.llm.train.local_train

    def spy(model, lora, batches, lr, **kw):
        seen.append(float(lr))
        return real(model, lora, batches, lr, **kw)

    monkeypatch.setattr(fedlora.llm.train, "local_train", spy)
    _run(
        tmp_path,
        "cos",
        "training.optimizer=sgd",
        "training.lr=0.1",
        "training.lr_min=0.02",
        "training.lr_schedule=cosine",
        "training.sketch_step=paper",
        "method.k=full",
    )
    assert seen == [0.1, pytest.approx(0.06)]


# ----------------------------------------------------------------------------- Flower


@needs_data
def test_the_flower_node_trains_with_adamw_as_the_engine_and_refuses_keep(tmp_path):
    from fedlora.federation.flower import node
    from fedlora.federation.flower.common import check_flower_method
    from fedlora.federation.trainer import train_clients

    sent = load_config(None, [*TINY, "training.slots=1", "training.weight_decay=0.01"])
    cfg = node.config_from_toml(dump_toml(sent))  # what the server sends, as the node reads it
    assert cfg.training == sent.training and cfg.training.adam_betas == (0.9, 0.999)
    check_flower_method(cfg)  # reset: accepted
    state = node.client_state(cfg)
    start = {k: v.numpy().copy() for k, v in state.lora.global_state().items()}
    scale = [0.0, 2.0, 0.0, 2.0]
    task = {"client": 1, "round": 0, "index": 0, "scale": scale, "trains": "AB"}
    got, loss = node.train_one(state, start, task)
    losses = train_clients(state, 0, [1], np.asarray([scale], dtype=np.float32), 0)
    want = {k: v.numpy() for k, v in state.lora.slot_state(0).items()}
    assert np.isfinite(loss) and np.isfinite(losses).all()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert any(not np.array_equal(got[k], start[k]) for k in got)
    with pytest.raises(ConfigError, match=r"training\.optimizer_state = 'keep'.*Flower"):
        check_flower_method(cfg.replace(training=replace(cfg.training, optimizer_state="keep")))
