"""The frozen-layer cache (LoRA on the top K layers: the layers below computed once per
example) == no cache, its bounds, invalidation and bad input."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import TrainingConfig
from fedlora.errors import ConfigError
from fedlora.llm.layer_cache import LayerCache, cacheable_layers
from fedlora.llm.models import load_model
from fedlora.llm.train import collate_clients, layer_cache_for, local_train, target_token_loss
from train_cases import PROMPTS, RANK, fresh, make_batch


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-qwen2")


def deep_tiny(kind: str, layers: int = 4, **extra):
    """A `layers`-deep variant of a tiny model (seeded N(0, 0.02) weights, norms 1)."""
    from transformers import AutoModelForCausalLM

    from fedlora.llm.tiny_models import build_tiny_tokenizer, tiny_config

    tok = build_tiny_tokenizer()
    d = tiny_config(kind, vocab_size=len(tok)).to_dict()
    d.update(num_hidden_layers=layers, **extra)
    d.pop("layer_types", None)  # recomputed for the new depth
    config = type(tiny_config(kind))(**d)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(
                torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02
            )
            p.requires_grad_(False)
    return model.eval(), tok


DEEP = {
    "tiny-llama": {},
    # layers 1..3 use a 6-token sliding window: the cache must rebuild both mask kinds
    "tiny-qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(DEEP))
def deep(request):
    return deep_tiny(request.param, **DEEP[request.param])


def with_lora(base_model, slots: int, layers=2, seed=0):
    return fresh((base_model, None), slots, seed=seed, layers=layers)


def client_steps(tok, c: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Client c's H batches of 2 rows of different lengths; step 2 repeats step 0."""
    out = [make_batch(tok, [PROMPTS[(c + h) % 6], PROMPTS[(c + 2 * h + 3) % 6]]) for h in range(2)]
    return (out + [out[0]] * steps)[:steps]


def test_cached_training_equals_uncached_with_padding_and_slots(deep):
    # Prepare: 4 layers, LoRA on the top 2 (layers 0-1 cached), 3 slots with sketched scales,
    # rows of different lengths (right padding), H = 3 with step 2 = step 0 (cache hits)
    model_def, tok = deep
    batches = [client_steps(tok, c, 3) for c in range(3)]
    scales = torch.tensor([[2.0, 0, 2.0, 0], [1.0, 1, 1, 1], [4.0, 0, 0, 0]])
    ref_model, ref_lora = with_lora(model_def, slots=3)
    ref_lora.set_clients(scales)
    model, lora = with_lora(model_def, slots=3)
    lora.set_clients(scales)
    cache = layer_cache_for(model, lora)
    # Execute
    ref = local_train(ref_model, ref_lora, batches, lr=0.3)
    got = local_train(model, lora, batches, lr=0.3, cache=cache)
    # Assert: same losses and adapters (fp32, to 1e-6); each distinct example computed once
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    for c in range(3):
        ref_state, state = ref_lora.slot_state(c), lora.slot_state(c)
        for k in state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=0, atol=1e-6)
    distinct = {
        bytes(row[m.bool()].numpy())
        for bc in batches
        for b in bc
        for row, m in zip(b["input_ids"], b["attention_mask"])
    }
    rows = sum(b["input_ids"].shape[0] for bc in batches for b in bc)
    stats = cache.stats()
    assert stats["cached_layers"] == 2 and stats["uncached_steps"] == 0
    assert stats["misses"] == len(distinct) == len(cache)
    assert stats["hits"] == rows - len(distinct)
    assert ref[1, -1] != ref[1, 0]  # training moved the adapter


def test_cached_loss_and_gradients_equal_uncached(deep):
    # Prepare: one step of 2 slots (uneven b: filler rows), padded to the common T
    model_def, tok = deep
    batch, _ = collate_clients([make_batch(tok, PROMPTS[:1]), make_batch(tok, PROMPTS[2:5])])
    results = []
    for use_cache in (False, True):
        model, lora = with_lora(model_def, slots=2)
        lora.set_clients(torch.tensor([[2.0, 0, 2.0, 0], [1.0, 1, 1, 1]]))
        cache = LayerCache(model, lora) if use_cache else None
        # Execute
        loss, counts = target_token_loss(model, batch, 2, cache)
        loss.sum().backward()
        results.append((loss.detach(), counts, [p.grad.clone() for p in lora.parameters()]))
    # Assert
    (ref_loss, ref_counts, ref_grads), (loss, counts, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert torch.equal(counts, ref_counts)
    assert len(grads) == 2 * 2 * 2  # q,v of the top 2 layers: A and B each
    for g, r in zip(grads, ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)


def test_cached_matches_uncached_to_bf16_rounding_with_a_bf16_base(base):
    # Prepare: the bf16 model path (base stored in bf16, autocast); cache stored as fp32.
    # In bf16 the uncached path itself moves with the padding: 7 extra pad columns change
    # this batch's loss by ~4e-5 relative. The cache computes misses at their own padded
    # length, so it matches to that level (in fp32: 1e-6, tested above).
    base_bf16, tok = copy.deepcopy(base[0]).to(torch.bfloat16), base[1]
    batches = [[make_batch(tok, PROMPTS[:3]), make_batch(tok, PROMPTS[2:5])]]
    results = []
    for use_cache in (False, True):
        model, lora = with_lora(base_bf16, slots=1, layers=1)
        lora.set_clients(torch.ones(1, RANK))
        cache = LayerCache(model, lora) if use_cache else None
        # Execute
        losses = local_train(model, lora, batches, lr=0.3, autocast_bf16=True, cache=cache)
        results.append((losses, lora.slot_state(0)))
    # Assert
    (ref, ref_state), (got, state) = results
    assert got[0, 0] == ref[0, 0]  # step 0: the same misses, bitwise equal
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=0)
    for k in state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-3, atol=1e-4)
    assert cache.stats()["hits"] == 1  # PROMPTS[2] appears in both steps


def _rows(tok, n_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (b, T) ids/mask of rows with the given lengths (distinct contents)."""
    t = max(n_tokens)
    ids = torch.zeros(len(n_tokens), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(n_tokens):
        ids[i, :n] = torch.arange(10 + 7 * i, 10 + 7 * i + n)
        mask[i, :n] = 1
    return ids, mask


def test_lru_eviction_within_the_mb_bound(base):
    # Prepare: tiny-llama (hidden 64, LoRA on the top layer): an example of n tokens holds
    # n*64*4 bytes of fp32 hidden state + 8n bytes of key = 264n; room for two 5-token ones
    model, lora = fresh(base, slots=1, layers=1)
    per_entry = 5 * 64 * 4 + 5 * 8
    assert per_entry == 1320
    cache = LayerCache(model, lora, max_mb=2700 / 2**20)
    ids, mask = _rows(base[1], [5, 5, 5])
    a, b, c = ((ids[i : i + 1], mask[i : i + 1]) for i in range(3))
    # Execute: A, B, A (A most recent), C -> B is the least recently used and goes
    with torch.no_grad():
        for x in (a, b, a, c):
            cache.last_hidden_state(*x)
        stats = cache.stats()
        cache.last_hidden_state(*a)
        after_a = cache.stats()
        cache.last_hidden_state(*b)
        after_b = cache.stats()
    # Assert
    assert stats["entries"] == 2 and stats["evictions"] == 1
    assert stats["mb"] * 2**20 == 2 * per_entry <= 2700
    assert (stats["hits"], stats["misses"]) == (1, 3)
    assert after_a["hits"] == 2  # A was kept
    assert after_b["misses"] == 4 and after_b["evictions"] == 2  # B was evicted


def test_an_example_larger_than_the_bound_is_not_kept(base):
    model, lora = fresh(base, slots=1, layers=1)
    cache = LayerCache(model, lora, max_mb=1000 / 2**20)  # < 1320 bytes of a 5-token example
    ids, mask = _rows(base[1], [5])
    with torch.no_grad():
        out = cache.last_hidden_state(ids, mask)
        ref = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert len(cache) == 0 and cache.nbytes == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_bf16_storage_halves_memory_and_stays_close(base):
    # Prepare
    ids, mask = _rows(base[1], [6, 4])
    model, lora = fresh(base, slots=1, layers=1)
    fp32, bf16 = LayerCache(model, lora), LayerCache(model, lora, dtype="bf16")
    # Execute
    with torch.no_grad():
        ref = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        out32 = fp32.last_hidden_state(ids, mask)
        out16 = bf16.last_hidden_state(ids, mask)
    # Assert: 10 tokens * 64 * (4 or 2) bytes + 10 * 8 key bytes
    assert fp32.nbytes == 10 * 64 * 4 + 80 and bf16.nbytes == 10 * 64 * 2 + 80
    real = mask.bool()
    torch.testing.assert_close(out32[real], ref[real], rtol=0, atol=1e-6)
    torch.testing.assert_close(out16[real], ref[real], rtol=0.05, atol=0.05)
    assert not torch.equal(out16[real], ref[real])  # rounded: why fp32 is the default


def test_cache_is_dropped_when_lower_weights_change_but_not_upper(base):
    # Prepare
    ids, mask = _rows(base[1], [6, 4])
    model, lora = fresh(base, slots=1, layers=1)
    cache = LayerCache(model, lora)
    with torch.no_grad():
        cache.last_hidden_state(ids, mask)
        # Execute 1: an update of the adapted (top) layer's base weight, as FedStackLoRA merges
        name = lora.names[0]
        lora.add_to_base({name: torch.full(lora.modules[name].weight.shape, 0.01)})
        out = cache.last_hidden_state(ids, mask)
        ref = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        kept = cache.stats()
        # Execute 2: an in-place change of a cached (lower) layer
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        out2 = cache.last_hidden_state(ids, mask)
        ref2 = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    # Assert
    real = mask.bool()
    assert (kept["hits"], kept["misses"]) == (2, 2)  # upper change: entries still valid
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=1e-6)
    assert cache.stats()["misses"] == 4  # lower change: recomputed
    torch.testing.assert_close(out2[real], ref2[real], rtol=0, atol=1e-6)
    assert not torch.allclose(ref2[real], ref[real])


def test_left_padded_batch_bypasses_the_cache(base):
    # Left padding shifts position ids with the padding: not cacheable, computed directly
    model, lora = fresh(base, slots=1, layers=1)
    cache = LayerCache(model, lora)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = cache.last_hidden_state(ids, mask)
        ref = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert cache.stats()["uncached_steps"] == 1 and len(cache) == 0
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=0, atol=0)


def test_layer_cache_for_memoizes_and_applies_only_to_top_k(base):
    model, lora = fresh(base, slots=1, layers=1)
    cache = layer_cache_for(model, lora, 64)
    assert cache is not None and layer_cache_for(model, lora, 64) is cache
    assert layer_cache_for(model, lora, 64, "bf16") is not cache  # new options: new cache
    assert layer_cache_for(model, lora, 0) is None  # off
    assert cacheable_layers(model, lora) == (1, "")
    model_all, lora_all = fresh(base, slots=1)  # lora.layers = "all"
    assert layer_cache_for(model_all, lora_all) is None
    n, reason = cacheable_layers(model_all, lora_all)
    assert n == 0 and "layer 0" in reason


def test_cache_is_freed_with_its_adapter(base):
    # A run's cache must not outlive the run (e.g. the planner's calibration runs)
    import gc
    import weakref

    model, lora = fresh(base, slots=1, layers=1)
    ref = weakref.ref(layer_cache_for(model, lora, 64))
    assert ref() is not None and ref().lora is lora and ref().model is model
    del model, lora
    gc.collect()
    assert ref() is None


def test_layer_cache_bad_inputs(base):
    model, lora = fresh(base, slots=1, layers=1)
    for bad in (-1, float("nan"), "big", True):
        with pytest.raises(ConfigError, match=r"training.layer_cache_mb = .* MB >= 0"):
            LayerCache(model, lora, max_mb=bad)
    with pytest.raises(ConfigError, match=r"training.layer_cache_dtype = 'fp16'.*fp32, bf16"):
        layer_cache_for(model, lora, 64, "fp16")
    model_all, lora_all = fresh(base, slots=1)
    with pytest.raises(ConfigError, match="cannot be used: LoRA starts at decoder layer 0"):
        LayerCache(model_all, lora_all)
    other_model, other_lora = fresh(base, slots=1, layers=1)
    b = make_batch(base[1], PROMPTS[:1])
    with pytest.raises(ConfigError, match="cache belongs to another model/adapter"):
        local_train(model, lora, [[b]], lr=0.1, cache=LayerCache(other_model, other_lora))
    with pytest.raises(ConfigError, match="training.layer_cache_mb = -2"):
        TrainingConfig(layer_cache_mb=-2)
    with pytest.raises(ConfigError, match="training.layer_cache_dtype = 'fp64'"):
        TrainingConfig(layer_cache_dtype="fp64")


DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_engine_uses_the_cache_for_top_k_and_gets_the_same_adapters(tmp_path):
    # Prepare: real data, tiny-llama with LoRA on its top layer; the same round twice
    from fedlora.config import load_config
    from fedlora.federation.methods.base import ClientTask, RoundPlan
    from fedlora.federation.run import prepare_run_dir
    from fedlora.federation.runstate import build_run
    from fedlora.federation.trainer import train_participants
    from fedlora.llm.device import resolve_runtime

    overrides = [
        "model.name=tiny-llama",
        f'data.data_dir="{DATA}"',
        'data.tasks=["arc-e"]',
        "data.train_limit=12",
        "data.eval_limit=2",
        "data.n_clients=3",
        "data.min_client_examples=2",
        "lora.rank=4",
        "lora.layers=1",
        "training.local_steps=2",
        "training.batch_size=2",
        "training.slots=2",
    ]
    results = []
    for mb in (0, 256):
        cfg = load_config(None, [*overrides, f"training.layer_cache_mb={mb}"])
        prepare_run_dir(cfg, tmp_path / f"mb{mb}")
        run = build_run(resolve_runtime(cfg), tmp_path / f"mb{mb}", log=lambda m: None)
        plan = RoundPlan(0, tuple(ClientTask(c, np.ones(4), 4, 1.0) for c in range(3)))
        # Execute
        rounds = [train_participants(run, plan) for _ in range(2)]
        results.append((rounds, layer_cache_for(run.model, run.lora, mb)))
    # Assert: identical states and losses; the second round hit the cache
    (plain, no_cache), (cached, cache) = results
    assert no_cache is None and cache.stats()["hits"] > 0 and cache.stats()["cached_layers"] == 1
    for (s0, l0), (s1, l1) in zip(plain, cached):
        np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-6)
        for a, b in zip(s0, s1):
            for k in a:
                np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6)
