"""The method registry: the name in ``method.name`` → the `Method` class that runs it.

A method is one file in this folder whose class registers itself::

    @dataclass(frozen=True)
    class FSLoRAOptions:          # its own options: the table [method.fslora]
        k: str = "reference"
        def __post_init__(self) -> None: ...    # errors name method.fslora.k

    @register_method("fslora")
    class FSLoRA(Method):
        options = FSLoRAOptions
        @classmethod
        def from_config(cls, ctx: MethodContext) -> FSLoRA: ...   # ctx.options.k

(the package imports every module of this folder, so the decorator runs). A third-party
package registers its methods in the ``fedlora.methods`` entry-point group, name → class::

    [project.entry-points."fedlora.methods"]
    my_method = "my_package.my_method:MyMethod"

An entry point is loaded only when its name is asked for (`method_class`); a built-in name
wins over an entry point of the same name (`fedlora.config.registry.Registry`: the one
registration idiom of methods, privacy mechanisms, trackers and tasks). The config layer cannot see this registry (it
sits below the federation layer): it keeps the ``[method.<name>]`` tables as given, and
``method.name`` and each method's options are checked here, by `check_method_config`, at
every boundary where a config becomes a run (`make_method`,
`fedlora.federation.preflight.check_inputs`, `fedlora config show`, the Flower runtime, a
suite's runs). `resolve_method_options` gives the config as a run records it (the chosen
method's table in full, no other).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.registry import Registry
from fedlora.errors import ConfigError, suggest_key
from fedlora.federation.methods.base import Method, options_table
from fedlora.federation.privacy_mechanisms.registry import check_privacy_config

ENTRY_POINT_GROUP = "fedlora.methods"

M = TypeVar("M", bound=type)


def _name_the_class(name: str, cls: Any) -> None:
    """A method's class is a `Method` subclass; it takes the name it is registered as."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"@register_method({name!r}) needs a Method subclass, got {cls!r}")
    cls.name = name


METHODS: Registry[type[Method]] = Registry(
    "method.name",
    ENTRY_POINT_GROUP,
    kind="method",
    accepts=lambda obj: isinstance(obj, type) and issubclass(obj, Method),
    on_add=_name_the_class,
)
_REGISTRY = METHODS.table  # name -> class (tests save and restore it)


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: `cls` runs ``method.name = name`` (and its ``name`` becomes `name`)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a method name must be an identifier, got {name!r}")
    return METHODS.register(name)


def method_names() -> tuple[str, ...]:
    """Every name ``method.name`` accepts: the registered methods and the entry points."""
    return METHODS.names()


def method_class(name: str) -> type[Method]:
    """The class registered as `name` (an entry point is loaded here); ConfigError if none."""
    return METHODS.get(name)


def check_method_config(cfg: ExperimentConfig) -> type[Method]:
    """``method.name`` names a method, every ``[method.<name>]`` table holds the options of a
    method (`check_option_tables`), every loaded method accepts the config
    (`Method.check_config`), and the method accepts the run's privacy settings
    (`check_privacy`); the class of ``method.name``; and the privacy settings name a mechanism
    and a clipping rule that accept them (`check_privacy_config`). Raises ConfigError."""
    cls = method_class(cfg.method.name)
    check_option_tables(cfg)
    check_privacy_config(cfg)
    check_privacy(cfg, cls)
    cls.check_config(cfg)  # the chosen method first, then the others in name order
    for name in sorted(_REGISTRY):
        if _REGISTRY[name] is not cls:
            _REGISTRY[name].check_config(cfg)
    m = cfg.method
    plain = m.server_optimizer == "avg" and m.server_lr == 1.0 and m.server_weight_decay == 0
    if not plain and not cls.delta_aggregate:
        delta = sorted(n for n, c in _REGISTRY.items() if c.delta_aggregate)
        raise ConfigError(
            f"method.server_optimizer = {m.server_optimizer!r} (server_lr = {m.server_lr}, "
            f"server_weight_decay = {m.server_weight_decay}) is invalid for method.name = "
            f"{m.name!r}: its aggregate is not the global adapter plus an update "
            '(docs/methods.md, "Server optimizers"); allowed: avg with server_lr = 1 and '
            f"server_weight_decay = 0, or one of the methods {', '.join(delta)}"
        )
    return cls


def check_option_tables(cfg: ExperimentConfig) -> Any:
    """Every ``[method.<name>]`` table names a method and holds valid options for it (a
    table of a method other than ``method.name`` is checked too, then unused: a base config
    may carry the options of several methods, switched by ``method.name``); the options of
    ``method.name`` (`Method.read_options`). ConfigError otherwise."""
    names = method_names()
    for name in cfg.method.options:
        if name not in names:
            raise ConfigError(
                f"[method.{name}] is invalid: no method is named {name!r}"
                f"{suggest_key(name, names)}; a table [method.<name>] holds the options of "
                "the method <name>"
            )
        method_class(name).read_options(cfg)
    return method_class(cfg.method.name).read_options(cfg)


def resolve_method_options(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with its ``[method.<name>]`` tables as a run records them: the table of
    ``method.name`` in full (its defaults filled in), no other (they are checked, then
    dropped: unused). Two spellings of the same options (a table or the old flat keys,
    defaults written or left out) resolve to the same config. ConfigError as
    `check_option_tables`."""
    options = check_option_tables(cfg)
    tables = {} if options is None else {cfg.method.name: options_table(options)}
    if cfg.method.options == tables:
        return cfg
    return cfg.replace(method=dataclasses.replace(cfg.method, options=tables))


DP_SAMPLINGS = ("independent", "uniform")


def check_privacy(cfg: ExperimentConfig, cls: type[Method]) -> None:
    """ConfigError unless privacy is off or `cls`'s aggregate is a weighted sum of client
    updates (`Method.dp_sampling`; else its `dp_refusal`), and the method accepts the rest
    (`Method.check_privacy`: HeteroLoRA's self-pruning). The same for secure aggregation,
    which the server can only apply to a sum (that it does not combine with differential
    privacy yet is the config layer's own check)."""
    p, name = cfg.privacy, cfg.method.name
    if not (p.enabled or p.secure_aggregation):
        return
    if cls.dp_sampling is not None and cls.dp_sampling not in DP_SAMPLINGS:
        raise ConfigError(
            f"method.name = {name!r}: {cls.__qualname__}.dp_sampling = {cls.dp_sampling!r} "
            f"is invalid: allowed: {', '.join(DP_SAMPLINGS)}, or None (not a sum of updates)"
        )
    if cls.dp_sampling is None:
        why = cls.dp_refusal or (
            f"it does not declare its aggregate a weighted sum of updates "
            f"({cls.__qualname__}.dp_sampling is None; a method whose aggregate is one sets "
            "it to 'independent' or 'uniform', docs/methods.md)"
        )
        sums = ", ".join(sorted(n for n, c in _REGISTRY.items() if c.dp_sampling))
        if p.secure_aggregation:
            raise ConfigError(
                f"privacy.secure_aggregation = true is invalid with method.name = {name!r}: "
                f"{why}; secure aggregation reveals only a sum, so it needs one of "
                f"{sums} (or privacy.secure_aggregation = false)"
            )
        raise ConfigError(
            f"privacy.mode = {p.mode!r} is invalid with method.name = {name!r}: "
            f"{why}; differential privacy needs one of {sums} (or privacy.mode = 'none')"
        )
    cls.check_privacy(cfg)
