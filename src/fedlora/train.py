"""Local training of several clients at once: H plain SGD steps on their LoRA slots.

Shared by the round engine and the Flower client. One step for the c active slots:

1. concatenate the c client batches into one (c*b, T) batch (padded to the common T),
2. run the decoder once (each row's LoRA delta uses its own slot),
3. apply the LM head ONLY at target positions (shifted label != -100): the LM head over a
   49k vocabulary is a large share of a small model's FLOPs, and the loss is exactly the
   full-logit loss,
4. loss = Σ_c (mean token loss of client c); backward; X_c ← X_c − η ∇X_c per slot (paper
   Eq. 4, the local update of each client's sketched adapter).

Because the slots share nothing but the frozen base, the result equals c separate
single-client runs.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError, DataError, FedloraError
from fedlora.lora import SlotLora

__all__ = ["TrainingError", "local_train", "collate_clients", "target_token_loss"]

IGNORE = -100


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
            labels = F.pad(labels, (0, t - tc), value=IGNORE)
        if n < b:  # filler rows: a copy of row 0 that carries no target tokens
            fill = b - n
            ids = torch.cat([ids, ids[:1].expand(fill, t)])
            mask = torch.cat([mask, mask[:1].expand(fill, t)])
            labels = torch.cat([labels, torch.full((fill, t), IGNORE, dtype=labels.dtype)])
        parts["input_ids"].append(ids)
        parts["attention_mask"].append(mask)
        parts["labels"].append(labels)
    return {k: torch.cat(v) for k, v in parts.items()}, b  # each (c*b, T)


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise ConfigError(
            f"model {type(model).__name__} has no decoder/LM head pair (a causal LM is needed)"
        )
    return decoder, head


def target_token_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean next-token loss with the LM head applied only at target positions.

    `batch` is (groups*b, T) grouped by group. Returns (loss_per_group (groups,), tokens
    per group (groups,)). Equals the cross-entropy of the full logits over the same targets.
    """
    decoder, head = _decoder_and_head(model)
    hidden = decoder(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state  # (c*b, T, d)
    targets = batch["labels"][:, 1:]  # (c*b, T-1): token t+1 is predicted at position t
    sel = targets != IGNORE
    rows = torch.nonzero(sel)[:, 0]  # (M,) row of each target token
    h = hidden[:, :-1][sel]  # (M, d)
    logits = head(h).float()  # (M, V): fp32 log-softmax, as the full-logit loss
    tok_loss = F.cross_entropy(logits, targets[sel], reduction="none")  # (M,)
    b = batch["input_ids"].shape[0] // groups
    group = torch.div(rows, b, rounding_mode="floor")
    counts = torch.bincount(group, minlength=groups)  # (groups,)
    sums = torch.zeros(groups, dtype=tok_loss.dtype).index_add(0, group, tok_loss)
    return sums / counts.clamp(min=1), counts


def local_train(
    model: torch.nn.Module,
    lora: SlotLora,
    batches: list[list[dict[str, torch.Tensor]]],
    lr: float,
    *,
    autocast_bf16: bool = False,
) -> np.ndarray:
    """H SGD steps for the c active slots; `batches[c][h]` is client c's batch at step h.

    Each batch is a dict of (b, T) tensors input_ids, attention_mask, labels (labels -100 off
    the response tokens). Returns the losses (c, H), float64: client c's mean token loss
    before its step-h update. Raises `TrainingError` on a non-finite loss and `DataError` on
    a batch without target tokens.
    """
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
    if not (isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0):
        raise ConfigError(f"training.lr = {lr!r} is invalid: must be a finite number > 0")
    params = lora.parameters()
    losses = np.zeros((c, steps))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    lora.train(True)
    try:
        for h in range(steps):
            batch, _ = collate_clients([batches[k][h] for k in range(c)])
            with autocast:
                per_client, counts = target_token_loss(model, batch, c)
            empty = torch.nonzero(counts == 0)[:, 0].tolist()
            if empty:
                raise DataError(
                    f"local step {h}: the batch of client slot(s) {empty} has no target "
                    "tokens (labels are all -100; is the response truncated by max_seq_len?)"
                )
            values = per_client.detach().double().numpy()
            if not np.all(np.isfinite(values)):
                bad = np.flatnonzero(~np.isfinite(values)).tolist()
                raise TrainingError(
                    f"non-finite training loss at local step {h} for client slot(s) {bad}: "
                    f"lower training.lr (now {lr})"
                )
            losses[:, h] = values
            for p in params:
                p.grad = None
            per_client.sum().backward()
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p[:c].sub_(p.grad[:c], alpha=lr)  # X_c ← X_c − η ∇X_c, per slot
                    p.grad = None
    finally:
        lora.train(False)
    return losses
