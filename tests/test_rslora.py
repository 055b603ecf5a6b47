"""rsLoRA (`lora.rslora`, issue 22): scaling α/√r as PEFT's ``use_rslora``, in the slots, the
PEFT export, and the methods that merge or rescale with the scaling."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from fedlora.config import LoraConfig, load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods import make_method
from fedlora.llm.lora import inject_lora
from fedlora.llm.models import load_model

RANK = 4


def test_scaling_is_alpha_over_sqrt_rank_with_rslora():
    assert LoraConfig(rank=16, alpha=32.0).scaling == 2.0  # α/r, bit for bit as before
    assert LoraConfig(rank=16, alpha=32.0, rslora=True).scaling == 8.0  # α/√r
    assert LoraConfig(rank=64, alpha=1.0, rslora=True).scaling == 0.125  # FSLoRA's adapters
    with pytest.raises(ConfigError, match="lora.rslora = 1 is invalid: true or false"):
        load_config(None, ["lora.rslora=1"])


def test_rslora_slots_match_peft_use_rslora_after_export(tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    base, tok = load_model("tiny-llama")
    model = copy.deepcopy(base)
    cfg = LoraConfig(rank=RANK, alpha=2.0, layers=1, rslora=True)
    lora = inject_lora(model, cfg, slots=1, seed=0)
    assert lora.scaling == 2.0 / RANK**0.5
    gen = torch.Generator().manual_seed(3)
    lora.load_global(
        {k: torch.randn(v.shape, generator=gen) * 0.2 for k, v in lora.global_state().items()}
    )
    lora.set_clients(torch.ones(1, RANK))
    lora.export_peft(tmp_path / "adapter", base_model_name_or_path="tiny-llama")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["use_rslora"] is True and saved["lora_alpha"] == 2.0 and saved["r"] == RANK
    batch = dict(tok(["plants need light", "heat moves from warm to cold"], padding=True,
                     return_tensors="pt"))  # fmt: skip
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter"))
    with torch.no_grad():
        ours, theirs = model(**batch).logits, loaded(**batch).logits
        plain = base(**batch).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-3  # the adapter does change the output
    # PEFT's own rsLoRA model has the same scaling (α/√r)
    fresh = get_peft_model(
        copy.deepcopy(base),
        PeftLoraConfig(r=RANK, lora_alpha=2.0, target_modules=["q_proj"], use_rslora=True),
    )
    layer = fresh.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(lora.scaling, rel=1e-15)


def test_methods_use_the_rslora_scaling():
    common = ["data.n_clients=2", "lora.rank=16", "lora.alpha=8", "lora.rslora=true",
              "method.ranks=[4, 16]"]  # fmt: skip
    stack = make_method(load_config(None, [*common, "method.name=fedstacklora"]),
                        np.full(2, 0.5), np.random.default_rng(0))  # fmt: skip
    assert stack.scaling == 8 / 4  # α/√γ: the merge uses the slots' factor
    het = make_method(load_config(None, [*common, "method.name=heterolora"]),
                      np.full(2, 0.5), np.random.default_rng(0))  # fmt: skip
    plan = het.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    # the slot's α/√γ times s must be a rank-r LoRA's α/√r: s = √(γ/r) = 2 for r = 4
    scales = {t.client: float(np.max(t.scale)) for t in plan.tasks}
    assert scales == {0: 2.0, 1: 1.0}
    plain = make_method(load_config(None, [*common[:3], "method.ranks=[4, 16]",
                                           "method.name=heterolora"]),
                        np.full(2, 0.5), np.random.default_rng(0))  # fmt: skip
    plan = plain.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    assert {t.client: float(np.max(t.scale)) for t in plan.tasks} == {0: 4.0, 1: 1.0}
