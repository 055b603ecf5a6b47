"""The frozen-layer cache on disk: hidden states of the layers below LoRA, shared by every run
and evaluation on this machine that uses the same model, layers, dtype and tokens.

A `LayerCache` (memory, per run) asks its `DiskStore` for what it misses before computing it,
and writes what it computed. An entry's name is a hash of

- a *prefix*: fedlora's, torch's and transformers' versions, the CPU capability torch
  dispatches to, the device type, the decoder's class, config and attention implementation,
  the number of cached layers, the autocast mode, the cache's storage dtype, and a hash of
  the frozen weights themselves (the embedding and every cached layer: names, dtypes, shapes,
  bytes);
- the row's kind (a training row, or a packed evaluation row) and its tokens (ids; for packed
  rows also positions and segments).

So a new fedlora, torch or transformers, other weights (another model, a merged adapter),
another precision or another depth never read an old entry. Each entry is one file
``<root>/<2 hex>/<name>.bin``: a header (the name, dtypes, shape, a blake2b of the payload)
and the payload; a file whose header, size or checksum does not match is deleted and its
row recomputed, never trusted. Files are written atomically (a temporary file renamed), so
runs in parallel share the store. The store is bounded: past `max_mb`, the least recently
used files (a hit refreshes a file's mtime) are deleted down to 90% of it. Deleting the
whole folder is always safe: it only costs recomputation.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["DiskStore", "disk_store", "disk_store_for", "weights_fingerprint", "ENABLED"]

MAGIC = b"FLC1"
FOLDER = "frozen_layers"
ENABLED = True  # tests turn the store off unless they ask for it (tests/conftest.py)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _payload(value: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU tensor (bf16 through an integer view)."""
    value = value.detach().contiguous().cpu()
    return value.view(_INT_VIEW[value.element_size()]).numpy().tobytes()


# id(first lower parameter) -> (a weak reference to it, the state it was hashed at, its
# fingerprint): a model freed and another allocated at the same address never reuses one
_FINGERPRINTS: dict[int, tuple[weakref.ref, Any, str]] = {}


def weights_fingerprint(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """A blake2b of the tensors' names, dtypes, shapes and bytes (hex), memoised per tensor
    storage and in-place version (a weight changed in place is hashed again)."""
    state = tuple((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for _, t in named)
    first = named[0][1]
    known = _FINGERPRINTS.get(id(first))
    if known is not None and known[0]() is first and known[1] == state:
        return known[2]
    h = hashlib.blake2b(digest_size=20)
    for name, t in named:
        h.update(f"{name}|{_dtype_name(t.dtype)}|{tuple(t.shape)}\n".encode())
        h.update(_payload(t))
    digest = h.hexdigest()
    for k in [k for k, v in _FINGERPRINTS.items() if v[0]() is None]:
        del _FINGERPRINTS[k]
    _FINGERPRINTS[id(first)] = (weakref.ref(first), state, digest)
    return digest


class DiskStore:
    """Entries of the frozen-layer cache under `root`, at most `max_mb` (LRU by mtime).

    `get(name)` -> (tensor, hidden dtype) or None (absent, or corrupt: then deleted);
    `put(name, value, hidden_dtype)` writes atomically. I/O errors never fail a run: a read
    error is a miss, a write error is counted and skipped."""

    def __init__(self, root: Path, max_mb: float) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_mb * 2**20)
        self._bytes: int | None = None  # measured on the first write
        self.reads = self.writes = self.corrupt = self.evictions = self.write_errors = 0

    def stats(self) -> dict[str, Any]:
        """Disk hits (reads), writes, corrupt entries deleted, evictions, write errors."""
        return {
            "disk_reads": self.reads,
            "disk_writes": self.writes,
            "disk_corrupt": self.corrupt,
            "disk_evictions": self.evictions,
            "disk_write_errors": self.write_errors,
        }

    def path(self, name: str) -> Path:
        return self.root / name[:2] / f"{name}.bin"

    def get(self, name: str) -> tuple[torch.Tensor, torch.dtype] | None:
        path = self.path(name)
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        entry = self._decode(name, raw)
        if entry is None:
            self.corrupt += 1
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        self.reads += 1
        return entry

    @staticmethod
    def _decode(name: str, raw: bytes) -> tuple[torch.Tensor, torch.dtype] | None:
        """The entry in `raw` if every check passes, else None."""
        if len(raw) < 8 or raw[:4] != MAGIC:
            return None
        (size,) = struct.unpack("<I", raw[4:8])
        try:
            head = json.loads(raw[8 : 8 + size].decode("utf-8"))
            dtype, hidden = _DTYPES[head["dtype"]], _DTYPES[head["hidden"]]
            shape = [int(x) for x in head["shape"]]
            payload = raw[8 + size :]
            itemsize = torch.empty((), dtype=dtype).element_size()
            ok = (
                head["name"] == name
                and len(shape) == 2
                and len(payload) == shape[0] * shape[1] * itemsize
                and hashlib.blake2b(payload, digest_size=20).hexdigest() == head["blake2b"]
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None
        if not ok:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=_INT_VIEW[itemsize]).view(dtype)
        return flat.reshape(shape), hidden

    def put(self, name: str, value: torch.Tensor, hidden_dtype: torch.dtype) -> None:
        payload = _payload(value)
        head = json.dumps(
            {
                "name": name,
                "dtype": _dtype_name(value.dtype),
                "hidden": _dtype_name(hidden_dtype),
                "shape": list(value.shape),
                "blake2b": hashlib.blake2b(payload, digest_size=20).hexdigest(),
            }
        ).encode()
        data = MAGIC + struct.pack("<I", len(head)) + head + payload
        if len(data) > self.max_bytes:
            return
        path = self.path(name)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            return
        self.writes += 1
        if self._bytes is None:
            self._bytes = self._total()
        else:
            self._bytes += len(data)
        if self._bytes > self.max_bytes:
            self._evict()

    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        for sub in self.root.glob("??"):
            try:
                with os.scandir(sub) as it:
                    for e in it:
                        if e.name.endswith(".bin"):
                            try:
                                st = e.stat()
                            except OSError:
                                continue
                            out.append((st.st_mtime, st.st_size, Path(e.path)))
            except OSError:
                continue
        return out

    def _total(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _evict(self) -> None:
        """Delete the least recently used files until the store holds <= 90% of its bound."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        goal = int(0.9 * self.max_bytes)
        for _, size, path in files:
            if total <= goal:
                break
            path.unlink(missing_ok=True)
            total -= size
            self.evictions += 1
        self._bytes = total


_STORES: dict[tuple[str, int], DiskStore] = {}


def disk_store(root: Path, max_mb: float) -> DiskStore | None:
    """The process's `DiskStore` of `root` (one per folder and bound, so a run's training and
    evaluation caches share its accounting); None when `max_mb` is 0 or the store is off."""
    if not ENABLED or max_mb <= 0:
        return None
    key = (str(Path(root).expanduser().resolve()), int(max_mb * 2**20))
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = DiskStore(Path(key[0]), max_mb)
    return store


def disk_store_for(model_cfg: Any) -> DiskStore | None:
    """The store a run's config names: ``<model.cache_dir or the fedlora cache>/frozen_layers``
    bounded by ``model.disk_cache_mb`` (0 = off)."""
    from fedlora.files import default_cache_dir

    base = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    return disk_store(base / FOLDER, float(model_cfg.disk_cache_mb))


def entry_prefix(decoder: torch.nn.Module, first_layer: int, extra: Sequence[Any]) -> str:
    """The part of every entry name that is not the tokens (see the module docstring):
    versions, CPU capability, the decoder and its config, `first_layer`, `extra` (autocast
    mode, storage dtype, device type) and the frozen weights' fingerprint."""
    import transformers

    import fedlora

    named = [(f"embed_tokens.{n}", p) for n, p in decoder.embed_tokens.named_parameters()]
    for i in range(first_layer):
        named += [(f"layers.{i}.{n}", p) for n, p in decoder.layers[i].named_parameters()]
    config = decoder.config
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    parts = [
        f"fedlora {fedlora.__version__}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
        f"cpu {capability}",
        type(decoder).__name__,
        config.to_json_string(use_diff=False),
        str(getattr(config, "_attn_implementation", None)),
        str(first_layer),
        repr(tuple(extra)),
        weights_fingerprint(named),
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=20).hexdigest()


def entry_name(prefix: str, kind: str, key: bytes) -> str:
    """The file name (hex) of a row: its prefix, kind ("rows" | "packed") and token bytes."""
    h = hashlib.blake2b(digest_size=20)
    h.update(prefix.encode() + b"|" + kind.encode() + b"|")
    h.update(key)
    return h.hexdigest()
