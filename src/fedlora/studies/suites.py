"""The suites of `fedlora compare`: each suite's labels and the overrides each label applies on
top of the suite file's config (`fedlora.studies.experiments` runs them). They are data files
shipped in the package, one a suite: fedlora/studies/suite_files/NAME.toml, with a `title` and
a `[labels]` table (label -> its list of overrides, in run order). An override's value
``$section.key`` is the suite file's own value of that key (before the label's overrides)."""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from fedlora.errors import ConfigError

# the suites in the order `fedlora compare --suite` lists them
SUITE_NAMES = ("table1", "sampling", "ranks", "methods", "references")
SUITE_FOLDER = "suite_files"


def read_suite(name: str, folder: Any = None) -> tuple[str, dict[str, tuple[str, ...]]]:
    """The suite `name` (shipped, or from `folder`, a path): its title and label ->
    overrides, checked."""
    shipped = folder is None
    folder = resources.files(__package__) / SUITE_FOLDER if shipped else folder
    where = f"fedlora/studies/{SUITE_FOLDER}/{name}.toml" if shipped else f"{folder}/{name}.toml"
    text = (folder / f"{name}.toml").read_text("utf-8")
    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from None
    title, labels = raw.get("title"), raw.get("labels")
    if not isinstance(title, str) or not title or set(raw) != {"title", "labels"}:
        raise ConfigError(f"{where}: needs exactly a non-empty `title` and a [labels] table")
    if not isinstance(labels, dict) or not labels:
        raise ConfigError(f"{where}: [labels] must map each label to its list of overrides")
    for label, overrides in labels.items():
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ConfigError(
                f"{where}: labels.{label} = {overrides!r}: allowed: a list of override strings "
                "(section.key=value)"
            )
    return title, {label: tuple(overrides) for label, overrides in labels.items()}


def _read_all() -> tuple[dict[str, dict[str, tuple[str, ...]]], dict[str, str]]:
    suites, titles = {}, {}
    for name in SUITE_NAMES:
        titles[name], suites[name] = read_suite(name)
    return suites, titles


# label -> overrides applied on top of the suite file's config, per suite; each suite's title
SUITES, TITLES = _read_all()
# the `methods` suite's non-planned methods
METHOD_SUITE = tuple(label for label in SUITES["methods"] if label != "proposed")
