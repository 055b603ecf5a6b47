"""The tiny test models (``tiny-llama``, ``tiny-qwen2``): random-initialised, seeded, 2 layers,
hidden 64, 4 heads, 2 kv heads, with a byte-level BPE tokenizer trained in code on a built-in
English text, so any prompt text encodes. No files, no network; `fedlora.llm.models.load_model`
loads them by name like any other model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedlora.errors import bad_value

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TINY_MODELS",
    "TINY_SEED",
    "build_tiny_tokenizer",
    "tiny_config",
    "build_tiny_model",
]

TINY_MODELS = ("tiny-llama", "tiny-qwen2")
# Special tokens of the tiny tokenizer (ids 0..3, in this order).
TINY_SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
TINY_VOCAB_SIZE = 1024
TINY_SEED = 0

# A small built-in English corpus for the tiny tokenizer's BPE merges. Byte-level BPE keeps all
# 256 byte symbols, so text outside this corpus still encodes (in more tokens).
_TINY_CORPUS = """
Please choose the correct answer to the question. Answer1 Answer2 Answer3 Answer4 Answer5
answer1 answer2 answer3 answer4 answer5 option1 option2 solution1 solution2 ending1 ending2
Answer format: answer1/answer2/answer3/answer4. the correct answer is true false yes no.
Below is an instruction that describes a task. Write a response that appropriately completes
the request. Instruction: Response: Input: Question: Which of the following best explains why
the sun rises in the east and sets in the west? The earth rotates on its axis once a day.
A student wants to measure the mass of a rock. Which tool should the student use? A balance.
Plants make their own food by photosynthesis, using water, carbon dioxide and light energy.
Animals need food, water, air and shelter to survive. Heat moves from warmer to colder objects.
What happens when ice is heated? It melts and becomes liquid water, then evaporates into gas.
People often help their friends when they are sad, and they feel happy when others thank them.
Alex went to the store to buy some milk because the family had run out at breakfast time.
How would you describe Sarah after she gave her lunch to a classmate? kind and generous.
Is the following statement true or false? The moon is larger than the earth. false.
Electricity flows through copper wire; rubber and plastic are insulators, metals conduct.
The first thing to do is read the question carefully, then think about each possible answer.
A magnet attracts iron and steel. Sound travels faster in water than in air. Light is fast.
In the spring, many birds build nests and lay eggs; in the fall, leaves change color and drop.
a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 , . ; : ? ! ' " ( ) -
"""


def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A deterministic byte-level BPE tokenizer (vocab 1024) trained on a built-in text.

    Special tokens: ``<pad>`` = 0, ``<s>`` = 1 (bos), ``</s>`` = 2 (eos), ``<unk>`` = 3.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(TINY_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _TINY_CORPUS.strip().splitlines() if line]
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="right",
    )


def tiny_config(kind: str, vocab_size: int = TINY_VOCAB_SIZE):
    """The config of a tiny test model: 2 layers, hidden 64, 4 heads, 2 kv heads."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        use_cache=False,
    )
    if kind == "tiny-llama":
        return LlamaConfig(**common)
    if kind == "tiny-qwen2":
        return Qwen2Config(**common)
    raise bad_value("model.name", kind, f"a tiny model: {', '.join(TINY_MODELS)}")


def build_tiny_model(kind: str, *, attn_implementation: str, dtype: Any, seed: int = TINY_SEED):
    """(model, tokenizer) of the tiny test model `kind`: weights ~ N(0, 0.02) from a generator
    seeded with `seed`, stored in the torch `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = tiny_config(kind, vocab_size=len(tokenizer))
    config._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Seeded init with an explicit generator (no global RNG): weights ~ N(0, 0.02), biases
    # ~ N(0, 0.02) (so Qwen2's q/k/v biases matter in tests), norms 1.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
    model.to(dtype)
    return model, tokenizer
