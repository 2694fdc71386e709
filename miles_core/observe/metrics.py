"""metrics.jsonl: one JSON object per step, flushed as it is written; strict JSON for it and summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def strict_json(record: dict[str, Any], indent: int | None = None) -> str:
    """``record`` as strict JSON: a NaN or infinite number (a diverged loss) is null, not the ``NaN`` that Python
    writes and jq or JavaScript refuse."""
    return json.dumps({k: _clean(v) for k, v in record.items()}, indent=indent)


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(strict_json(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
