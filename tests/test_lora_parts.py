"""The SlotLora support the post-FSLoRA methods need: frozen factors (FFA-LoRA, RoLoRA,
Fed-SB), Fed-SB's middle r × r factor R, a client's own tensors in its slot (FedSA-LoRA),
and base merges that a resume reproduces bit for bit (FedEx-LoRA)."""

from __future__ import annotations

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.llm.models import load_model
from fedlora.llm.train import local_train
from train_cases import PROMPTS, RANK, fresh, make_batch


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-qwen2")


def _train(model, lora, tok, steps=2):
    batches = [[make_batch(tok, PROMPTS[2 * c : 2 * c + 2])] * steps for c in range(lora.active)]
    return local_train(model, lora, batches, 0.05)


@pytest.mark.parametrize("parts", ["B", "A"])
def test_a_frozen_factor_does_not_move_and_the_other_does(base, parts):
    model, lora = fresh(base, slots=2)
    g = lora.global_state()
    lora.set_clients(torch.ones(2, RANK))
    lora.set_trainable(parts)
    _train(model, lora, base[1])
    frozen = "lora_A" if parts == "B" else "lora_B"
    moved = "lora_B" if parts == "B" else "lora_A"
    for c in range(2):
        s = lora.slot_state(c)
        for k in s:
            if k.endswith(frozen):
                assert torch.equal(s[k], g[k])
        assert any(not torch.equal(s[k], g[k]) for k in s if k.endswith(moved))
    lora.set_trainable("AB")
    with pytest.raises(ConfigError, match="trainable LoRA factors"):
        lora.set_trainable("R")  # no middle factor yet


def test_middle_factor_computes_b_r_a_and_trains_alone(base):
    model, lora = fresh(base, slots=1)
    tok = base[1]
    batch = make_batch(tok, PROMPTS[:2])
    with torch.no_grad():
        before = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits
    lora.enable_middle()  # R = I: the same function
    with torch.no_grad():
        same = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits
    torch.testing.assert_close(same, before, rtol=0, atol=1e-6)
    # with R random, the layer's delta is (α/r) B R A x
    gen = torch.Generator().manual_seed(5)
    g = lora.global_state()
    g = {
        k: (torch.randn(v.shape, generator=gen) if k.endswith("lora_R") else v)
        for k, v in g.items()
    }
    lora.load_global(g)
    lora.set_clients(torch.ones(1, RANK))
    name = lora.names[0]
    layer = lora.layers[name]
    x = torch.randn(3, layer.in_features, generator=gen)
    ref = lora.scaling * x @ (g[f"{name}.lora_B"] @ g[f"{name}.lora_R"] @ g[f"{name}.lora_A"]).T
    torch.testing.assert_close(layer.delta(x), ref, rtol=1e-5, atol=1e-6)
    # Fed-SB trains R only: A and B stay exactly as they were
    lora.set_trainable("R")
    _train(model, lora, tok)
    s = lora.slot_state(0)
    for k in s:
        assert torch.equal(s[k], g[k]) != k.endswith("lora_R")


def test_set_slot_puts_a_clients_own_tensors_in_its_slot(base):
    _, lora = fresh(base, slots=2)
    lora.set_clients(torch.ones(2, RANK))
    key = next(k for k in lora.global_state() if k.endswith("lora_B"))
    own = torch.full_like(lora.global_state()[key], 0.5)
    lora.set_slot(1, {key: own})
    assert torch.equal(lora.slot_state(1)[key], own)
    assert torch.equal(lora.slot_state(0)[key], lora.global_state()[key])
    with pytest.raises(ConfigError, match="not a tensor"):
        lora.set_slot(0, {"nope.lora_B": own})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_the_sum_at_once_equals_merging_round_by_round(base, dtype):
    # a resumed run merges the checkpoint's sum of deltas; the uninterrupted one merged each
    gen = torch.Generator().manual_seed(0)
    deltas = [{n: torch.randn(64, 64, generator=gen) * 1e-3} for n in ["x"] * 5]
    runs = []
    for at_once in (False, True):
        model, lora = fresh(base, slots=1)
        model.to(dtype)
        name = lora.names[0]
        ds = [{name: d["x"]} for d in deltas]
        if at_once:
            total = torch.zeros(64, 64)
            for d in ds:
                total += d[name]
            lora.add_to_base({name: total})
        else:
            for d in ds:
                lora.add_to_base(d)
        runs.append(model.get_submodule(name).weight.detach().clone())
    assert torch.equal(runs[0], runs[1])
