"""A fresh pluggy manager per run, with a typed facade so call sites never name hooks as strings.

Loading order: the built-in plugins (``miles_core.plugins.builtin``), then every entry point in
the group ``miles``. ``blocked`` names (``-p no:NAME``) are never registered; set
``MILES_DISABLE_PLUGIN_AUTOLOAD=1`` to skip entry points, ``MILES_TRACE_PLUGINS=1`` to print every
hook call to stderr.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import pluggy

from miles_core import hookspecs
from miles_core.errors import MilesUserError, PluginError, did_you_mean
from miles_core.kernels.base import KernelImpl
from miles_core.models.base import ModelFamily
from miles_core.platforms import Platform
from miles_core.plugins.builtin import BUILTIN_PLUGINS
from miles_core.plugins.registry import Registry
from miles_core.precision.base import PrecisionRecipe


def _reward_name(name: str) -> str | None:
    if name == "task":
        return "reward.name=task is the task's own verifier"
    if ":" in name:
        return "reward.name=module:function imports a function"
    return None


@dataclass
class Registries:
    """One registry per kind of component; field name = hook suffix (miles_register_<field>)."""

    tasks: Registry = field(default_factory=lambda: Registry("task", arity=1))
    rewards: Registry = field(default_factory=lambda: Registry("reward", arity=1, name_check=_reward_name))
    rollout_backends: Registry = field(default_factory=lambda: Registry("rollout backend", arity=2))
    trainers: Registry = field(default_factory=lambda: Registry("trainer", arity=2))
    advantage_estimators: Registry = field(default_factory=lambda: Registry("advantage estimator", arity=2))
    policy_losses: Registry = field(default_factory=lambda: Registry("policy loss", arity=2))
    weight_transports: Registry = field(default_factory=lambda: Registry("weight transport", arity=1))
    precision_recipes: Registry = field(default_factory=lambda: Registry("precision recipe", type_=PrecisionRecipe))
    kernels: Registry = field(default_factory=lambda: Registry("kernel", type_=KernelImpl))
    platforms: Registry = field(default_factory=lambda: Registry("platform", type_=Platform))
    model_families: Registry = field(default_factory=lambda: Registry("model family", type_=ModelFamily))

    def items(self) -> Iterable[tuple[str, Registry]]:
        for f in fields(self):
            yield f.name, getattr(self, f.name)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    version: str
    builtin: bool
    hooks: tuple[str, ...]
    registered: dict[str, list[str]]  # registry field -> names this plugin added

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "builtin": self.builtin,
            "hooks": list(self.hooks),
            "registered": self.registered,
        }


_HOOK_NAMES = tuple(n for n in vars(hookspecs.MilesSpecs) if n.startswith("miles_"))


def _one_line(exc: BaseException) -> str:
    """pluggy's messages span lines (hookimpl definition, arguments); the CLI prints one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


class MilesPlugins:
    """The plugin manager for one run."""

    def __init__(
        self,
        blocked: Iterable[str] = (),
        *,
        autoload: bool | None = None,
        trace: bool | None = None,
        extra_plugins: Iterable[tuple[str, object]] = (),
        keep_broken: bool = False,
    ) -> None:
        """``keep_broken``: a plugin that fails to import, or whose registration hook raises when :meth:`info` fills
        the registries, is left out and its error kept in ``broken`` (for ``miles plugins``, which lists the others),
        instead of a PluginError."""
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs.MilesSpecs)
        self.blocked = tuple(blocked)
        self._versions: dict[str, str] = {}
        self._builtin: set[str] = set()
        self._packages: dict[str, tuple[str, str]] = {}  # entry point plugin name -> (its package, its module path)
        self.broken: dict[str, str] = {}  # plugin name -> why it failed to import or register (keep_broken)
        self._keep_broken = keep_broken
        for name in self.blocked:
            self.pm.set_blocked(name)
        if trace if trace is not None else _env_flag("MILES_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda msg: sys.stderr.write(msg))
            self.pm.enable_tracing()
        self._load_builtins()
        autoload = (not _env_flag("MILES_DISABLE_PLUGIN_AUTOLOAD")) if autoload is None else autoload
        if autoload:
            self._load_entry_points(keep_broken)
        extra_plugins = list(extra_plugins)
        for name, plugin in extra_plugins:
            self.register(plugin, name)
        self._check()
        self._check_blocked([name for name, _ in BUILTIN_PLUGINS] + [name for name, _ in extra_plugins])

    # ------------------------------------------------------------------ loading
    def _load_builtins(self) -> None:
        from miles_core import __version__

        for name, module_path in BUILTIN_PLUGINS:
            if self.pm.is_blocked(name):
                continue
            self.pm.register(importlib.import_module(module_path), name)
            self._versions[name] = __version__
            self._builtin.add(name)

    def _load_entry_points(self, keep_broken: bool) -> None:
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
            package = ep.dist.name if ep.dist is not None else ep.value
            if self.pm.is_blocked(ep.name):
                continue
            if self.pm.has_plugin(ep.name):  # pluggy would refuse the name: say who holds it
                holder = self._packages.get(ep.name, ("?",))[0]
                first = "a built-in plugin" if ep.name in self._builtin else f"package '{holder}'"
                raise PluginError(
                    f"two plugins are named '{ep.name}': {first} and package '{package}' ({ep.value}); "
                    "uninstall one of them or rename its [project.entry-points.miles] entry"
                )
            self._packages[ep.name] = (package, ep.value)
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party package must say which one it is
                error = f"plugin '{ep.name}' ({ep.value}) failed to import: {exc}; run without it with -p no:{ep.name}"
                if not keep_broken:
                    raise PluginError(error) from exc
                self.broken[ep.name] = error
                continue
            self.register(plugin, ep.name)
            if ep.dist is not None:
                self._versions[ep.name] = ep.dist.version

    def register(self, plugin: object, name: str) -> None:
        unmarked = [h for h in _HOOK_NAMES if hasattr(plugin, h) and self.pm.parse_hookimpl_opts(plugin, h) is None]
        if unmarked and not self.pm.is_blocked(name):  # pluggy would ignore them: the plugin would do nothing
            raise PluginError(
                f"plugin '{name}' defines {', '.join(unmarked)} without @hookimpl (from miles_core.hookspecs import hookimpl)"
            )
        holder = self.pm.get_name(plugin)
        if holder is not None and not self.pm.is_blocked(name):  # pluggy's error lists every plugin, no package
            raise PluginError(
                f"plugin '{name}'{self._origin(name)} is the module or object already loaded as plugin '{holder}'"
                f"{self._origin(holder)}; a plugin loads once: uninstall one of them, or block one with -p no:NAME"
            )
        try:
            self.pm.register(plugin, name)
        except ValueError as exc:
            raise PluginError(f"cannot register plugin '{name}': {_one_line(exc)}") from exc
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin '{name}' is invalid: {_one_line(exc)}") from exc

    def _origin(self, name: str) -> str:
        if name in self._builtin:
            return " (built-in)"
        if name in self._packages:
            package, value = self._packages[name]
            return f" (package '{package}', {value})"
        return ""

    def _check_blocked(self, known: list[str]) -> None:
        """``-p no:NAME`` must name a plugin: a typo would block nothing, silently."""
        if not self.blocked:
            return
        known = known + [ep.name for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT)]
        for name in self.blocked:
            if name not in known:
                raise PluginError(f"-p no:{name}: no plugin is named '{name}'{did_you_mean(name, known)}")

    def _check(self) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.pm.get_name(exc.plugin) if exc.plugin is not None else "?"
            raise PluginError(f"plugin '{name}' implements a hook that Miles does not define: {_one_line(exc)}") from exc

    # ------------------------------------------------------------------ registries
    @cached_property
    def registries(self) -> Registries:
        """Every registry, filled by calling each plugin's registration hooks one plugin at a time."""
        return self._fill_registries(None)

    def _fill_registries(self, broken: dict[str, str] | None) -> Registries:
        """The registries; with ``broken``, a plugin whose registration raises is recorded there and skipped."""
        regs = Registries()
        names = self.plugin_names()
        for kind, registry in regs.items():
            hook_name = f"miles_register_{kind}"
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                registry._bind(impl.plugin_name)
                others = [self.pm.get_plugin(n) for n in names if n != impl.plugin_name]
                try:
                    self.pm.subset_hook_caller(hook_name, remove_plugins=others)(registry=registry)
                except Exception as exc:  # a broken plugin must say which one it is, like a failed import
                    error = exc if isinstance(exc, PluginError) else PluginError(
                        f"plugin '{impl.plugin_name}' raised {type(exc).__name__}: {exc} (in {hook_name})")
                    if broken is None:
                        raise error from exc
                    broken.setdefault(impl.plugin_name, str(error))
            registry._bind("<unknown>")
        return regs

    def _loaded(self) -> list[tuple[str, object]]:
        return [(name, plugin) for name, plugin in self.pm.list_name_plugin() if plugin is not None]  # None = blocked

    def plugin_names(self) -> list[str]:
        return [name for name, _ in self._loaded()]

    def info(self) -> list[PluginInfo]:
        regs = self._fill_registries(self.broken if self._keep_broken else None)
        out = []
        for name, plugin in self._loaded():
            hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))
            registered = {kind: reg.by_plugin(name) for kind, reg in regs.items() if reg.by_plugin(name)}
            out.append(PluginInfo(name, self._versions.get(name, "?"), name in self._builtin, hooks, registered))
        return out

    # ------------------------------------------------------------------ typed hook calls
    def _call(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a hook; an exception from a plugin's implementation becomes a PluginError naming the plugin."""
        caller = getattr(self.pm.hook, hook_name)
        try:
            return caller(**kwargs)
        except MilesUserError:
            raise
        except Exception as exc:
            raise PluginError(f"plugin '{_raiser(caller, exc)}' raised {type(exc).__name__}: {exc} (in {hook_name})") from exc

    def kernel_select(self, op: str, platform: str, candidates: list) -> Any:
        """One of ``candidates`` or None; anything else is a PluginError naming the plugins that implement the hook."""
        chosen = self._call("miles_kernel_select", op=op, platform=platform, candidates=candidates)
        if chosen is not None and not any(chosen is c for c in candidates):
            choosers = [impl.plugin_name for impl in self.pm.hook.miles_kernel_select.get_hookimpls()]
            raise PluginError(
                f"miles_kernel_select returned {chosen!r} for op '{op}', not one of its candidates (a KernelImpl "
                f"registered for it) or None; plugins implementing it: {', '.join(choosers)}"
            )
        return chosen

    def run_start(self, ctx: Any) -> None:
        self._call("miles_run_start", ctx=ctx)

    def after_rollout(self, ctx: Any, step: int, samples: list) -> None:
        self._call("miles_after_rollout", ctx=ctx, step=step, samples=samples)

    def after_train_step(self, ctx: Any, step: int, metrics: dict) -> None:
        self._call("miles_after_train_step", ctx=ctx, step=step, metrics=metrics)

    def after_weight_sync(self, ctx: Any, version: int) -> None:
        self._call("miles_after_weight_sync", ctx=ctx, version=version)

    def run_end(self, ctx: Any, summary: dict) -> None:
        self._call("miles_run_end", ctx=ctx, summary=summary)


def _raiser(caller: Any, exc: BaseException) -> str:
    """The plugin whose implementation of ``caller``'s hook raised ``exc``: the outermost of its frames in the traceback."""
    codes = {getattr(impl.function, "__code__", None): impl.plugin_name for impl in caller.get_hookimpls()}
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return codes[tb.tb_frame.f_code]
        tb = tb.tb_next
    return " or ".join(impl.plugin_name for impl in caller.get_hookimpls()) or "?"
