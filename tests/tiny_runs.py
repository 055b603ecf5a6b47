"""Run configs the evaluation tests share: a tiny random-init model on real commonsense data."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))

# Two clients, two rounds, evaluation every round on ARC-e and BoolQ (10 questions each).
TINY_EVAL_RUN = [
    "model.name=tiny-llama",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]',
    'data.eval_tasks=["arc-e", "boolq"]',
    "data.train_limit=40",
    "data.eval_limit=10",
    "data.max_seq_len=96",
    "data.n_clients=2",
    "data.min_client_examples=4",
    "lora.rank=4",
    "lora.layers=1",
    "training.rounds=2",
    "training.local_steps=1",
    "training.batch_size=2",
    "training.eval_every=1",
    "training.lr=0.05",
    "method.q=full",
    "method.k=full",
    "output.progress=false",
]

# Four clients of 6 ARC-e examples on tiny-llama with LoRA on every layer (one local step of
# batch 2, 4 evaluation questions): the base of the optimizer and privacy runs, which add
# their rounds, evaluation grid and method.
TINY_FOUR_CLIENTS = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]',
    "data.train_limit=24",
    "data.eval_limit=4",
    "data.max_seq_len=64",
    "data.n_clients=4",
    "data.min_client_examples=4",
    "lora.rank=4",
    'lora.layers="all"',
    "training.local_steps=1",
    "training.batch_size=2",
    "training.checkpoint_every=1",
    "output.progress=false",
]


def load_script(relative: str) -> ModuleType:
    """A research script (not a package module) loaded by its path from the repository root."""
    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
