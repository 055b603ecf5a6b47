"""Checkpoints: ``<run>/checkpoints/round-NNNNNN.safetensors``, the newest `keep` of them.

Tensors are stored in safetensors, every other field as JSON in the header, so loading one
never runs code. Each also holds the metrics lines up to its round, so a resume rewrites a
damaged metrics.jsonl exactly (`fedlora.federation.metrics_file.restore_metrics`). Old
``round-*.pt`` pickles are read with ``torch.load(weights_only=True)`` and an allow-list of
numpy types; anything else in them is refused. A damaged checkpoint is named and skipped for
the previous one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.errors import DataError
from fedlora.federation.metrics_file import METRICS_FILE, read_metrics_lines
from fedlora.files import atomic_write, refuse_link, remove_own_file

CHECKPOINT_FORMAT = "fedlora-checkpoint-1"
# stored as tensors "<group>/<key>": FedStackLoRA's / FedEx-LoRA's base merges, the server
# optimizer's state, what clients keep across rounds (FedSA-LoRA's B_n), the clients' kept
# AdamW states (training.optimizer_state = "keep")
TENSOR_GROUPS = ("base_delta", "server_opt", "memory", "client_optim")


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """Every checkpoint file, newest round first (both formats)."""
    ckpt = run_dir / "checkpoints"
    paths = [*ckpt.glob("round-*.safetensors"), *ckpt.glob("round-*.pt")]

    def key(p: Path) -> tuple[int, int]:
        digits = p.stem.split("-", 1)[1]
        return (int(digits) if digits.isdigit() else -1, p.suffix == ".safetensors")

    return sorted(paths, key=key, reverse=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as ``checkpoints/round-NNNNNN.safetensors`` (atomically); keep `keep`.

    ``state["global"]`` (torch tensors) and ``state["base_delta"]`` (numpy arrays) become
    tensors; everything else is JSON in the header, with the first
    ``progress.metrics_lines`` lines of metrics.jsonl (for `restore_metrics`)."""
    import torch
    from safetensors.torch import save

    run_dir = Path(run_dir)
    bad = non_finite({k: v for k, v in state.items() if k != "metrics"})
    if bad:  # never kept as the "last good" checkpoint: a resume would refuse it anyway
        raise DataError(
            f"round {state['round']}: the run's state holds a non-finite value in {bad}: it "
            "diverged; not checkpointed (the previous checkpoint is kept)"
        )
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_symlink():  # its rotation would delete files in the folder it points to
        raise refuse_link(ckpt_dir)
    ckpt_dir.mkdir(exist_ok=True)
    tensors = {f"global/{k}": v.detach().cpu().contiguous() for k, v in state["global"].items()}
    for group in TENSOR_GROUPS:  # server_opt: its m, v, t; memory: FedSA-LoRA's B_n; ...
        for k, v in (state.get(group) or {}).items():
            tensors[f"{group}/{k}"] = torch.from_numpy(np.ascontiguousarray(v))
    rest = {k: v for k, v in state.items() if k not in ("global", *TENSOR_GROUPS)}
    n_lines = int(state["progress"]["metrics_lines"])
    rest["metrics"] = read_metrics_lines(run_dir / METRICS_FILE)[:n_lines]
    meta = {"format": CHECKPOINT_FORMAT, "state": json.dumps(rest, default=_json_default)}
    path = ckpt_dir / f"round-{state['round']:06d}.safetensors"
    # serialized here and written by atomic_write: a full disk is an OSError naming the file
    # (safetensors' save_file reports it as a SafetensorError without errno or path)
    atomic_write(path, save(tensors, metadata=meta))
    for old in checkpoint_paths(run_dir)[keep:]:
        remove_own_file(old)  # a regular file only: never a link nor through one
    return path


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} file")
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API
    state = json.loads(meta["state"])
    state["global"] = {k[7:]: v for k, v in tensors.items() if k.startswith("global/")}
    for group in TENSOR_GROUPS:
        n = len(group) + 1
        state[group] = {k[n:]: v.numpy() for k, v in tensors.items() if k.startswith(group + "/")}
    return state


def _numpy_allow_list() -> list[Any]:
    """The numpy objects a pre-safetensors checkpoint's base_delta arrays unpickle to."""
    import numpy.dtypes

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    dtypes = [getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


def _load_pickle(path: Path) -> dict[str, Any]:
    """A checkpoint written before safetensors: tensors, numbers, strings and numpy arrays
    only (``weights_only=True`` with a numpy allow-list); any other object is refused."""
    import torch

    with torch.serialization.safe_globals(_numpy_allow_list()):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("base_delta"), dict):
        state["base_delta"] = {k: np.asarray(v) for k, v in state["base_delta"].items()}
    return state


def non_finite(value: Any, where: str = "") -> str:
    """The first field of a checkpoint state holding NaN or ±inf ('' when none): tensors,
    arrays and numbers, recursively (metrics lines are JSON text and are not looked into)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "metrics" and (bad := non_finite(v, f"{where}.{k}" if where else str(k))):
                return bad
        return ""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if bad := non_finite(v, f"{where}[{i}]"):
                return bad
        return ""
    if isinstance(value, float):
        return "" if math.isfinite(value) else where
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return "" if np.isfinite(value).all() else where
    if hasattr(value, "is_floating_point") and value.is_floating_point():
        import torch

        return "" if bool(torch.isfinite(value).all()) else where
    return ""


def refuse_unusable_state(path: Path, state: dict[str, Any]) -> None:
    """`DataError` naming `path` when a run cannot continue from `state`: a NaN or ±inf in
    any field (weights, the clock, the server optimizer's moments), or a negative second
    moment v of the server optimizer (every ``method.server_optimizer`` keeps v >= 0)."""
    remedy = (
        "the run diverged or the file was altered; resume from an earlier round's checkpoint "
        "(remove this one) or start a new run"
    )
    bad = non_finite(state)
    if bad:
        raise DataError(
            f"checkpoint {str(path)!r} (round {state['round']}) holds a non-finite value in "
            f"{bad}: {remedy}"
        )
    for key, v in (state.get("server_opt") or {}).items():
        if key.startswith("v/") and (np.asarray(v) < 0).any():
            raise DataError(
                f"checkpoint {str(path)!r} (round {state['round']}) holds a negative server "
                f"optimizer second moment in server_opt.{key}: {remedy}"
            )


def load_checkpoint(run_dir: Path, warn=print) -> dict[str, Any] | None:
    """The newest readable checkpoint; a damaged one is named and skipped.

    None when the run has none. When every checkpoint is unusable, `DataError` names them
    (starting over silently would throw the run's progress away)."""
    import pickle

    paths = checkpoint_paths(Path(run_dir))
    why: dict[str, str] = {}  # file name -> why it is unusable (for the final error)
    for path in paths:
        try:
            if path.suffix == ".safetensors":
                state = _load_safetensors(path)
            else:
                state = _load_pickle(path)
            if not isinstance(state, dict) or "round" not in state or "global" not in state:
                raise ValueError("missing fields")
            if not isinstance(state.get("progress"), dict):
                raise ValueError("no 'progress' record")
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warn(
                f"checkpoint {path} was not loaded: it holds objects that a fedlora checkpoint "
                f"never holds and loading them could run code ({first[:200]}); "
                "trying the previous one"
            )
            why[path.name] = "could not be loaded safely"
            continue
        except Exception as e:  # noqa: BLE001 - any unreadable file falls back to the previous
            warn(f"checkpoint {path} is damaged ({type(e).__name__}: {e}); trying the previous one")
            why[path.name] = "damaged: " + (str(e).splitlines() or [type(e).__name__])[0][:200]
            continue
        refuse_unusable_state(path, state)
        return state
    if paths:
        raise DataError(
            f"no usable checkpoint in {str(Path(run_dir) / 'checkpoints')!r} "
            f"({'; '.join(f'{n}: {w}' for n, w in why.items())}): remove them to "
            "start this run over from round 0, or start a new run"
        )
    return None
