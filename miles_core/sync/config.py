from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncConfig:
    transport: str = "in_process"  # a registered weight transport

    def validate(self) -> None:
        pass
