"""What every component factory and lifecycle hook receives about the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from miles_core.config.schema import MilesConfig
    from miles_core.data.tokenizer import Tokenizer
    from miles_core.kernels.base import Kernels
    from miles_core.plugins.manager import MilesPlugins


@dataclass
class RunContext:
    config: MilesConfig
    plugins: MilesPlugins
    tokenizer: Tokenizer
    device: torch.device
    platform: str  # the name of the selected platform ("cpu", "cuda", ...)
    kernels: Kernels  # op name -> the implementation chosen for this platform
    output_dir: Path | None = None  # None for `miles validate`
    extras: dict[str, Any] = field(default_factory=dict)  # free space for plugins, per run
