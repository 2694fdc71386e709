"""Triton where it is installed, ``None`` where not: the engine's GPU kernels (``triton_*.py``) need
it; the torch path is the reference and runs without it. Each kernel module imports ``triton`` and
``tl`` from here and defines its kernels under ``if triton is not None``."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def available() -> bool:
    return triton is not None
