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

The store deletes only what it writes, never through a link: an entry is a regular file
named ``<40 hex>.bin`` in a real (not linked) folder named by its first two hex digits;
anything else under the root (a user's ``*.bin``, a linked folder or file) is neither read,
counted nor deleted. An I/O error never fails a run: a read error is a miss, a write error
(a full disk, a root that is a file or read-only) is counted (``disk_write_errors``) and
skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import struct
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["DiskStore", "disk_store", "disk_store_for", "weights_fingerprint"]

MAGIC = b"FLC1"
FOLDER = "frozen_layers"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_ENTRY = re.compile(r"[0-9a-f]{40}\.bin")  # entry_name's blake2b (20 bytes), the only files
_FOLDER = re.compile(r"[0-9a-f]{2}")


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
            raw = _read_own(path)
        except OSError:
            return None
        entry = self._decode(name, raw)
        if entry is None:
            self.corrupt += 1
            _remove_own(path)
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
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            _write_new(tmp, data)
            os.replace(tmp, path)
        except OSError:  # counted and skipped: the row is computed again when needed
            _remove_own(tmp)
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
        """(mtime, size, path) of every entry the store wrote: regular files named as entries
        in their real two-hex-digit folder; links and anything else are left out."""
        out = []
        try:
            subs = [e for e in os.scandir(self.root) if _FOLDER.fullmatch(e.name)]
        except OSError:
            return out
        for sub in subs:
            try:
                if not sub.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(sub.path) as it:
                    for e in it:
                        if not (_ENTRY.fullmatch(e.name) and e.name[:2] == sub.name):
                            continue
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
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
            _remove_own(path)
            total -= size
            self.evictions += 1
        self._bytes = total


def _folder_ok(path: Path) -> bool:
    """The entry's folder is a real folder (not a link): the store never acts through one."""
    try:
        return stat.S_ISDIR(os.lstat(path.parent).st_mode)
    except OSError:
        return False


def _read_own(path: Path) -> bytes:
    """An entry's bytes, never through a link (OSError for a link, a linked folder, ...)."""
    if not _folder_ok(path):
        raise OSError(f"{path.parent} is not a folder of the store")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read()


def _write_new(path: Path, data: bytes) -> None:
    """A new file at `path` (its folder made if missing), never through a link: O_EXCL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not _folder_ok(path):
        raise OSError(f"{path.parent} is not a folder of the store")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, 0o666), "wb") as f:
        f.write(data)


def _remove_own(path: Path) -> None:
    """Delete a regular file of the store; a link, or anything in a linked folder, stays."""
    try:
        if _folder_ok(path) and stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:  # gone already, or not ours to delete: never fails a run
        pass


_STORES: dict[tuple[str, int], DiskStore] = {}


def disk_store(root: Path, max_mb: float) -> DiskStore | None:
    """The process's `DiskStore` of `root` (one per folder and bound, so a run's training and
    evaluation caches share its accounting); None when `max_mb` is 0 (off)."""
    if max_mb <= 0:
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
