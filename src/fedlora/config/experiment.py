"""The whole experiment config: `ExperimentConfig` of the ten sections, its cross-section
checks, and how it is built from nested ``{section: {key: value}}`` (TOML-shaped) data."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from fedlora.config.method_options import SUBTABLES, upgrade_renamed_keys
from fedlora.config.planner_section import PlannerConfig
from fedlora.config.privacy_section import PrivacyConfig
from fedlora.config.sections import (
    DataConfig,
    EvaluationConfig,
    LoraConfig,
    MethodConfig,
    ModelConfig,
    NetworkConfig,
    OutputConfig,
)
from fedlora.config.training_section import TrainingConfig
from fedlora.errors import ConfigError, bad_value, shown, suggest_key


@dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        n = self.data.n_clients
        _check_budget(self.planner.max_epsilon, self.privacy, n)
        _check_delta(self.privacy, n)
        for name in ("q", "k", "ranks"):
            value = getattr(self.method, name)
            if isinstance(value, tuple) and len(value) != n:
                raise bad_value(
                    f"method.{name}",
                    value,
                    f"one entry per client: data.n_clients = {n}, got {len(value)}",
                )
        if isinstance(self.method.k, tuple) and max(self.method.k) > self.lora.rank:
            raise bad_value(
                "method.k", self.method.k, f"every k_n must be in 1..lora.rank = {self.lora.rank}"
            )
        if isinstance(self.method.ranks, tuple) and max(self.method.ranks) > self.lora.rank:
            raise bad_value(
                "method.ranks",
                self.method.ranks,
                f"every r_n must be in 1..lora.rank = {self.lora.rank}",
            )
        if self.method.rank_range and self.method.rank_range[1] > self.lora.rank:
            raise bad_value(
                "method.rank_range",
                self.method.rank_range,
                f"[a, b] with b <= lora.rank = {self.lora.rank}",
            )
        if self.method.clients_per_round > n:
            raise bad_value(
                "method.clients_per_round",
                self.method.clients_per_round,
                f"at most data.n_clients = {n}",
            )

    def replace(self, **sections: Any) -> ExperimentConfig:
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` (TOML-shaped: lists, and a section's sub-tables, e.g.
        ``[method.<name>]``, as nested dicts)."""
        return {f.name: _section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _section_dict(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name == SUBTABLES:  # method.options: its tables, beside the section's keys
            out.update({name: _to_plain(table) for name, table in value.items()})
        elif dataclasses.is_dataclass(value):  # a table of the section's own: [data.mc]
            out[f.name] = _section_dict(value)
        else:
            out[f.name] = _to_plain(value)
    return out


def _check_budget(max_epsilon: float | tuple[float, ...], privacy: PrivacyConfig, n: int) -> None:
    """planner.max_epsilon: one budget per client (or one for all), and noise (which privacy
    mechanisms a budget holds for is theirs: `check_privacy_config`)."""
    if isinstance(max_epsilon, tuple) and len(max_epsilon) != n:
        raise bad_value(
            "planner.max_epsilon", max_epsilon, f"one number, or one per client: {n} numbers"
        )
    if max_epsilon and privacy.noise_multiplier == 0:
        raise bad_value(
            "planner.max_epsilon",
            max_epsilon,
            "a privacy budget needs privacy.noise_multiplier > 0 (σ = 0: ε = inf); 0 = no budget",
        )


def _check_delta(privacy: PrivacyConfig, n: int) -> None:
    """privacy.delta < 1/N: a δ of 1/N or more is kept by a mechanism that publishes one
    client's whole data at random (and makes every ε about 0)."""
    if privacy.enabled and privacy.delta * n >= 1:
        raise bad_value(
            "privacy.delta",
            privacy.delta,
            f"must be < 1/data.n_clients = {1 / n:.3g}: a δ of 1/N or more allows publishing "
            "one client's whole data",
        )


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(ExperimentConfig)[f.name]
    for f in dataclasses.fields(ExperimentConfig)
}


def _to_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    return [_to_plain(v) for v in value] if isinstance(value, tuple) else value


def coerce_value(qualname: str, hint: Any, value: Any) -> Any:
    """A TOML value converted to the declared type `hint` (a section's field, a method's
    option); ConfigError naming `qualname` otherwise. No silent clamping."""
    return _coerce(qualname, hint, value)


def _coerce(qualname: str, hint: Any, value: Any) -> Any:
    """Convert a TOML value to the field's declared type; no silent clamping."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        # a string for a union field stays a string (a strategy, a path, "all")
        if isinstance(value, str) and str in options:
            return value
        errors = []
        for option in options:
            if option is str:
                continue
            try:
                return _coerce(qualname, option, value)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # already "field = value is invalid: ..." (no doubled prefix)
            raise ConfigError(errors[0])
        raise bad_value(qualname, value, "; ".join(errors) or "wrong type")
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        if isinstance(value, str) and item is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad_value(qualname, value, "a list")
        return tuple(_coerce(f"{qualname}[{i}]", item, v) for i, v in enumerate(value))
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_value(qualname, value, "a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                raise bad_value(qualname, value, "an integer (write it without a decimal point)")
            raise bad_value(qualname, value, "an integer")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise bad_value(qualname, value, "true or false")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise bad_value(qualname, value, "a string")
        return value
    return value


def config_from_dict(raw: dict[str, Any], *, source: str = "config") -> ExperimentConfig:
    """Build and validate an `ExperimentConfig` from nested ``{section: {key: value}}``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a table of sections, got {type(raw).__name__}")
    raw = upgrade_renamed_keys(raw, source=source)  # old flat keys, with a FutureWarning
    sections: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}]{suggest_key(section, list(SECTIONS))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {values!r}")
        sections[section] = _build_section(SECTIONS[section], section, values, source)
    return ExperimentConfig(**sections)


def _build_section(cls: type, section: str, values: dict[str, Any], source: str) -> Any:
    """One section from its TOML table: each key coerced to its field's type; a table the
    section declares (``[data.mc]``: a dataclass field) built the same way; another sub-table
    (``[method.<name>]``) kept as it is in the section's `SUBTABLES` field, if it has one."""
    hints = typing.get_type_hints(cls)
    has_tables = SUBTABLES in hints
    kwargs: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for key, value in values.items():
        if key in hints and dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: {section}.{key} must be a table [{section}.{key}], got "
                    f"{shown(value)}"
                )
            kwargs[key] = _build_section(hints[key], f"{section}.{key}", value, source)
        elif key in hints and key != SUBTABLES:
            kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
        elif has_tables and isinstance(value, dict):
            tables[key] = value
        else:
            valid = [f.name for f in dataclasses.fields(cls) if f.name != SUBTABLES]
            own = f"; a method's own option goes in its table: {section}.<method name>.{key}"
            raise ConfigError(
                f"{source}: unknown key {section}.{key}{suggest_key(key, valid)}"
                + (own if has_tables else "")
            )
    if tables:
        kwargs[SUBTABLES] = tables
    return cls(**kwargs)


def diff_configs(a: ExperimentConfig, b: ExperimentConfig) -> list[str]:
    """The ``section.key`` names (``section.table.key`` in a sub-table) whose values differ
    between two configs; a key only one of them has counts as differing."""
    da, db = a.to_dict(), b.to_dict()
    return [name for s in da for name in _differing(s, da[s], db[s])]


def _differing(prefix: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for key in [*a, *(k for k in b if k not in a)]:
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_differing(f"{prefix}.{key}", va, vb))
        elif va != vb:
            out.append(f"{prefix}.{key}")
    return out


_ABSENT = object()
