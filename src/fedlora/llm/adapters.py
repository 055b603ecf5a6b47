"""PEFT LoRA adapters on disk: `check_adapter` refuses, before PEFT loads it, an adapter
that was not trained on the model it is applied to (`fedlora eval --model
tiny-qwen2 --adapter <a tiny-llama adapter>` used to score), or whose weights file is
truncated or not safetensors at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from fedlora.errors import ConfigError


def _same_model(a: str, b: str) -> bool:
    """Two model specs naming the same model (a local directory by its resolved path)."""

    def norm(spec: str) -> str:
        p = Path(spec).expanduser()
        return str(p.resolve()) if p.is_dir() else spec.rstrip("/")

    return norm(a) == norm(b)


def check_adapter(adapter_dir: str | os.PathLike[str], model: nn.Module, model_spec: str) -> None:
    """Refuse a PEFT LoRA adapter that was not trained on `model` (`model_spec`), before
    PEFT loads it: its ``base_model_name_or_path`` must name the same model, its weights file
    must be a readable safetensors file, and every lora_A / lora_B must fit the module it
    names (lora_A: r × in_features, lora_B: out_features × r). Raises `ConfigError`."""
    from safetensors import SafetensorError, safe_open

    path = Path(adapter_dir)
    try:
        config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"--adapter = {str(path)!r}: adapter_config.json unreadable: {e}"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"--adapter = {str(path)!r}: adapter_config.json is not a JSON object")
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and not _same_model(base, model_spec):
        raise ConfigError(
            f"--adapter = {str(path)!r} was trained on {base!r}, not on --model {model_spec!r}: "
            f"evaluate it with --model {base}"
        )
    weights = path / "adapter_model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(
            f"--adapter = {str(path)!r}: {weights.name} is not a readable safetensors file "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from None
    modules = dict(model.named_modules())
    for key, shape in sorted(shapes.items()):
        name, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        module = modules.get(name)
        if module is None or not hasattr(module, "in_features"):
            raise ConfigError(
                f"--adapter = {str(path)!r}: {key} names module {name!r}, which model "
                f"{model_spec!r} does not have"
            )
        if part.startswith("A"):
            fits = len(shape) == 2 and shape[1] == module.in_features
        else:
            fits = len(shape) == 2 and shape[0] == module.out_features
        if not fits:
            raise ConfigError(
                f"--adapter = {str(path)!r}: {key} has shape {list(shape)}, which does not fit "
                f"{name} ({module.in_features} -> {module.out_features}) of model {model_spec!r}"
            )
