"""Shared by the data tests (test_tasks.py, test_prompts.py, test_data.py): a character
tokenizer and small LLM-Adapters records and directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = os.environ.get("FEDLORA_DATA", "")
needs_data = pytest.mark.skipif(
    not DATA or not Path(DATA).is_dir(), reason="FEDLORA_DATA (shared commonsense data) absent"
)


class CharTok:
    """One token per character (id = ord + 3); BOS = 1 when special tokens are asked for."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) + 3 for c in text]}


def chars(text: str) -> list[int]:
    return [ord(c) + 3 for c in text]


def mc_record(q: str, options: list[str], answer: int) -> dict[str, str]:
    labels = [f"answer{i + 1}" for i in range(len(options))]
    opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
    return {
        "instruction": f"Please choose the correct answer to the question: {q}\n\n{opts}\n\n"
        f"Answer format: {'/'.join(labels)}",
        "input": "",
        "output": f"the correct answer is {labels[answer]}",
        "answer": labels[answer],
    }


def write_layout(root: Path, tasks: dict[str, dict[str, list[dict]]]) -> Path:
    """An LLM-Adapters directory: {folder: {split: records}}."""
    for folder, splits in tasks.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for split, records in splits.items():
            (root / folder / f"{split}.json").write_text(json.dumps(records))
    return root


def small_layout(root: Path) -> Path:
    arc = [mc_record(f"arc q{i}", ["a", "b", "c", "d"], i % 4) for i in range(30)]
    obqa = [mc_record(f"obqa q{i}", ["w", "x", "y", "z"], (i + 1) % 4) for i in range(20)]
    siqa = [mc_record(f"siqa q{i}", ["p", "q", "r"], i % 3) for i in range(9)]
    return write_layout(
        root,
        {
            "ARC-Easy": {"train": arc, "test": arc[:12]},
            "openbookqa": {"train": obqa, "test": obqa[:5]},
            "social_i_qa": {"test": siqa},
        },
    )
