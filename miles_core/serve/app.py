"""Build the server of `miles serve MODEL`: load the model, start the engine thread, bind."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from miles_core.data.tokenizer import hf_eos_token_ids, load_tokenizer
from miles_core.errors import ConfigError
from miles_core.kernels.base import Kernels
from miles_core.models.checkpoint import find_family, load_hf_folder, read_hf_config
from miles_core.platforms import select_platform
from miles_core.plugins.manager import MilesPlugins
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core.threaded import ThreadedEngine
from miles_core.rollout.engine_core.transformers_runner import is_transformers_model, load_transformers_model
from miles_core.serve.server import MilesServer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class _HFTok:
    """The Tokenizer interface over a transformers tokenizer object (for GGUF files)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_model(model: str, plugins: MilesPlugins):
    """``model``: an HF safetensors folder, or a ``.gguf`` file -> (model, tokenizer). A folder whose
    ``model_type`` no Miles family handles loads as a transformers model (the engine's transformers path)."""
    path = Path(model)
    families = plugins.registries.model_families
    if path.suffix == ".gguf":
        from miles_core.models.gguf import load_gguf

        m, _family, tok = load_gguf(path, families)
        return m, _HFTok(tok)
    if not path.is_dir():
        raise ConfigError(f"MODEL '{model}' is neither an HF folder nor a .gguf file")
    hf = read_hf_config(path)
    family = find_family(hf, families)
    reason = "no Miles model family" if family is None else family.unsupported(hf)
    if reason is not None:  # no Miles implementation of this checkpoint: transformers' own, slower
        m = load_transformers_model(path)
        log.warning("%s: architecture '%s': %s; it runs through transformers (eager, slower)", path, m.config.model_type, reason)
        return m, load_tokenizer(path)
    m, _family = load_hf_folder(path, families)
    return m, load_tokenizer(path)


def build_server(model: str, host: str = "127.0.0.1", port: int = 30000, device: str = "auto", dtype: str = "auto",
                 engine: EngineConfig | None = None, seed: int = 0, max_request_bytes: int = 64 << 20,
                 plugins: MilesPlugins | None = None) -> MilesServer:
    plugins = plugins or MilesPlugins()
    _platform, dev = select_platform(plugins.registries.platforms, device, "--device")
    m, tok = load_model(model, plugins)
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif dtype in _DTYPES:
        dt = _DTYPES[dtype]
    else:
        raise ConfigError(f"--dtype '{dtype}' is not one of auto, {', '.join(_DTYPES)}")
    m = m.to(device=dev, dtype=dt)
    if not is_transformers_model(m):  # the platform's rmsnorm/rope/swiglu, as the trainer uses
        m.use_kernels(Kernels(plugins, _platform.name))
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if Path(model).is_dir():  # and the checkpoint's own (config.json, generation_config.json), as SGLang stops on
        eos += hf_eos_token_ids(Path(model))
    core = EngineCore(m, engine or EngineConfig(), eos_token_ids=eos, detokenize=tok.decode, seed=seed,
                      special_token_id=getattr(tok, "special_token_id", None))
    return MilesServer(ThreadedEngine(core), tok, model, host, port, max_request_bytes)
