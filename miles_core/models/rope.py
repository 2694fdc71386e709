"""Rotary embedding frequencies, and the HF configs' RoPE scaling variants that Miles implements.

The rotary angle of position ``p`` in pair ``i`` of a head of ``D`` dimensions is ``p * inv_freq[i]`` with
``inv_freq[i] = theta ** (-2i / D)``. A scaled RoPE (HF ``rope_scaling`` / ``rope_parameters``) changes only
``inv_freq``:

``linear``  every frequency divided by ``factor`` (position interpolation; Chen et al., 2023).
``llama3``  Llama 3.1's frequency-dependent scaling: with ``L = original_max_position_embeddings`` and
            wavelength ``w = 2 pi / inv_freq``, frequencies whose wavelength is shorter than ``L / high_freq_factor``
            are kept, those longer than ``L / low_freq_factor`` are divided by ``factor``, and those between are
            mixed, ``(1 - s) f / factor + s f`` with ``s = (L / w - low_freq_factor) / (high_freq_factor -
            low_freq_factor)``.

Other variants (``dynamic``, ``yarn``, ``longrope``, partial rotary) are not implemented: :func:`unsupported`
names them, so that a checkpoint using one loads through transformers (``miles serve``) or is refused with
the reason (training), never silently run with the plain frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch

IMPLEMENTED = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def theta_from_hf(hf: dict[str, Any]) -> float:
    """The RoPE base of an HF config (``rope_theta``, or inside transformers 5's ``rope_parameters``). A base of 0 is
    returned as it is (not taken for an absent key), for :func:`inv_freq` to refuse."""
    theta = hf.get("rope_theta")
    if theta is None:
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return float(theta)


def scaling_from_hf(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling parameters of an HF config (``rope_scaling``, or transformers 5's ``rope_parameters``), or
    None for plain RoPE. The dict keeps HF's keys; its ``rope_type`` is filled in from the older ``type``."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    if kind == "default" and not extra:
        return None
    return {"rope_type": kind, **extra}


def unsupported(scaling: dict[str, Any] | None) -> str | None:
    """Why Miles cannot run this scaling, or None if it can."""
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if kind not in IMPLEMENTED:
        return f"RoPE scaling '{kind}' (Miles implements {', '.join(IMPLEMENTED)})"
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        return f"partial rotary embeddings (partial_rotary_factor {scaling['partial_rotary_factor']})"
    need = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(kind, ())
    missing = [k for k in need if k not in scaling]
    if missing:
        return f"RoPE scaling '{kind}' without {', '.join(missing)}"
    return None


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """``inv_freq`` [dim / 2] fp32 for heads of ``dim``, base ``theta``, and an implemented ``scaling``."""
    reason = unsupported(scaling)
    if reason is not None:
        raise ValueError(f"cannot compute rotary frequencies: {reason}")
    if not theta > 0:  # 0 gives inf frequencies, a negative base nan ones: every logit nan
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    f = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "linear":
        return f / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in _LLAMA3_KEYS[:3])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / f
        f = torch.where(wavelen > old / low, f / factor, f)
        s = (old / wavelen - low) / (high - low)
        mid = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(mid, (1 - s) * f / factor + s * f, f)
    return f
