"""Typed registries that registration hooks fill.

A plugin receives a registry in ``miles_register_<things>(registry)`` and calls
``registry.add(name, value)``. The plugin manager tells the registry which plugin is calling, so
that a clash names both plugins and ``miles plugins`` can show what each one registered.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    """Name -> component, for one kind of component (e.g. "advantage estimator")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._current_plugin = "<unknown>"

    def _bind(self, plugin: str) -> None:
        """Called by the plugin manager before it runs one plugin's registration hook."""
        self._current_plugin = plugin

    def add(self, name: str, value: T) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin '{self._current_plugin}' registered a {self.kind} with an empty or non-string name")
        if name in self._entries:
            first = self._entries[name].plugin
            raise PluginError(
                f"{self.kind} '{name}' is registered twice: by plugin '{first}' and by plugin "
                f"'{self._current_plugin}'; block one of them with -p no:NAME"
            )
        self._entries[name] = Entry(name, value, self._current_plugin)

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
