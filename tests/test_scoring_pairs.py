"""`pair_logliks`: lm-eval's (context, continuation) requests scored with one context pass per
question and batches across questions equal the one-request-at-a-time pass (fp32 rounding),
including winogrande's partial scoring (different contexts, the same continuation), and so do
the packed rows through the frozen-layer eval cache under a LoRA adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlora.llm.models import load_model
from fedlora.llm.scoring import pair_items, pair_logliks

PAIRS = [
    ("Question: Which gas do plants take in?\nAnswer:", " oxygen"),
    ("Question: Which gas do plants take in?\nAnswer:", " carbon dioxide"),
    ("Question: Which gas do plants take in?\nAnswer:", " helium"),
    ("the sun is a", " star"),
    ("the sun is a", " big ball of very hot gas"),
    # winogrande: the blank filled by each option is the context, the tail is shared
    ("Sam beat Max because Sam", " was fast."),
    ("Sam beat Max because Max", " was fast."),
    ("Question: is ice cold?\nAnswer:", " no"),
    ("Question: is ice cold?\nAnswer:", " yes"),
    ("A context with a trailing space ", "moves it to the continuation"),
]


@pytest.fixture(scope="module")
def llama() -> tuple:
    return load_model("tiny-llama", dtype="fp32", progress=False)


def test_pair_items_share_contexts(llama) -> None:
    _, tok = llama
    items, where = pair_items(tok, PAIRS)
    assert len(items) == 6  # arc, obqa, two winogrande contexts, boolq, the trailing-space one
    assert where[:3] == [(0, 0), (0, 1), (0, 2)] and where[5:7] == [(2, 0), (3, 0)]
    assert [len(c) for _, c in items] == [3, 2, 1, 1, 2, 1]


def test_shared_pass_equals_per_option_pass(llama) -> None:
    model, tok = llama
    ref = pair_logliks(model, tok, PAIRS, batch_size=1, share_prompt=False)
    for batch in (1, 3, 16):
        shared = pair_logliks(model, tok, PAIRS, batch_size=batch, share_prompt=True)
        np.testing.assert_allclose(shared, ref, atol=2e-5, rtol=0)
    full_batched = pair_logliks(model, tok, PAIRS, batch_size=16, share_prompt=False)
    np.testing.assert_allclose(full_batched, ref, atol=2e-5, rtol=0)
    # a by-hand reference: the continuation's tokens after the context, one sequence
    ctx = tok(PAIRS[6][0])["input_ids"]
    whole = tok(PAIRS[6][0] + PAIRS[6][1])["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    by_hand = sum(float(lp[p - 1, whole[p]]) for p in range(len(ctx), len(whole)))
    assert ref[6] == pytest.approx(by_hand, abs=1e-5)
    assert ref[5] != pytest.approx(ref[6], abs=1e-6)  # the contexts differ, so do the scores


def test_cached_packed_pass_equals_per_option_pass(llama) -> None:
    from fedlora.config import LoraConfig
    from fedlora.llm.evaluation import eval_cache_for
    from fedlora.llm.lora import inject_lora

    model, tok = load_model("tiny-llama", dtype="fp32", progress=False)  # LoRA: a fresh copy
    lora = inject_lora(model, LoraConfig(rank=4, layers=1), slots=1, seed=0)
    gen = torch.Generator().manual_seed(0)
    lora.load_global(
        {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in lora.global_state().items()}
    )
    lora.set_clients(torch.ones(1, 4))
    cache = eval_cache_for(model, lora, 64.0)
    assert cache is not None
    ref = pair_logliks(model, tok, PAIRS, batch_size=1, share_prompt=False)
    for _ in range(2):  # the first pass fills the cache, the second reads it
        packed = pair_logliks(model, tok, PAIRS, batch_size=4, cache=cache)
        np.testing.assert_allclose(packed, ref, atol=2e-5, rtol=0)
