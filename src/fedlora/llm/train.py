"""Local training of several clients at once: H SGD (or AdamW) steps on their LoRA slots.

Shared by the round engine and the Flower client. One step for the c active slots:

1. concatenate the c client batches into one (c*b, T) batch (padded to the common T),
2. run the decoder once (each row's LoRA delta uses its own slot),
3. apply the LM head ONLY at target positions (shifted label != -100): the LM head over a
   49k vocabulary is a large share of a small model's FLOPs, and the loss is exactly the
   full-logit loss,
4. loss = Σ_c (mean token loss of client c); backward; X_c ← X_c − η ∇X_c per slot (paper
   Eq. 4, the local update of each client's sketched adapter), or AdamW's update per slot and
   per sketched rank component (`fedlora.llm.client_optim.SlotAdamW`).

Because the slots share nothing but the frozen base, the result equals c separate
single-client runs. With LoRA on the top K decoder layers only, the frozen layers below come
from a per-example `LayerCache` (`fedlora.llm.layer_cache`; same losses and gradients). The
step sizes η (one for all, or per client) follow `fedlora.llm.step_sizes`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError, DataError, FedloraError, bad_value
from fedlora.llm.client_optim import SlotAdamW
from fedlora.llm.decoder_replay import decoder_and_head
from fedlora.llm.device import autocast_context
from fedlora.llm.layer_cache import LayerCache, cacheable_layers, check_cache_options
from fedlora.llm.lora import SlotLora
from fedlora.llm.prompts import IGNORE_INDEX
from fedlora.llm.step_sizes import check_step_sizes

if TYPE_CHECKING:
    from fedlora.llm.disk_cache import DiskStore

__all__ = [
    "TrainingError",
    "layer_cache_for",
    "local_train",
    "collate_clients",
    "target_token_loss",
]


class TrainingError(FedloraError, FloatingPointError):
    """Local training produced a non-finite loss (lower the learning rate)."""


def collate_clients(
    client_batches: list[dict[str, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], int]:
    """Stack c client batches into one (c*b, T) batch grouped by client; returns (batch, b).

    Batches are right-padded to the longest T (attention_mask 0, labels -100). A client with
    fewer rows than the largest b gets copies of its first row with labels -100 appended
    (they add no loss and no gradient).
    """
    b = max(int(cb["input_ids"].shape[0]) for cb in client_batches)
    t = max(int(cb["input_ids"].shape[1]) for cb in client_batches)
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for cb in client_batches:
        ids, mask, labels = cb["input_ids"], cb["attention_mask"], cb["labels"]
        n, tc = ids.shape
        if mask.shape != ids.shape or labels.shape != ids.shape:
            raise DataError(
                f"a client batch has input_ids {tuple(ids.shape)}, attention_mask "
                f"{tuple(mask.shape)}, labels {tuple(labels.shape)}: all must be (b, T)"
            )
        if tc < t:  # right-pad to the common T
            ids = F.pad(ids, (0, t - tc), value=0)
            mask = F.pad(mask, (0, t - tc), value=0)
            labels = F.pad(labels, (0, t - tc), value=IGNORE_INDEX)
        if n < b:  # filler rows: a copy of row 0 that carries no target tokens
            fill = b - n
            ids = torch.cat([ids, ids[:1].expand(fill, t)])
            mask = torch.cat([mask, mask[:1].expand(fill, t)])
            labels = torch.cat([labels, torch.full((fill, t), IGNORE_INDEX, dtype=labels.dtype)])
        parts["input_ids"].append(ids)
        parts["attention_mask"].append(mask)
        parts["labels"].append(labels)
    return {k: torch.cat(v) for k, v in parts.items()}, b  # each (c*b, T)


_CACHES: weakref.WeakKeyDictionary[SlotLora, LayerCache] = weakref.WeakKeyDictionary()


def layer_cache_for(
    model: torch.nn.Module,
    lora: SlotLora,
    max_mb: float = 2048.0,
    dtype: str = "fp32",
    disk: DiskStore | None = None,
) -> LayerCache | None:
    """The `LayerCache` of (model, lora), created on first use and kept as long as `lora`
    lives (a client's partition is reused every round it joins); None when `max_mb` is 0 or
    nothing lies below the lowest LoRA layer (e.g. ``lora.layers = "all"``). `disk`: its
    `fedlora.llm.disk_cache.DiskStore` (entries shared across runs), None = memory only."""
    check_cache_options(max_mb, dtype)
    cache = _CACHES.get(lora)
    if (
        cache is not None
        and cache.model is model
        and cache.disk is disk
        and (cache.max_bytes, cache.dtype) == (int(max_mb * 2**20), dtype)
    ):
        return cache
    if max_mb == 0 or cacheable_layers(model, lora)[0] == 0:
        return None
    cache = LayerCache(model, lora, max_mb=max_mb, dtype=dtype, disk=disk)
    _CACHES[lora] = cache
    return cache


def target_token_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    groups: int,
    cache: LayerCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean next-token loss with the LM head applied only at target positions.

    `batch` is (groups*b, T) grouped by group. Returns (loss_per_group (groups,), tokens
    per group (groups,)). Equals the cross-entropy of the full logits over the same targets.
    With `cache`, the frozen lower layers' hidden states come from it (same result).
    """
    decoder, head = decoder_and_head(model)
    if cache is not None:
        hidden = cache.last_hidden_state(batch["input_ids"], batch["attention_mask"])
    else:
        hidden = decoder(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state  # (c*b, T, d)
    targets = batch["labels"][:, 1:]  # (c*b, T-1): token t+1 is predicted at position t
    sel = targets != IGNORE_INDEX
    rows = torch.nonzero(sel)[:, 0]  # (M,) row of each target token
    h = hidden[:, :-1][sel]  # (M, d)
    logits = head(h).float()  # (M, V): fp32 log-softmax, as the full-logit loss
    tok_loss = F.cross_entropy(logits, targets[sel], reduction="none")  # (M,)
    b = batch["input_ids"].shape[0] // groups
    group = torch.div(rows, b, rounding_mode="floor")
    counts = torch.bincount(group, minlength=groups)  # (groups,)
    sums = torch.zeros(groups, dtype=tok_loss.dtype, device=tok_loss.device)
    sums = sums.index_add(0, group, tok_loss)
    return sums / counts.clamp(min=1), counts


def local_train(
    model: torch.nn.Module,
    lora: SlotLora,
    batches: list[list[dict[str, torch.Tensor]]],
    lr: float | np.ndarray,
    *,
    autocast_bf16: bool = False,
    cache: LayerCache | None = None,
    momentum: float = 0.0,
    optimizer: SlotAdamW | None = None,
) -> np.ndarray:
    """H local steps for the c active slots; `batches[c][h]` is client c's batch at step h.

    Each batch is a dict of (b, T) tensors input_ids, attention_mask, labels (labels -100 off
    the response tokens). Returns the losses (c, H), float64: client c's mean token loss
    before its step-h update. Raises `TrainingError` on a non-finite loss and `DataError` on
    a batch without target tokens. `cache` (see `layer_cache_for`) takes the frozen layers
    below the lowest LoRA layer from a per-example cache: same losses and updates, faster.

    `lr` is one η for every slot, or (c,) per-client step sizes (`client_step_sizes`).
    `momentum` μ > 0 uses heavy-ball SGD as torch.optim.SGD (v ← μ·v + g, X ← X − η·v; v = 0
    at the call's start, so once per round); μ = 0 is plain SGD. `optimizer`: AdamW instead
    of SGD (`SlotAdamW`, built on these c slots; its state stays in it), stepping slot c with
    η_c; `momentum` must then be 0.
    """
    c, steps, lrs = _checked_arguments(model, lora, batches, lr, momentum, optimizer, cache)
    params = lora.parameters()
    velocity: dict[int, torch.Tensor] = {}  # momentum buffers v, per parameter
    losses = np.zeros((c, steps))
    device = params[0].device  # batches follow the slots (which follow the base model)
    # (c, 1, 1) per-slot step sizes, broadcast over each slot's (r, in) / (out, r) block
    lr_t = (
        None if lrs is None else torch.tensor(lrs, dtype=torch.float32, device=device).view(c, 1, 1)
    )
    adam_lrs = None  # AdamW's (c,) step sizes
    if optimizer is not None:
        adam_lrs = torch.tensor(lrs if lrs is not None else [float(lr)] * c, dtype=torch.float32)
    autocast = autocast_context(device.type, autocast_bf16)
    lora.train(True)
    try:
        for h in range(steps):
            batch, _ = collate_clients([batches[k][h] for k in range(c)])
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast:
                per_client, counts = target_token_loss(model, batch, c, cache)
            losses[:, h] = _checked_losses(per_client, counts, h, lr)
            for p in params:
                p.grad = None
            per_client.sum().backward()
            if optimizer is not None:
                optimizer.step(adam_lrs)
                for p in params:
                    p.grad = None
                continue
            _sgd_step(params, c, lr, lr_t, momentum, velocity)
    finally:
        lora.train(False)
    return losses


def _checked_arguments(
    model: torch.nn.Module,
    lora: SlotLora,
    batches: list[list[dict[str, torch.Tensor]]],
    lr: float | np.ndarray,
    momentum: float,
    optimizer: SlotAdamW | None,
    cache: LayerCache | None,
) -> tuple[int, int, np.ndarray | None]:
    """`local_train`'s arguments checked against each other before any step: returns the
    number c of clients, H of steps, and the per-client step sizes (None for one η)."""
    c = len(batches)
    if c == 0:
        raise ConfigError("local_train needs at least one client")
    if c != lora.active:
        raise ConfigError(
            f"{c} client batch lists for {lora.active} active LoRA slots: call "
            "lora.set_clients(scales) with one scale row per client first"
        )
    steps = len(batches[0])
    if steps == 0 or any(len(bc) != steps for bc in batches):
        raise ConfigError(
            f"every client needs the same number H >= 1 of local batches, got "
            f"{[len(bc) for bc in batches]}"
        )
    lrs = check_step_sizes(lr, c)
    if (
        isinstance(momentum, bool)
        or not isinstance(momentum, (int, float))
        or not 0 <= momentum < 1
    ):
        raise bad_value("training.momentum", momentum, "a number in [0, 1)")
    if optimizer is not None and (momentum or optimizer.active != c):
        raise ConfigError(
            f"an AdamW of {optimizer.active} slots with training.momentum = {momentum} for "
            f"{c} active slots: build SlotAdamW after set_clients, and use momentum 0 with it"
        )
    if cache is not None and (cache.model is not model or cache.lora is not lora):
        raise ConfigError(
            "cache belongs to another model/adapter: use layer_cache_for(model, lora)"
        )
    return c, steps, lrs


def _checked_losses(
    per_client: torch.Tensor, counts: torch.Tensor, h: int, lr: float | np.ndarray
) -> np.ndarray:
    """Step h's per-client losses as float64 on the host, after checking that every client
    had target tokens (`DataError`) and a finite loss (`TrainingError`)."""
    empty = [i for i, n in enumerate(counts.tolist()) if n == 0]  # on the host
    if empty:
        raise DataError(
            f"local step {h}: the batch of client slot(s) {empty} has no target "
            "tokens (labels are all -100; is the response truncated by max_seq_len?)"
        )
    values = per_client.detach().double().cpu().numpy()
    if not np.all(np.isfinite(values)):
        bad = np.flatnonzero(~np.isfinite(values)).tolist()
        raise TrainingError(
            f"non-finite training loss at local step {h} for client slot(s) {bad}: "
            f"lower training.lr (now {lr})"
        )
    return values


def _sgd_step(
    params: list[torch.Tensor],
    c: int,
    lr: float | np.ndarray,
    lr_t: torch.Tensor | None,
    momentum: float,
    velocity: dict[int, torch.Tensor],
) -> None:
    """One SGD step on the c active slots of every parameter (heavy-ball when `momentum` > 0,
    its buffers in `velocity`), with one η (`lr`) or per-slot η_c (`lr_t`); clears the grads."""
    with torch.no_grad():
        for i, p in enumerate(params):
            if p.grad is not None:
                step = p.grad[:c]
                if momentum > 0:  # v ← μ·v + g (v = g at the first step)
                    v = velocity.get(i)
                    step = velocity[i] = step.clone() if v is None else v.mul_(momentum).add_(step)
                if lr_t is None:
                    p[:c].sub_(step, alpha=lr)  # X_c ← X_c − η ∇X_c, per slot
                else:
                    p[:c].sub_(step * lr_t)  # X_c ← X_c − η_c ∇X_c
            p.grad = None
