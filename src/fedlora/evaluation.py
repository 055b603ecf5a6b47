"""Multiple-choice accuracy by constrained log-likelihood (the LLM-Adapters protocol, no
free generation).

For each example and each allowed label ℓ, the model scores the continuation
``"the correct answer is " + ℓ`` after the LLM-Adapters prompt; the score is the summed
log-probability of the tokens of ℓ (the shared prefix is context, not scored). The
prediction is the arg-max (ties -> the first label). ``scoring="option"`` scores the option
TEXT instead of its label (options parsed from the instruction's ``Answer1: ... Answer2: ...``;
yes/no tasks score the label words themselves).

Batching: `batch_size` examples per forward. By default each example's context (prompt +
"the correct answer is") runs once, LEFT-padded with explicit ``position_ids`` and a KV
cache whose rows are then repeated for every candidate, so only the few label tokens run once
per candidate (``share_prompt=False``: full sequences, one per candidate, the LM head only on
the last K+1 positions). Both are exact (tested against a one-sequence-at-a-time reference);
log-softmax is taken in fp32, so bf16 models are scored the same way.
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


def _left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any, Any]:
    """(ids, mask, position_ids), each (rows, T), every row ending at T - 1."""
    import torch

    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, t - len(s) :] = torch.tensor(list(s), dtype=torch.long)
        mask[r, t - len(s) :] = 1
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


def _score_full(model: Any, rows: list[tuple[list[int], int]], pad_id: int) -> Any:
    """Summed log-prob of the last n tokens of each (ids, n) row: one forward of full
    sequences, left-padded, LM head on the last K+1 positions only."""
    import torch

    device = next(model.parameters()).device
    ids, mask, positions = _left_pad([r for r, _ in rows], pad_id)
    t, k = ids.shape[1], max(n for _, n in rows)
    logits = _forward_last(model, ids.to(device), mask.to(device), positions.to(device), k + 1)
    logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)  # (rows, k, V)
    targets = ids[:, t - k :].to(device)  # (rows, k): window position j predicts token t-k+j
    tok_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (rows, k)
    n_scored = torch.tensor([n for _, n in rows], device=device)
    scored = torch.arange(k, device=device).unsqueeze(0) >= (k - n_scored).unsqueeze(1)
    return torch.where(scored, tok_logp, 0.0).sum(dim=1).double().cpu().numpy()


class _NoCache(Exception):
    """The model returned no usable key/value cache."""


def _score_shared(model: Any, items: list[tuple[list[int], list[list[int]]]], pad_id: int) -> Any:
    """Same scores as `_score_full`, computing each shared context once.

    items: per example (context ids = prompt + "the correct answer is", the scored tail ids of
    each candidate). Pass 1: the contexts, left-padded, with a KV cache; its last logits score
    every tail's first token. Pass 2: the cache rows repeated per candidate, and the tails
    (minus their last token) right-padded after it, score the remaining tail tokens."""
    import torch

    device = next(model.parameters()).device
    ids, mask, positions = _left_pad([c for c, _ in items], pad_id)
    try:
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
    except TypeError:  # a forward without these arguments
        raise _NoCache from None
    cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise _NoCache
    first = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)  # (G, V)
    rep = [g for g, (_, tails) in enumerate(items) for _ in tails]  # example of each row
    tails = [t for _, ts in items for t in ts]
    rep_t = torch.tensor(rep, device=device)
    heads = torch.tensor([t[0] for t in tails], device=device)
    scores = first[rep_t, heads]  # (R,)
    tc = max(len(t) for t in tails) - 1  # tail tokens predicted inside pass 2
    if tc > 0:
        cont = torch.full((len(tails), tc), pad_id, dtype=torch.long)
        cmask = torch.zeros((len(tails), tc), dtype=torch.long)
        for r, t in enumerate(tails):
            cont[r, : len(t) - 1] = torch.tensor(t[:-1], dtype=torch.long)
            cmask[r, : len(t) - 1] = 1
        ctx_len = torch.tensor([len(items[g][0]) for g in rep])
        cpos = ctx_len.unsqueeze(1) + torch.arange(tc).unsqueeze(0)  # (R, tc)
        cache.batch_select_indices(rep_t)
        full_mask = torch.cat([mask[torch.tensor(rep)], cmask], dim=1)  # (R, T + tc)
        out2 = model(
            input_ids=cont.to(device),
            attention_mask=full_mask.to(device),
            position_ids=cpos.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        logp = torch.log_softmax(out2.logits.float(), dim=-1)  # (R, tc, V)
        targets = torch.full((len(tails), tc), 0, dtype=torch.long)
        for r, t in enumerate(tails):
            targets[r, : len(t) - 1] = torch.tensor(t[1:], dtype=torch.long)
        tok_logp = logp.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # (R, tc)
        scores = scores + torch.where(cmask.to(device).bool(), tok_logp, 0.0).sum(dim=1)
    return scores.double().cpu().numpy()


def candidate_logprobs(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
    share_prompt: bool = True,
) -> list[np.ndarray]:
    """Per example, the summed log-probability of each label's scored tokens (float64,
    aligned with ``ex.labels``). `batch_size` examples (all their candidates) per forward.

    `share_prompt`: compute each example's prompt once and reuse its KV cache for all its
    candidates (same scores, about as many times faster as there are candidates); models
    that return no cache fall back to full sequences."""
    import torch

    if scoring not in SCORINGS:
        raise DataError(f"scoring = {scoring!r} is invalid: allowed: {', '.join(SCORINGS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size = {batch_size!r} is invalid: must be an integer >= 1")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)

    items: list[tuple[list[int], list[list[int]]]] = []  # (context, tails) per example
    for ex in examples:
        prompt, conts = _candidates(ex, tokenizer, scoring)
        heads = {tuple(ids[: len(ids) - n]) for ids, n in conts}
        if len(heads) != 1:  # pragma: no cover - encode_continuation keeps one head
            raise DataError(f"task {ex.task!r}: candidates do not share the response prefix")
        items.append((prompt + list(heads.pop()), [ids[len(ids) - n :] for ids, n in conts]))
    # longest first, so one batch holds sequences of similar length
    order = sorted(
        range(len(items)), key=lambda i: -(len(items[i][0]) + max(map(len, items[i][1])))
    )
    scores: list[np.ndarray] = [np.empty(0)] * len(items)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                group = order[start : start + batch_size]
                row_scores = None
                if share_prompt:
                    try:
                        row_scores = _score_shared(model, [items[i] for i in group], pad_id)
                    except _NoCache:
                        share_prompt = False
                if row_scores is None:
                    rows = [(items[i][0] + t, len(t)) for i in group for t in items[i][1]]
                    row_scores = _score_full(model, rows, pad_id)
                r = 0
                for i in group:
                    m = len(items[i][1])
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
