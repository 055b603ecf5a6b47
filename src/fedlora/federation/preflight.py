"""Checks of a run's inputs that need no model weights: they run before anything heavy loads
(and before `--overwrite` removes anything), so a bad input fails in a second, not after the
model has loaded.

A run checks them once, at its entry (`fedlora.federation.run.run`), which then resolves
``model.device`` / ``model.dtype`` once (`fedlora.llm.device.resolve_runtime`: a device this
machine lacks fails there, before anything is created).

Checked: the method's fields and the chosen method's own rule (`Method.check_run`); the model spec's form and, from its config alone, its layer
count against ``lora.layers`` and its module names against ``lora.target_modules``
(Llama/Qwen2/Mistral shapes); the data directory, every task name, eval task and task file; the client profiles
file; the q / k / ranks files of the method.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError, DataError, bad_value

# The linear modules of a decoder layer in the model families fedlora is tested on.
_LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LLAMA_TYPES = ("llama", "qwen2", "mistral")
SMOLLM2_LAYERS = 30  # SmolLM2-135M, when its converted copy is not there yet


def model_config(spec: str, cache_dir: str = "") -> dict[str, Any] | None:
    """The model's config.json as a dict, read without loading weights (None if unknown
    without a download, e.g. a hub id not in the local cache). Bad specs raise ConfigError."""
    from fedlora.files import default_cache_dir
    from fedlora.llm.models import ACCEPTED_FORMS, SMOLLM2_SPEC, looks_like_hub_id
    from fedlora.llm.tiny_models import TINY_MODELS, tiny_config

    spec = spec.strip()
    if spec in TINY_MODELS:
        return tiny_config(spec).to_dict()
    if spec.lower() == SMOLLM2_SPEC:
        path = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        file = path / SMOLLM2_SPEC / "config.json"
        if file.is_file():
            return _read_json(file)
        return {"model_type": "llama", "num_hidden_layers": SMOLLM2_LAYERS, "hidden_size": 576}
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise bad_value(
                "model.name", spec, f"the directory has no config.json; accepted: {ACCEPTED_FORMS}"
            )
        return _read_json(path / "config.json")
    if looks_like_hub_id(spec):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(spec, "config.json")
        except Exception:  # noqa: BLE001 - no cache: the model load will tell
            return None
        return _read_json(Path(cached)) if isinstance(cached, str) else None
    raise bad_value("model.name", spec, f"accepted: {ACCEPTED_FORMS}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model config {str(path)!r} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    return data


def check_model(cfg: ExperimentConfig) -> None:
    """lora.layers, lora.target_modules and the adapter's size against the model's config
    (no weights)."""
    config = model_config(cfg.model.name, cfg.model.cache_dir)
    if config is None:
        return
    check_adapter_size(cfg, config)
    n_layers = config.get("num_hidden_layers")
    layers = cfg.lora.layers
    if isinstance(n_layers, int) and layers != "all" and int(layers) > n_layers:
        raise bad_value(
            "lora.layers",
            layers,
            f"at most the {n_layers} layers of model {cfg.model.name!r} (lora.layers = "
            f'"all", or a number of top layers from 1 to {n_layers})',
        )
    if config.get("model_type") in _LLAMA_TYPES:
        unknown = [m for m in cfg.lora.target_modules if m not in _LLAMA_LINEAR]
        if unknown:
            raise bad_value(
                "lora.target_modules",
                list(cfg.lora.target_modules),
                f"{', '.join(unknown)} is no linear module of model {cfg.model.name!r}; "
                f"it has: {', '.join(_LLAMA_LINEAR)}",
            )


def check_adapter_size(cfg: ExperimentConfig, config: dict[str, Any]) -> None:
    """A lower bound of the adapter's memory (every target module of every LoRA layer is at
    least hidden_size wide on one side) against the memory available, before any tensor is
    allocated; the exact check runs again when LoRA is attached."""
    from fedlora.config.checks import check_fits_in_memory

    hidden, n_layers = config.get("hidden_size"), config.get("num_hidden_layers")
    if not (isinstance(hidden, int) and isinstance(n_layers, int)):
        return
    lora, slots = cfg.lora, cfg.training.slots
    layers = n_layers if lora.layers == "all" else min(int(lora.layers), n_layers)
    need = 4 * (slots + 1) * int(lora.rank) * len(lora.target_modules) * layers * hidden
    check_fits_in_memory("the adapter", f"lora.rank = {lora.rank}, training.slots = {slots}", need)


def check_data(cfg: ExperimentConfig) -> None:
    """Task names, the data directory, the eval tasks' test splits and the task files."""
    from fedlora.llm.task_registry import TASK_REGISTRY, task_names
    from fedlora.llm.tasks import resolve_data_dir, task_available, task_path

    data = cfg.data
    allowed = ", ".join(task_names())  # the built-in, the registered and the entry points
    for field, names in (("data.tasks", data.tasks), ("data.eval_tasks", data.eval_tasks)):
        for name in names:
            if TASK_REGISTRY.find(name) is None:
                raise DataError(f"{field}: task {name!r} is unknown: allowed: {allowed}")
    if not data.eval_tasks and not data.mc.eval_files:
        raise bad_value(
            "data.eval_tasks",
            [],
            'at least one task (the run\'s accuracy is the mean over them), e.g. ["arc-e"]',
        )
    for path in data.task_files:
        if not Path(path).is_file():
            raise DataError(f"data.task_files: {path!r} is not a file")
    if data.mc.files or data.mc.eval_files:  # every record read now: file, line, field
        from fedlora.llm.user_tasks import load_mc_files

        for paths in (data.mc.files, data.mc.eval_files):
            load_mc_files(paths, data.mc)
    if data.instruct_files or data.instruct_eval_files:  # and the template renders them
        from fedlora.llm.instruct import check_instruction_templates, load_instructions

        paths = [*data.instruct_files, *data.instruct_eval_files]
        check_instruction_templates(
            data.chat_template, load_instructions(paths, data.instruct_task)
        )
    data_dir = resolve_data_dir(data.data_dir)
    if data_dir is None:  # the hub: checked when the data loads
        return
    if not Path(data_dir).is_dir():
        source = "data.data_dir" if data.data_dir else "$FEDLORA_DATA"
        raise DataError(f"{source} = {data_dir!r} is not a directory")
    for name in data.eval_tasks:
        task_path(name, data_dir, "test")  # DataError naming what the directory holds
    if not (data.task_files or data.mc.files or data.instruct_files) and not any(
        task_available(t, data_dir, "train") for t in data.tasks
    ):
        raise DataError(
            f"data.tasks = {list(data.tasks)!r}: none has a train split in {data_dir!r} "
            "and data.task_files is empty"
        )
    check_partition_size(cfg)


def check_partition_size(cfg: ExperimentConfig) -> None:
    """The training mix (read, not tokenized) holds data.n_clients × data.min_client_examples
    examples, and each has a scalar value of data.partition_key: the partition's own checks,
    before anything is created."""
    from fedlora.llm.data import training_records
    from fedlora.llm.partition import partition_keys

    data = cfg.data
    records = training_records(data, cfg.training.seed)
    partition_keys(records, data.partition_key)  # a key a record lacks, or not scalar
    need = data.n_clients * data.min_client_examples
    if need <= 1 or data.partition_mode == "per_value":  # one client per value: no minimum
        return
    have = len(records)
    if have < need:
        raise ConfigError(
            f"data.n_clients = {data.n_clients} with data.min_client_examples = "
            f"{data.min_client_examples} is invalid: it needs >= {need} training examples, the "
            f"training mix has {have} (data.tasks = {list(data.tasks)!r}, data.train_limit = "
            f"{data.train_limit}); allowed: n_clients x min_client_examples <= {have}"
        )


def check_network(cfg: ExperimentConfig) -> None:
    """The generated client profiles give every client a finite compute time and a finite
    upload time (an SNR of 0 gives an infinite one), checked for a unit payload: a run's
    times scale with its payload. The error names the fields behind the times."""
    from fedlora.federation.profiles import build_profiles

    if cfg.network.profiles_file:
        return  # a profiles file is checked when it is read (check_clients)
    n = cfg.network
    fields = (
        f"network.tx_power_dbm = {n.tx_power_dbm!r}, network.noise_psd_dbm_hz = "
        f"{n.noise_psd_dbm_hz!r}, network.path_loss_exponent = {n.path_loss_exponent!r}, "
        f"network.distance_max_m = {n.distance_max_m!r}, network.f_tot_hz = {n.f_tot_hz!r}, "
        f"network.step_time_median_s = {n.step_time_median_s!r}"
    )
    allowed = (
        "allowed: values that give every client a finite time (an SNR above 0, a finite step time)"
    )
    try:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            profiles = build_profiles(cfg, full_payload_bits=1.0)
    except ConfigError as e:  # the profiles' own check: name the fields behind it
        raise ConfigError(f"{fields}: the client profiles are invalid ({e}); {allowed}") from None
    for name, times in (("upload time", profiles.t_full), ("compute time", profiles.tau_full_s)):
        bad = np.flatnonzero(~np.isfinite(np.asarray(times, dtype=float)))
        if bad.size:
            i = int(bad[0])
            raise ConfigError(
                f"{fields}: client {i} gets a{'n' if name[0] == 'u' else ''} {name} of "
                f"{float(times[i])!r} s; {allowed}"
            )


def check_clients(cfg: ExperimentConfig) -> None:
    """The client profiles file and the method's per-client files (q, k, ranks)."""
    from fedlora.federation.methods.ranks import resolve_ranks
    from fedlora.federation.methods.strategies import resolve_k, resolve_q
    from fedlora.files import load_profiles

    n, m = cfg.data.n_clients, cfg.method
    if cfg.network.profiles_file:
        profiles = load_profiles(cfg.network.profiles_file)
        if profiles.n != n:
            raise ConfigError(
                f"network.profiles_file = {cfg.network.profiles_file!r} has {profiles.n} "
                f"clients, but data.n_clients = {n}"
            )
    rng = np.random.default_rng(0)  # only the files' contents are checked here
    if isinstance(m.q, str) and m.q.endswith((".json", ".csv")):
        resolve_q(m.q, a=np.full(n, 1.0 / n), q_fixed=m.q_fixed)
    if isinstance(m.k, str) and m.k.endswith((".json", ".csv")):
        resolve_k(m.k, n=n, gamma=cfg.lora.rank, rng=rng)
    if isinstance(m.ranks, str) and m.ranks.endswith((".json", ".csv")):
        resolve_ranks(m.ranks, n=n, gamma=cfg.lora.rank, rng=rng)


def check_inputs(cfg: ExperimentConfig) -> None:
    """Every check above; raises `ConfigError` / `DataError` naming the field and the value."""
    from fedlora.federation.methods.registry import check_method_config
    from fedlora.federation.tracking import check_trackers

    cls = check_method_config(cfg)  # method.name and the method's own fields (the registry)
    cls.check_run(cfg)  # the chosen method's own rule across sections (`Method.check_run`)
    check_trackers(cfg)  # output.trackers: names, packages, output.mlflow_uri's form
    check_model(cfg)
    check_data(cfg)
    check_clients(cfg)
    check_network(cfg)
