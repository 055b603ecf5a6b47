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

With LoRA on the top K decoder layers only (``lora.layers = K``), the layers below the first
adapted one see no trainable parameter: their output for an example depends on its tokens
alone. A `LayerCache` runs that frozen lower part (embeddings + layers ``0..L-1``) once per
example, keeps its hidden states (LRU, bounded in MB), and each step runs only the top layers,
the final norm and the target-only LM head on the cached rows. Position ids, the causal mask
and the rotary embeddings are recomputed for the padded batch, so the loss and gradients
equal the uncached path (to float rounding: 1e-6 in fp32, tested).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError, DataError, FedloraError, bad_value
from fedlora.llm.device import autocast_context, autocast_state
from fedlora.llm.lora import SlotLora, layer_index

__all__ = [
    "TrainingError",
    "LayerCache",
    "cacheable_layers",
    "layer_cache_for",
    "local_train",
    "collate_clients",
    "target_token_loss",
    "SKETCH_STEP_POWER",
    "client_step_sizes",
    "step_sizes_for",
]

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


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise ConfigError(
            f"model {type(model).__name__} has no decoder/LM head pair (a causal LM is needed)"
        )
    return decoder, head


# ----------------------------------------------------------------------------- layer cache

# Decoder classes whose forward is: embed_tokens -> rotary_emb(position_ids) -> causal mask(s)
# -> layers[i](hidden, mask of layer_types[i], position_embeddings) -> norm. The cache replays
# exactly that, so it is limited to classes checked against their source (tested: Llama, Qwen2).
_CACHEABLE_DECODERS = ("LlamaModel", "Qwen2Model")
_CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cacheable_layers(model: torch.nn.Module, lora: SlotLora) -> tuple[int, str]:
    """(L, reason): the decoder layers 0..L-1 below the lowest LoRA layer, which a
    `LayerCache` can compute once per example; L = 0 with the reason when nothing can be cached.
    """
    decoder, _ = decoder_and_head(model)
    name = type(decoder).__name__
    if name not in _CACHEABLE_DECODERS:
        return 0, f"decoder {name} is not one of {', '.join(_CACHEABLE_DECODERS)}"
    types = getattr(decoder.config, "layer_types", None) or []
    if set(types) - {"full_attention", "sliding_attention"}:
        return 0, f"unsupported attention layer types {sorted(set(types))}"
    prefix = getattr(model, "base_model_prefix", "model") + ".layers."
    indices = [layer_index(n) if n.startswith(prefix) else None for n in lora.names]
    if any(i is None for i in indices):
        return 0, "a LoRA target lies outside the decoder layers"
    lowest = min(i for i in indices if i is not None)
    if lowest == 0:
        return 0, "LoRA starts at decoder layer 0 (lora.layers = all or K = all layers)"
    return lowest, ""


def _check_cache_options(max_mb: float, dtype: str) -> None:
    if (
        isinstance(max_mb, bool)
        or not isinstance(max_mb, (int, float))
        or not (np.isfinite(max_mb) and max_mb >= 0)
    ):
        raise bad_value("training.layer_cache_mb", max_mb, "a number of MB >= 0 (0 = off)")
    if dtype not in _CACHE_DTYPES:
        raise bad_value("training.layer_cache_dtype", dtype, ", ".join(_CACHE_DTYPES))


class LayerCache:
    """Hidden states of a model's frozen lower decoder layers, per example, LRU-bounded.

    The lower part is embeddings + decoder layers ``0..L-1`` (L from `cacheable_layers`: the
    first layer with LoRA). An example's key is its token ids (the unpadded row), so the same
    example in any batch, padding or slot hits the same entry; its value is the (n, d) output
    of layer L-1 at its n tokens. `last_hidden_state(ids, mask)` equals the decoder's
    ``last_hidden_state`` for a right-padded batch: rows are assembled from the cache (misses
    are computed in one no-grad pass), zeros fill the padding (masked out as keys, no loss),
    and the top layers + final norm run with recomputed position ids, masks and rotary
    embeddings. Entries are dropped when the lower part's weights change in place, the
    autocast mode changes, or the size passes `max_mb` (least recently used first).

    `dtype` "fp32" stores exactly what the lower part computed (fp32 or bf16 values); "bf16"
    halves the memory but rounds fp32 hidden states to bf16 (then not exact).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lora: SlotLora,
        *,
        max_mb: float = 2048.0,
        dtype: str = "fp32",
        evict: bool = True,
    ) -> None:
        _check_cache_options(max_mb, dtype)
        # evict=False: once full, new entries are not kept (a fixed set read in the same order
        # every time, e.g. the eval set, then hits on a fixed part instead of thrashing an LRU)
        self.evict = evict
        first, reason = cacheable_layers(model, lora)
        if first == 0:
            raise ConfigError(f"the frozen-layer cache cannot be used: {reason}")
        # weak: the cache lives in a WeakKeyDictionary keyed by `lora` (see layer_cache_for)
        self._model_ref, self._lora_ref = weakref.ref(model), weakref.ref(lora)
        self.decoder, _ = decoder_and_head(model)
        self.first_layer = first  # L: layers 0..L-1 are cached
        self.max_bytes = int(max_mb * 2**20)
        self.dtype = dtype
        self._store_dtype = _CACHE_DTYPES[dtype]
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> (n, d)
        self._lower_params = list(self.decoder.embed_tokens.parameters()) + [
            p for layer in self.decoder.layers[:first] for p in layer.parameters()
        ]
        self._lower_modules = [self.decoder.embed_tokens, *self.decoder.layers[:first]]
        self._state: tuple[Any, ...] | None = None
        self._hidden_dtype: torch.dtype | None = None
        self.nbytes = 0
        self.hits = self.misses = self.evictions = self.uncached_steps = 0

    @property
    def model(self) -> torch.nn.Module | None:
        """The model this cache belongs to (None once it is gone)."""
        return self._model_ref()

    @property
    def lora(self) -> SlotLora | None:
        """The adapter this cache belongs to (None once it is gone)."""
        return self._lora_ref()

    # ------------------------------------------------------------------ bookkeeping

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        self._entries.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        """Entries, MB held, hits, misses, evictions and steps that bypassed the cache."""
        return {
            "entries": len(self._entries),
            "mb": self.nbytes / 2**20,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "uncached_steps": self.uncached_steps,
            "cached_layers": self.first_layer,
        }

    def _lower_state(self) -> tuple[Any, ...]:
        """What the cached values depend on besides the tokens: the lower weights (storage
        and in-place version) and the autocast mode."""
        autocast, autocast_dtype = autocast_state(self._lower_params[0].device.type)
        return (
            autocast,
            autocast_dtype,
            tuple((p.data_ptr(), p._version, p.dtype) for p in self._lower_params),
        )

    def _entry_bytes(self, key: bytes, value: torch.Tensor) -> int:
        return value.numel() * value.element_size() + len(key)

    def _put(self, key: bytes, value: torch.Tensor) -> None:
        size = self._entry_bytes(key, value)
        if size > self.max_bytes:
            return  # larger than the whole budget: not kept
        if not self.evict and self.nbytes + size > self.max_bytes:
            return  # full: keep what is there
        while self._entries and self.nbytes + size > self.max_bytes:
            old_key, old = self._entries.popitem(last=False)  # least recently used
            self.nbytes -= self._entry_bytes(old_key, old)
            self.evictions += 1
        self._entries[key] = value
        self.nbytes += size

    # ------------------------------------------------------------------ forward

    def _masks(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor
    ) -> dict[str, Any]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kwargs = {
            "config": self.decoder.config,
            "inputs_embeds": hidden,
            "attention_mask": mask,
            "past_key_values": None,
            "position_ids": pos,
        }
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(self.decoder.config, "layer_types", None) or []):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def _run_layers(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, layers: range
    ) -> torch.Tensor:
        """Decoder layers `layers` on (N, T, d) hidden states, as the decoder's forward does."""
        t = hidden.shape[1]
        pos = torch.arange(t, device=hidden.device).unsqueeze(0)  # (1, T), as without cache
        masks = self._masks(hidden, mask, pos)
        rotary = self.decoder.rotary_emb(hidden, pos)
        types = getattr(self.decoder.config, "layer_types", None)
        for i in layers:
            hidden = self.decoder.layers[i](
                hidden,
                attention_mask=masks[types[i] if types else "full_attention"],
                position_embeddings=rotary,
                position_ids=pos,
                past_key_values=None,
                use_cache=False,
            )
        return hidden

    def _bypass(self, mask: torch.Tensor, lengths: torch.Tensor) -> bool:
        """True when caching would not be exact: a row that is not right-padded (its
        position ids would depend on the padding), or lower modules in training mode."""
        right_padded = bool(
            ((mask == 0) | (mask == 1)).all()
            and (mask.cumprod(dim=1).sum(dim=1) == lengths).all()
            and (lengths > 0).all()
        )
        return not right_padded or any(m.training for m in self._lower_modules)

    def last_hidden_state(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """The decoder's final-norm hidden states (N, T, d) for a right-padded (N, T) batch,
        with layers 0..L-1 taken from the cache (filled for the rows it misses)."""
        n_rows, t = input_ids.shape
        lengths = attention_mask.sum(dim=1)  # (N,)
        if self._bypass(attention_mask, lengths):
            self.uncached_steps += 1
            return self.decoder(
                input_ids=input_ids, attention_mask=attention_mask
            ).last_hidden_state
        state = self._lower_state()
        if state != self._state:
            self.clear()
            self._state = state
        lens = lengths.tolist()
        ids_cpu = input_ids.cpu()  # keys are host bytes wherever the batch lives
        keys = [ids_cpu[i, : lens[i]].numpy().tobytes() for i in range(n_rows)]
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, int] = {}  # distinct missing key -> its first row
        for i, k in enumerate(keys):
            if k in found or k in missing:
                self.hits += 1  # a repeat within the batch (e.g. a filler row)
                continue
            value = self._entries.get(k)
            if value is None:
                missing[k] = i
            else:
                self._entries.move_to_end(k)  # most recently used
                found[k] = value
                self.hits += 1
        if missing:
            self.misses += len(missing)
            rows = list(missing.values())
            t_miss = max(lens[i] for i in rows)
            ids = input_ids[rows, :t_miss]  # (m, t_miss)
            mask = attention_mask[rows, :t_miss]
            with torch.no_grad():
                lower = self._run_layers(
                    self.decoder.embed_tokens(ids), mask, range(self.first_layer)
                )  # (m, t_miss, d)
            self._hidden_dtype = lower.dtype
            for row, i in enumerate(rows):
                value = lower[row, : lens[i]].to(self._store_dtype).clone()  # (n_i, d)
                found[keys[i]] = value
                self._put(keys[i], value)
        d = self.decoder.config.hidden_size
        dtype = self._hidden_dtype or next(iter(found.values())).dtype
        hidden = torch.zeros(n_rows, t, d, dtype=dtype, device=input_ids.device)  # 0 on padding
        for i, k in enumerate(keys):
            hidden[i, : lens[i]] = found[k].to(dtype)
        hidden = self._run_layers(
            hidden, attention_mask, range(self.first_layer, len(self.decoder.layers))
        )
        return self.decoder.norm(hidden)

    # ------------------------------------------------------------------ packed rows

    def packable(self) -> bool:
        """Whether `packed_last_hidden_state` can run this decoder (full attention only)."""
        types = getattr(self.decoder.config, "layer_types", None) or []
        return set(types) <= {"full_attention"}

    def _packed_mask(self, segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(N, 1, T, T) attention mask of packed rows: query q sees key k <= q when k is in
        the shared segment 0 or in q's own segment; padding (-1) sees only itself."""
        n, t = segments.shape
        q_seg, k_seg = segments.unsqueeze(2), segments.unsqueeze(1)  # (N, T, 1), (N, 1, T)
        dev = segments.device
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().unsqueeze(0)
        allowed = causal & (k_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
        allowed |= torch.eye(t, dtype=torch.bool, device=dev).unsqueeze(0) & (q_seg < 0)
        allowed = allowed.unsqueeze(1)
        if getattr(self.decoder.config, "_attn_implementation", "sdpa") == "sdpa":
            return allowed  # SDPA takes a boolean mask (True = attend)
        zero = torch.zeros((), dtype=dtype, device=dev)
        return torch.where(allowed, zero, torch.finfo(dtype).min)  # additive (eager)

    def _run_packed(
        self, hidden: torch.Tensor, segments: torch.Tensor, pos: torch.Tensor, layers: range
    ) -> torch.Tensor:
        mask = self._packed_mask(segments, hidden.dtype)
        rotary = self.decoder.rotary_emb(hidden, pos)
        for i in layers:
            hidden = self.decoder.layers[i](
                hidden,
                attention_mask=mask,
                position_embeddings=rotary,
                position_ids=pos,
                past_key_values=None,
                use_cache=False,
            )
        return hidden

    def packed_last_hidden_state(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: torch.Tensor
    ) -> torch.Tensor:
        """Final-norm hidden states (N, T, d) of right-padded *packed* rows, layers 0..L-1
        from the cache (filled for the rows it misses).

        A packed row is a shared prefix (segment 0) followed by several continuations
        (segments 1, 2, ...), each attending to the prefix and to itself, with its own
        `position_ids` continuing the prefix's: one row scores all candidates of a
        multiple-choice question as if each ran after the prefix alone. Segment -1 is padding.
        A row's key is its ids, positions and segments."""
        if not self.packable():
            raise ConfigError("packed rows need a decoder with full attention only")
        n_rows, t = input_ids.shape
        lens = (segments >= 0).sum(dim=1).tolist()
        state = self._lower_state()
        if state != self._state:
            self.clear()
            self._state = state
        ids_h, pos_h, seg_h = input_ids.cpu(), position_ids.cpu(), segments.cpu()  # host keys
        keys = [
            ids_h[i, : lens[i]].numpy().tobytes()
            + pos_h[i, : lens[i]].numpy().tobytes()
            + seg_h[i, : lens[i]].numpy().tobytes()
            for i in range(n_rows)
        ]
        device = self.decoder.embed_tokens.weight.device  # the rows follow the model
        input_ids, position_ids = input_ids.to(device), position_ids.to(device)
        segments = segments.to(device)
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            if k in found or k in missing:
                self.hits += 1
                continue
            value = self._entries.get(k)
            if value is None:
                missing[k] = i
            else:
                self._entries.move_to_end(k)
                found[k] = value
                self.hits += 1
        if missing:
            self.misses += len(missing)
            rows = list(missing.values())
            t_miss = max(lens[i] for i in rows)
            with torch.no_grad():
                lower = self._run_packed(
                    self.decoder.embed_tokens(input_ids[rows, :t_miss]),
                    segments[rows, :t_miss],
                    position_ids[rows, :t_miss],
                    range(self.first_layer),
                )  # (m, t_miss, d)
            self._hidden_dtype = lower.dtype
            for row, i in enumerate(rows):
                value = lower[row, : lens[i]].to(self._store_dtype).clone()
                found[keys[i]] = value
                self._put(keys[i], value)
        d = self.decoder.config.hidden_size
        dtype = self._hidden_dtype or next(iter(found.values())).dtype
        hidden = torch.zeros(n_rows, t, d, dtype=dtype, device=device)
        for i, k in enumerate(keys):
            hidden[i, : lens[i]] = found[k].to(dtype)
        hidden = self._run_packed(
            hidden, segments, position_ids, range(self.first_layer, len(self.decoder.layers))
        )
        return self.decoder.norm(hidden)


_CACHES: weakref.WeakKeyDictionary[SlotLora, LayerCache] = weakref.WeakKeyDictionary()


def layer_cache_for(
    model: torch.nn.Module, lora: SlotLora, max_mb: float = 2048.0, dtype: str = "fp32"
) -> LayerCache | None:
    """The `LayerCache` of (model, lora), created on first use and kept as long as `lora`
    lives (a client's partition is reused every round it joins); None when `max_mb` is 0 or
    nothing lies below the lowest LoRA layer (e.g. ``lora.layers = "all"``)."""
    _check_cache_options(max_mb, dtype)
    cache = _CACHES.get(lora)
    if (
        cache is not None
        and cache.model is model
        and (cache.max_bytes, cache.dtype) == (int(max_mb * 2**20), dtype)
    ):
        return cache
    if max_mb == 0 or cacheable_layers(model, lora)[0] == 0:
        return None
    cache = LayerCache(model, lora, max_mb=max_mb, dtype=dtype)
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
    sel = targets != IGNORE
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


# training.sketch_step = "scaled": client n steps with η·(k_n/γ)^p. A sketch scales its k
# rank components by s = γ/k in the forward pass, so each component's gradient carries s and
# its effect on ΔW = (α/r)·B·diag(s)·A another s: s² per component. The k components' updates
# are nearly orthogonal (random init, in_features ≫ γ), so their norms add in quadrature:
# E‖ΔW‖² ∝ s⁴·k = γ⁴/k³ and the RMS size ∝ k^(-3/2). p = 3/2 cancels it (docs/methods.md).
SKETCH_STEP_POWER = 1.5


def client_step_sizes(lr: float, scales: np.ndarray, sketch_step: str = "paper") -> np.ndarray:
    """Each client's local step size η_n (c,), float64, from its (c, γ) rank scale vector.

    "paper": η for everyone (Eq. 4). "scaled": η·s_n^(-3/2) with s_n = max(scale_n), the
    sketch's γ/k_n (so η·(k_n/γ)^(3/2)); a full adapter or a rank truncation (s_n = 1) keeps η.
    """
    from fedlora.config import SKETCH_STEPS

    if sketch_step not in SKETCH_STEPS:
        raise bad_value("training.sketch_step", sketch_step, ", ".join(SKETCH_STEPS))
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (np.isfinite(lr) and lr > 0):
        raise bad_value("training.lr", lr, "a finite number > 0")
    scales = np.asarray(scales, dtype=np.float64)
    if scales.ndim != 2 or scales.shape[0] == 0:
        raise ConfigError(f"scales must be (c, γ) with c >= 1, got shape {scales.shape}")
    if not np.all(np.isfinite(scales) & (scales >= 0)):
        raise ConfigError(f"scales must be finite and >= 0, got {scales.tolist()}")
    s = scales.max(axis=1)  # (c,)
    if sketch_step == "paper":
        return np.full(s.shape, float(lr))
    # a client with no active component (all scales 0) trains nothing: it keeps η
    return float(lr) * np.where(s > 0, s, 1.0) ** (-SKETCH_STEP_POWER)


def step_sizes_for(training: Any, scales: np.ndarray) -> float | np.ndarray:
    """What `local_train` gets as `lr` under a `TrainingConfig`: the scalar η for
    sketch_step = "paper" (the plain path, bit for bit), else `client_step_sizes`."""
    if training.sketch_step == "paper":
        return training.lr
    return client_step_sizes(training.lr, scales, training.sketch_step)


def _check_lr(lr: Any, c: int) -> np.ndarray | None:
    """None for one scalar η (the plain path); else the (c,) per-client step sizes."""
    if np.ndim(lr) == 0:
        if isinstance(lr, bool) or not (
            isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0
        ):
            raise ConfigError(f"training.lr = {lr!r} is invalid: must be a finite number > 0")
        return None
    lrs = np.asarray(lr, dtype=np.float64)
    if lrs.shape != (c,) or not np.all(np.isfinite(lrs) & (lrs > 0)):
        raise ConfigError(
            f"per-client step sizes {np.asarray(lr).tolist()} are invalid: need {c} finite "
            "numbers > 0, one per active slot"
        )
    return lrs


def local_train(
    model: torch.nn.Module,
    lora: SlotLora,
    batches: list[list[dict[str, torch.Tensor]]],
    lr: float | np.ndarray,
    *,
    autocast_bf16: bool = False,
    cache: LayerCache | None = None,
    momentum: float = 0.0,
) -> np.ndarray:
    """H SGD steps for the c active slots; `batches[c][h]` is client c's batch at step h.

    Each batch is a dict of (b, T) tensors input_ids, attention_mask, labels (labels -100 off
    the response tokens). Returns the losses (c, H), float64: client c's mean token loss
    before its step-h update. Raises `TrainingError` on a non-finite loss and `DataError` on
    a batch without target tokens. `cache` (see `layer_cache_for`) takes the frozen layers
    below the lowest LoRA layer from a per-example cache: same losses and updates, faster.

    `lr` is one η for every slot, or (c,) per-client step sizes (`client_step_sizes`).
    `momentum` μ > 0 uses heavy-ball SGD as torch.optim.SGD (v ← μ·v + g, X ← X − η·v; v = 0
    at the call's start, so once per round); μ = 0 is plain SGD.
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
    lrs = _check_lr(lr, c)
    if (
        isinstance(momentum, bool)
        or not isinstance(momentum, (int, float))
        or not 0 <= momentum < 1
    ):
        raise bad_value("training.momentum", momentum, "a number in [0, 1)")
    if cache is not None and (cache.model is not model or cache.lora is not lora):
        raise ConfigError(
            "cache belongs to another model/adapter: use layer_cache_for(model, lora)"
        )
    params = lora.parameters()
    velocity: dict[int, torch.Tensor] = {}  # momentum buffers v, per parameter
    losses = np.zeros((c, steps))
    device = params[0].device  # batches follow the slots (which follow the base model)
    # (c, 1, 1) per-slot step sizes, broadcast over each slot's (r, in) / (out, r) block
    lr_t = (
        None if lrs is None else torch.tensor(lrs, dtype=torch.float32, device=device).view(c, 1, 1)
    )
    autocast = autocast_context(device.type, autocast_bf16)
    lora.train(True)
    try:
        for h in range(steps):
            batch, _ = collate_clients([batches[k][h] for k in range(c)])
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast:
                per_client, counts = target_token_loss(model, batch, c, cache)
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
            losses[:, h] = values
            for p in params:
                p.grad = None
            per_client.sum().backward()
            with torch.no_grad():
                for i, p in enumerate(params):
                    if p.grad is not None:
                        step = p.grad[:c]
                        if momentum > 0:  # v ← μ·v + g (v = g at the first step)
                            v = velocity.get(i)
                            step = velocity[i] = (
                                step.clone() if v is None else v.mul_(momentum).add_(step)
                            )
                        if lr_t is None:
                            p[:c].sub_(step, alpha=lr)  # X_c ← X_c − η ∇X_c, per slot
                        else:
                            p[:c].sub_(step * lr_t)  # X_c ← X_c − η_c ∇X_c
                    p.grad = None
    finally:
        lora.train(False)
    return losses


# Names before issue 11 (code in flight may still use them; remove once none does).
_decoder_and_head = decoder_and_head
