"""Packed evaluation rows through a `fedlora.llm.layer_cache.LayerCache` (its base class):
one row per multiple-choice question, the prompt then every candidate's tail, each tail
attending to the prompt and to itself; and the cache keys of rows."""

from __future__ import annotations

from typing import Any

import torch

from fedlora.errors import ConfigError
from fedlora.llm.decoder_replay import layer_stack

__all__ = ["PackedRows", "row_keys"]


def row_keys(lens: list[int], *rows: torch.Tensor) -> list[bytes]:
    """A cache key per row: the bytes of its first `lens[i]` entries in each (N, T) tensor of
    `rows` (token ids; for packed rows also positions and segments), read on the host."""
    host = [x.cpu() for x in rows]
    return [b"".join(x[i, : lens[i]].numpy().tobytes() for x in host) for i in range(len(lens))]


class PackedRows:
    """The packed-row methods of `LayerCache` (which provides `decoder`, `first_layer` and
    `_lower_hidden`)."""

    decoder: Any
    first_layer: int
    _lower_hidden: Any

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
        return layer_stack(self.decoder, hidden, pos, layers, lambda i: mask)

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
        lens = (segments >= 0).sum(dim=1).tolist()
        keys = row_keys(lens, input_ids, position_ids, segments)
        device = self.decoder.embed_tokens.weight.device  # the rows follow the model
        input_ids, position_ids = input_ids.to(device), position_ids.to(device)
        segments = segments.to(device)

        def lower_of(rows: list[int], t_miss: int) -> torch.Tensor:
            return self._run_packed(
                self.decoder.embed_tokens(input_ids[rows, :t_miss]),
                segments[rows, :t_miss],
                position_ids[rows, :t_miss],
                range(self.first_layer),
            )

        hidden = self._lower_hidden("packed", keys, lens, input_ids.shape[1], device, lower_of)
        hidden = self._run_packed(
            hidden, segments, position_ids, range(self.first_layer, len(self.decoder.layers))
        )
        return self.decoder.norm(hidden)
