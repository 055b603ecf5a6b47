"""`fedlora export RUN_DIR --merged OUT`: the run's base model with its adapter folded in,
as a transformers model directory (`fedlora.llm.merge`). The run's PEFT adapter
(`RUN_DIR/adapter`) stays its default output; this is the model to ship without fedlora."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedlora.errors import ConfigError, bad_value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a merged transformers model (base + the run's adapter) to ship",
        description="Write the run's base model with its final adapter folded into the weights "
        "(W + scaling·B·R·A, plus the run's merges into the base), in the run's base dtype, as a "
        "directory AutoModelForCausalLM.from_pretrained loads without fedlora.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run directory")
    p.add_argument("--merged", required=True, metavar="OUT", help="the model directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.set_defaults(func=cmd_export)


def _final_adapter(run_dir: Path, scaling: float) -> tuple[dict, dict, float, str]:
    """(adapter state, base delta, scaling, source): the newest checkpoint's global adapter
    (A, B and Fed-SB's R) and merged base delta, else the PEFT adapter directory."""
    from fedlora.federation.checkpoints import load_checkpoint
    from fedlora.llm.merge import read_peft_adapter

    state = load_checkpoint(run_dir, warn=lambda m: None)
    if state is not None:
        where = f"checkpoint of round {state['round']}"
        return state["global"], state.get("base_delta") or {}, scaling, where
    if (run_dir / "adapter" / "adapter_config.json").is_file():
        adapter, peft_scaling = read_peft_adapter(run_dir / "adapter")
        return adapter, {}, peft_scaling, str(run_dir / "adapter")
    raise bad_value("RUN_DIR", str(run_dir), "a run with a checkpoint or an adapter/ directory")


def cmd_export(args: argparse.Namespace) -> int:
    from fedlora.config.toml_io import load_config

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise bad_value("RUN_DIR", str(run_dir), "a run directory (with config.toml)")
    out = Path(args.merged)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"--merged {str(out)!r} exists and is not empty: pass --overwrite")
    if out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents:
        raise bad_value("--merged", str(out), "a directory outside the run directory")
    cfg = load_config(str(run_dir / "config.toml"), [])
    adapter, base_delta, scaling, source = _final_adapter(run_dir, cfg.lora.scaling)

    from fedlora.llm.merge import lora_deltas, merge_into, save_merged
    from fedlora.llm.models import load_model

    dtype = cfg.model.dtype if cfg.model.dtype in ("fp32", "bf16") else "fp32"
    model, tokenizer = load_model(
        cfg.model.name, dtype=dtype, cache_dir=cfg.model.cache_dir or None, device="cpu"
    )
    names = merge_into(model, lora_deltas(adapter, scaling), base_delta)
    save_merged(model, tokenizer, out)
    print(
        f"merged model ({cfg.model.name}, {dtype}, {len(names)} layers from the {source}, "
        f"scaling {scaling:g}): {out}"
    )
    return 0
