"""A tiny Qwen3-shaped run (trainer + built-in engine) built through the plugin manager."""

from __future__ import annotations

import torch

from miles_core.config.schema import MilesConfig
from miles_core.data.tokenizer import CharTokenizer
from miles_core.kernels.base import Kernels
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.plugins.manager import MilesPlugins
from miles_core.rollout.engine import BuiltinEngine
from miles_core.train.torch_trainer import TorchTrainer


def plugins() -> MilesPlugins:
    import miles_nvidia.plugin

    return MilesPlugins(autoload=False, extra_plugins=[("miles_nvidia", miles_nvidia.plugin)])


def tiny_pair(precision: str, device: str, platform: str, **model):
    pm = plugins()
    tok = CharTokenizer()
    dims = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, qk_norm=True)
    dims.update(model)
    torch.manual_seed(0)
    net = Decoder(DecoderConfig(vocab_size=tok.vocab_size, **dims))
    cfg = MilesConfig()
    cfg.train.precision = precision
    recipe = pm.registries.precision_recipes.get(precision)
    kernels = Kernels(pm, platform)
    dev = torch.device(device)
    trainer = TorchTrainer(net, cfg, dev, recipe, kernels)
    engine = BuiltinEngine(net, tok, dev, seed=0, precision=recipe, kernels=kernels)
    return trainer, engine, tok
