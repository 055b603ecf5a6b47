"""Scoring a model loaded with eager attention (bf16 on a CPU) runs SDPA and restores eager;
the shared-context scorer's log-softmax only at real tail positions keeps its scores."""

from __future__ import annotations

import copy

import numpy as np
import torch

from fedlora.llm.models import load_model
from fedlora.llm.scoring import inference_attention, pair_logliks

PAIRS = [
    ("Question: Which gas do plants take in?\nAnswer:", " oxygen"),
    ("Question: Which gas do plants take in?\nAnswer:", " carbon dioxide and water"),
    ("Question: Which gas do plants take in?\nAnswer:", " helium"),
    ("the sun is a", " star"),
    ("the sun is a", " big ball of very hot gas"),
    ("Question: is ice cold?\nAnswer:", " no"),
]


def test_scoring_an_eager_model_uses_sdpa_and_restores_eager():
    # Prepare: the same weights with SDPA (as loaded in fp32) and with eager attention
    sdpa, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    eager = copy.deepcopy(sdpa)
    eager.config._attn_implementation = "eager"
    seen = []

    def spy(module, args, kwargs, out):
        seen.append(module.config._attn_implementation)

    eager.model.layers[0].self_attn.register_forward_hook(spy, with_kwargs=True)
    # Execute
    ref = pair_logliks(sdpa, tok, PAIRS, batch_size=1, share_prompt=False)  # the reference
    got = pair_logliks(eager, tok, PAIRS, batch_size=4)
    # Assert: attention ran as SDPA inside, eager again after; the same scores
    assert seen and set(seen) == {"sdpa"}
    assert eager.config._attn_implementation == "eager"
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    with inference_attention(sdpa):  # an SDPA model is left as it is
        assert sdpa.config._attn_implementation == "sdpa"


def test_shared_scores_equal_full_sequences_in_bf16_to_rounding():
    # The bf16 path (bf16 weights, eager as loaded on a CPU) agrees with fp32 to bf16 rounding
    model32, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    model16, _ = load_model("tiny-llama", dtype="bf16", progress=False)
    ref = pair_logliks(model32, tok, PAIRS, batch_size=1, share_prompt=False)
    got = pair_logliks(model16, tok, PAIRS, batch_size=4)
    assert model16.config._attn_implementation == "eager"
    assert np.all(np.isfinite(got)) and np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))
    assert not np.array_equal(got, ref)  # it did run in bf16
    assert torch.get_default_dtype() == torch.float32
