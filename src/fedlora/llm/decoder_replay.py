"""A causal LM's decoder layers run outside its own forward, as that forward runs them.

The frozen-layer cache (`fedlora.llm.layer_cache`) computes the lower layers once per example
and then runs only the upper ones; packed evaluation rows (`fedlora.llm.packed_rows`) run
every layer with a mask of their own. Both replay the decoder's forward piece by piece:
embed_tokens -> rotary_emb(position_ids) -> causal mask(s) -> layers[i](hidden, mask of
layer_types[i], position_embeddings) -> norm. That order is the decoder class's own, so the
replay is limited to the classes checked against their source (`REPLAYED_DECODERS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedlora.errors import ConfigError

__all__ = ["REPLAYED_DECODERS", "decoder_and_head", "causal_masks", "run_layers", "layer_stack"]

# Decoder classes whose forward is the order above (tested: Llama, Qwen2).
REPLAYED_DECODERS = ("LlamaModel", "Qwen2Model")


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A causal LM's decoder (embeddings, layers, final norm) and its LM head."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise ConfigError(
            f"model {type(model).__name__} has no decoder/LM head pair (a causal LM is needed)"
        )
    return decoder, head


def causal_masks(
    decoder: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor
) -> dict[str, Any]:
    """The decoder's attention masks for (N, T, d) `hidden` with padding `mask` at positions
    `pos`, by attention layer type (full; sliding where the config has such layers)."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    # (config, inputs_embeds, attention_mask, no cache): positional, because transformers
    # 5.x renamed past_key_values to cache and warns on the old name at every call
    args = (decoder.config, hidden, mask, None)
    masks = {"full_attention": create_causal_mask(*args, position_ids=pos)}
    if "sliding_attention" in (getattr(decoder.config, "layer_types", None) or []):
        masks["sliding_attention"] = create_sliding_window_causal_mask(*args, position_ids=pos)
    return masks


def run_layers(
    decoder: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None, layers: range
) -> torch.Tensor:
    """Decoder layers `layers` on (N, T, d) hidden states, as the decoder's forward does."""
    t = hidden.shape[1]
    pos = torch.arange(t, device=hidden.device).unsqueeze(0)  # (1, T), as without cache
    masks = causal_masks(decoder, hidden, mask, pos)
    types = getattr(decoder.config, "layer_types", None)
    return layer_stack(
        decoder, hidden, pos, layers, lambda i: masks[types[i] if types else "full_attention"]
    )


def layer_stack(
    decoder: torch.nn.Module,
    hidden: torch.Tensor,
    pos: torch.Tensor,
    layers: range,
    mask_of: Callable[[int], Any],
) -> torch.Tensor:
    """Decoder layers `layers` on (N, T, d) hidden states at positions `pos`, layer i
    attending through `mask_of(i)`."""
    rotary = decoder.rotary_emb(hidden, pos)
    for i in layers:
        hidden = decoder.layers[i](
            hidden,
            attention_mask=mask_of(i),
            position_embeddings=rotary,
            position_ids=pos,
            use_cache=False,  # and no cache argument: its name differs across releases
        )
    return hidden
