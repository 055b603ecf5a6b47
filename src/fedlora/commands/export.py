"""`fedlora export RUN_DIR --merged OUT`: the run's base model with its adapter folded in,
as a transformers model directory (`fedlora.llm.merge`). The run's PEFT adapter
(`RUN_DIR/adapter`) stays its default output; this is the model to ship without fedlora.

OUT is written whole or not at all (a staging sibling renamed to OUT); `--overwrite` replaces
only an earlier export (its fedlora_export.json lists what it wrote). Refused: an adapter or
merged weight holding NaN or ±inf, and an unfinished run unless `--unfinished` says so."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, DataError, bad_value


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
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT, an earlier fedlora export"
    )
    p.add_argument(
        "--unfinished",
        action="store_true",
        help="export a run that has not finished (its newest checkpoint's adapter, as it is)",
    )
    p.set_defaults(func=cmd_export)


def _final_adapter(run_dir: Path, scaling: float) -> tuple[dict, dict, float, str, int | None]:
    """(adapter state, base delta, scaling, source, round): the newest checkpoint's global
    adapter (A, B and Fed-SB's R) and merged base delta, else the PEFT adapter directory
    (round None)."""
    from fedlora.federation.checkpoints import load_checkpoint
    from fedlora.llm.merge import read_peft_adapter

    state = load_checkpoint(run_dir, warn=lambda m: None)
    if state is not None:
        where = f"checkpoint of round {state['round']}"
        return state["global"], state.get("base_delta") or {}, scaling, where, int(state["round"])
    if (run_dir / "adapter" / "adapter_config.json").is_file():
        adapter, peft_scaling = read_peft_adapter(run_dir / "adapter")
        return adapter, {}, peft_scaling, str(run_dir / "adapter"), None
    raise bad_value("RUN_DIR", str(run_dir), "a run with a checkpoint or an adapter/ directory")


def unfinished_reason(run_dir: Path, round_: int | None, rounds: int) -> str:
    """Why `run_dir`'s final adapter is not a finished run's ('' when it is): no summary.json
    (stopped, or still running), a failed run's summary, or a summary of fewer or more rounds
    than the newest checkpoint (resumed for more rounds and stopped)."""
    from fedlora.federation.runfiles import SUMMARY_FILE, read_summary

    at = f"its newest checkpoint is round {round_} of training.rounds = {rounds}"
    if not (run_dir / SUMMARY_FILE).exists():
        return f"{at if round_ is not None else 'it'} and it has no {SUMMARY_FILE}"
    summary = read_summary(run_dir / SUMMARY_FILE)
    if summary.error is not None:
        return f"its {SUMMARY_FILE} records a failure ({summary.error[:200]})"
    if round_ is not None and summary.rounds != round_:
        return f"{at} but its {SUMMARY_FILE} ends at round {summary.rounds}"
    return ""


def _check_finite(adapter: dict, base_delta: dict, source: str) -> None:
    from fedlora.federation.checkpoints import non_finite

    bad = non_finite(adapter) or non_finite(base_delta)
    if bad:
        raise DataError(
            f"the adapter ({source}) holds a non-finite value in {bad}: the run diverged or the "
            "file was altered; nothing exported"
        )


def cmd_export(args: argparse.Namespace) -> int:
    from fedlora.config.toml_io import load_config
    from fedlora.llm.merge import check_export_out

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise bad_value("RUN_DIR", str(run_dir), "a run directory (with config.toml)")
    out = Path(args.merged)
    if out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents:
        raise bad_value("--merged", str(out), "a directory outside the run directory")
    check_export_out(out, args.overwrite)
    cfg = load_config(str(run_dir / "config.toml"), [])
    adapter, base_delta, scaling, source, round_ = _final_adapter(run_dir, cfg.lora.scaling)
    _check_finite(adapter, base_delta, source)
    unfinished = unfinished_reason(run_dir, round_, cfg.training.rounds)
    if unfinished and not args.unfinished:
        raise ConfigError(
            f"RUN_DIR {str(run_dir)!r} is not a finished run: {unfinished}; finish it "
            f"(fedlora run --resume {run_dir}) or pass --unfinished to export its adapter as "
            "it is"
        )
    model, tokenizer, names = _merged_model(cfg, adapter, base_delta, scaling)
    record: dict[str, Any] = {"run_dir": str(run_dir.resolve()), "source": source}
    record |= {"round": round_, "finished": not unfinished, "dtype": _dtype(cfg)}
    from fedlora.llm.merge import save_merged

    save_merged(model, tokenizer, out, record)
    state = f"; UNFINISHED: {unfinished}" if unfinished else ""
    print(
        f"merged model ({cfg.model.name}, {_dtype(cfg)}, {len(names)} layers from the {source}, "
        f"scaling {scaling:g}{state}): {out}"
    )
    return 0


def _dtype(cfg: Any) -> str:
    return cfg.model.dtype if cfg.model.dtype in ("fp32", "bf16") else "fp32"


def _merged_model(cfg: Any, adapter: dict, base_delta: dict, scaling: float) -> tuple:
    """(model with the adapter folded in, tokenizer, merged layers); a merged weight that
    overflowed the base dtype (±inf) is refused."""
    from fedlora.llm.merge import lora_deltas, merge_into, non_finite_weights
    from fedlora.llm.models import load_model

    model, tokenizer = load_model(
        cfg.model.name, dtype=_dtype(cfg), cache_dir=cfg.model.cache_dir or None, device="cpu"
    )
    names = merge_into(model, lora_deltas(adapter, scaling), base_delta)
    bad = non_finite_weights(model, names)
    if bad:
        raise DataError(
            f"merging the adapter makes {', '.join(bad[:3])} non-finite in {_dtype(cfg)} (the "
            "sum overflowed): nothing exported"
        )
    return model, tokenizer, names
