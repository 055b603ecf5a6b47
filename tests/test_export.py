"""`fedlora export RUN_DIR --merged OUT`: a transformers directory whose logits equal the base
model's with the run's adapter attached, for every adapter form fedlora writes (the top-K
layers, rsLoRA's scaling, Fed-SB's B·R·A, merges into the base), loaded without fedlora."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.config.toml_io import dump_toml
from fedlora.federation.checkpoints import save_checkpoint
from fedlora.llm.lora import inject_lora
from fedlora.llm.merge import lora_deltas
from fedlora.llm.models import load_model

IDS = [[1, 17, 230, 99, 512, 7, 45, 300]]
# the transformers-only side: no fedlora import, its logits written as .npy
LOAD = (
    "import sys, numpy, torch\n"
    "from transformers import AutoModelForCausalLM\n"
    "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
    "with torch.no_grad():\n"
    f"    out = m(torch.tensor({IDS!r})).logits.float().numpy()\n"
    "assert not any(k.startswith('fedlora') for k in sys.modules), 'fedlora was imported'\n"
    "numpy.save(sys.argv[2], out)\n"
    "print(m.dtype)\n"
)


def _fake_run(run_dir: Path, dtype: str, overrides: list[str]):
    """A run directory whose final state is a random adapter (and base merge) on tiny-llama;
    returns the logits of base + adapter, the base's weights and the final adapter state."""
    cfg = load_config(
        None,
        ["model.name=tiny-llama", f'model.dtype="{dtype}"', "lora.rank=4", *overrides],
    )
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    model, _ = load_model("tiny-llama", dtype=dtype)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = inject_lora(model, cfg.lora, slots=1, seed=0)
    gen = torch.Generator().manual_seed(1)
    state = {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in lora.global_state().items()}
    if "method.name=fedsb" in overrides:
        lora.enable_middle()
        state.update({f"{n}.lora_R": torch.randn(4, 4, generator=gen) for n in lora.names})
    lora.load_global(state)
    lora.set_clients(torch.ones(1, 4))
    layer = lora.names[0]
    base_delta = {layer: np.random.default_rng(2).normal(size=lora.layer_shapes()[layer]) * 0.01}
    lora.add_to_base({k: torch.from_numpy(v) for k, v in base_delta.items()})
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits.float().numpy()
    progress = {"round": 3, "metrics_lines": 0}
    save_checkpoint(
        run_dir,
        {"round": 3, "progress": progress, "global": lora.global_state(), "base_delta": base_delta},
    )
    lora.export_peft(run_dir / "adapter", base_model_name_or_path="tiny-llama")
    (run_dir / "summary.json").write_text(json.dumps({"rounds": 3, "stop_reason": "max_rounds"}))
    return logits, base, lora


def _export_and_load(run_dir: Path, out: Path, tmp_path: Path) -> tuple[np.ndarray, str]:
    assert main(["export", str(run_dir), "--merged", str(out)]) == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(out), str(tmp_path / "logits.npy")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(tmp_path / "logits.npy"), done.stdout.strip()


def test_fed_sb_rslora_top_k_and_a_base_merge_fold_into_the_same_logits(tmp_path: Path) -> None:
    run = tmp_path / "run"
    want, base, lora = _fake_run(
        run, "fp32", ["lora.layers=1", "lora.rslora=true", "method.name=fedsb"]
    )
    assert lora.scaling == pytest.approx(32 / 2)  # alpha / sqrt(r)
    got, dtype = _export_and_load(run, tmp_path / "merged", tmp_path)
    assert dtype == "torch.float32"
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    # the top-K rule: only the last layer was adapted; every other weight is the base's bits
    from safetensors.torch import load_file

    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    adapted = {f"{n}.weight" for n in lora.names}
    assert adapted and all(".layers.1." in k for k in adapted)
    for k, v in base.items():
        if k in merged:
            assert torch.equal(merged[k], v) == (k not in adapted), k


def test_a_bf16_base_is_rounded_once_and_the_peft_adapter_serves_without_checkpoints(
    tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    _, base, lora = _fake_run(run, "bf16", ["lora.layers=1"])
    for ckpt in (run / "checkpoints").iterdir():
        ckpt.unlink()  # the PEFT adapter alone: no base merge, B already B·R
    out = tmp_path / "merged"
    assert main(["export", str(run), "--merged", str(out)]) == 0
    assert "from the " + str(run / "adapter") in capsys.readouterr().out
    from safetensors.torch import load_file

    merged = load_file(str(out / "model.safetensors"))
    deltas = lora_deltas(lora.global_state(), 32 / 4)  # alpha / r
    for n, d in deltas.items():
        want = (base[f"{n}.weight"].float() + d).to(torch.bfloat16)
        assert merged[f"{n}.weight"].dtype == torch.bfloat16
        assert torch.equal(merged[f"{n}.weight"], want)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert main(["export", str(run), "--merged", str(out)]) == 2  # not empty: --overwrite
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--merged", str(tmp_path / "x")]) == 2
