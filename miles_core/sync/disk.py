"""``disk`` weight transport: the trainer writes each version as a safetensors folder, atomically
(a temporary folder renamed into place), and the engines load it (``/update_weights_from_disk``
for HTTP engines, ``BuiltinEngine.update_weights_from_disk`` in process).

Folders are ``<sync.disk_dir or output_dir/weights>/v<version>``; the one written and the newest
before it are kept (an engine restarted during a push may still read the previous one), higher
versions left in the folder by an earlier run are removed. ``config.json`` and the
tokenizer files of the engine's model folder are copied in, so a real SGLang server can load the
folder as a model.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from miles_core.errors import ConfigError
from miles_core.models.checkpoint import atomic_dir

KEEP = 2


def write_weights(weights: Mapping[str, torch.Tensor], root: str | Path, version: int, model_dir: str | None = None) -> str:
    from safetensors.torch import save_file

    root = Path(root)
    state, seen = {}, set()
    for k, v in weights.items():  # a tied tensor (lm_head = embed_tokens) is written once
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        state[k] = v.detach().to("cpu").contiguous()

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "weight_version": str(version)})
        if model_dir:
            for f in Path(model_dir).iterdir():
                if f.is_file() and f.suffix != ".safetensors":
                    shutil.copy2(f, tmp / f.name)

    dest = root / f"v{version}"
    atomic_dir(dest, write)
    _prune(root, version)
    return str(dest)


def _prune(root: Path, version: int) -> None:
    """Keep ``v<version>`` and the newest version before it. Higher versions are not this run's (an earlier run
    in the same ``sync.disk_dir``, or steps past the checkpoint a run resumed from): ordered by number, they
    would count as the newest and the folder just written would be removed before any engine loaded it."""
    found = sorted((p for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    keep = [p for p in found if int(p.name[1:]) <= version][-KEEP:]
    for p in found:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


class DiskTransport:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend) -> None:
        load = getattr(backend, "update_weights_from_disk", None)
        if load is None:
            raise ConfigError(f"sync.transport=disk: the rollout backend {type(backend).__name__} cannot load weights from disk")
        path = write_weights(weights, self.root, version, getattr(backend, "model_dir", None))
        load(path, version)
