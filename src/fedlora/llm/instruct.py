"""Instruction data: Alpaca ``instruction / input / output`` records and chat ``messages``,
trained on the response tokens only and evaluated by held-out response loss and perplexity.

    {"instruction": "Name a primary colour.", "input": "", "output": "Red."}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

An Alpaca record reads the LLM-Adapters (Alpaca) prompt and its output then EOS; a chat
record is rendered with the tokenizer's chat template (`data.chat_template` gives one to a
tokenizer without it): the conversation up to its last message with the generation prompt is
the prompt, the rest of the rendered conversation (the last assistant message and the
template's end of turn) the response. Labels are -100 on the prompt: the loss is on the
response tokens only. An example longer than `data.max_seq_len` is dropped, never cut.

`response_loss` scores held-out records: per record the mean negative log-likelihood of its
response tokens, averaged over the records with a normal 95% interval (records are the
independent units); perplexity = exp(loss), its interval exp of the loss's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.chat_render import (
    NOT_PREFIX,
    RENDER_SECONDS,
    check_chat_records,
    no_response,
    read_chat_template,
    template_failure,
    within,
)
from fedlora.llm.prompts import IGNORE_INDEX, TokenizedSet, collate, encode_prompt, format_prompt
from fedlora.llm.user_tasks import field_names, kind, non_scalars, read_records, scalars

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Instruction:
    """One instruction record: Alpaca (`instruction`, `input`, `output`) or chat
    (`messages`: (role, content) pairs, the last the assistant's response)."""

    task: str
    instruction: str = ""
    input: str = ""
    output: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    fields: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    source: str = field(default="", compare=False)  # "file: line N"
    non_scalar: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # (name, kind)

    @property
    def chat(self) -> bool:
        return bool(self.messages)


def _text(rec: dict, name: str, where: str, required: bool = True) -> str:
    value = rec.get(name, "")
    if value is None:
        value = ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise DataError(f"{where}: field {name!r} must be a non-empty string, got {kind(value)}")
    return value


def record_to_instruction(rec: Any, task: str, where: str) -> Instruction:
    """One Alpaca or chat record as an `Instruction` (`DataError` naming `where` and the field)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a record must be an object, got {kind(rec)}")
    meta = {"fields": scalars(rec), "source": where, "non_scalar": non_scalars(rec)}
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or len(msgs) < 2:
            raise DataError(f"{where}: field 'messages' must be a list of >= 2 messages")
        out = []
        for i, m in enumerate(msgs):
            f = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                got = kind(m) if not isinstance(m, dict) else f"role {kind(m.get('role'))}"
                raise DataError(
                    f"{where}: field {f!r} must be an object with role {', '.join(ROLES)}, "
                    f"got {got}"
                )
            out.append((m["role"], _text(m, "content", f"{where}: {f}")))
        if out[-1][0] != "assistant":
            raise DataError(
                f"{where}: field 'messages[{len(out) - 1}]': the last message must be the "
                f"assistant's (the response trained on), got role {out[-1][0]!r}"
            )
        return Instruction(task, messages=tuple(out), **meta)
    if "instruction" not in rec and "output" not in rec:
        raise DataError(
            f"{where}: neither 'messages' nor 'instruction'/'output' fields (fields: "
            f"{field_names(rec)})"
        )
    return Instruction(
        task,
        instruction=_text(rec, "instruction", where),
        input=_text(rec, "input", where, required=False),
        output=_text(rec, "output", where),
        **meta,
    )


def load_instructions(paths: Sequence[str], task: str) -> list[Instruction]:
    """Every record of .json / .jsonl / .csv instruction files."""
    return [
        record_to_instruction(rec, task, where) for p in paths for where, rec in read_records(p)
    ]


def set_chat_template(tokenizer: Any, path: str) -> None:
    """Give the tokenizer the Jinja chat template in file `path` ("" = keep its own): a
    regular file of at most 1 MiB (`fedlora.llm.chat_render.read_chat_template`)."""
    if path:
        tokenizer.chat_template = read_chat_template(path)


def check_instruction_templates(template: str, records: Sequence[Instruction]) -> None:
    """Before any run directory exists: `template` (data.chat_template, "" = none) read,
    compiled and rendered, bounded, for every chat record (`check_chat_records`)."""
    if template:
        chats = [(r.source or f"task {r.task!r}", r.messages) for r in records if r.chat]
        check_chat_records(template, chats)


def _chat_texts(tokenizer: Any, ins: Instruction) -> tuple[str, str]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"task {ins.task!r}: chat records need a chat template and this tokenizer has none: "
            "set data.chat_template to a Jinja template file, or use Alpaca records"
        )
    msgs = [{"role": r, "content": c} for r, c in ins.messages]
    where = ins.source or f"task {ins.task!r}"
    try:  # bounded in time; any error of the template is one line naming the record
        prompt = within(
            RENDER_SECONDS,
            lambda: tokenizer.apply_chat_template(
                msgs[:-1], tokenize=False, add_generation_prompt=True
            ),
        )
        whole = within(RENDER_SECONDS, lambda: tokenizer.apply_chat_template(msgs, tokenize=False))
    except Exception as e:  # noqa: BLE001 - whatever the template raises
        raise DataError(f"{where}: the chat template fails: {template_failure(e)}") from None
    if not whole.startswith(prompt):
        raise DataError(f"{where}: {NOT_PREFIX}")
    return prompt, whole[len(prompt) :]


def encode_instruction(tokenizer: Any, ins: Instruction) -> tuple[list[int], list[int]]:
    """(prompt tokens, response tokens) of one record."""
    if ins.chat:
        prompt, response = _chat_texts(tokenizer, ins)
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        target = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        return ids, target
    eos = getattr(tokenizer, "eos_token_id", None)
    target = list(tokenizer(ins.output, add_special_tokens=False)["input_ids"])
    return encode_prompt(tokenizer, format_prompt(ins)), target + ([eos] if eos is not None else [])


def tokenize_instructions(
    records: Sequence[Instruction], tokenizer: Any, max_len: int
) -> tuple[TokenizedSet, list[int]]:
    """Prompt + response tokens, labels -100 on the prompt; records longer than `max_len`
    are dropped. Returns the set and the indices it kept. Chat records whose rendering has
    no response token are a `DataError` naming them (a template that writes nothing for the
    last message), not dropped."""
    ids_out, labels_out, kept, silent = [], [], [], []
    for i, ins in enumerate(records):
        prompt, target = encode_instruction(tokenizer, ins)
        if not target:
            silent.append(ins.source or f"task {ins.task!r} record {i}")
            continue
        if len(prompt) + len(target) > max_len:
            continue
        ids = np.asarray(prompt + target, dtype=np.int64)
        labels = ids.copy()
        labels[: len(prompt)] = IGNORE_INDEX
        ids_out.append(ids)
        labels_out.append(labels)
        kept.append(i)
    if silent:
        raise DataError(no_response(silent))
    return TokenizedSet(ids_out, labels_out), kept


@dataclass(frozen=True)
class ResponseLoss:
    """Held-out response loss (mean over records of their mean response-token NLL), its
    normal 95% interval, perplexity = exp(loss) with exp of that interval, and per record."""

    task: str
    n: int
    dropped: int
    loss: float
    loss_ci95: tuple[float, float]
    perplexity: float
    perplexity_ci95: tuple[float, float]
    nll: list[float]


def response_loss(
    model: Any,
    tokenizer: Any,
    records: Sequence[Instruction],
    *,
    max_len: int,
    batch_size: int = 8,
    task: str = "",
) -> ResponseLoss:
    """Score held-out `records` by their response tokens' NLL (see `ResponseLoss`)."""
    import torch

    from fedlora.llm.eval_stats import mean_interval

    ts, kept = tokenize_instructions(records, tokenizer, max_len)
    if not kept:
        raise DataError(f"task {task!r}: no held-out record fits data.max_seq_len = {max_len}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    nll: list[float] = []
    with torch.no_grad():
        for s in range(0, len(ts), batch_size):
            batch = collate(ts, list(range(s, min(s + batch_size, len(ts)))), pad)
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            labels = batch["labels"][:, 1:]
            mask = labels != IGNORE_INDEX
            tok = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            per = -(tok * mask).sum(1) / mask.sum(1)
            nll.extend(float(x) for x in per.cpu())
    loss, (lo, hi) = mean_interval(nll, lower=0.0)
    return ResponseLoss(
        task=task or records[0].task,
        n=len(kept),
        dropped=len(records) - len(kept),
        loss=loss,
        loss_ci95=(lo, hi),
        perplexity=math.exp(loss),
        perplexity_ci95=(math.exp(lo), math.exp(hi)) if not math.isnan(lo) else (lo, hi),
        nll=nll,
    )


def response_fields(
    model: Any,
    tokenizer: Any,
    held_out: dict[str, Sequence[Instruction]],
    *,
    max_len: int,
    batch_size: int = 8,
) -> dict[str, Any]:
    """The metrics-line field of the held-out instruction sets: ``eval_response`` = task ->
    loss, loss_ci95, perplexity, perplexity_ci95, n (empty without held-out records)."""
    if not held_out:
        return {}
    out = {}
    for task, records in held_out.items():
        r = response_loss(model, tokenizer, records, max_len=max_len, batch_size=batch_size)
        out[task] = {
            "loss": r.loss,
            "loss_ci95": list(r.loss_ci95),
            "perplexity": r.perplexity,
            "perplexity_ci95": list(r.perplexity_ci95),
            "n": r.n,
        }
    return {"eval_response": out}
