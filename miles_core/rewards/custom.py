"""User reward functions given as ``module:function`` or ``file.py:function``, checked at start-up."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

from miles_core.errors import ConfigError
from miles_core.rewards.base import RewardFn


def check_reward_fn(fn: object, where: str) -> RewardFn:
    """The protocol every reward meets, registered or given by path: callable with one sample."""
    if not callable(fn):
        raise ConfigError(f"reward '{where}' is not callable (a reward is fn(sample) -> float)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    try:
        sig.bind(object())
    except TypeError:
        raise ConfigError(f"reward '{where}' must accept one argument, the sample; its signature is {sig}") from None
    return fn


def load_reward_path(spec: str) -> RewardFn:
    """``module:function``, ``path/to/file.py:function``, or slime's dotted ``module.function`` (the value of its
    ``--custom-rm-path``)."""
    if ":" not in spec and spec.endswith(".py"):  # not slime's module.function: module 'path/file', function 'py'
        raise ConfigError(f"reward.name '{spec}' names a file but no function: write '{spec}:function'")
    module_name, _, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"reward.name '{spec}' is not 'module:function' or 'file.py:function'")
    if module_name.endswith(".py"):
        return _function_of(_load_file(Path(module_name), spec), attr, spec, f"file '{module_name}'")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`, let users point at local modules
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError(f"reward.name '{spec}': module '{module_name}' not found") from None
        raise ConfigError(f"reward.name '{spec}': importing '{module_name}' failed: {exc}") from None
    except (Exception, SystemExit) as exc:  # SystemExit: a module that runs argparse or sys.exit at import
        raise ConfigError(f"reward.name '{spec}': importing '{module_name}' raised {type(exc).__name__}: {exc}") from None
    return _function_of(module, attr, spec, f"module '{module_name}'")


def _load_file(path: Path, spec: str):
    """The module that a reward file defines, imported under a name of its own (``miles_reward_<stem>``), registered in
    ``sys.modules`` so that its functions pickle by reference (Ray workers, multiprocessing). The file's folder goes
    first on ``sys.path``, as for a script, so that helper modules beside it import."""
    if not path.is_file():
        raise ConfigError(f"reward.name '{spec}': file '{path}' " + ("is not a file" if path.exists() else "does not exist"))
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # like `python path/to/file.py`: the modules beside the file import by their names
        sys.path.insert(0, folder)
    name = "miles_reward_" + re.sub(r"\W", "_", path.stem)  # reward_v1.2.py: a dotted name would need a parent package
    loader_spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise ConfigError(f"reward.name '{spec}': importing '{path}' raised {type(exc).__name__}: {exc}") from None
    return module


def _function_of(module, attr: str, spec: str, where: str) -> RewardFn:
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        from miles_core.errors import did_you_mean

        raise ConfigError(f"reward.name '{spec}': {where} has no function '{attr}'{did_you_mean(attr, names)}")
    return check_reward_fn(getattr(module, attr), spec)
