"""Model specs: tiny test models, local directories, the smollm2 cache, bad specs."""

from __future__ import annotations

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.llm.models import load_model
from fedlora.llm.tiny_models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_llama():
    return load_model("tiny-llama")


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
def test_tiny_model_is_deterministic_and_frozen(spec):
    # Prepare / Execute: two independent loads
    m1, tok1 = load_model(spec)
    m2, tok2 = load_model(spec)
    # Assert: identical weights and vocabularies, frozen, eval mode, no KV cache
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert tok1.get_vocab() == tok2.get_vocab()
    assert not any(p.requires_grad for p in m1.parameters())
    assert not m1.training
    assert m1.config.use_cache is False
    assert m1.config.num_hidden_layers == 2 and m1.config.hidden_size == 64
    assert m1.config.num_attention_heads == 4 and m1.config.num_key_value_heads == 2


def test_tiny_models_differ_in_architecture():
    llama, _ = load_model("tiny-llama")
    qwen, _ = load_model("tiny-qwen2")
    assert llama.config.model_type == "llama" and qwen.config.model_type == "qwen2"
    # Qwen2 has q/k/v biases, Llama none
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    assert llama.model.layers[0].self_attn.q_proj.bias is None


def test_tiny_tokenizer_encodes_arbitrary_text():
    tok = build_tiny_tokenizer()
    text = "Which is correct? Ωmega — naïve café ☃ 42%"
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    batch = tok(["a", "a longer sentence"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, -1].item() == tok.pad_token_id  # right padding
    assert batch["attention_mask"][0].sum().item() == len(tok("a")["input_ids"])


def test_bf16_stores_base_in_bf16_with_eager_attention():
    model, _ = load_model("tiny-llama", dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"


def test_local_directory_round_trip(tmp_path, tiny_llama):
    # Prepare: save the tiny model as a Hugging Face checkpoint
    model, tok = tiny_llama
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    enc = tok(["the correct answer is answer1"], return_tensors="pt")
    # Execute
    loaded, loaded_tok = load_model(str(tmp_path))
    # Assert: same tokenization and logits
    assert (
        loaded_tok(["the correct answer is answer1"])["input_ids"][0]
        == enc["input_ids"][0].tolist()
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded(**enc).logits, model(**enc).logits, rtol=0, atol=0)


def test_smollm2_is_served_from_the_cache_dir(tmp_path, tiny_llama):
    # Prepare: a converted checkpoint already in <cache_dir>/smollm2-135m/ (a stand-in)
    model, tok = tiny_llama
    model.save_pretrained(tmp_path / "smollm2-135m")
    tok.save_pretrained(tmp_path / "smollm2-135m")
    # Execute: no hub, no pip: the cache hit must be used
    loaded, _ = load_model("smollm2-135m", cache_dir=str(tmp_path), progress=False)
    # Assert
    assert loaded.config.hidden_size == 64
    assert loaded.config.use_cache is False


@pytest.mark.parametrize(
    "spec", ["no-such-model", "./does/not/exist", "a/b/c", "  ", "smollm2-13m"]
)
def test_unknown_spec_lists_the_accepted_forms(spec):
    with pytest.raises(ConfigError) as e:
        load_model(spec)
    msg = str(e.value)
    assert "model.name" in msg
    assert "tiny-llama" in msg and "smollm2-135m" in msg and "hub id" in msg


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model(str(tmp_path))


def test_bad_dtype_is_rejected():
    with pytest.raises(ConfigError, match=r"model.dtype = 'fp16'.*fp32, bf16"):
        load_model("tiny-llama", dtype="fp16")


def test_unreachable_hub_id_is_a_config_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_model("nobody-here/not-a-model-xyz")
