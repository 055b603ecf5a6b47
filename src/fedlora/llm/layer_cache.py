"""The frozen-layer cache: hidden states of the decoder layers below the first LoRA layer.

With LoRA on the top K decoder layers only (``lora.layers = K``), the layers below the first
adapted one see no trainable parameter: their output for an example depends on its tokens
alone. A `LayerCache` runs that frozen lower part (embeddings + layers ``0..L-1``) once per
example, keeps its hidden states (LRU, bounded in MB), and each step runs only the top layers
and the final norm on the cached rows (`fedlora.llm.decoder_replay`). Position ids, the causal
mask and the rotary embeddings are recomputed for the padded batch, so the loss and gradients
equal the uncached path (to float rounding: 1e-6 in fp32, tested). Training uses right-padded rows
(`LayerCache.last_hidden_state`); evaluation packs a question's candidates into one row
(`LayerCache.packed_last_hidden_state`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedlora.errors import ConfigError, bad_value
from fedlora.llm.decoder_replay import REPLAYED_DECODERS, decoder_and_head, run_layers
from fedlora.llm.device import autocast_state
from fedlora.llm.lora import SlotLora
from fedlora.llm.lora_targets import layer_index
from fedlora.llm.packed_rows import PackedRows, row_keys

__all__ = ["cacheable_layers", "check_cache_options", "LayerCache"]


_CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cacheable_layers(model: torch.nn.Module, lora: SlotLora) -> tuple[int, str]:
    """(L, reason): the decoder layers 0..L-1 below the lowest LoRA layer, which a
    `LayerCache` can compute once per example; L = 0 with the reason when nothing can be cached.
    """
    decoder, _ = decoder_and_head(model)
    name = type(decoder).__name__
    if name not in REPLAYED_DECODERS:
        return 0, f"decoder {name} is not one of {', '.join(REPLAYED_DECODERS)}"
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


def check_cache_options(max_mb: float, dtype: str) -> None:
    """Raise `ConfigError` on a bad training.layer_cache_mb or training.layer_cache_dtype."""
    if (
        isinstance(max_mb, bool)
        or not isinstance(max_mb, (int, float))
        or not (np.isfinite(max_mb) and max_mb >= 0)
    ):
        raise bad_value("training.layer_cache_mb", max_mb, "a number of MB >= 0 (0 = off)")
    if dtype not in _CACHE_DTYPES:
        raise bad_value("training.layer_cache_dtype", dtype, ", ".join(_CACHE_DTYPES))


class LayerCache(PackedRows):
    """Hidden states of a model's frozen lower decoder layers, per example, LRU-bounded;
    with `disk` (a `DiskStore`), a second tier on disk that other runs share.

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
        disk: Any = None,
    ) -> None:
        check_cache_options(max_mb, dtype)
        # evict=False: once full, new entries are not kept (a fixed set read in the same order
        # every time, e.g. the eval set, then hits on a fixed part instead of thrashing an LRU)
        self.evict = evict
        self.disk = disk  # a `fedlora.llm.disk_cache.DiskStore`: entries shared across runs
        self._disk_prefix: str | None = None
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
        """Entries, MB held, hits, misses, evictions, steps that bypassed the cache, and the
        disk store's counters."""
        return {
            **(self.disk.stats() if self.disk is not None else {}),
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

    # ------------------------------------------------------------------ lookup

    def _lower_hidden(
        self,
        kind: str,
        keys: list[bytes],
        lens: list[int],
        t: int,
        device: torch.device,
        lower_of: Callable[[list[int], int], torch.Tensor],
    ) -> torch.Tensor:
        """(N, T, d) output of layer L-1 for N rows of keys `keys` and lengths `lens`, zeros
        on the padding: cached entries, and for the distinct misses one no-grad pass
        `lower_of(rows, t_miss)` -> (m, t_miss, d), whose rows are then kept."""
        state = self._lower_state()
        if state != self._state:
            self.clear()
            self._state, self._disk_prefix = state, None
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
        if missing and self.disk is not None:
            self._from_disk(kind, missing, found, device)
        if missing:
            self.misses += len(missing)
            rows = list(missing.values())
            with torch.no_grad():
                lower = lower_of(rows, max(lens[i] for i in rows))  # (m, t_miss, d)
            self._hidden_dtype = lower.dtype
            for row, i in enumerate(rows):
                value = lower[row, : lens[i]].to(self._store_dtype).clone()  # (n_i, d)
                found[keys[i]] = value
                self._put(keys[i], value)
                if self.disk is not None:
                    self.disk.put(self._disk_name(kind, keys[i]), value, lower.dtype)
        d = self.decoder.config.hidden_size
        dtype = self._hidden_dtype or next(iter(found.values())).dtype
        hidden = torch.zeros(len(keys), t, d, dtype=dtype, device=device)
        for i, k in enumerate(keys):
            hidden[i, : lens[i]] = found[k].to(dtype)
        return hidden

    def _disk_name(self, kind: str, key: bytes) -> str:
        from fedlora.llm.disk_cache import entry_name, entry_prefix

        if self._disk_prefix is None:  # the weights' hash: once per lower-weight state
            extra = (*(self._state or ())[:2], self.dtype, self._lower_params[0].device.type)
            self._disk_prefix = entry_prefix(self.decoder, self.first_layer, extra)
        return entry_name(self._disk_prefix, kind, key)

    def _from_disk(
        self,
        kind: str,
        missing: dict[bytes, int],
        found: dict[bytes, torch.Tensor],
        device: torch.device,
    ) -> None:
        """Move the rows of `missing` that the disk store holds into `found` (and memory)."""
        for k in list(missing):
            entry = self.disk.get(self._disk_name(kind, k))
            if entry is None:
                continue
            value, self._hidden_dtype = entry[0].to(device, self._store_dtype), entry[1]
            found[k] = value
            self._put(k, value)
            self.hits += 1
            del missing[k]

    # ------------------------------------------------------------------ forward

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
        lengths = attention_mask.sum(dim=1)  # (N,)
        if self._bypass(attention_mask, lengths):
            self.uncached_steps += 1
            return self.decoder(
                input_ids=input_ids, attention_mask=attention_mask
            ).last_hidden_state
        lens = lengths.tolist()

        def lower_of(rows: list[int], t_miss: int) -> torch.Tensor:
            ids = input_ids[rows, :t_miss]  # (m, t_miss)
            mask = attention_mask[rows, :t_miss]
            return run_layers(
                self.decoder, self.decoder.embed_tokens(ids), mask, range(self.first_layer)
            )

        hidden = self._lower_hidden(
            "rows",
            row_keys(lens, input_ids),
            lens,
            input_ids.shape[1],
            input_ids.device,
            lower_of,
        )  # (N, T, d), 0 on padding
        hidden = run_layers(
            self.decoder, hidden, attention_mask, range(self.first_layer, len(self.decoder.layers))
        )
        return self.decoder.norm(hidden)
