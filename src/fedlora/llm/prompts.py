"""What the model reads: LLM-Adapters prompts, training responses, tokens and padded batches.

A training example is the Alpaca-style prompt followed by its response ("the correct answer
is answer2", or the correct option's text) and EOS; the loss is on the response and EOS only
(labels `IGNORE_INDEX` = -100 elsewhere).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.tasks import RESPONSE_PREFIX, Example

if TYPE_CHECKING:  # pragma: no cover
    import torch

PROMPT_HEADER = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)
PROMPT_HEADER_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request."
)
IGNORE_INDEX = -100


def format_prompt(ex: Example) -> str:
    """The LLM-Adapters (Alpaca) prompt up to and including ``### Response:\\n``."""
    if ex.input:
        return (
            f"{PROMPT_HEADER_INPUT}\n\n### Instruction:\n{ex.instruction}\n\n"
            f"### Input:\n{ex.input}\n\n### Response:\n"
        )
    return f"{PROMPT_HEADER}\n\n### Instruction:\n{ex.instruction}\n\n### Response:\n"


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt tokens, with the tokenizer's BOS (if it adds one)."""
    return _encode(tokenizer, prompt, True)


def encode_continuation(tokenizer: Any, prefix: str, text: str) -> tuple[list[int], int]:
    """Tokens of ``prefix + text`` (no special tokens) and how many of them belong to `text`.

    Tokenized together so that the tokens are those the model sees in training; when the
    tokens of `prefix` alone are not a prefix of them, `text` is tokenized on its own."""
    whole = _encode(tokenizer, prefix + text, False)
    head = _encode(tokenizer, prefix.rstrip(" "), False) if prefix else []
    if whole[: len(head)] == head and len(whole) > len(head):
        return whole, len(whole) - len(head)
    tail = _encode(tokenizer, (" " if prefix.endswith(" ") else "") + text, False)
    return head + tail, len(tail)


@dataclass
class TokenizedSet:
    """Token ids per example and the training labels (IGNORE_INDEX = -100 off the response)."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    cut: int = 0  # examples whose prompt lost tokens to max_len (LLM-Adapters format)

    def __len__(self) -> int:
        return len(self.input_ids)


def parse_options(ex: Example) -> tuple[str, ...]:
    """The option texts of `ex`, aligned with `ex.labels`.

    Reads ``Label: text`` markers (case-insensitive, e.g. ``Answer1: ...``) in label order;
    a label's text runs to the next marker or the ``Answer format`` line. When no label has
    a marker (true/false tasks), the labels are their own texts."""
    text = ex.instruction
    fmt = re.search(r"\n?\s*Answer format:", text, re.IGNORECASE)
    body_end = fmt.start() if fmt else len(text)
    spans: list[tuple[int, int]] = []
    pos = 0
    for label in ex.labels:
        pat = re.compile(rf"(?<![A-Za-z0-9]){re.escape(label)}\s*:", re.IGNORECASE)
        m = pat.search(text, pos, body_end)
        if m is None:
            spans.append((-1, -1))
            continue
        spans.append((m.start(), m.end()))
        pos = m.end()
    found = [s for s in spans if s[0] >= 0]
    if not found:
        return tuple(ex.labels)
    if len(found) != len(spans):
        missing = [lab for lab, s in zip(ex.labels, spans) if s[0] < 0]
        raise DataError(
            f"task {ex.task!r}: cannot parse the options of instruction {ex.instruction!r:.100}: "
            f"no '{missing[0]}:' marker (labels {list(ex.labels)})"
        )
    options = []
    for i, (_, end) in enumerate(spans):
        stop = spans[i + 1][0] if i + 1 < len(spans) else body_end
        option = text[end:stop].strip()
        if not option:
            raise DataError(
                f"task {ex.task!r}: option {ex.labels[i]!r} is empty in {ex.instruction!r:.100}"
            )
        options.append(option)
    return tuple(options)


def response_text(ex: Example, response: str = "label") -> str:
    """The training target of `ex`: its LLM-Adapters output ("the correct answer is answer2")
    for ``response="label"``, or "the correct answer is " + the correct option's text for
    ``"option"`` (what ``evaluation.scoring = option | option_norm`` scores)."""
    if response == "label":
        return ex.output
    if response == "option":
        return RESPONSE_PREFIX + parse_options(ex)[ex.labels.index(ex.answer)]
    raise DataError(f"data.response = {response!r} is invalid: allowed: label, option")


def tokenize_examples(
    examples: Sequence[Example], tokenizer: Any, max_len: int, response: str = "label"
) -> TokenizedSet:
    """Prompt + response (+ EOS); loss only on the response and EOS (`response_text`: the
    label or the option text). Too long: the prompt is cut from the LEFT (its BOS kept) so
    the response is always whole (cut only if it alone exceeds `max_len`)."""
    if max_len < 2:
        raise DataError(f"max_len = {max_len!r} is invalid: must be >= 2")
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids_out, labels_out, cut = [], [], 0
    for ex in examples:
        prompt = encode_prompt(tokenizer, format_prompt(ex))
        target = _encode(tokenizer, response_text(ex, response), False)
        target = (target + ([eos] if eos is not None else []))[:max_len]
        room = max_len - len(target)
        if len(prompt) > room:
            cut += 1
            if room == 0:
                prompt = []
            elif bos is not None and prompt[0] == bos:
                prompt = [bos] + prompt[len(prompt) - (room - 1) :]
            else:
                prompt = prompt[len(prompt) - room :]
        ids = np.asarray(prompt + target, dtype=np.int64)
        labels = ids.copy()
        labels[: len(prompt)] = IGNORE_INDEX
        ids_out.append(ids)
        labels_out.append(labels)
    return TokenizedSet(ids_out, labels_out, cut)


def collate(ts: TokenizedSet, idx: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask (1 on tokens) and labels (-100 on pad)."""
    import torch

    if len(idx) == 0:
        raise DataError("collate: empty batch")
    t = max(len(ts.input_ids[i]) for i in idx)
    input_ids = torch.full((len(idx), t), int(pad_id), dtype=torch.long)
    labels = torch.full((len(idx), t), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(idx), t), dtype=torch.long)
    for row, i in enumerate(idx):
        n = len(ts.input_ids[i])
        input_ids[row, :n] = torch.from_numpy(ts.input_ids[i])
        labels[row, :n] = torch.from_numpy(ts.labels[i])
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
