"""The post-FSLoRA methods on the Flower node path: a task's trained factors travel in its
ConfigRecord, and the node (`fedlora.federation.flower.node.train_one`, what the ClientApp
and the node worker run) trains exactly those, bit for bit as the engine's trainer; Fed-SB's
middle factor R arrives with the adapter; FedEx-LoRA's base merges arrive as arrays.
FedSA-LoRA is refused."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.flower.common import check_flower_method
from flower_cases import needs_data, write_config


@needs_data
@pytest.mark.parametrize("name, r", [("ffalora", 0), ("rolora", 1), ("fedsb", 0)])
def test_the_node_trains_the_factors_the_task_names(tmp_path, name, r):
    from flwr.app import ConfigRecord

    from fedlora.federation.flower import node
    from fedlora.federation.methods import make_method
    from fedlora.federation.trainer import train_clients

    cfg = load_config(write_config(tmp_path, rounds=1, q='"full"'), [f"method.name={name}"])
    state = node.client_state(cfg)
    method = make_method(cfg, state.fed.a, np.random.default_rng(0))
    start = {k: v.numpy().copy() for k, v in state.lora.global_state().items()}
    global_adapter = method.initial_state(start)
    if name == "rolora":  # an A-round after a B-round: B ≠ 0 (with B = 0, A gets no gradient)
        rng = np.random.default_rng(3)
        global_adapter = {
            k: (rng.normal(0, 0.1, v.shape).astype(v.dtype) if k.endswith("lora_B") else v)
            for k, v in global_adapter.items()
        }
    plan = method.plan_round(r, np.random.default_rng(1), np.random.default_rng(2))
    t = plan.tasks[0]
    record = ConfigRecord(  # what the ServerApp sends (server_app.train_remote)
        {"client": t.client, "round": r, "index": 0, "scale": [float(s) for s in t.scale],
         "rank-used": t.rank_used, "weight": t.weight, "trains": t.trains}
    )  # fmt: skip
    got, _ = node.train_one(state, global_adapter, dict(record))
    # the engine's trainer on the same task (one slot, torch_id 0): the same bits
    losses = train_clients(state, r, [t.client], np.asarray(t.scale)[None, :], 0, trains=t.trains)
    want = {k: v.numpy() for k, v in state.lora.slot_state(0).items()}
    assert np.isfinite(losses).all()
    assert set(got) == set(want) == set(global_adapter)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        moved = not np.array_equal(got[k], global_adapter[k])
        assert moved == (k[-1] in t.trains), k
    state.lora.set_trainable("AB")


def test_fedsalora_is_refused_on_flower_and_fedexlora_is_not():
    with pytest.raises(ConfigError, match="method.name = 'fedsalora' is not supported on Flower"):
        check_flower_method(load_config(None, ["method.name=fedsalora"]))
    check_flower_method(load_config(None, ["method.name=fedexlora"]))


@needs_data
def test_the_node_trains_on_the_base_the_server_sends(tmp_path):
    # FedEx-LoRA on Flower: the server's sum of residuals arrives as base/<layer> arrays; the
    # node's weights become W_init + sum (bit for bit the engine's), and the next message
    # without them puts the initial base back

    from fedlora.federation.flower import node

    cfg = load_config(write_config(tmp_path, rounds=1, q='"full"'), ["method.name=fedexlora"])
    state = node.client_state(cfg)
    name = state.lora.names[0]
    w_init = state.model.get_submodule(name).weight.detach().clone()
    rng = np.random.default_rng(0)
    d1, d2 = (rng.normal(0, 1e-3, w_init.shape).astype(np.float32) for _ in range(2))
    adapter = {k: v.numpy().copy() for k, v in state.lora.global_state().items()}
    task = {"client": 0, "round": 0, "index": 0, "scale": [1.0] * cfg.lora.rank,
            "rank-used": cfg.lora.rank, "weight": 1.0, "trains": "AB"}  # fmt: skip
    sent = {**adapter, f"{node.BASE_PREFIX}{name}": d1 + d2}  # the server's run.base_delta
    node.train_one(state, sent, task)
    on_node = state.model.get_submodule(name).weight.detach().clone()
    # the engine merged d1, then d2
    state.lora.add_to_base({}, total=True)
    assert torch.equal(state.model.get_submodule(name).weight, w_init)
    state.lora.add_to_base({name: torch.from_numpy(d1)})
    state.lora.add_to_base({name: torch.from_numpy(d2)})
    assert torch.equal(state.model.get_submodule(name).weight, on_node)
    assert not torch.equal(on_node, w_init)
    node.train_one(state, adapter, task)  # no base arrays: the initial base
    assert torch.equal(state.model.get_submodule(name).weight, w_init)


@pytest.mark.slow
@needs_data
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_fedexlora_on_the_ray_simulation_is_the_engine_bit_for_bit(tmp_path):
    # the residuals merged on the server reach the nodes, or round 2 would train on another base
    from fedlora.federation.checkpoints import load_checkpoint
    from fedlora.federation.flower.common import safe_env
    from flower_cases import assert_matches_engine, engine_run

    path = write_config(tmp_path, rounds=2, q='"full"')
    path.write_text(path.read_text().replace("[method]\n", '[method]\nname = "fedexlora"\n'))
    out = tmp_path / "sim-run"
    args = [sys.executable, "-m", "fedlora.cli", "flower", "simulate", "--config", str(path),
            "--out", str(out), "--num-cpus", "2"]  # fmt: skip
    done = subprocess.run(args, env=safe_env(HF_HUB_OFFLINE="1"), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert_matches_engine(out, path, tmp_path)
    got, want = load_checkpoint(out), load_checkpoint(engine_run(path, tmp_path))
    for k, v in want["global"].items():
        assert torch.equal(got["global"][k], v), k
    assert want["base_delta"].keys() == got["base_delta"].keys()
    for k, v in want["base_delta"].items():
        np.testing.assert_array_equal(got["base_delta"][k], v, err_msg=k)
    assert any(np.abs(v).max() > 1e-4 for v in want["base_delta"].values())
