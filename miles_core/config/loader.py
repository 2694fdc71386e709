"""Build a :class:`MilesConfig` from a YAML recipe plus ``key=value`` overrides and flags.

Every error names the key (and the file) and, for an unknown key, the closest valid one.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from miles_core.config.flags import ESTIMATOR_VALUES, KL_SWITCH_FLAG, KL_VALUE_FLAGS, SLIME_FLAGS, SWITCH_FLAGS, resolve_kl_flags
from miles_core.config.schema import MilesConfig
from miles_core.errors import ConfigError, did_you_mean


# a number with an exponent and no dot (1e-5), which YAML 1.1 (PyYAML) reads as text
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _all_keys(cls: type = MilesConfig, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value):  # `lr: 1e-5` in a recipe
            value = float(value)
        # NaN passes every range check (each is a comparison, and NaN compares false): it is refused here
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            return float(value)
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    raise ConfigError(f"config key '{key}' has an unsupported type {tp!r}")  # pragma: no cover


def _apply(obj: Any, data: dict[str, Any], prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or 'the recipe'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"{source}: unknown config key '{key}'{did_you_mean(key, _all_keys())}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            _apply(getattr(obj, name), value, f"{key}.", source)
        else:
            try:
                setattr(obj, name, _coerce(value, tp, key))
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None


SGLANG_FLAG_PREFIX = "--sglang-"
SERVER_ARGS_KEY = "rollout.sglang.server_args."


def _key_type(parts: list[str]) -> Any:
    """The annotation of the config key ``parts`` (section, name), or None where there is no such key."""
    tp: Any = MilesConfig
    for part in parts:
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
    return tp


def _mapping_depth(parts: list[str]) -> int | None:
    """How many of ``parts`` name a mapping key (data.task_options) when the rest names an entry inside it, else None."""
    tp: Any = MilesConfig
    for i, part in enumerate(parts[:-1]):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
        if typing.get_origin(tp) is dict:
            return i + 1
    return None


def _is_text(tp: Any) -> bool:
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and set(typing.get_args(tp)) == {str, type(None)})


def _cli_value(raw: str, tp: Any) -> Any:
    """A command-line value. For a text key (a path, a name) the text as written: read as YAML and turned back into
    text, '1e-5' became '1e-05', '0755' '493' and 'runs/a #2' 'runs/a'; null / none / ~ still unset an optional one.
    Any other key's value is read as YAML, and a number YAML 1.1 leaves as text ('2e-5') as a number."""
    if _is_text(tp):
        return None if tp is not str and raw.lower() in ("null", "none", "~") else raw
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if value is None and raw.lower() not in ("null", "none", "~"):
        value = raw
    if isinstance(value, str) and value.lower() == "none":
        value = None
    elif isinstance(value, str):
        try:  # YAML 1.1 reads "2e-5" as a string; on the command line it is a number
            value = float(value)
        except ValueError:
            pass
    return value


def _set_dotted(cfg: MilesConfig, key: str, raw: str, source: str) -> None:
    if key.startswith(SERVER_ARGS_KEY):  # one entry of the mapping, not the whole mapping
        name = key[len(SERVER_ARGS_KEY):]
        if not name:
            raise ConfigError(f"{source}: give the server option's name after {SGLANG_FLAG_PREFIX}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        cfg.rollout.sglang.server_args[name] = raw if value is None else value
        return
    parts = key.split(".")
    depth = _mapping_depth(parts)
    if depth is not None:  # data.task_options.size=5: one entry of the mapping (nested keys too), not the whole mapping
        cursor = cfg
        for part in parts[:depth]:
            cursor = getattr(cursor, part)
        for i in range(depth, len(parts) - 1):
            cursor = cursor.setdefault(parts[i], {})
            if not isinstance(cursor, dict):
                raise ConfigError(f"{source}: '{'.'.join(parts[:i + 1])}' is {cursor!r}, not a mapping: cannot set '{key}'")
        cursor[parts[-1]] = _cli_value(raw, Any)
        return
    nested: dict[str, Any] = {}
    cursor = nested
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = _cli_value(raw, _key_type(parts))
    if len(parts) == 1:
        raise ConfigError(f"{source}: '{key}' is not a config key; keys look like section.name{did_you_mean(key, _all_keys())}")
    _apply(cfg, nested, "", source)


def parse_cli_args(args: list[str]) -> list[tuple[str, str, str]]:
    """Turn ``key=value``, ``--slime-flag value`` and ``--section.key=value`` into (key, value, source)."""
    out = []
    kl_flags: dict[str, str] = {}  # slime's KL flags mean something together: resolved after the loop
    use_kl_loss = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            if flag == KL_SWITCH_FLAG:
                if eq:
                    raise ConfigError(f"option '{flag}' takes no value")
                use_kl_loss = True
                i += 1
                continue
            if flag in SWITCH_FLAGS and not eq:
                out.append((SWITCH_FLAGS[flag], "true", f"option {flag}"))
                i += 1
                continue
            if flag in SWITCH_FLAGS:
                key = SWITCH_FLAGS[flag]
            elif flag in SLIME_FLAGS:
                key = SLIME_FLAGS[flag]
            elif flag.startswith(SGLANG_FLAG_PREFIX):  # --sglang-mem-fraction-static 0.7 -> server_args
                key = SERVER_ARGS_KEY + flag[len(SGLANG_FLAG_PREFIX):].replace("-", "_")
                if not eq and (i + 1 >= len(args) or args[i + 1].startswith("--") or "." in args[i + 1].partition("=")[0] and "=" in args[i + 1]):
                    out.append((key, "true", f"option {flag}"))  # a bare switch
                    i += 1
                    continue
            elif flag in KL_VALUE_FLAGS:
                key = flag
            elif "." in flag:
                key = flag[2:].replace("-", "_")
            else:
                known = list(SLIME_FLAGS) + list(SWITCH_FLAGS) + list(KL_VALUE_FLAGS) + [KL_SWITCH_FLAG]
                raise ConfigError(f"unknown option '{flag}'{did_you_mean(flag, known + ['--' + k for k in _all_keys()])}")
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):  # `--save --resume`: the folder was forgotten
                    raise ConfigError(f"option '{flag}' needs a value")
                i += 1
                value = args[i]
            if flag in KL_VALUE_FLAGS:
                kl_flags[flag] = value
            elif flag == "--advantage-estimator" and value in ESTIMATOR_VALUES:
                out += [(k, v, f"option {flag} {value}") for k, v in ESTIMATOR_VALUES[value]]
            else:
                out.append((key, value, f"option {flag}"))
        elif "=" in arg:
            key, _, value = arg.partition("=")
            out.append((key.strip(), value, f"override '{arg}'"))
        else:
            raise ConfigError(f"cannot read argument '{arg}': overrides look like key=value (e.g. rollout.temperature=0.8)")
        i += 1
    kl = resolve_kl_flags(kl_flags, use_kl_loss)
    for key, _, flag_source in kl:  # applied last: a key also set by name would depend on the order given
        clash = next((source for k, _, source in out if k == key), None)
        if clash:
            raise ConfigError(f"{flag_source.removeprefix('option ')} sets {key}, and {clash} sets it too: give one of them")
    return out + kl


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last silently, so a recipe with a
    second ``algorithm:`` section (a snippet pasted below its own) lost every key of the first. Keys merged in with
    ``<<`` may still be overridden."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader refuses it itself
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"'{key}' is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(recipe: str | Path | None = None, overrides: list[str] = ()) -> MilesConfig:
    """The validated config of a run: defaults, then the recipe file, then the overrides in order."""
    cfg = MilesConfig()
    if recipe is not None:
        path = Path(recipe)
        if path.is_dir():  # a run folder given back as RECIPE: its config is the config.yaml in it
            hint = f" (did you mean '{path / 'config.yaml'}'?)" if (path / "config.yaml").is_file() else ""
            raise ConfigError(f"recipe '{path}' is a folder, not a YAML file{hint}")
        if not path.is_file():
            raise ConfigError(f"recipe file '{path}' does not exist")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except UnicodeDecodeError as exc:  # another file given as RECIPE (a model file), or a recipe in another encoding
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); a recipe is a YAML file") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            problem = " ".join(str(getattr(exc, "problem", exc)).split())  # on one line, as the CLI prints it
            raise ConfigError(f"{path}{where}: not valid YAML ({problem})") from None
        _apply(cfg, data, "", str(path))
    for key, value, source in parse_cli_args(list(overrides)):
        _set_dotted(cfg, key, value, source)
    cfg.validate()
    return cfg


def config_to_dict(cfg: MilesConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
