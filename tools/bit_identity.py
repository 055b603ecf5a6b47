"""Bit-identity hashes of fixed-config tiny runs, for structural changes that must not move a
number: run it before and after, and diff the two outputs.

    .venv/bin/python tools/bit_identity.py /tmp/hashes-run > before.txt
    ... the change ...
    .venv/bin/python tools/bit_identity.py /tmp/hashes-run > after.txt && diff before.txt after.txt

Every config field is written out in full (OUT/cfg_*.toml), never the defaults, so a change
of a default does not move the hashes. Each line: the case, the sha256 of the final adapter's
safetensors file and of metrics.jsonl without its wall-clock field (`compute_s`). Cases:
sketched (given q and k), fedavg, fslora, proposed with in-run calibration and re-planning,
and the same proposed run stopped after 3 rounds and resumed to 6. Not a timing benchmark.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

from fedlora.cli import main
from fedlora.config import dump_toml, load_config

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
BASE = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.device=cpu",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "boolq"]',
    'data.eval_tasks=["arc-e"]',
    "data.train_limit=48",
    "data.eval_limit=6",
    "data.max_seq_len=80",
    "data.n_clients=4",
    "data.min_client_examples=4",
    "lora.rank=4",
    'lora.layers="all"',
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=2",
    "training.eval_every=1",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    'training.sketch_step="scaled"',
    'evaluation.format="harness"',
    "output.progress=false",
]
PROPOSED = [
    "method.name=proposed",
    'planner.calibration="in-run"',
    "planner.probe_rounds=1",
    "planner.replan_every=1",
    "planner.replan_margin=0",
]
CASES = {
    "sketched": [
        "method.name=sketched",
        "method.q=[0.5, 1.0, 0.5, 1.0]",
        "method.k=[1, 2, 3, 4]",
        "training.rounds=3",
    ],
    "fedavg": ["method.name=fedavg", "training.rounds=3"],
    "fslora": ["method.name=fslora", "training.rounds=3"],
    "proposed_inrun": [*PROPOSED, "training.rounds=6"],
}


def config_file(out: Path, name: str, extra: list[str]) -> Path:
    path = out / f"cfg_{name}.toml"
    path.write_text(dump_toml(load_config(None, BASE + extra)))
    return path


def digest(run: Path) -> tuple[str, str]:
    adapter = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [{k: v for k, v in m.items() if k != "compute_s"} for m in lines]
    metrics = json.dumps(lines, sort_keys=True).encode()
    return hashlib.sha256(adapter).hexdigest(), hashlib.sha256(metrics).hexdigest()


def cli(argv: list[str]) -> None:
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"fedlora {' '.join(argv)}: exit {rc}\n{err.getvalue()}")


def run_all(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name, extra in CASES.items():
        cli(
            [
                "run",
                "--quiet",
                "--config",
                str(config_file(out, name, extra)),
                "--out",
                str(out / name),
            ]
        )
        adapter, metrics = digest(out / name)
        print(f"{name}: adapter {adapter} metrics {metrics}", flush=True)
    cut = config_file(out, "proposed_cut", [*PROPOSED, "training.rounds=3"])
    resumed = out / "proposed_resume"
    cli(["run", "--quiet", "--config", str(cut), "--out", str(resumed)])
    cli(["run", "--quiet", "--resume", str(resumed), "--force", "training.rounds=6"])
    adapter, metrics = digest(resumed)
    print(f"proposed_inrun_resumed: adapter {adapter} metrics {metrics}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    run_all(Path(sys.argv[1]))
