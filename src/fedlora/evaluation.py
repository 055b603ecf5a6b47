"""Multiple-choice accuracy by constrained log-likelihood (the LLM-Adapters protocol, no
free generation).

For each example and each allowed label ℓ, the model scores the continuation
``"the correct answer is " + ℓ`` after the LLM-Adapters prompt; the score is the summed
log-probability of the tokens of ℓ (the shared prefix is context, not scored). The
prediction is the arg-max (ties -> the first label). ``scoring="option"`` scores the option
TEXT instead of its label (options parsed from the instruction's ``Answer1: ... Answer2: ...``;
yes/no tasks score the label words themselves).

Batching: all candidates of `batch_size` examples go through one forward, LEFT-padded with
explicit ``position_ids`` so every sequence ends at the last position; the LM head is then
computed only over the last K+1 positions (K = the longest scored continuation), which is
exact and skips the 49k-word head everywhere else. Log-softmax is taken in fp32, so bf16
models are scored the same way.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlora.data import (
    RESPONSE_PREFIX,
    Example,
    encode_continuation,
    encode_prompt,
    format_prompt,
)
from fedlora.errors import DataError

SCORINGS = ("label", "option")
Z95 = 1.959963984540054  # Φ^{-1}(0.975)


@dataclass
class EvalResult:
    task: str
    accuracy: float
    n: int
    ci95: tuple[float, float]  # Wilson score interval
    seconds: float


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion correct/n (95% for the default z)."""
    if n <= 0:
        raise DataError(f"n = {n!r} is invalid: the interval needs at least one example")
    if not 0 <= correct <= n:
        raise DataError(f"correct = {correct!r} is invalid: must be in 0..{n}")
    p = correct / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


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


def _candidates(
    ex: Example, tokenizer: Any, scoring: str
) -> tuple[list[int], list[tuple[list[int], int]]]:
    """Prompt ids, and per label: (continuation ids, number of scored trailing tokens)."""
    prompt = encode_prompt(tokenizer, format_prompt(ex))
    texts = ex.labels if scoring == "label" else parse_options(ex)
    return prompt, [encode_continuation(tokenizer, RESPONSE_PREFIX, t) for t in texts]


def _forward_last(model: Any, input_ids: Any, mask: Any, positions: Any, keep: int) -> Any:
    """Logits of the last `keep` positions; the LM head only there when the model allows."""
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=keep,
            use_cache=False,
        )
    except TypeError:  # a model without logits_to_keep
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions)
    return out.logits[:, -keep:, :]


def candidate_logprobs(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
) -> list[np.ndarray]:
    """Per example, the summed log-probability of each label's scored tokens (float64,
    aligned with ``ex.labels``). `batch_size` examples (all their candidates) per forward."""
    import torch

    if scoring not in SCORINGS:
        raise DataError(f"scoring = {scoring!r} is invalid: allowed: {', '.join(SCORINGS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size = {batch_size!r} is invalid: must be an integer >= 1")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)
    device = next(model.parameters()).device

    seqs: list[list[tuple[list[int], int]]] = []  # per example: (full ids, n scored)
    for ex in examples:
        prompt, conts = _candidates(ex, tokenizer, scoring)
        seqs.append([(prompt + ids, n) for ids, n in conts])
    # longest first, so one batch holds sequences of similar length
    order = sorted(range(len(seqs)), key=lambda i: -max(len(s) for s, _ in seqs[i]))
    scores: list[np.ndarray] = [np.empty(0)] * len(seqs)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                group = order[start : start + batch_size]
                rows = [c for i in group for c in seqs[i]]
                t = max(len(ids) for ids, _ in rows)
                k = max(n for _, n in rows)
                input_ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
                mask = torch.zeros((len(rows), t), dtype=torch.long)
                for r, (ids, _) in enumerate(rows):  # left padding: every row ends at t - 1
                    input_ids[r, t - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                    mask[r, t - len(ids) :] = 1
                positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
                logits = _forward_last(
                    model, input_ids.to(device), mask.to(device), positions.to(device), k + 1
                )
                logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)  # (rows, k, V)
                # window position j predicts token t - k + j
                targets = input_ids[:, t - k :].to(device)  # (rows, k)
                tok_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (rows, k)
                n_scored = torch.tensor([n for _, n in rows], device=device)
                scored = torch.arange(k, device=device).unsqueeze(0) >= (k - n_scored).unsqueeze(1)
                row_scores = torch.where(scored, tok_logp, 0.0).sum(dim=1).double().cpu().numpy()
                r = 0
                for i in group:
                    m = len(seqs[i])
                    scores[i] = row_scores[r : r + m]
                    r += m
    finally:
        model.train(was_training)
    return scores


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
    task: str = "",
) -> EvalResult:
    """Accuracy of the arg-max label (ties -> first) with its 95% Wilson interval."""
    if not examples:
        raise DataError(f"task {task!r}: no examples to evaluate")
    t0 = time.perf_counter()
    scores = candidate_logprobs(model, tokenizer, examples, batch_size=batch_size, scoring=scoring)
    correct = sum(int(ex.labels[int(np.argmax(s))] == ex.answer) for ex, s in zip(examples, scores))
    n = len(examples)
    return EvalResult(
        task=task or examples[0].task,
        accuracy=correct / n,
        n=n,
        ci95=wilson_interval(correct, n),
        seconds=time.perf_counter() - t0,
    )
