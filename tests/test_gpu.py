"""The engine on a CUDA GPU: two rounds on tiny-llama and SmolLM2, and a GPU run resumed on the
CPU. Marked `gpu`; skipped (not failed) where CUDA is absent (`pytest -m gpu` selects them)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.files import default_cache_dir
from fedlora.llm.models import SMOLLM2_SPEC

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found"),
]

BASE = [
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "boolq"]',
    "data.train_limit=40",
    "data.eval_limit=12",
    "data.max_seq_len=96",
    "data.n_clients=4",
    "data.min_client_examples=4",
    "lora.rank=4",
    "training.rounds=2",
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=2",
    "training.eval_every=1",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    "method.q=[1.0, 0.5, 0.5, 1.0]",
    "method.k=[1, 2, 4, 3]",
    "output.progress=false",
]
MODELS = {
    "tiny-llama": ["model.name=tiny-llama", 'lora.layers="all"'],
    "tiny-llama-cache": ["model.name=tiny-llama", "lora.layers=1"],  # the frozen-layer cache
    "smollm2-135m": ["model.name=smollm2-135m", "lora.layers=2"],
}


def _run(run_dir: Path, *overrides: str, resume: bool = False) -> dict:
    cfg = load_config(None, [*BASE, *overrides])
    if not resume:
        prepare_run_dir(cfg, run_dir)
    return run_experiment(cfg, run_dir, resume=resume, quiet=True, log=lambda m: None)


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("model", list(MODELS))
def test_two_rounds_on_cuda(tmp_path, model):
    if model == SMOLLM2_SPEC and not (default_cache_dir() / SMOLLM2_SPEC).is_dir():
        pytest.skip("smollm2-135m is not converted in the cache (needs a network once)")
    run_dir = tmp_path / model
    summary = _run(run_dir, *MODELS[model], "model.device=cuda")  # dtype auto
    saved = load_config(run_dir / "config.toml")
    assert saved.model.device.startswith("cuda:")
    assert saved.model.dtype == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 2 and len(lines) == 3
    assert all(np.isfinite(m["train_loss"]) for m in lines[1:] if m["train_loss"] is not None)
    assert all(0.0 <= m["eval_accuracy"] <= 1.0 for m in lines)
    assert all(t.device.type == "cpu" for t in _adapter(run_dir).values())


def test_a_gpu_run_resumes_on_the_cpu_with_the_same_adapter(tmp_path):
    """Checkpoints are device-independent: round 2 after a GPU round 1 gives, on the CPU, the
    adapter the GPU gives (fp32, to float tolerance)."""
    first = tmp_path / "gpu"
    _run(first, *MODELS["tiny-llama"], "model.device=cuda", "model.dtype=fp32", "training.rounds=1")
    on_gpu, on_cpu = tmp_path / "resume-gpu", tmp_path / "resume-cpu"
    shutil.copytree(first, on_gpu)
    shutil.copytree(first, on_cpu)
    _run(on_gpu, *MODELS["tiny-llama"], "model.device=cuda", "model.dtype=fp32", resume=True)
    _run(on_cpu, *MODELS["tiny-llama"], "model.device=cpu", "model.dtype=fp32", resume=True)
    a, b = _adapter(on_gpu), _adapter(on_cpu)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
