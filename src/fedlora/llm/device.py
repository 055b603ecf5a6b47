"""Where a run's tensors live and in what precision: ``model.device`` and ``model.dtype``.

Both settings accept ``"auto"``; `resolve_runtime` turns a config into one with concrete
values, once, before anything loads, and says why it chose them:

- device ``auto``: ``cuda`` when CUDA is available, else ``mps``, else ``cpu``. An explicit
  device that is not there (``cuda`` without a GPU, ``cuda:3`` on a 2-GPU machine, ``mps``
  off Apple silicon) is a `ConfigError` naming the devices that are.
- dtype ``auto``: on a CUDA GPU, bf16 for the frozen base (when the GPU supports it) with
  fp32 master LoRA weights; on MPS, fp32; on a CPU, bf16 only where the CPU has native bf16
  (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo) AND the run's own training step, timed
  now in each precision (`run_step_probe`), is at least `BF16_MIN_SPEEDUP` faster in bf16;
  else fp32 (`choose_dtype`). A machine that is busy now gets the precision that is faster
  now. CPUs without those flags emulate bf16 and run it about 2x slower, so they are never
  timed.

The run directory's config.toml holds the resolved values, so a resumed run keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedlora.config.checks import check_device_spec
from fedlora.errors import bad_value
from fedlora.llm.step_probe import bf16_probe, run_step_probe

__all__ = [
    "BF16_CPU_FLAGS",
    "BF16_MIN_SPEEDUP",
    "Resolution",
    "available_devices",
    "resolve_device",
    "cpu_flags",
    "read_cpuinfo",
    "native_bf16_flags",
    "choose_dtype",
    "resolve_dtype",
    "resolve_runtime",
    "resolve_device_dtype",
    "inherit_auto",
    "synchronize",
    "autocast_state",
    "autocast_context",
    "slots_for_memory",
    "activation_bytes_per_slot",
]

DTYPE_CHOICES = ("auto", "fp32", "bf16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_MIN_SPEEDUP = 1.1  # bf16 must beat fp32 by 10% in the probe: noise does not flip it


# ----------------------------------------------------------------------------- device


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def available_devices() -> list[str]:
    """The devices torch can use here: ``cpu``, then ``cuda:0..`` and/or ``mps``."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        found.append("mps")
    return found


def resolve_device(spec: str, field: str = "model.device") -> str:
    """A concrete device for `spec` (``cuda`` -> ``cuda:<current>``); a device that is not
    there raises `ConfigError` naming the available ones."""
    import torch

    check_device_spec(field, spec)
    if spec == "auto":
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return "mps" if _mps_available() else "cpu"
    if spec == "cpu":
        return "cpu"
    have = available_devices()
    if spec == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    if spec in have:
        return spec
    raise bad_value(field, spec, f"not available on this machine; available: {', '.join(have)}")


def synchronize(device: str) -> None:
    """Wait for the device's queued work (so wall-clock timings include it); no-op on CPU."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elif device == "mps":
        torch.mps.synchronize()


def autocast_state(device_type: str) -> tuple[bool, Any]:
    """(enabled, dtype) of autocast for `device_type`; (False, None) where torch has no
    autocast (e.g. the meta device)."""
    import torch

    try:
        if torch.is_autocast_enabled(device_type):
            return True, torch.get_autocast_dtype(device_type)
    except RuntimeError:
        pass
    return False, None


def autocast_context(device_type: str, bf16: bool) -> Any:
    """bf16 autocast on `device_type` when `bf16`, else a no-op context."""
    from contextlib import nullcontext

    import torch

    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else nullcontext()


# ----------------------------------------------------------------------------- dtype


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text; "" where unreadable (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU feature flags (``flags`` lines of /proc/cpuinfo; empty where unreadable)."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def native_bf16_flags(flags: set[str]) -> list[str]:
    """The native-bf16 flags among `flags` (avx512_bf16, amx_bf16)."""
    return [f for f in BF16_CPU_FLAGS if f in flags]


def choose_dtype(fp32_s: float, bf16_s: float, what: str = "timed") -> tuple[str, str]:
    """(fp32 | bf16, why) from the seconds of the same work in each precision: bf16 when it
    is at least `BF16_MIN_SPEEDUP` times faster, else fp32 (also when a timing is not a
    positive finite number)."""
    ok = all(isinstance(x, (int, float)) and 0 < x < float("inf") for x in (fp32_s, bf16_s))
    speedup = fp32_s / bf16_s if ok else float("nan")
    measured = f"{what}: fp32 {fp32_s:.3g} s, bf16 {bf16_s:.3g} s, bf16/fp32 speed {speedup:.2f}x"
    if ok and speedup >= BF16_MIN_SPEEDUP:
        return "bf16", measured
    return "fp32", f"{measured} (bf16 not {BF16_MIN_SPEEDUP}x faster)"


def resolve_dtype(
    spec: str,
    device: str,
    *,
    flags: set[str] | None = None,
    probe: Callable[[], dict[str, Any]] | None = None,
) -> tuple[str, str]:
    """(fp32 | bf16, why) for `spec` on the concrete `device` (see the module docstring).

    `flags` default to this machine's CPU flags; `probe` (default `bf16_probe`) returns the
    seconds of the same work in each precision ({"fp32_s", "bf16_s"}, optionally "what"); it
    is called only on a CPU with native bf16 and `spec` = auto, and `choose_dtype` decides."""
    if spec not in DTYPE_CHOICES:
        raise bad_value("model.dtype", spec, f"allowed: {', '.join(DTYPE_CHOICES)}")
    if spec != "auto":
        return spec, "set in the config"
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA GPU with bf16: bf16 base, fp32 master LoRA weights"
        return "fp32", "this CUDA GPU has no bf16 support"
    if device == "mps":
        return "fp32", "MPS: fp32 (bf16 support there depends on the macOS version)"
    if device == "meta":  # tests that check tensor placement
        return "fp32", "meta device"
    have = native_bf16_flags(cpu_flags() if flags is None else flags)
    if not have:
        return "fp32", "the CPU has no native bf16 (no avx512_bf16/amx_bf16 flag)"
    figures = (probe or bf16_probe)()
    dtype, measured = choose_dtype(
        figures["fp32_s"], figures["bf16_s"], str(figures.get("what", "timed"))
    )
    return dtype, f"CPU with {'/'.join(have)}; {measured}"


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Resolution:
    """A config with concrete model.device / model.dtype, and why they were chosen."""

    cfg: Any  # ExperimentConfig
    device_reason: str
    dtype_reason: str

    def describe(self) -> str:
        m = self.cfg.model
        return f"device {m.device} ({self.device_reason}); dtype {m.dtype} ({self.dtype_reason})"


def resolve_runtime(cfg: Any, *, probe: Callable[[], dict[str, Any]] | None = None) -> Resolution:
    """`cfg` with ``model.device`` and ``model.dtype`` resolved (see the module docstring).

    A run resolves once, at its entry (`fedlora.federation.run.run`), and hands the
    `Resolution` on; nothing after it resolves again. Idempotent: a config with concrete
    values comes back unchanged (the device checked to be available), so a resumed run keeps
    the dtype it started with. Sets torch's thread count from ``model.threads`` first, so the
    timing measures what the run will use. ``dtype = auto`` on a CPU with native bf16 times
    the run's own training step in each precision (`run_step_probe`; `probe` replaces it);
    the choice and its timings go to ``model.dtype_choice``."""
    m = cfg.model
    device, device_reason, dtype, dtype_reason = resolve_device_dtype(
        m.device, m.dtype, threads=m.threads, probe=probe or (lambda: run_step_probe(cfg))
    )
    if m.dtype == "auto":
        model = replace(m, device=device, dtype=dtype, dtype_choice=f"{dtype}: {dtype_reason}")
    else:
        model = replace(m, device=device)
        if m.dtype_choice.startswith(f"{m.dtype}:"):  # a resumed run: what auto chose then
            dtype_reason += f"; chosen by auto when the run started: {m.dtype_choice}"
    return Resolution(cfg.replace(model=model), device_reason, dtype_reason)


def resolve_device_dtype(
    device_spec: str,
    dtype_spec: str,
    *,
    threads: int = 0,
    device_field: str = "model.device",
    probe: Callable[[], dict[str, Any]] | None = None,
) -> tuple[str, str, str, str]:
    """(device, why, dtype, why) for a device and a dtype setting: torch's thread count set
    from `threads` (0: left as is), then `resolve_device` and `resolve_dtype`. The one
    resolver of `resolve_runtime` (a run's config) and `fedlora eval` (its options)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(device_spec, device_field)
    device_reason = "set in the config" if device_spec != "auto" else _auto_device_reason(device)
    dtype, dtype_reason = resolve_dtype(dtype_spec, device, probe=probe)
    return device, device_reason, dtype, dtype_reason


def _auto_device_reason(device: str) -> str:
    if device.startswith("cuda"):
        return "auto: CUDA is available"
    if device == "mps":
        return "auto: no CUDA, MPS is available"
    return "auto: no CUDA or MPS"


def inherit_auto(given: Any, saved: Any) -> Any:
    """`given` with its ``auto`` device/dtype replaced by `saved`'s values: resuming a run
    keeps the device and precision it started with unless the user names others."""
    changes = {
        name: getattr(saved.model, name)
        for name in ("device", "dtype")
        if getattr(given.model, name) == "auto"
    }
    return given.replace(model=replace(given.model, **changes)) if changes else given


# ----------------------------------------------------------------------------- memory


def activation_bytes_per_slot(
    model_config: Any, *, batch_size: int, seq_len: int, trained_layers: int, dtype_bytes: int
) -> int:
    """A deliberate over-estimate of the activation memory one client slot keeps for the
    backward pass: per token and trained decoder layer, 12·hidden + 4·intermediate values
    (norms, q/k/v/o inputs and outputs, the MLP's three projections and activation) plus the
    eager attention probabilities (heads · seq_len), and the target-only LM head's input."""
    d = int(model_config.hidden_size)
    inter = int(getattr(model_config, "intermediate_size", 4 * d))
    heads = int(model_config.num_attention_heads)
    per_token_layer = 12 * d + 4 * inter + heads * seq_len
    tokens = batch_size * seq_len
    return int(tokens * (trained_layers * per_token_layer + d) * dtype_bytes)


def slots_for_memory(
    requested: int, free_bytes: int, per_slot_bytes: int, share: float = 0.5
) -> int:
    """Client slots per forward/backward: at most `requested`, and at most what `share` of
    the free device memory holds at `per_slot_bytes` each; at least 1."""
    if requested < 1:
        raise bad_value("training.slots", requested, "an integer >= 1")
    if per_slot_bytes <= 0:
        return requested
    return max(1, min(requested, int(share * max(free_bytes, 0) // per_slot_bytes)))
