"""Client-batched LoRA slots: PEFT equivalence, slot independence, sketch gradients, export."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from fedlora.config import LoraConfig
from fedlora.errors import ConfigError
from fedlora.lora import inject_lora
from fedlora.models import load_model
from fedlora.sketch import sketch_scale_vectors, truncation_scale_vectors

RANK = 4


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-llama")


def _random_global(lora, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """A global adapter with non-zero A and B, so every test exercises both factors."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in lora.global_state().items()}


def _batch(tok, texts: list[str]) -> dict[str, torch.Tensor]:
    return dict(tok(texts, padding=True, return_tensors="pt"))


def _loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    )


def _sgd(params, lr):
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None


TEXTS = [
    ["the correct answer is answer1", "plants need light"],
    ["heat moves from warm to cold", "a magnet attracts iron and steel"],
    ["is the moon larger? false", "birds build nests in the spring"],
]


def test_one_slot_equals_peft_lora(base):
    # Prepare: our adapter with random A, B; a PEFT LoraModel with the same weights
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model, tok = copy.deepcopy(base[0]), base[1]
    cfg = LoraConfig(
        rank=RANK, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), layers="all"
    )
    ref = get_peft_model(
        copy.deepcopy(model),
        PeftLoraConfig(r=RANK, lora_alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    lora = inject_lora(model, cfg, slots=3, seed=1)
    state = _random_global(lora, seed=2)
    lora.load_global(state)
    lora.set_clients(torch.ones(1, RANK))
    with torch.no_grad():
        for name in lora.names:
            mod = ref.base_model.model.get_submodule(name)
            mod.lora_A["default"].weight.copy_(state[f"{name}.lora_A"])
            mod.lora_B["default"].weight.copy_(state[f"{name}.lora_B"])
    batch = _batch(tok, TEXTS[0] + TEXTS[1])
    # Execute
    with torch.no_grad():
        ours = model(**batch).logits
        theirs = ref(**batch).logits
        plain = base[0](**batch).logits
    # Assert: same logits, and the adapter really changes them
    assert lora.scaling == 2.0
    assert len(lora.names) == 6  # 3 targets × 2 layers
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-3


def test_global_init_like_peft_and_seeded(base):
    model = copy.deepcopy(base[0])
    cfg = LoraConfig(rank=RANK, alpha=8.0, layers="all")
    s1 = inject_lora(model, cfg, slots=1, seed=7).global_state()
    s2 = inject_lora(copy.deepcopy(base[0]), cfg, slots=1, seed=7).global_state()
    s3 = inject_lora(copy.deepcopy(base[0]), cfg, slots=1, seed=8).global_state()
    name = "model.layers.0.self_attn.q_proj"
    a = s1[f"{name}.lora_A"]
    assert a.shape == (RANK, 64) and s1[f"{name}.lora_B"].shape == (64, RANK)
    assert torch.count_nonzero(s1[f"{name}.lora_B"]) == 0
    bound = 1 / np.sqrt(64)  # kaiming_uniform(a=√5): U(-1/√in, 1/√in)
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not torch.equal(s1[f"{name}.lora_A"], s3[f"{name}.lora_A"])


def test_slots_trained_together_equal_separate_runs(base):
    # Prepare: 3 clients with different sketches, 3 SGD steps each
    model, tok = base
    cfg = LoraConfig(
        rank=RANK, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj"), layers="all"
    )
    scales = torch.tensor(
        sketch_scale_vectors(RANK, [1, 2, 4], np.random.default_rng(3)), dtype=torch.float32
    )
    steps, lr = 3, 0.5
    together = copy.deepcopy(model)
    lora = inject_lora(together, cfg, slots=3, seed=0)
    start = _random_global(lora, seed=5)
    lora.load_global(start)
    # Execute: together (one forward/backward per step, loss = Σ_c mean loss of c)
    lora.set_clients(scales)
    for _h in range(steps):
        batch = _batch(tok, [t for c in range(3) for t in TEXTS[c]])
        n = len(TEXTS[0])
        logits = together(**batch).logits
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = sum(
            torch.nn.functional.cross_entropy(
                logits[c * n : (c + 1) * n, :-1].reshape(-1, logits.shape[-1]),
                labels[c * n : (c + 1) * n, 1:].reshape(-1),
            )
            for c in range(3)
        )
        loss.backward()
        _sgd(lora.parameters(), lr)
    together_states = [lora.slot_state(c) for c in range(3)]
    # Execute: each client alone in a single-slot adapter
    for c in range(3):
        alone = copy.deepcopy(model)
        single = inject_lora(alone, cfg, slots=1, seed=0)
        single.load_global(start)
        single.set_clients(scales[c : c + 1])
        # each client's batch padded to the common length, as in the together run
        full = _batch(tok, [t for k in range(3) for t in TEXTS[k]])
        rows = slice(c * n, (c + 1) * n)
        batch_c = {k: v[rows] for k, v in full.items()}
        for _h in range(steps):
            logits = alone(**batch_c).logits
            labels = batch_c["input_ids"].masked_fill(batch_c["attention_mask"] == 0, -100)
            torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            ).backward()
            _sgd(single.parameters(), lr)
        alone_state = single.slot_state(0)
        # Assert
        for k, v in alone_state.items():
            torch.testing.assert_close(together_states[c][k], v, rtol=0, atol=1e-5)
        assert any((alone_state[k] - start[k]).abs().max() > 1e-4 for k in start)


def test_components_outside_the_sketch_get_zero_gradient(base):
    model, tok = copy.deepcopy(base[0]), base[1]
    lora = inject_lora(model, LoraConfig(rank=RANK, alpha=8.0, layers="all"), slots=2, seed=0)
    lora.load_global(_random_global(lora, seed=1))
    scales = torch.tensor([[0.0, 2.0, 0.0, 2.0], [1.0, 1.0, 1.0, 0.0]])  # sketch, truncation
    lora.set_clients(scales)
    _loss(model, _batch(tok, TEXTS[0] + TEXTS[1])).backward()
    for layer in lora.layers.values():
        ga, gb = layer.lora_A.grad, layer.lora_B.grad  # (2, r, in), (2, out, r)
        for c in range(2):
            off = scales[c] == 0
            assert torch.all(ga[c, off] == 0) and torch.all(gb[c][:, off] == 0)
            assert ga[c, ~off].abs().max() > 0 and gb[c][:, ~off].abs().max() > 0


def test_set_clients_broadcasts_global_and_scales_from_sketch_helpers(base):
    model = copy.deepcopy(base[0])
    lora = inject_lora(model, LoraConfig(rank=RANK, layers="all"), slots=4, seed=0)
    g = _random_global(lora, seed=3)
    lora.load_global(g)
    scales = torch.tensor(truncation_scale_vectors(RANK, [1, 3]), dtype=torch.float32)
    lora.set_clients(scales)
    assert lora.active == 2
    for c in range(2):
        assert all(torch.equal(lora.slot_state(c)[k], g[k]) for k in g)
    layer = next(iter(lora.layers.values()))
    assert torch.equal(layer.scale[:2], torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 0]]))
    with pytest.raises(ConfigError, match="slot 2 is not active"):
        lora.slot_state(2)


def test_sketch_scale_multiplies_the_adapter_output(base):
    # Prepare: scale 2 on every component must double the LoRA delta exactly
    model, tok = copy.deepcopy(base[0]), base[1]
    lora = inject_lora(
        model, LoraConfig(rank=RANK, target_modules=("v_proj",), layers="all"), slots=1
    )
    lora.load_global(_random_global(lora, seed=4))
    batch = _batch(tok, TEXTS[0])
    name = lora.names[0]
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    layer = lora.layers[name]
    lora.set_clients(torch.ones(1, RANK))
    d1 = layer.delta(x)
    lora.set_clients(2 * torch.ones(1, RANK))
    d2 = layer.delta(x)
    # Assert: hand-computed delta = scaling · x Aᵀ Bᵀ
    g = lora.global_state()
    expected = lora.scaling * x @ g[f"{name}.lora_A"].T @ g[f"{name}.lora_B"].T
    torch.testing.assert_close(d1, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(d2, 2 * expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        model(**batch)


def test_export_loads_in_peft_with_the_same_logits(base, tmp_path):
    from peft import PeftModel

    model, tok = copy.deepcopy(base[0]), base[1]
    lora = inject_lora(model, LoraConfig(rank=RANK, alpha=16.0, layers=1), slots=2, seed=0)
    lora.load_global(_random_global(lora, seed=9))
    lora.set_clients(torch.ones(1, RANK))
    lora.export_peft(tmp_path / "adapter", base_model_name_or_path="tiny-llama")
    batch = _batch(tok, TEXTS[2])
    loaded = PeftModel.from_pretrained(copy.deepcopy(base[0]), str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=1e-5)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == 16.0
    assert cfg["base_model_name_or_path"] == "tiny-llama"


def test_top_k_layers_and_layer_shapes(base):
    model = copy.deepcopy(base[0])
    lora = inject_lora(model, LoraConfig(target_modules=("q_proj", "k_proj"), layers=1), slots=1)
    assert lora.names == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    # tiny-llama: hidden 64, 4 heads of 16, 2 kv heads -> k_proj is 32 × 64
    assert lora.layer_shapes() == {
        "model.layers.1.self_attn.q_proj": (64, 64),
        "model.layers.1.self_attn.k_proj": (32, 64),
    }


def test_add_to_base_changes_the_frozen_weight(base):
    model = copy.deepcopy(base[0])
    lora = inject_lora(model, LoraConfig(target_modules=("q_proj",), layers="all"), slots=1)
    name = lora.names[0]
    before = model.get_submodule(name).weight.clone()
    delta = torch.full((64, 64), 0.25)
    lora.add_to_base({name: delta})
    torch.testing.assert_close(model.get_submodule(name).weight, before + 0.25)
    with pytest.raises(ConfigError, match="expected \\(64, 64\\)"):
        lora.add_to_base({name: torch.zeros(3, 3)})


def test_bad_inputs(base):
    model = copy.deepcopy(base[0])
    with pytest.raises(ConfigError, match=r"lora.target_modules.*q_proj.*v_proj"):
        inject_lora(model, LoraConfig(target_modules=("qkv",), layers="all"), slots=1)
    with pytest.raises(ConfigError, match="lora.layers"):
        inject_lora(model, LoraConfig(layers=3), slots=1)
    with pytest.raises(ConfigError, match="lora.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="training.slots"):
        inject_lora(model, LoraConfig(layers="all"), slots=0)
    lora = inject_lora(model, LoraConfig(rank=RANK, layers="all"), slots=2)
    with pytest.raises(ConfigError, match=r"expected \(c, 4\) with 1 <= c <= slots = 2"):
        lora.set_clients(torch.ones(3, RANK))
    state = lora.global_state()
    state.pop(next(iter(state)))
    with pytest.raises(ConfigError, match="missing"):
        lora.load_global(state)


def test_add_to_base_in_bf16_carries_the_rounding_error_over_20_merges(base):
    # Prepare: a bf16 base; 20 FedStackLoRA-sized merges (mean |ΔW| = 1e-5, below bf16's
    # resolution at |W| ~ 0.02, where one ulp is ~1e-4)
    model = copy.deepcopy(base[0]).to(torch.bfloat16)
    lora = inject_lora(model, LoraConfig(target_modules=("q_proj",), layers="all"), slots=1)
    name = lora.names[0]
    w0 = model.get_submodule(name).weight.detach().float().clone()
    gen = torch.Generator().manual_seed(0)
    total = torch.zeros_like(w0)
    # Execute
    for _ in range(20):
        delta = torch.randn(w0.shape, generator=gen) * 1.25e-5  # mean |d| = 1e-5
        total += delta
        lora.add_to_base({name: delta})
    # Assert: the bf16 weight is the fp32 merge rounded once (to bf16 resolution: half an
    # ulp, 2^-8 relative); per-merge rounding instead loses most of these updates
    w = model.get_submodule(name).weight.detach().float()
    ref = w0 + total
    assert torch.all((w - ref).abs() <= ref.abs() * 2.0**-8 * 1.0001)
    assert (w == ref.to(torch.bfloat16).float()).float().mean() > 0.999
    # and the fp32 residual holds what bf16 cannot: weight + residual = the fp32 merge
    residual = lora.base_residual()[name]
    torch.testing.assert_close(w + residual, ref, rtol=0, atol=1e-7)
