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

``evaluation.format = "harness"`` (`evaluate(fmt="harness")`) scores lm-evaluation-harness's
zero-shot requests instead (`fedlora.llm.harness`): ``accuracy`` is lm-eval's ``acc`` (the
primary metric: the first metric of every lm-eval task, and the only one of social_iqa,
winogrande and boolq), ``acc_norm`` is reported beside it.

``mc_loss`` (both formats): per question, −log softmax over the options' arg-max scores of the
correct option's, averaged over the questions (chance: the mean of ln n_options); it falls only
as the correct option gains on the others.

``eval_loss`` (the low-noise metric a small model can move): per question, the mean negative
log-likelihood of the correct candidate's *discriminative* tokens (its scored tokens after the
token prefix all candidates share: ``1`` of `` answer1``, all of an option's text), averaged
over the questions.

Batching: `batch_size` examples per forward, through one of the exact scoring kernels of
`fedlora.llm.scoring` (by default each example's context runs once and its KV cache serves
every candidate). This module turns their token log-probabilities into the scores, the
eval_loss and the intervals (`fedlora.llm.eval_stats`) of an `EvalResult`.
"""

from __future__ import annotations

import hashlib
import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlora.config.eval_format import EvalFormat
from fedlora.config.sections import SCORINGS
from fedlora.errors import DataError
from fedlora.llm.eval_stats import chance_score, majority_score, mean_interval, wilson_interval
from fedlora.llm.harness import (
    acc_norm_pred,
    acc_pred,
    encode_pair,
    harness_request,
    mc_loss,
)
from fedlora.llm.prompts import encode_continuation, encode_prompt, format_prompt, parse_options
from fedlora.llm.scoring import Item, token_logprobs
from fedlora.llm.task_types import HarnessRequest
from fedlora.llm.tasks import RESPONSE_PREFIX, Example


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
    fmt: str = EvalFormat.LLM_ADAPTERS  # the concrete `EvalFormat` it was scored in
    acc_norm: float = math.nan  # harness: lm-eval's acc_norm (accuracy is its acc)
    acc_norm_ci95: tuple[float, float] = (math.nan, math.nan)
    mc_loss: float = math.nan  # mean −log softmax(option scores)[correct]
    mc_loss_ci95: tuple[float, float] = (math.nan, math.nan)  # normal interval over questions
    mc_chance: float = math.nan  # mc_loss of equal scores: mean ln(n_options)
    mc: list[float] = field(default_factory=list)  # per question
    correct_norm: list[bool] = field(default_factory=list)  # harness: per question, acc_norm


def question_id(ex: Example) -> str:
    """A stable id of a question (its task, text and answer), to pair two runs' predictions."""
    text = "\x1f".join((ex.task, ex.instruction, ex.input, ex.answer))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=6).hexdigest()


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


_EVAL_CACHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def eval_cache_for(model: Any, lora: Any, max_mb: float, disk: Any = None) -> Any:
    """The evaluation `LayerCache` of (model, lora): the frozen layers below the first LoRA
    layer, per packed eval question, kept across evaluations (the eval set is fixed for a
    run); it keeps what fits in `max_mb` and stops adding when full (no LRU thrashing on a
    set read in the same order every time). None when `max_mb` is 0 or nothing can be
    cached (LoRA on every layer, an unsupported decoder, sliding-window attention). `disk`:
    its `fedlora.llm.disk_cache.DiskStore` (entries shared across runs), None = memory only."""
    from fedlora.llm.layer_cache import LayerCache, cacheable_layers

    cache = _EVAL_CACHES.get(lora)
    same = cache is not None and cache.model is model and cache.disk is disk
    if same and cache.max_bytes == int(max_mb * 2**20):
        return cache
    if max_mb == 0 or cacheable_layers(model, lora)[0] == 0:
        return None
    cache = LayerCache(model, lora, max_mb=max_mb, dtype="fp32", evict=False, disk=disk)
    if not cache.packable():
        return None
    _EVAL_CACHES[lora] = cache
    return cache


def scoring_items(examples: Sequence[Example], tokenizer: Any, scoring: str) -> list[Item]:
    """Per example: (context ids = prompt + "the correct answer is", each candidate's scored
    tail ids)."""
    items: list[Item] = []
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
    scored token (float64). `batch_size` examples (all their candidates) per forward.

    `share_prompt`: compute each example's prompt once and reuse its KV cache for all its
    candidates (same scores, about as many times faster as there are candidates); models
    that return no cache fall back to full sequences. `cache` (from `eval_cache_for`): one
    packed row per example, the frozen lower layers from the cache (same scores, to float
    rounding)."""
    _check_args(scoring, batch_size)
    items = scoring_items(examples, tokenizer, scoring)
    return token_logprobs(
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
    scoring: str = "label",
    **options: Any,
) -> list[np.ndarray]:
    """Per example, the score of each label (float64, aligned with ``ex.labels``): the summed
    log-probability of its scored tokens (per character of the option for ``option_norm``).
    `options` are those of `candidate_token_logprobs`."""
    lps = candidate_token_logprobs(model, tokenizer, examples, scoring=scoring, **options)
    return [candidate_scores(ex, t, scoring) for ex, t in zip(examples, lps)]


def harness_items(
    requests: Sequence[HarnessRequest], tokenizer: Any
) -> tuple[list[Item], list[list[tuple[int, int]]]]:
    """Scoring items of lm-eval requests (tokens as lm-eval's `encode_pair`): one item per
    question whose options share the context, one per option otherwise (winogrande); and per
    question, per option, its (item, candidate) position."""
    items: list[Item] = []
    where: list[list[tuple[int, int]]] = []
    for req in requests:
        pairs = [encode_pair(tokenizer, c, t) for c, t in req.pairs]
        if req.shared_context:
            items.append((pairs[0][0], [cont for _, cont in pairs]))
            where.append([(len(items) - 1, j) for j in range(len(pairs))])
        else:
            where.append([])
            for ctx, cont in pairs:
                items.append((ctx, [cont]))
                where[-1].append((len(items) - 1, 0))
    return items, where


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    *,
    batch_size: int = 16,
    scoring: str = "label",
    task: str = "",
    cache: Any = None,
    fmt: str | EvalFormat = EvalFormat.LLM_ADAPTERS,
) -> EvalResult:
    """Accuracy of the arg-max option (ties -> first) with its 95% Wilson interval, eval_loss,
    mc_loss, the majority-label and chance scores, and the per-question predictions. `fmt`:
    ``llm-adapters`` (the LLM-Adapters prompt, `scoring`) or ``harness`` (lm-eval's requests;
    accuracy = acc, acc_norm beside it; `scoring` unused). `cache`: see `eval_cache_for`
    (same results, later evaluations of the same questions faster)."""
    if not examples:
        raise DataError(f"task {task!r}: no examples to evaluate")
    _check_args(scoring, batch_size)
    fmt = EvalFormat(fmt).concrete()
    t0 = time.perf_counter()
    requests = [harness_request(ex) for ex in examples] if fmt.harness else []
    if fmt.harness:
        items, where = harness_items(requests, tokenizer)
    else:
        items = scoring_items(examples, tokenizer, scoring)
        where = [[(q, j) for j in range(len(ex.labels))] for q, ex in enumerate(examples)]
    lps = token_logprobs(
        model, tokenizer, items, batch_size=batch_size, share_prompt=True, cache=cache
    )
    preds, correct, nll, mc, norm_correct = [], [], [], [], []
    for q, ex in enumerate(examples):
        tok_lps = [lps[i][j] for i, j in where[q]]  # per option
        if fmt.harness:
            req = requests[q]
            gold = req.gold
            scores = np.array([float(np.sum(t)) for t in tok_lps])
            pred = acc_pred(scores)
            norm_correct.append(acc_norm_pred(scores, req.choices) == gold)
            tails = [items[i][1][j] for i, j in where[q]]
            start = discriminative_start(tails) if req.shared_context else 0
        else:
            gold = ex.labels.index(ex.answer)
            scores = candidate_scores(ex, tok_lps, scoring)
            pred = int(np.argmax(scores))
            start = discriminative_start(items[q][1])
        preds.append(pred)
        correct.append(pred == gold)
        mc.append(mc_loss(scores, gold))
        nll.append(-float(np.mean(tok_lps[gold][start:])))
    n = len(examples)
    loss, loss_ci = mean_interval(nll, lower=0.0)  # both are losses: >= 0
    mc_mean, mc_ci = mean_interval(mc, lower=0.0)
    acc_norm = sum(norm_correct) / n if norm_correct else math.nan
    return EvalResult(
        task=task or examples[0].task,
        accuracy=sum(correct) / n,
        n=n,
        ci95=wilson_interval(sum(correct), n),
        seconds=time.perf_counter() - t0,
        loss=loss,
        loss_ci95=loss_ci,
        majority=majority_score(examples),
        chance=chance_score(examples),
        scoring="acc" if fmt.harness else scoring,
        ids=[question_id(ex) for ex in examples],
        predictions=preds,
        correct=correct,
        nll=nll,
        fmt=fmt,
        acc_norm=acc_norm,
        acc_norm_ci95=(
            wilson_interval(sum(norm_correct), n) if norm_correct else (math.nan, math.nan)
        ),
        mc_loss=mc_mean,
        mc_loss_ci95=mc_ci,
        mc_chance=float(np.mean([math.log(len(w)) for w in where])),
        mc=mc,
        correct_norm=[bool(c) for c in norm_correct],
    )
