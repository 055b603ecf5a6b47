"""Experiment configuration: frozen dataclasses, defaults in one place, TOML in and out.

A whole experiment is an `ExperimentConfig` of nine sections (model, lora, data, network,
training, method, planner, output, evaluation). Every field is validated in its section's
``__post_init__``; a bad value raises `ConfigError` naming ``section.field``, the value and
what is allowed. Unknown keys are errors with a suggestion of the closest valid key.

    cfg = load_config("configs/demo.toml", ["training.rounds=5", "method.q=[0.5, 0.5]"])
    print(dump_toml(cfg))

The modules: `checks` (the field checks, the ``model.device`` syntax), `eval_format`
(`EvalFormat`, the values of ``evaluation.format``), `sections` (one dataclass per section;
the planner and training sections in `planner_section` and `training_section`, the data
section's ``[data.mc]`` table in `data_mc`), `method_options` (the methods' own
``[method.<name>]`` tables, kept raw for the method registry, and the flat keys renamed into
tables), `experiment` (`ExperimentConfig`, built from nested dicts), `toml_io` (files,
overrides, TOML out). Every public name is importable from `fedlora.config` itself.
"""

from fedlora.config.checks import (
    DEVICE_FORMS,
    check_choice,
    check_device_spec,
    check_int,
    check_number,
    check_vector_or_strategy,
)
from fedlora.config.data_mc import ANSWER_TYPES, McConfig
from fedlora.config.eval_format import EvalFormat
from fedlora.config.experiment import (
    SECTIONS,
    ExperimentConfig,
    coerce_value,
    config_from_dict,
    diff_configs,
)
from fedlora.config.method_options import RENAMED_KEYS, FrozenTable, upgrade_renamed_keys
from fedlora.config.planner_section import PlannerConfig
from fedlora.config.privacy_section import PrivacyConfig
from fedlora.config.sections import (
    EVAL_FORMATS,
    K_STRATEGIES,
    Q_STRATEGIES,
    RANK_STRATEGIES,
    REFERENCE_RANK_STRATEGIES,
    RESPONSES,
    SCORINGS,
    SERVER_OPTIMIZERS,
    DataConfig,
    EvaluationConfig,
    LoraConfig,
    MethodConfig,
    ModelConfig,
    NetworkConfig,
    OutputConfig,
)
from fedlora.config.toml_io import (
    apply_overrides,
    dump_toml,
    load_config,
    parse_override,
    read_toml,
    set_override,
    toml_string,
    toml_value,
)
from fedlora.config.training_section import (
    LR_SCHEDULES,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    SKETCH_STEPS,
    TrainingConfig,
)

__all__ = [
    "ANSWER_TYPES",
    "EVAL_FORMATS",
    "EvalFormat",
    "FrozenTable",
    "RENAMED_KEYS",
    "DEVICE_FORMS",
    "K_STRATEGIES",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "Q_STRATEGIES",
    "RANK_STRATEGIES",
    "REFERENCE_RANK_STRATEGIES",
    "SERVER_OPTIMIZERS",
    "RESPONSES",
    "SCORINGS",
    "SECTIONS",
    "SKETCH_STEPS",
    "DataConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "LoraConfig",
    "McConfig",
    "MethodConfig",
    "ModelConfig",
    "NetworkConfig",
    "OutputConfig",
    "PlannerConfig",
    "PrivacyConfig",
    "TrainingConfig",
    "apply_overrides",
    "check_choice",
    "check_device_spec",
    "check_int",
    "check_number",
    "check_vector_or_strategy",
    "coerce_value",
    "config_from_dict",
    "diff_configs",
    "dump_toml",
    "load_config",
    "parse_override",
    "read_toml",
    "set_override",
    "toml_string",
    "toml_value",
    "upgrade_renamed_keys",
]
