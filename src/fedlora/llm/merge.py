"""A merged model to ship: the base weights with the run's adapter folded in.

For every adapted linear layer W (out × in) of the base, the merged weight is

    W' = W + Δ_base + s · B R A

with `s` the adapter's scaling (α/r, or α/√r with rsLoRA), R Fed-SB's r × r middle factor
(the identity when the adapter has none) and Δ_base the run's sum of merges into the frozen
base (FedStackLoRA's stacked updates, FedEx-LoRA's residuals; zero for every other method).
The sum is formed in fp32 and rounded once into the base's dtype. Layers the adapter does not
cover (lora.layers = K adapts the top K only) keep their weights bit for bit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedlora.errors import ConfigError, bad_value
from fedlora.files import atomic_write, write_directory


def lora_deltas(state: Mapping[str, Any], scaling: float) -> dict[str, torch.Tensor]:
    """ΔW = scaling · B R A (fp32, out × in) per layer of an adapter state with keys
    ``{layer}.lora_A`` (r × in), ``{layer}.lora_B`` (out × r) and optional ``{layer}.lora_R``."""
    layers = sorted(k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A"))
    if not layers:
        raise ConfigError("the adapter holds no lora_A tensors")
    out = {}
    for n in layers:
        if f"{n}.lora_B" not in state:
            raise ConfigError(f"the adapter has {n}.lora_A but no {n}.lora_B")
        a = torch.as_tensor(state[f"{n}.lora_A"]).detach().float().cpu()
        b = torch.as_tensor(state[f"{n}.lora_B"]).detach().float().cpu()
        if f"{n}.lora_R" in state:  # Fed-SB: B R A
            b = b @ torch.as_tensor(state[f"{n}.lora_R"]).detach().float().cpu()
        out[n] = float(scaling) * (b @ a)
    return out


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """A PEFT LoRA adapter directory (as fedlora writes it) as (state, scaling): keys
    ``{layer}.lora_A`` / ``.lora_B``; scaling lora_alpha / r, or / √r with use_rslora."""
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    try:
        config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"adapter {str(path)!r} is unreadable: {e}") from None
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    state = {
        k.removeprefix("base_model.model.")
        .replace(".lora_A.weight", ".lora_A")
        .replace(".lora_B.weight", ".lora_B"): v
        for k, v in tensors.items()
    }
    return state, scaling


def merge_into(
    model: nn.Module,
    deltas: Mapping[str, torch.Tensor],
    base_delta: Mapping[str, Any] | None = None,
) -> list[str]:
    """W = W + base_delta + delta for every layer named in either (fp32 sum, rounded once into
    the weight's dtype). Returns the merged layers' names."""
    base_delta = dict(base_delta or {})
    names = sorted(set(deltas) | set(base_delta))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for n in names:
            module = modules.get(n)
            if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
                raise ConfigError(f"the adapter names layer {n!r}, which the base model lacks")
            w = module.weight
            total = w.detach().float().cpu().clone()
            for part in (base_delta.get(n), deltas.get(n)):
                if part is None:
                    continue
                part = torch.as_tensor(part).float().cpu()
                if tuple(part.shape) != tuple(w.shape):
                    raise ConfigError(
                        f"layer {n!r}: the update has shape {tuple(part.shape)}, the weight "
                        f"{tuple(w.shape)}"
                    )
                total += part
            w.copy_(total.to(device=w.device, dtype=w.dtype))
    return names


EXPORT_MARKER = "fedlora_export.json"  # what `save_merged` wrote: the only files it replaces


def check_export_out(out: Path, overwrite: bool) -> None:
    """Refuse, before anything loads, an OUT that `save_merged` may not write: a link, a file,
    a non-empty directory without `overwrite`, or (with it) one that is not an earlier
    fedlora export holding only the files that export wrote."""
    out = Path(out)
    if out.is_symlink():
        raise bad_value("--merged", str(out), "a directory, not a symbolic link (name its target)")
    if out.exists() and not out.is_dir():
        raise bad_value("--merged", str(out), "a directory (this is a file)")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not names:
        return
    if not overwrite:
        raise ConfigError(f"--merged {str(out)!r} exists and is not empty: pass --overwrite")
    try:
        written = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))["files"]
        if not isinstance(written, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--merged {str(out)!r} --overwrite: it is not a fedlora export (no readable "
            f"{EXPORT_MARKER}); fedlora replaces only its own exports: move it away or choose "
            "another --merged"
        ) from None
    foreign = [n for n in names if n not in written and n != EXPORT_MARKER]
    if foreign:
        raise ConfigError(
            f"--merged {str(out)!r} --overwrite: it holds files the export did not write "
            f"({', '.join(foreign[:6])}{', ...' if len(foreign) > 6 else ''}); move them away "
            "or choose another --merged"
        )


def non_finite_weights(model: nn.Module, names: list[str]) -> list[str]:
    """The layers among `names` whose weight holds NaN or ±inf (a sum that overflowed)."""
    modules = dict(model.named_modules())
    return [n for n in names if not bool(torch.isfinite(modules[n].weight).all())]


def save_merged(
    model: Any, tokenizer: Any, out_dir: str | Path, record: Mapping[str, Any] | None = None
) -> None:
    """The model and its tokenizer as a transformers directory (safetensors) that
    ``AutoModelForCausalLM.from_pretrained`` loads alone; the KV cache on, for generation.
    Written whole or not at all (`fedlora.files.write_directory`: a staging sibling renamed
    to `out_dir`), with `EXPORT_MARKER` listing its files and `record` (where it came from)."""
    model.config.use_cache = True

    def fill(staging: Path) -> None:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        files = sorted(p.name for p in staging.iterdir())
        marker = {"format": 1, **dict(record or {}), "files": files}
        atomic_write(staging / EXPORT_MARKER, (json.dumps(marker, indent=2) + "\n").encode())

    write_directory(Path(out_dir), fill)
