"""Typed registries that registration hooks fill.

A plugin receives a registry in ``miles_register_<things>(registry)`` and calls
``registry.add(name, value)``. The plugin manager tells the registry which plugin is calling, so
that a clash names both plugins and ``miles plugins`` can show what each one registered.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from miles_core.errors import PluginError, did_you_mean

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    value: T
    plugin: str


class Registry(Generic[T]):
    """Name -> component, for one kind of component (e.g. "advantage estimator").

    What ``add`` accepts, so that a wrong component is refused where it is registered, naming the plugin
    (not when a run first calls it): ``arity``, a callable that takes that many positional arguments;
    ``type_``, an instance of that type; ``name_check(name)``, why the config could never select ``name``
    (or None).
    """

    def __init__(
        self,
        kind: str,
        *,
        arity: int | None = None,
        type_: type | None = None,
        name_check: Callable[[str], str | None] | None = None,
    ) -> None:
        self.kind = kind
        self.arity = arity
        self.type_ = type_
        self.name_check = name_check
        self._entries: dict[str, Entry[T]] = {}
        self._current_plugin = "<unknown>"

    def _bind(self, plugin: str) -> None:
        """Called by the plugin manager before it runs one plugin's registration hook."""
        self._current_plugin = plugin

    def add(self, name: str, value: T) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin '{self._current_plugin}' registered a {self.kind} with an empty or non-string name")
        self._check(name, value)
        if name in self._entries:
            first = self._entries[name].plugin
            if first == self._current_plugin:  # blocking it would remove both
                raise PluginError(f"plugin '{first}' registered the {self.kind} '{name}' twice; register each under its own name")
            raise PluginError(
                f"{self.kind} '{name}' is registered twice: by plugin '{first}' and by plugin "
                f"'{self._current_plugin}'; block one of them with -p no:NAME"
            )
        self._entries[name] = Entry(name, value, self._current_plugin)

    def _check(self, name: str, value: object) -> None:
        what = f"plugin '{self._current_plugin}' registered the {self.kind} '{name}'"
        why = self.name_check(name) if self.name_check else None
        if why:
            raise PluginError(f"{what}, a name the config cannot select ({why}); register it under another name")
        if self.type_ is not None and not isinstance(value, self.type_):
            expected = f"{self.type_.__module__}.{self.type_.__qualname__}"
            raise PluginError(f"{what} as a {type(value).__name__}; a {self.kind} is a {expected}")
        if self.arity is None:
            return
        if not callable(value):
            raise PluginError(f"{what} as a {type(value).__name__}, which is not callable")
        try:
            sig = inspect.signature(value)
        except (TypeError, ValueError):  # a builtin or C function: nothing to check
            return
        try:
            sig.bind(*[None] * self.arity)
        except TypeError:
            raise PluginError(
                f"{what} with the signature {sig}; it is called with {self.arity} positional argument(s) "
                "(see the hook's docstring in miles_core.hookspecs)"
            ) from None

    def get(self, name: str, *, key: str | None = None) -> T:
        """The component called ``name``; ``key`` is the config key that asked for it, for the error."""
        try:
            return self._entries[name].value
        except KeyError:
            where = f" (config key '{key}')" if key else ""
            raise PluginError(
                f"unknown {self.kind} '{name}'{where}{did_you_mean(name, self._entries)}"
            ) from None

    def entry(self, name: str) -> Entry[T]:
        self.get(name)
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def by_plugin(self, plugin: str) -> list[str]:
        return sorted(n for n, e in self._entries.items() if e.plugin == plugin)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
