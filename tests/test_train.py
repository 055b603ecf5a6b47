"""Local training: target-only LM head loss, client batching == separate runs, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError, DataError
from fedlora.llm.models import load_model
from fedlora.llm.train import (
    TrainingError,
    collate_clients,
    local_train,
    target_token_loss,
)
from train_cases import PROMPTS, RANK, fresh, make_batch


@pytest.fixture(scope="module")
def base():
    return load_model("tiny-qwen2")


def test_target_only_loss_equals_full_logit_loss(base):
    # Prepare: two groups of two rows with different lengths
    model, lora = fresh(base, slots=2)
    tok = base[1]
    lora.set_clients(torch.ones(2, RANK))
    batch, _ = collate_clients([make_batch(tok, PROMPTS[:2]), make_batch(tok, PROMPTS[2:4])])
    # Execute
    with torch.no_grad():
        ours, counts = target_token_loss(model, batch, groups=2)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Assert: HF's full-logit loss of each group's rows (mean over its target tokens)
    for g in range(2):
        rows = slice(2 * g, 2 * g + 2)
        ref = torch.nn.functional.cross_entropy(
            logits[rows, :-1].reshape(-1, logits.shape[-1]).float(),
            batch["labels"][rows, 1:].reshape(-1),
            ignore_index=-100,
        )
        torch.testing.assert_close(ours[g], ref, rtol=0, atol=1e-5)
        assert counts[g] == (batch["labels"][rows, 1:] != -100).sum()


def test_clients_trained_together_equal_separate_runs(base):
    # Prepare: 3 clients, H = 3 steps, different T per client batch, sketched scales
    tok = base[1]
    batches = [
        [
            make_batch(tok, PROMPTS[(c + h) % 6 : (c + h) % 6 + 1] + PROMPTS[c : c + 1])
            for h in range(3)
        ]
        for c in range(3)
    ]
    scales = torch.tensor([[2.0, 0, 2.0, 0], [1.0, 1, 1, 1], [4.0, 0, 0, 0]])
    model, lora = fresh(base, slots=3)
    lora.set_clients(scales)
    # Execute
    together = local_train(model, lora, batches, lr=0.3)
    together_states = [lora.slot_state(c) for c in range(3)]
    # Assert: each client alone reaches the same adapter and the same losses
    assert together.shape == (3, 3)
    for c in range(3):
        m1, l1 = fresh(base, slots=1)
        l1.set_clients(scales[c : c + 1])
        alone = local_train(m1, l1, [batches[c]], lr=0.3)
        np.testing.assert_allclose(together[c], alone[0], rtol=0, atol=1e-5)
        state = l1.slot_state(0)
        for k in state:
            torch.testing.assert_close(together_states[c][k], state[k], rtol=0, atol=1e-5)
    # training moved the adapter and (for this lr) lowered client 1's loss
    assert together[1, -1] < together[1, 0]


def test_first_loss_is_the_hf_loss_and_step_is_plain_sgd(base):
    # Prepare
    tok = base[1]
    batch = make_batch(tok, PROMPTS[:3])
    model, lora = fresh(base, slots=1)
    lora.set_clients(torch.ones(1, RANK))
    before = lora.slot_state(0)
    ref_model, ref_lora = fresh(base, slots=1)
    ref_lora.set_clients(torch.ones(1, RANK))
    out = ref_model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")})
    out.loss.backward()
    grads = {}
    for n, layer in ref_lora.layers.items():
        grads[f"{n}.lora_A"], grads[f"{n}.lora_B"] = layer.lora_A.grad[0], layer.lora_B.grad[0]
    # Execute
    losses = local_train(model, lora, [[batch]], lr=0.1)
    # Assert: loss = HF's shifted loss; X ← X − η ∇X
    assert losses[0, 0] == pytest.approx(out.loss.item(), abs=1e-5)
    after = lora.slot_state(0)
    for k in before:
        torch.testing.assert_close(after[k], before[k] - 0.1 * grads[k], rtol=0, atol=1e-6)


def test_uneven_client_batch_sizes_are_filled_without_changing_results(base):
    tok = base[1]
    small, big = make_batch(tok, PROMPTS[:1]), make_batch(tok, PROMPTS[1:4])
    batch, b = collate_clients([small, big])
    assert b == 3 and batch["input_ids"].shape[0] == 6
    assert torch.all(batch["labels"][1:3] == -100)  # filler rows carry no targets
    model, lora = fresh(base, slots=2)
    lora.set_clients(torch.ones(2, RANK))
    together = local_train(model, lora, [[small], [big]], lr=0.2)
    m1, l1 = fresh(base, slots=1)
    l1.set_clients(torch.ones(1, RANK))
    alone = local_train(m1, l1, [[small]], lr=0.2)
    np.testing.assert_allclose(together[0], alone[0], rtol=0, atol=1e-5)
    for k, v in l1.slot_state(0).items():
        torch.testing.assert_close(lora.slot_state(0)[k], v, rtol=0, atol=1e-5)


def test_bf16_autocast_runs_and_is_close_to_fp32(base):
    tok = base[1]
    batch = make_batch(tok, PROMPTS[:2])
    model, lora = fresh(base, slots=1)
    lora.set_clients(torch.ones(1, RANK))
    fp32 = local_train(model, lora, [[batch, batch]], lr=0.1)
    model, lora = fresh(base, slots=1)
    lora.set_clients(torch.ones(1, RANK))
    bf16 = local_train(model, lora, [[batch, batch]], lr=0.1, autocast_bf16=True)
    assert lora.layers[lora.names[0]].lora_A.dtype == torch.float32  # fp32 master weights
    np.testing.assert_allclose(bf16, fp32, rtol=0.05)


def test_non_finite_loss_raises_training_error(base):
    tok = base[1]
    model, lora = fresh(base, slots=1)
    state = lora.global_state()
    state[f"{lora.names[0]}.lora_A"].fill_(float("inf"))
    lora.load_global(state)
    lora.set_clients(torch.ones(1, RANK))
    with pytest.raises(
        TrainingError, match=r"non-finite training loss at local step 0.*training.lr"
    ):
        local_train(model, lora, [[make_batch(tok, PROMPTS[:1])]], lr=0.1)


def test_bad_inputs(base):
    tok = base[1]
    model, lora = fresh(base, slots=2)
    lora.set_clients(torch.ones(2, RANK))
    b = make_batch(tok, PROMPTS[:1])
    with pytest.raises(ConfigError, match="1 client batch lists for 2 active"):
        local_train(model, lora, [[b]], lr=0.1)
    with pytest.raises(ConfigError, match=r"same number H >= 1.*\[2, 1\]"):
        local_train(model, lora, [[b, b], [b]], lr=0.1)
    with pytest.raises(ConfigError, match="training.lr = -1"):
        local_train(model, lora, [[b], [b]], lr=-1)
    no_target = dict(b, labels=torch.full_like(b["labels"], -100))
    with pytest.raises(DataError, match=r"slot\(s\) \[1\] has no target tokens"):
        local_train(model, lora, [[b], [no_target]], lr=0.1)
