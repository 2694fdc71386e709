"""HF safetensors folders in and out. Writes are atomic: a folder appears whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from miles_core.data.tokenizer import missing_folder
from miles_core.errors import ConfigError
from miles_core.models.base import ModelFamily
from miles_core.plugins.registry import Registry


def atomic_dir(dest: Path, write) -> None:
    """Call ``write(tmp_dir)`` then move the finished folder to ``dest`` (replacing an old one)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
        share_as_umask_allows(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, dest)
    fsync_dir(dest.parent)  # the rename itself on disk


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def share_as_umask_allows(root: Path) -> None:
    """Give the folders and files under ``root`` the modes a plain mkdir / open would (0755 / 0644 under the usual
    umask): mkdtemp makes 0700 and safetensors writes 0600, so an exported model was readable by its owner only (a
    server running as another user, a shared model folder, could not load it)."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


def atomic_file(dest: Path, write) -> Path:
    """Call ``write(tmp_path)`` then rename the flushed file to ``dest``: a reader (or a run killed mid-write) sees the
    old file or the new one, never half of one."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` (subfolders included) and each folder's entries to disk."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (creations, renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished folder ``tmp`` to ``dest``. An old ``dest`` is moved aside first (a rename) and removed
    only once the new one is in place, or put back if that move fails: ``dest`` is never a half-removed folder."""
    old = _aside(dest, os.getpid()) if dest.exists() else None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:  # the new folder could not be moved in: the old one goes back
        if old is not None:
            os.replace(old, dest)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _aside(dest: Path, pid: int | str) -> Path:
    """Where :func:`replace_dir` moves an old ``dest`` while the new one moves in."""
    return dest.parent / f".{dest.name}.old-{pid}"


def restore_moved_aside(dest: Path, complete) -> None:
    """A kill between :func:`replace_dir`'s two renames leaves no ``dest``: put back the old folder it moved aside,
    the first for which ``complete(folder)`` holds."""
    for old in sorted(dest.parent.glob(_aside(dest, "*").name)):
        if complete(old):
            os.replace(old, dest)
            return


def save_hf_folder(model: nn.Module, family: ModelFamily, dest: Path, extra_files: dict[str, str | bytes] | None = None) -> None:
    save_hf_state(model.state_dict(), model.config, family, dest, extra_files)


def save_hf_state(state: dict[str, torch.Tensor], cfg, family: ModelFamily, dest: Path, extra_files: dict[str, str | bytes] | None = None) -> None:
    """Write full (unsharded) tensors ``state`` with the decoder config ``cfg`` as an HF folder."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    config = family.config_to_hf(cfg)
    config["torch_dtype"] = str(stored_dtype(state)).removeprefix("torch.")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, content in (extra_files or {}).items():  # text, or bytes (a tokenizer's files)
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content)

    atomic_dir(dest, write)


def stored_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype that holds most of ``state``'s elements (config.json's torch_dtype, which transformers and
    the servers load the model in); float32 if it has no floating tensor."""
    counts: dict[torch.dtype, int] = {}
    for t in state.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def read_hf_config(path: Path) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"model checkpoint '{path}' has no config.json (expected an HF safetensors folder)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_file}: not a JSON object (an HF config is a mapping of settings)")
    return hf


def find_family(hf: dict, families: Registry) -> ModelFamily | None:
    """The family whose ``hf_model_types`` hold the config's ``model_type``, or None."""
    model_type = hf.get("model_type", "")
    return next((e.value for e in families if model_type in e.value.hf_model_types), None)


def family_for(hf: dict, families: Registry, path: Path) -> ModelFamily:
    """The family that runs this checkpoint natively; a ConfigError naming why if there is none."""
    family = find_family(hf, families)
    if family is not None:
        reason = family.unsupported(hf)
        if reason is None:
            return family
        raise ConfigError(f"model checkpoint '{path}' ({hf.get('model_type')}) uses {reason}, which Miles' {family.name} "
                          "implementation does not; `miles serve` runs it through transformers")
    model_type = hf.get("model_type", "")
    raise ConfigError(
        f"model checkpoint '{path}' has model_type '{model_type}', which no model family handles "
        f"(known: {', '.join(t for e in families for t in e.value.hf_model_types)}); `miles serve` runs other "
        "architectures through transformers"
    )


INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The files that hold the model, as transformers picks them: ``model.safetensors`` where there is one, else the
    shards ``model.safetensors.index.json`` names (other ``*.safetensors`` there, such as an adapter_model.safetensors
    or an earlier save's shards of another count, are not the model); with neither, every ``*.safetensors`` file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{index}: not a safetensors index (no weight_map of tensor -> file: {exc})") from None
    for name in names:
        if not (folder / name).is_file():
            raise ConfigError(f"model checkpoint '{folder}': '{name}', which {INDEX_FILE} names, is not there")
    return [folder / name for name in names]


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model's ``*.safetensors`` files in ``folder`` (:func:`weight_files`); a ConfigError naming
    the file that cannot be read."""
    files = weight_files(folder)
    if not files:
        raise ConfigError(f"model checkpoint '{folder}' has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as exc:  # truncated, not safetensors, unreadable
            raise ConfigError(f"'{f}' is not a readable safetensors file ({exc})") from None
    return state


def build_from_config(family: ModelFamily, hf: dict, path: Path) -> nn.Module:
    """The family's model for config.json ``hf``; a key it needs that is absent or of the wrong type is named
    (config_from_hf reads them as they are, and would raise a KeyError or a TypeError from deep in torch)."""
    try:
        return family.build(family.config_from_hf(hf))
    except KeyError as exc:
        raise ConfigError(f"{path / 'config.json'} has no '{exc.args[0]}' (needed to build a {family.name} model)") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path / 'config.json'}: cannot build a {family.name} model from it ({exc})") from None


def check_shapes(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """A tensor whose shape is not the one the config gives (another model's file, an edited config.json) is named
    here; load_state_dict would raise a RuntimeError listing every mismatch."""
    own = model.state_dict()
    for name, tensor in state.items():
        if name in own and own[name].shape != tensor.shape:
            raise ConfigError(f"model checkpoint '{path}': '{name}' has shape {tuple(tensor.shape)}; "
                              f"its config.json gives {tuple(own[name].shape)}")


def check_tied_head(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """With tie_word_embeddings the head is the embedding (one tensor): a file holding an ``lm_head.weight`` with
    other values would load it over the embedding. Refused (transformers unties such a model); equal values load."""
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if model.config.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        raise ConfigError(f"model checkpoint '{path}': its config.json's tie_word_embeddings is true, but its 'lm_head.weight' "
                          "differs from 'model.embed_tokens.weight'; set tie_word_embeddings to false in config.json to "
                          "keep both")


def load_hf_folder(path: Path, families: Registry) -> tuple[nn.Module, ModelFamily]:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(missing_folder(path))
    hf = read_hf_config(path)
    family = family_for(hf, families, path)
    model = build_from_config(family, hf, path)
    state = read_safetensors(path)
    check_shapes(model, state, path)
    check_tied_head(model, state, path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(
            f"model checkpoint '{path}' does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model, family
