"""The frozen-layer cache on disk: cold and warm equal no disk bit for bit, corrupt or
truncated entries are recomputed, keys change with the weights and versions, the bound holds."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlora
from fedlora.llm import disk_cache
from fedlora.llm.disk_cache import DiskStore, disk_store
from fedlora.llm.layer_cache import LayerCache
from fedlora.llm.models import load_model
from fedlora.llm.train import local_train
from tiny_runs import DATA, TINY_EVAL_RUN
from train_cases import PROMPTS, RANK, fresh, make_batch


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-llama")


def _batches(tok) -> list[list[dict[str, torch.Tensor]]]:
    """Two clients, H = 2, rows of different lengths."""
    return [
        [make_batch(tok, PROMPTS[c : c + 2]), make_batch(tok, PROMPTS[c + 2 : c + 5])]
        for c in range(2)
    ]


def _train(base, store) -> tuple[np.ndarray, list[dict], LayerCache]:
    """A fresh model, adapter and memory cache (as a new run), trained on `_batches`."""
    model, lora = fresh(base, slots=2, layers=1)
    lora.set_clients(torch.ones(2, RANK))
    cache = LayerCache(model, lora, disk=store)
    losses = local_train(model, lora, _batches(base[1]), lr=0.3, cache=cache)
    return losses, [lora.slot_state(i) for i in range(2)], cache


def _equal(a: tuple, b: tuple) -> None:
    assert np.array_equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_cold_then_warm_disk_equals_no_disk_bit_for_bit(base, tmp_path):
    # Prepare: the reference without a disk store
    ref = _train(base, None)
    store = DiskStore(tmp_path, 64)
    # Execute: a first "run" fills the store, a second reads every lower row from it
    cold = _train(base, store)
    written = store.writes
    warm = _train(base, store)
    # Assert: same losses and adapters, bit for bit; the warm run computed no lower row
    _equal(cold, ref)
    _equal(warm, ref)
    assert written == cold[2].stats()["misses"] > 0
    assert warm[2].stats()["misses"] == 0 and store.reads == written
    assert store.writes == written  # nothing rewritten


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "swap"])
def test_a_damaged_entry_is_detected_and_recomputed(base, tmp_path, damage):
    # Prepare: a filled store, then one entry damaged
    ref = _train(base, None)
    store = DiskStore(tmp_path, 64)
    _train(base, store)
    files = sorted(tmp_path.glob("*/*.bin"))
    victim = files[0]
    raw = victim.read_bytes()
    if damage == "flip":  # one bit of the payload
        victim.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    elif damage == "truncate":
        victim.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        victim.write_bytes(b"not an entry")
    else:  # another entry's (valid) content under this name
        victim.write_bytes(files[1].read_bytes())
    # Execute
    store2 = DiskStore(tmp_path, 64)
    got = _train(base, store2)
    # Assert: the damaged entry was not trusted: deleted, recomputed and written again
    assert store2.corrupt == 1 and got[2].stats()["misses"] == 1
    assert store2.reads == len(files) - 1 and store2.writes == 1
    # the row is recomputed alone (not in its first batch): equal to float rounding
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=1e-6)
    for x, y in zip(got[1], ref[1]):
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=1e-6)
    assert DiskStore._decode(victim.stem, victim.read_bytes()) is not None


def test_other_weights_or_versions_never_read_an_entry(base, tmp_path, monkeypatch):
    # Prepare: a filled store
    store = DiskStore(tmp_path, 64)
    _train(base, store)
    # Execute 1: other lower weights (the embedding) -> another key
    other = (copy.deepcopy(base[0]), base[1])
    with torch.no_grad():
        other[0].model.embed_tokens.weight.mul_(1.01)
    store_w = DiskStore(tmp_path, 64)
    _train(other, store_w)
    # Execute 2: another fedlora version with the original weights
    monkeypatch.setattr(fedlora, "__version__", "0.0.0-other")
    store_v = DiskStore(tmp_path, 64)
    _train(base, store_v)
    # Assert: neither read anything; both wrote their own entries
    assert store_w.reads == 0 and store_w.writes > 0
    assert store_v.reads == 0 and store_v.writes > 0


def test_the_store_stays_within_its_bound_and_evicts_least_recently_used(tmp_path):
    # Prepare: entries of ~4.1 KB under a 0.02 MB (~21 KB) bound
    store = DiskStore(tmp_path, 0.02)
    value = torch.arange(1024, dtype=torch.float32).reshape(16, 64)
    names = [f"{i:02x}" + "0" * 38 for i in range(4)]
    for i, name in enumerate(names):
        store.put(name, value, torch.float32)
        os.utime(store.path(name), (1e9 + i, 1e9 + i))  # written in this order, long ago
    assert store.get(names[0]) is not None  # used: the most recent now
    # Execute: two more entries pass the bound
    for i in (4, 5, 6):
        store.put(f"{i:02x}" + "0" * 38, value, torch.float32)
    # Assert: total within the bound; the oldest unused went first, the used one stayed
    total = sum(p.stat().st_size for p in tmp_path.glob("*/*.bin"))
    assert total <= store.max_bytes and store.evictions > 0
    assert store.get(names[1]) is None and store.get(names[0]) is not None
    got, hidden = store.get(names[0])
    assert torch.equal(got, value) and hidden == torch.float32


def test_bf16_values_round_trip_and_the_store_is_one_per_folder(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1)
    value = torch.randn(3, 8).to(torch.bfloat16)
    store.put("ab" + "1" * 38, value, torch.bfloat16)
    got, hidden = store.get("ab" + "1" * 38)
    assert got.dtype == torch.bfloat16 and torch.equal(got, value) and hidden == torch.bfloat16
    head = json.loads(store.path("ab" + "1" * 38).read_bytes()[8:].split(b"}")[0] + b"}")
    assert head["shape"] == [3, 8] and head["dtype"] == "bfloat16"
    assert disk_store(tmp_path, 8) is disk_store(tmp_path, 8)
    assert disk_store(tmp_path, 0) is None


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_runs_with_the_disk_cache_cold_and_warm_equal_a_run_without(tmp_path, monkeypatch):
    # Prepare: the tiny run (LoRA on tiny-llama's top layer, evaluated every round)
    from fedlora.config import load_config
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cache_dir = tmp_path / "cache"  # named: the store is on (tests/conftest.py)

    def run(name: str, mb: float) -> tuple[list[dict], bytes]:
        extra = [f'model.cache_dir="{cache_dir}"', f"model.disk_cache_mb={mb}"]
        cfg = load_config(None, [*TINY_EVAL_RUN, *extra])
        prepare_run_dir(cfg, tmp_path / name)
        run_experiment(cfg, tmp_path / name, quiet=True, log=lambda m: None)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(x) for x in lines]
        for m in metrics:  # timings differ between runs
            for k in [k for k in m if k.endswith("_s") and "sim" not in k]:
                m.pop(k)
        adapter = (tmp_path / name / "adapter" / "adapter_model.safetensors").read_bytes()
        return metrics, adapter

    # Execute
    ref = run("off", 0)
    cold = run("cold", 64)
    files = len(list((cache_dir / disk_cache.FOLDER).glob("*/*.bin")))
    warm = run("warm", 64)
    # Assert: the same metrics and adapter bytes; the warm run added no entry
    assert cold == ref and warm == ref
    assert files > 0 and len(list((cache_dir / disk_cache.FOLDER).glob("*/*.bin"))) == files
