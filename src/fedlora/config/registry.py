"""The one registration idiom (issue 38): a name a config field accepts → the object that runs
it. Methods (``method.name``), privacy mechanisms (``privacy.mode``) and their clipping rules
(``privacy.clipping``), trackers (``output.trackers``) and tasks (``data.tasks``) each keep one
`Registry`:

    METHODS = Registry("method.name", "fedlora.methods", kind="method")

    @METHODS.register("fslora")           # a built-in: its module registers it on import
    class FSLoRA(Method): ...

    [project.entry-points."fedlora.methods"]   # another package's, in its pyproject.toml
    my_method = "my_package.my_method:MyMethod"

An entry point is loaded only when its name is asked for (`get`, `find`); a registered name wins
over an entry point of the same name. An unknown name is a ConfigError naming the field, the
value and every allowed name. It sits in the config layer because it is what a config field
may name; the registries themselves live beside what they hold (the layer that runs it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from fedlora.errors import ConfigError, bad_value

T = TypeVar("T")


def _same(known: Any, new: Any) -> bool:
    """The same declaration again (a module imported twice defines an equal class anew)."""
    if known is new:
        return True
    if isinstance(known, type) and isinstance(new, type):
        return (known.__module__, known.__qualname__) == (new.__module__, new.__qualname__)
    return known == new


class Registry(Generic[T]):
    """Names → objects (classes, or declarations such as a `TaskSpec`) of one config field.

    `field`: the config field the name is the value of (it leads every error message);
    `group`: the entry-point group other packages register in; `kind`: what one entry is, in
    messages ("privacy mechanism"); `accepts`: whether a loaded entry point's object is one
    (a loaded object that is not is a ConfigError naming the entry point); `on_add`: run on
    every new entry before it is stored (it may refuse it, or set the class's own name);
    `sorted_names`: `names` in alphabetical order, else in the order of registration (then
    the entry points not loaded yet, sorted).
    """

    def __init__(
        self,
        field: str,
        group: str,
        *,
        kind: str,
        accepts: Callable[[Any], bool] = lambda obj: True,
        on_add: Callable[[str, Any], None] = lambda name, obj: None,
        sorted_names: bool = True,
    ) -> None:
        self.field, self.group, self.kind, self.accepts = field, group, kind, accepts
        self.on_add, self.sorted_names = on_add, sorted_names
        self.table: dict[str, T] = {}  # the registered entries (entry points once loaded)

    def add(self, name: str, obj: T) -> T:
        """Register `obj` as `name` (the same declaration again is a no-op); ValueError when
        another holds the name."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        known = self.table.get(name)
        if known is not None and not _same(known, obj):
            who = getattr(known, "__qualname__", repr(known))
            raise ValueError(f"{self.kind} {name!r} is already registered by {who}")
        self.on_add(name, obj)
        self.table[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@registry.register("name")`` registers the class (or object) below."""
        return lambda obj: self.add(name, obj)

    def unregister(self, name: str) -> None:
        """Forget `name` (a test's own entry); no error when it is not registered."""
        self.table.pop(name, None)

    @contextmanager
    def registered(self, name: str, obj: T) -> Iterator[T]:
        """`obj` registered as `name` inside the block only (tests, one-off extensions)."""
        self.add(name, obj)
        try:
            yield obj
        finally:
            self.unregister(name)

    def _entry_points(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group=self.group)}

    def names(self) -> tuple[str, ...]:
        """Every name the field accepts: the registered ones and the entry points."""
        if self.sorted_names:
            return tuple(sorted(set(self.table) | set(self._entry_points())))
        return (*self.table, *sorted(set(self._entry_points()) - set(self.table)))

    def find(self, name: str) -> T | None:
        """The entry of `name` (an entry point is loaded and registered here), or None."""
        if isinstance(name, str) and name in self.table:
            return self.table[name]
        ep = self._entry_points().get(name) if isinstance(name, str) else None
        if ep is None:
            return None
        try:
            obj = ep.load()
        except Exception as e:  # a broken third-party package: say which entry point
            raise ConfigError(
                f"{self.field} = {name!r}: entry point {ep.value!r} of group "
                f"{self.group!r} failed to load: {type(e).__name__}: {e}"
            ) from None
        if not self.accepts(obj):
            raise ConfigError(
                f"{self.field} = {name!r}: entry point {ep.value!r} of group {self.group!r} "
                f"is not a {self.kind}"
            )
        return self.table[name] if name in self.table else self.add(name, obj)

    def get(self, name: str, field: str | None = None) -> T:
        """`find`, raising ConfigError naming `field` (default: the registry's), the value and
        the allowed names when `name` is none of them."""
        obj = self.find(name)
        if obj is None:
            raise bad_value(field or self.field, name, f"allowed: {', '.join(self.names())}")
        return obj
