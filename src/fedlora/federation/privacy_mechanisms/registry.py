"""The privacy registries: the name in ``privacy.mode`` → the `PrivacyMechanism` class that
runs it, and the name in ``privacy.clipping`` → the `ClippingRule` class it clips with.

A mechanism (or a clipping rule) is one file in this folder whose class registers itself::

    @register_privacy("central")
    class CentralPrivacy(PrivacyMechanism): ...

(the package imports every module of this folder). Another package registers its own with
the same decorator, or in the ``fedlora.privacy`` (mechanisms) and ``fedlora.privacy_clipping``
(clipping rules) entry-point groups, loaded when the name is asked for. ``privacy.mode =
"none"`` is no mechanism at all. The config layer checks only the types of the privacy
section; `check_privacy_config` checks the names and each one's own fields, at every boundary
where a config becomes a run (it runs inside `check_method_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.registry import Registry
from fedlora.errors import bad_value
from fedlora.federation.privacy_mechanisms.base import ClippingRule, PrivacyMechanism

PRIVACY_GROUP = "fedlora.privacy"
CLIPPING_GROUP = "fedlora.privacy_clipping"
NO_PRIVACY = "none"  # privacy.mode's name for no mechanism (PrivacyConfig.enabled)

C = TypeVar("C", bound=type)


def _subclass_of(base: type) -> Callable[[Any], bool]:
    return lambda obj: isinstance(obj, type) and issubclass(obj, base)


def _named(base: type, decorator: str) -> Callable[[str, Any], None]:
    """The class is a `base` subclass; it takes the name it is registered as."""

    def name_it(name: str, cls: Any) -> None:
        if not _subclass_of(base)(cls):
            raise TypeError(f"@{decorator}({name!r}) needs a {base.__name__} subclass, got {cls!r}")
        cls.name = name

    return name_it


MECHANISMS: Registry[type[PrivacyMechanism]] = Registry(
    "privacy.mode",
    PRIVACY_GROUP,
    kind="privacy mechanism",
    accepts=_subclass_of(PrivacyMechanism),
    on_add=_named(PrivacyMechanism, "register_privacy"),
)
CLIPPINGS: Registry[type[ClippingRule]] = Registry(
    "privacy.clipping",
    CLIPPING_GROUP,
    kind="clipping rule",
    accepts=_subclass_of(ClippingRule),
    on_add=_named(ClippingRule, "register_clipping"),
)


def _identifier(name: str) -> str:
    if not isinstance(name, str) or not name.isidentifier() or name == NO_PRIVACY:
        raise ValueError(f"a privacy name must be an identifier other than 'none', got {name!r}")
    return name


def register_privacy(name: str) -> Callable[[C], C]:
    """Class decorator: `cls` runs ``privacy.mode = name``."""
    return MECHANISMS.register(_identifier(name))


def register_clipping(name: str) -> Callable[[C], C]:
    """Class decorator: `cls` runs ``privacy.clipping = name``."""
    return CLIPPINGS.register(_identifier(name))


def privacy_names() -> tuple[str, ...]:
    """Every name ``privacy.mode`` accepts: "none" and the mechanisms."""
    return (NO_PRIVACY, *MECHANISMS.names())


def privacy_class(name: str) -> type[PrivacyMechanism]:
    """The mechanism registered as `name`; ConfigError naming ``privacy.mode`` if none."""
    cls = MECHANISMS.find(name) if name != NO_PRIVACY else None
    if cls is None:
        raise bad_value("privacy.mode", name, f"allowed: {', '.join(privacy_names())}")
    return cls


def clipping_class(name: str) -> type[ClippingRule]:
    """The clipping rule registered as `name`; ConfigError naming ``privacy.clipping``."""
    return CLIPPINGS.get(name)


def check_privacy_config(cfg: ExperimentConfig) -> None:
    """``privacy.mode`` names "none" or a mechanism, ``privacy.clipping`` a clipping rule,
    each accepts its own settings, and a privacy budget (``planner.max_epsilon``) has a
    mechanism that the planner's accounting holds for (`accepts_budget`). Raises ConfigError."""
    p = cfg.privacy
    mechanism = privacy_class(p.mode) if p.mode != NO_PRIVACY else None
    clipping_class(p.clipping).check_config(cfg)
    budget = cfg.planner.max_epsilon
    if budget and (mechanism is None or not mechanism.accepts_budget):
        names = [n for n in MECHANISMS.names() if MECHANISMS.get(n).accepts_budget]
        raise bad_value(
            "planner.max_epsilon",
            budget,
            f"a privacy budget needs privacy.mode = {' or '.join(map(repr, names))} "
            f"(got {p.mode!r}); 0 = no budget",
        )
    if mechanism is not None:
        mechanism.check_config(cfg)


def make_mechanism(cfg: ExperimentConfig, method_cls: Any) -> PrivacyMechanism | None:
    """The run's mechanism (`method_cls`: the class of ``method.name``), or None with
    ``privacy.mode = "none"``."""
    if not cfg.privacy.enabled:
        return None
    return privacy_class(cfg.privacy.mode)(cfg, method_cls, clipping_class(cfg.privacy.clipping))
