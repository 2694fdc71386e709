"""Meta-tests: every hook is documented and exercised by a test; packaging lists every package."""

import inspect
import re
import tomllib
from pathlib import Path

from miles_core import hookspecs

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    return [n for n, f in inspect.getmembers(hookspecs.MilesSpecs, inspect.isfunction) if n.startswith("miles_")]


def test_every_hook_has_a_docstring_and_typed_arguments():
    for name in _hooks():
        fn = getattr(hookspecs.MilesSpecs, name)
        assert fn.__doc__ and len(fn.__doc__.strip()) > 30, f"{name} has no docstring"
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        assert all(p.annotation is not inspect.Parameter.empty for p in params), f"{name} has untyped arguments"


def test_every_hook_is_used_by_a_test():
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != "test_meta.py")  # not this file's own names
    impl_text = "\n".join(p.read_text() for p in (ROOT / "miles_core").rglob("plugin*.py"))
    impl_text += (ROOT / "miles_core" / "platforms.py").read_text()
    registries = re.findall(r"registries\.(\w+)", text)
    for name in _hooks():
        suffix = name.removeprefix("miles_register_")
        used = name in text or (name.startswith("miles_register_") and suffix in registries and name in impl_text)
        if name == "miles_kernel_select":
            used = used or "kernel_select" in text
        assert used, f"hook {name} is not exercised by any test"


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "miles_core").rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
