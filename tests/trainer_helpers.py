"""Small builders for trainer tests: a tiny decoder, a random batch, a trainer without a run."""

from __future__ import annotations

import functools

import torch

from miles_core.config.loader import load_config
from miles_core.kernels.base import Kernels
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.plugins.manager import MilesPlugins
from miles_core.train.batch import make_train_batch
from miles_core.train.torch_trainer import TorchTrainer
from miles_core.types import Sample

VOCAB = 48


def tiny_decoder(seed: int = 0, tie: bool = True, layers: int = 2) -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, qk_norm=True, tie_word_embeddings=tie)
    return Decoder(cfg)


def random_batch(n: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(1, 6, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (p + r,), generator=g).tolist()
        lp = (-torch.rand(r, generator=g) * 3).tolist()
        samples.append(Sample("", ids[:p], ids[p:], "", lp, group_id=i // 2, index=i))
    batch = make_train_batch(samples, pad_id=0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.old_logprobs = batch.rollout_logprobs.clone()
    return batch


def make_trainer(model, *overrides: str) -> TorchTrainer:
    cfg = load_config(None, ["rollout.temperature=1.0", "train.lr=0.01", *overrides])
    plugins = MilesPlugins()
    precision = plugins.registries.precision_recipes.get(cfg.train.precision, key="train.precision")
    return TorchTrainer(model, cfg, torch.device("cpu"), precision, Kernels(plugins, "cpu"))


def policy_loss(trainer: TorchTrainer):
    plugins = MilesPlugins()
    loss = plugins.registries.policy_losses.get(trainer.cfg.algorithm.policy_loss, key="algorithm.policy_loss")
    return functools.partial(loss, cfg=trainer.cfg.algorithm)
