"""Every baseline runs two rounds end to end on a tiny random-init model and real data, and
pays exactly for what it sends; FedStackLoRA's merge into the base keeps the model's function."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.methods.fedstacklora import FedStackLoRA
from fedlora.federation.methods.ranks import capability_ranks
from fedlora.federation.run import prepare_run_dir, run_experiment

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

GAMMA = 4
TINY = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "boolq"]',
    "data.train_limit=24",
    "data.eval_limit=8",
    "data.max_seq_len=64",
    "data.n_clients=4",
    "data.min_client_examples=4",
    f"lora.rank={GAMMA}",
    'lora.layers="all"',
    "training.rounds=2",
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=4",
    "training.eval_every=2",
    "training.lr=0.05",
    "network.bits_per_param=16",
    "output.progress=false",
]


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[Path, dict]:
    cfg = load_config(None, [*TINY, f'method.name="{name}"', *extra])
    run_dir = tmp_path / name
    prepare_run_dir(cfg, run_dir)
    return run_dir, run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tau(run_dir: Path) -> np.ndarray:
    with open(run_dir / "clients.csv", encoding="utf-8") as f:
        return np.array([float(row["tau_full_s"]) for row in csv.DictReader(f)])


def _per_component_params(run_dir: Path) -> int:
    """Σ (out + in) over the adapted layers, from the exported PEFT adapter."""
    from safetensors.torch import load_file

    tensors = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    total = 0
    for name, t in tensors.items():
        if "lora_A" in name:
            total += t.shape[1]  # in
        elif "lora_B" in name:
            total += t.shape[0]  # out
    return total


@needs_data
@pytest.mark.parametrize("name", ["fslora", "heterolora", "fedstacklora", "flexlora"])
def test_baseline_runs_two_rounds_and_pays_for_what_it_sends(tmp_path, name):
    # Prepare / Execute: 2 of 4 clients per round, capability rank budgets
    run_dir, summary = _run(tmp_path, name, "method.clients_per_round=2")
    lines = _metrics(run_dir)
    # Assert: round 0 + two rounds, two participants each, a finite loss and an accuracy
    assert summary["rounds"] == 2 and len(lines) == 3
    ranks = capability_ranks(_tau(run_dir), GAMMA)
    per_component = _per_component_params(run_dir)
    for line in lines[1:]:
        assert line["n_participants"] == 2
        assert np.isfinite(line["train_loss"])
        # fslora's reference sketch sizes are uniform on [4, γ]: γ = 4 here
        expected = [GAMMA if name == "fslora" else int(ranks[n]) for n in line["participants"]]
        assert line["k"] == expected
        up = 16 * per_component * sum(line["k"])
        assert line["uplink_bits"] == up
        # FedStackLoRA: each participant downloads the whole stack (2 × Σ r); others r_n each
        assert line["downlink_bits"] == (2 * up if name == "fedstacklora" else up)
    assert 0.0 <= lines[-1]["eval_accuracy"] <= 1.0
    state = load_checkpoint(run_dir)
    if name == "fedstacklora":  # merged into the base twice; the adapter is a fresh one
        assert state["base_delta"] and all(np.any(d != 0) for d in state["base_delta"].values())
        assert all(torch.all(v == 0) for k, v in state["global"].items() if "lora_B" in k)
    else:
        assert not state["base_delta"]
        assert any(torch.any(v != 0) for k, v in state["global"].items() if "lora_B" in k)


@needs_data
def test_fedstacklora_run_resumes_identically(tmp_path):
    # the fresh adapter of each round comes from (seed, round): a resumed run matches
    _, full = _run(tmp_path, "fedstacklora", "training.checkpoint_every=1")
    cfg = load_config(None, [*TINY, 'method.name="fedstacklora"', "training.rounds=1"])
    run_dir = tmp_path / "part"
    prepare_run_dir(cfg, run_dir)
    run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    cfg2 = load_config(None, [*TINY, 'method.name="fedstacklora"'])
    resumed = run_experiment(cfg2, run_dir, resume=True, quiet=True, log=lambda m: None)
    assert resumed["final_accuracy"] == full["final_accuracy"]
    a = _metrics(tmp_path / "fedstacklora")[-1]
    b = _metrics(run_dir)[-1]
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


def test_fedstacklora_merge_keeps_the_model_function():
    # Prepare: a tiny model whose adapter is a trained-looking B, A (one client, rank γ,
    # weight 1): base + scaling·B A must equal (base + base_delta) + fresh adapter (B = 0).
    from fedlora.config import LoraConfig
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model

    model, _ = load_model("tiny-llama", dtype="fp32")
    lora = inject_lora(model, LoraConfig(rank=GAMMA, alpha=8.0, layers="all"), slots=1, seed=0)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) * 0.2 for k, v in lora.global_state().items()}
    lora.load_global(state)
    ids = torch.randint(0, 100, (1, 12), generator=gen)
    with torch.no_grad():
        lora.set_clients(torch.zeros(1, GAMMA))
        base_only = model(input_ids=ids).logits
        lora.set_clients(torch.ones(1, GAMMA))
        before = model(input_ids=ids).logits
    method = FedStackLoRA(
        a=np.ones(1), ranks=np.array([GAMMA]), gamma=GAMMA, scaling=lora.scaling, seed=0
    )
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(1))
    numpy_state = {k: v.numpy() for k, v in state.items()}
    # Execute
    agg = method.aggregate(numpy_state, plan, [numpy_state])
    lora.add_to_base({k: torch.from_numpy(v) for k, v in agg.base_delta.items()})
    lora.load_global({k: torch.from_numpy(v) for k, v in agg.global_state.items()})
    lora.set_clients(torch.ones(1, GAMMA))
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # Assert: same function (fp32 rounding only); and the delta is really scaling · B A
    name = next(iter(agg.base_delta))
    expected = lora.scaling * numpy_state[f"{name}.lora_B"] @ numpy_state[f"{name}.lora_A"]
    assert np.allclose(agg.base_delta[name], expected, atol=1e-6)
    assert not torch.allclose(base_only, before, atol=1e-3)  # the adapter mattered
    assert torch.allclose(before, after, atol=1e-4)


@needs_data
def test_cli_runs_a_baseline(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["run", "-q", "--out", str(out), *TINY, 'method.name="flexlora"'])
    assert code == 0
    assert (out / "summary.json").exists()
    assert "rounds: 2" in capsys.readouterr().out
