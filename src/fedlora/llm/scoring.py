"""The scoring kernels of `fedlora.llm.evaluation`: the log-probability of each candidate's
scored tokens after its question's context, for a batch of questions at a time.

An item is one question: (context ids = prompt + "the correct answer is", the scored tail ids
of each candidate). Three exact ways to score a batch of items (tested against a
one-sequence-at-a-time reference; log-softmax in fp32, so bf16 models score the same way):

- `_score_shared` (default): each context runs once, LEFT-padded with explicit
  ``position_ids`` and a KV cache whose rows are then repeated for every candidate, so only
  the few tail tokens run once per candidate;
- `_score_full` (a model without a usable KV cache, or ``share_prompt=False``): full
  sequences, one per candidate, the LM head only on the last K+1 positions;
- `_score_packed` (with an evaluation `LayerCache`): one packed row per question, the frozen
  layers below the first LoRA layer from the cache.

`pair_logliks` scores lm-evaluation-harness's requests, (context, continuation) string pairs,
with these kernels: pairs with the same context become one item (one context pass, then only
the continuations), batched across questions; a winogrande option (its own context, the shared
tail) is an item of one candidate.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["Item", "inference_attention", "pair_items", "pair_logliks", "token_logprobs"]

# (context ids, each candidate's scored tail ids)
Item = tuple[list[int], list[list[int]]]


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


class _NoCache(Exception):
    """The model returned no usable key/value cache."""


def _score_shared(model: Any, items: list[Item], pad_id: int) -> list[np.ndarray]:
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
    # transformers 5.x calls the KV cache `cache` (the old name warns on every call)
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    cache = getattr(out, cache_kw, None)
    cache = getattr(out, "past_key_values", None) if cache is None else cache
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
            use_cache=True,
            **{cache_kw: cache},
        )
        # fp32 log-softmax only at the real tail positions (row by row, so fp32 values are
        # those of the whole (R, tc, V) block; a bf16 model converts M rows, not R·tc)
        real = cmask.bool().to(device)  # (R, tc)
        logp = torch.log_softmax(out2.logits[real].float(), dim=-1)  # (M, V)
        targets = torch.tensor([x for t in tails for x in t[1:]], dtype=torch.long)
        tok_logp = logp.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # (M,)
        rest, k = tok_logp.double().cpu().numpy(), 0
        for r, t in enumerate(tails):
            out[r] = np.concatenate([out[r], rest[k : k + len(t) - 1]])
            k += len(t) - 1
    return out


def _score_packed(model: Any, cache: Any, items: list[Item], pad_id: int) -> list[np.ndarray]:
    """Same log-probs as `_score_shared`, one packed row per example through a `LayerCache`:
    the context, then every candidate's tail but its last token, each tail attending to the
    context and itself at positions continuing the context's. The layers below the first
    LoRA layer come from the cache after the first evaluation."""
    import torch

    from fedlora.llm.decoder_replay import decoder_and_head

    _, head = decoder_and_head(model)
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


@contextmanager
def inference_attention(model: Any) -> Iterator[None]:
    """SDPA attention while scoring a model loaded with eager attention that supports SDPA
    (a bf16 model on a CPU: eager is chosen there for training, whose SDPA backward is slow
    in bf16; scoring has no backward, and eager's bf16 batched matmuls over a repeated KV
    cache copy their inputs). fp32 models use SDPA already: their scores do not change."""
    config = getattr(model, "config", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"
    if not (eager and getattr(model, "_supports_sdpa", False)):
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = "eager"


def token_logprobs(
    model: Any,
    tokenizer: Any,
    items: list[Item],
    *,
    batch_size: int,
    share_prompt: bool,
    cache: Any = None,
) -> list[list[np.ndarray]]:
    """Per item and candidate, the log-probability of each scored tail token (float64), with
    `batch_size` items per forward in eval mode and no grad: packed rows through `cache` when
    given, else shared contexts (`share_prompt`; full sequences if the model keeps no KV
    cache), else full sequences."""
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
        with torch.no_grad(), inference_attention(model):
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


def pair_items(
    tokenizer: Any, pairs: Sequence[tuple[str, str]]
) -> tuple[list[Item], list[tuple[int, int]]]:
    """Scoring items of (context, continuation) pairs, tokenized as lm-eval does
    (`fedlora.llm.harness.encode_pair`): pairs with the same context share one item; and per
    pair its (item, candidate) position."""
    from fedlora.llm.harness import encode_pair

    items: list[Item] = []
    where: list[tuple[int, int]] = []
    by_context: dict[str, int] = {}
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        i = by_context.setdefault(context, len(items))
        if i == len(items):
            items.append((ctx, []))
        items[i][1].append(cont)
        where.append((i, len(items[i][1]) - 1))
    return items, where


def pair_logliks(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    *,
    batch_size: int = 16,
    share_prompt: bool = True,
    cache: Any = None,
) -> np.ndarray:
    """lm-eval's ``loglikelihood`` of each (context, continuation) pair: the summed
    log-probability of the continuation's tokens after the context's (float64, pair order).
    `share_prompt=False` with `batch_size=1` is the one-request-at-a-time reference."""
    if share_prompt or cache is not None:
        items, where = pair_items(tokenizer, pairs)
    else:  # every pair its own sequence
        from fedlora.llm.harness import encode_pair

        items = [(c, [t]) for c, t in (encode_pair(tokenizer, *p) for p in pairs)]
        where = [(i, 0) for i in range(len(pairs))]
    lps = token_logprobs(
        model, tokenizer, items, batch_size=batch_size, share_prompt=share_prompt, cache=cache
    )
    return np.array([float(np.sum(lps[i][j])) for i, j in where], dtype=np.float64)
