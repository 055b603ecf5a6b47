"""Multiple-choice accuracy by constrained log-likelihood (the LLM-Adapters protocol, no
free generation).

For each example and each allowed label ℓ, the model scores the continuation
``"the correct answer is " + ℓ`` after the LLM-Adapters prompt; the score is the summed
log-probability of the tokens of ℓ (the shared prefix is context, not scored). The
prediction is the arg-max (ties -> the first label). ``scoring="option"`` scores the option
TEXT instead of its label (options parsed from the instruction's ``Answer1: ... Answer2: ...``;
yes/no tasks score the label words themselves). ``scoring="option_norm"`` divides each option's
summed log-probability by the option text's length in characters (lm-evaluation-harness's
``acc_norm``), so long options are not penalised for their length.

``eval_loss`` (the low-noise metric a small model can move): per question, the mean negative
log-likelihood of the correct candidate's *discriminative* tokens (its scored tokens after the
token prefix all candidates share: ``1`` of `` answer1``, all of an option's text), averaged
over the questions.

Batching: `batch_size` examples per forward. By default each example's context (prompt +
"the correct answer is") runs once, LEFT-padded with explicit ``position_ids`` and a KV
cache whose rows are then repeated for every candidate, so only the few label tokens run once
per candidate (``share_prompt=False``: full sequences, one per candidate, the LM head only on
the last K+1 positions). Both are exact (tested against a one-sequence-at-a-time reference);
log-softmax is taken in fp32, so bf16 models are scored the same way.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
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

SCORINGS = ("label", "option", "option_norm")
Z95 = 1.959963984540054  # Φ^{-1}(0.975)


@dataclass
class EvalResult:
    task: str
    accuracy: float
    n: int
    ci95: tuple[float, float]  # Wilson score interval
    seconds: float
    loss: float = math.nan  # eval_loss: mean NLL of the correct answer's discriminative tokens
    loss_ci95: tuple[float, float] = (math.nan, math.nan)  # normal interval over questions
    majority: float = math.nan  # score of always answering the most frequent label
    chance: float = math.nan  # expected score of a uniform guess, 1/len(labels) on average
    scoring: str = "label"
    ids: list[str] = field(default_factory=list)  # question ids (`question_id`)
    predictions: list[int] = field(default_factory=list)  # index of the predicted label
    correct: list[bool] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)  # per question, mean over its tokens


def question_id(ex: Example) -> str:
    """A stable id of a question (its task, text and answer), to pair two runs' predictions."""
    text = "\x1f".join((ex.task, ex.instruction, ex.input, ex.answer))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=6).hexdigest()


def majority_score(examples: Sequence[Example]) -> float:
    """Accuracy of always answering the label that is most often correct in `examples`."""
    if not examples:
        raise DataError("majority_score: no examples")
    return max(Counter(ex.answer for ex in examples).values()) / len(examples)


def chance_score(examples: Sequence[Example]) -> float:
    """Expected accuracy of a uniform random guess: the mean of 1 / (number of labels)."""
    if not examples:
        raise DataError("chance_score: no examples")
    return float(np.mean([1.0 / len(ex.labels) for ex in examples]))


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
    return prompt, [encode_continuation(tokenizer, RESPONSE_PREFIX, t) for t in _texts(ex, scoring)]


def _texts(ex: Example, scoring: str) -> tuple[str, ...]:
    """What each candidate's scored tokens spell: the labels, or the option texts."""
    return tuple(ex.labels) if scoring == "label" else parse_options(ex)


def discriminative_start(tails: Sequence[Sequence[int]]) -> int:
    """The number of leading tokens all candidates' scored tails share (they cannot tell the
    candidates apart), capped so that every tail keeps at least one token."""
    limit = min(len(t) for t in tails) - 1
    p = 0
    while p < limit and all(t[p] == tails[0][p] for t in tails):
        p += 1
    return p


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


def _score_full(model: Any, rows: list[tuple[list[int], int]], pad_id: int) -> list[np.ndarray]:
    """Log-probs of the last n tokens of each (ids, n) row: one forward of full sequences,
    left-padded, LM head on the last K+1 positions only."""
    import torch

    device = next(model.parameters()).device
    ids, mask, positions = _left_pad([r for r, _ in rows], pad_id)
    t, k = ids.shape[1], max(n for _, n in rows)
    logits = _forward_last(model, ids.to(device), mask.to(device), positions.to(device), k + 1)
    logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)  # (rows, k, V)
    targets = ids[:, t - k :].to(device)  # (rows, k): window position j predicts token t-k+j
    tok_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().cpu().numpy()
    return [tok_logp[i, k - n :] for i, (_, n) in enumerate(rows)]  # (n_i,) per row


_EVAL_CACHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class _NoCache(Exception):
    """The model returned no usable key/value cache."""


def _score_shared(
    model: Any, items: list[tuple[list[int], list[list[int]]]], pad_id: int
) -> list[np.ndarray]:
    """Same log-probs as `_score_full`, computing each shared context once.

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
    head_lp = first[rep_t, heads].double().cpu().numpy()  # (R,)
    out = [head_lp[r : r + 1] for r in range(len(tails))]
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
        rest = tok_logp.double().cpu().numpy()
        out = [np.concatenate([out[r], rest[r, : len(t) - 1]]) for r, t in enumerate(tails)]
    return out


def _score_packed(
    model: Any, cache: Any, items: list[tuple[list[int], list[list[int]]]], pad_id: int
) -> list[np.ndarray]:
    """Same log-probs as `_score_shared`, one packed row per example through a `LayerCache`:
    the context, then every candidate's tail but its last token, each tail attending to the
    context and itself at positions continuing the context's. The layers below the first
    LoRA layer come from the cache after the first evaluation."""
    import torch

    from fedlora.train import _decoder_and_head

    _, head = _decoder_and_head(model)
    seqs, poss, segs = [], [], []
    where: list[list[int]] = []  # per candidate row: the packed index predicting each token
    for context, tails in items:
        ids, pos, seg = list(context), list(range(len(context))), [0] * len(context)
        for j, tail in enumerate(tails):
            start = len(ids)
            ids += tail[:-1]
            pos += range(len(context), len(context) + len(tail) - 1)
            seg += [j + 1] * (len(tail) - 1)
            where.append([len(context) - 1, *range(start, start + len(tail) - 1)])
        seqs.append(ids)
        poss.append(pos)
        segs.append(seg)
    t = max(len(x) for x in seqs)
    ids_t = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    pos_t = torch.zeros((len(seqs), t), dtype=torch.long)
    seg_t = torch.full((len(seqs), t), -1, dtype=torch.long)
    for i, (a, b, c) in enumerate(zip(seqs, poss, segs)):
        ids_t[i, : len(a)] = torch.tensor(a)
        pos_t[i, : len(b)] = torch.tensor(b)
        seg_t[i, : len(c)] = torch.tensor(c)
    hidden = cache.packed_last_hidden_state(ids_t, pos_t, seg_t)  # (G, T, d)
    rows = [g for g, (_, tails) in enumerate(items) for _ in tails]
    dev = hidden.device
    flat_rows = torch.tensor([g for g, w in zip(rows, where) for _ in w], device=dev)
    flat_pos = torch.tensor([p for w in where for p in w], device=dev)
    targets = torch.tensor(
        [tok for _, tails in items for tail in tails for tok in tail], device=dev
    )
    logp = torch.log_softmax(head(hidden[flat_rows, flat_pos]).float(), dim=-1)  # (M, V)
    tok_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().cpu().numpy()  # (M,)
    out, k = [], 0
    for w in where:
        out.append(tok_lp[k : k + len(w)])
        k += len(w)
    return out


def eval_cache_for(model: Any, lora: Any, max_mb: float) -> Any:
    """The evaluation `LayerCache` of (model, lora): the frozen layers below the first LoRA
    layer, per packed eval question, kept across evaluations (the eval set is fixed for a
    run); it keeps what fits in `max_mb` and stops adding when full (no LRU thrashing on a
    set read in the same order every time). None when `max_mb` is 0 or nothing can be
    cached (LoRA on every layer, an unsupported decoder, sliding-window attention)."""
    from fedlora.train import LayerCache, cacheable_layers

    cache = _EVAL_CACHES.get(lora)
    if cache is not None and cache.model is model and cache.max_bytes == int(max_mb * 2**20):
        return cache
    if max_mb == 0 or cacheable_layers(model, lora)[0] == 0:
        return None
    cache = LayerCache(model, lora, max_mb=max_mb, dtype="fp32", evict=False)
    if not cache.packable():
        return None
    _EVAL_CACHES[lora] = cache
    return cache


def _items(
    examples: Sequence[Example], tokenizer: Any, scoring: str
) -> list[tuple[list[int], list[list[int]]]]:
    """Per example: (context ids = prompt + "the correct answer is", each candidate's scored
    tail ids)."""
    items: list[tuple[list[int], list[list[int]]]] = []
    for ex in examples:
        prompt, conts = _candidates(ex, tokenizer, scoring)
        heads = {tuple(ids[: len(ids) - n]) for ids, n in conts}
        if len(heads) != 1:  # pragma: no cover - encode_continuation keeps one head
            raise DataError(f"task {ex.task!r}: candidates do not share the response prefix")
        items.append((prompt + list(heads.pop()), [ids[len(ids) - n :] for ids, n in conts]))
    return items


def _check_args(scoring: str, batch_size: int) -> None:
    if scoring not in SCORINGS:
        raise DataError(f"scoring = {scoring!r} is invalid: allowed: {', '.join(SCORINGS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size = {batch_size!r} is invalid: must be an integer >= 1")


def _token_logprobs(
    model: Any,
    tokenizer: Any,
    items: list[tuple[list[int], list[list[int]]]],
    *,
    batch_size: int,
    share_prompt: bool,
    cache: Any = None,
) -> list[list[np.ndarray]]:
    import torch

    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)
    # longest first, so one batch holds sequences of similar length
    order = sorted(
        range(len(items)), key=lambda i: -(len(items[i][0]) + max(map(len, items[i][1])))
    )
    out: list[list[np.ndarray]] = [[] for _ in items]

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                group = order[start : start + batch_size]
                row_lps = None
                if cache is not None:
                    row_lps = _score_packed(model, cache, [items[i] for i in group], pad_id)
                elif share_prompt:
                    try:
                        row_lps = _score_shared(model, [items[i] for i in group], pad_id)
                    except _NoCache:
                        share_prompt = False
                if row_lps is None:
                    rows = [(items[i][0] + t, len(t)) for i in group for t in items[i][1]]
                    row_lps = _score_full(model, rows, pad_id)
                r = 0
                for i in group:
                    m = len(items[i][1])
                    out[i] = list(row_lps[r : r + m])
                    r += m
    finally:
        model.train(was_training)
    return out


def candidate_token_logprobs(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
    share_prompt: bool = True,
    cache: Any = None,
) -> list[list[np.ndarray]]:
    """Per example and candidate (aligned with ``ex.labels``), the log-probability of each
    scored token (float64). See `candidate_logprobs` for the arguments."""
    _check_args(scoring, batch_size)
    items = _items(examples, tokenizer, scoring)
    return _token_logprobs(
        model, tokenizer, items, batch_size=batch_size, share_prompt=share_prompt, cache=cache
    )


def candidate_scores(ex: Example, token_lps: Sequence[np.ndarray], scoring: str) -> np.ndarray:
    """The arg-max scores of one example's candidates from their token log-probs: the sum,
    or for ``option_norm`` the sum divided by the option text's length in characters."""
    sums = np.array([float(np.sum(t)) for t in token_lps])
    if scoring == "option_norm":
        sums = sums / np.array([max(1, len(text)) for text in _texts(ex, scoring)], dtype=float)
    return sums


def candidate_logprobs(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
    share_prompt: bool = True,
    cache: Any = None,
) -> list[np.ndarray]:
    """Per example, the score of each label (float64, aligned with ``ex.labels``): the summed
    log-probability of its scored tokens (per character of the option for ``option_norm``).
    `batch_size` examples (all their candidates) per forward.

    `share_prompt`: compute each example's prompt once and reuse its KV cache for all its
    candidates (same scores, about as many times faster as there are candidates); models
    that return no cache fall back to full sequences. `cache` (from `eval_cache_for`): one
    packed row per example, the frozen lower layers from the cache (same scores, to float
    rounding)."""
    lps = candidate_token_logprobs(
        model,
        tokenizer,
        examples,
        batch_size=batch_size,
        scoring=scoring,
        share_prompt=share_prompt,
        cache=cache,
    )
    return [candidate_scores(ex, t, scoring) for ex, t in zip(examples, lps)]


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
    task: str = "",
    cache: Any = None,
) -> EvalResult:
    """Accuracy of the arg-max label (ties -> first) with its 95% Wilson interval, eval_loss,
    the majority-label and chance scores, and the per-question predictions. `cache`: see
    `eval_cache_for` (same results, later evaluations of the same questions faster)."""
    if not examples:
        raise DataError(f"task {task!r}: no examples to evaluate")
    _check_args(scoring, batch_size)
    t0 = time.perf_counter()
    items = _items(examples, tokenizer, scoring)
    lps = _token_logprobs(
        model, tokenizer, items, batch_size=batch_size, share_prompt=True, cache=cache
    )
    preds, correct, nll = [], [], []
    for ex, (_, tails), tok_lps in zip(examples, items, lps):
        pred = int(np.argmax(candidate_scores(ex, tok_lps, scoring)))
        preds.append(pred)
        correct.append(ex.labels[pred] == ex.answer)
        gold = ex.labels.index(ex.answer)
        nll.append(-float(np.mean(tok_lps[gold][discriminative_start(tails) :])))
    n = len(examples)
    loss = float(np.mean(nll))
    half = Z95 * float(np.std(nll, ddof=1)) / math.sqrt(n) if n > 1 else math.nan
    return EvalResult(
        task=task or examples[0].task,
        accuracy=sum(correct) / n,
        n=n,
        ci95=wilson_interval(sum(correct), n),
        seconds=time.perf_counter() - t0,
        loss=loss,
        loss_ci95=(loss - half, loss + half),
        majority=majority_score(examples),
        chance=chance_score(examples),
        scoring=scoring,
        ids=[question_id(ex) for ex in examples],
        predictions=preds,
        correct=correct,
        nll=nll,
    )
