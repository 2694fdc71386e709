from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_core.errors import ConfigError


@dataclass
class SglangConfig:
    """``rollout.sglang``: where the SGLang-protocol engines are, or how many to launch.

    ``server_args`` are passed to each launched server as ``--KEY VALUE`` (underscores become
    dashes; ``true`` is a bare flag). ``--sglang-KEY VALUE`` on the command line sets
    ``server_args[KEY]``. ``launcher``: ``auto`` starts ``python -m sglang.launch_server`` when
    sglang is importable and ``miles serve`` otherwise.
    """

    urls: list[str] = field(default_factory=list)  # connect to these servers (no launching, no restarts)
    num_engines: int = 1  # servers to launch when urls is empty
    launcher: str = "auto"  # auto | sglang | miles
    server_args: dict[str, Any] = field(default_factory=dict)
    startup_timeout_s: float = 120.0  # a launched server must answer /health within this
    request_timeout_s: float = 600.0  # one /generate call
    recover: bool = True  # restart launched servers that die and resubmit their requests
    health_interval_s: float = 0.2  # how often the monitor checks the launched processes
    max_restarts: int = 100  # restarts of all launched engines together, per run; beyond it a dead engine fails the run

    def validate(self) -> None:
        if self.launcher not in ("auto", "sglang", "miles"):
            raise ConfigError(f"rollout.sglang.launcher must be auto, sglang or miles, got '{self.launcher}'")
        if not self.urls and self.num_engines < 1:
            raise ConfigError(f"rollout.sglang.num_engines must be >= 1 (or give rollout.sglang.urls), got {self.num_engines}")
        for u in self.urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.sglang.urls: '{u}' is not an http(s):// URL")
        if self.max_restarts < 0:
            raise ConfigError(f"rollout.sglang.max_restarts must be >= 0 (0: no restarts), got {self.max_restarts}")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0 or self.health_interval_s <= 0:
            raise ConfigError("rollout.sglang.*_timeout_s and health_interval_s must be > 0")
