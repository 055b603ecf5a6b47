"""Which linear layers of a model get LoRA: PEFT-style suffix matches on the top K decoder
layers (`lora.target_modules`, `lora.layers`)."""

from __future__ import annotations

import re

from torch import nn

from fedlora.config.sections import LoraConfig
from fedlora.errors import bad_value

__all__ = ["find_targets", "layer_index"]

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def find_targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Module paths of the linear layers that get LoRA (PEFT-style suffix match).

    A target name matches a module whose path equals it or ends with ``"." + name``.
    ``cfg.layers = K`` keeps only modules in the top K decoder layers.
    """
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    targets = set(cfg.target_modules)
    names = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    if not names:
        existing = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise bad_value(
            "lora.target_modules",
            list(cfg.target_modules),
            f"matches no linear module; the model has: {', '.join(existing)}",
        )
    if cfg.layers != "all":
        n_layers = num_layers(model, names)
        lowest = n_layers - int(cfg.layers)
        if lowest < 0:
            raise bad_value(
                "lora.layers",
                cfg.layers,
                f'at most the {n_layers} model layers (lora.layers = "all", or 1 to {n_layers})',
            )
        names = [n for n in names if (i := layer_index(n)) is not None and i >= lowest]
    return names


def layer_index(name: str) -> int | None:
    m = _LAYER_INDEX.search("." + name + ".")
    return int(m.group(1)) if m else None


def num_layers(model: nn.Module, names: list[str]) -> int:
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if isinstance(n, int):
        return n
    idx = [i for i in map(layer_index, names) if i is not None]
    return max(idx) + 1 if idx else 0
