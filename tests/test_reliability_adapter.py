"""Issue 24: adapter files are reproducible (PEFT keeps target_modules as a set, whose order
follows the string hash seed: the exported list is sorted), checked across two processes
with different PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

EXPORT = """
import sys
from fedlora.config import LoraConfig
from fedlora.llm.lora import inject_lora
from fedlora.llm.models import load_model
model, _ = load_model("tiny-llama", progress=False)
cfg = LoraConfig(rank=2, layers="all", target_modules=("v_proj", "q_proj", "o_proj", "k_proj"))
inject_lora(model, cfg, slots=1, seed=0).export_peft(sys.argv[1], base_model_name_or_path="tiny-llama")
"""


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def test_identical_exports_have_identical_sha256(tmp_path: Path) -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    digests = []
    for seed in ("1", "2"):
        out = tmp_path / f"adapter-{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": src}
        subprocess.run([sys.executable, "-c", EXPORT, str(out)], env=env, check=True)
        config = json.loads((out / "adapter_config.json").read_text(encoding="utf-8"))
        assert config["target_modules"] == sorted(config["target_modules"])
        assert len(config["target_modules"]) == 8  # 4 modules x 2 layers, full paths
        digests.append(_digest(out))
    assert digests[0] == digests[1]
