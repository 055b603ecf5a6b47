"""Shared by the local-training tests (test_train.py, test_layer_cache.py): prompts, a
right-padded batch with labels on the responses, a model copy with seeded LoRA slots."""

from __future__ import annotations

import copy

import torch

from fedlora.config import LoraConfig
from fedlora.llm.lora import inject_lora

RANK = 4
PROMPTS = [
    ("Question: which tool measures mass? Answer:", " a balance"),
    ("Is the moon larger than the earth?", " false"),
    ("What do plants need to make food?", " light and water"),
    ("Heat moves from", " warmer to colder objects"),
    ("A magnet attracts", " iron"),
    ("Birds build nests in", " the spring"),
]


def make_batch(tok, pairs) -> dict[str, torch.Tensor]:
    """Right-padded (b, T) batch with labels only on the response tokens."""
    rows = []
    for prompt, response in pairs:
        p = tok(prompt)["input_ids"]
        r = tok(response)["input_ids"] + [tok.eos_token_id]
        rows.append((p + r, [-100] * len(p) + r))
    t = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), t), tok.pad_token_id)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    labels = torch.full((len(rows), t), -100)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], mask[i, : len(x)], labels[i, : len(y)] = (
            torch.tensor(x),
            1,
            torch.tensor(y),
        )
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def fresh(base, slots, seed=0, layers="all"):
    model = copy.deepcopy(base[0])
    cfg = LoraConfig(rank=RANK, alpha=8.0, target_modules=("q_proj", "v_proj"), layers=layers)
    lora = inject_lora(model, cfg, slots=slots, seed=seed)
    gen = torch.Generator().manual_seed(11)
    lora.load_global(
        {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in lora.global_state().items()}
    )
    return model, lora
