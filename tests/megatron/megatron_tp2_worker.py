"""Run by test_megatron_tp2.py under torchrun with 2 CPU ranks (gloo): the Megatron trainer at
tensor_parallel=2 on the shared test batch. Rank 0 saves logprobs, metrics, the clipped gradients
and the updated weights (full tensors in HF names) to argv[1]; the test compares them with the
single-process torch trainer."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_cpu_patch
from megatron_helpers import batch
from test_megatron_trainer import FP32, KERNELS, _config, _decoder, off_policy

from miles_core.algorithms.losses import ppo_clip
from miles_core.train.megatron.arch import arch_from_decoder


def main(out: str) -> None:
    torch.set_num_threads(1)
    megatron_cpu_patch.apply(pytest.MonkeyPatch())
    from miles_core.train.megatron.trainer import MegatronTrainer

    cfg = _config("token_mean")
    cfg.train.megatron.tensor_parallel = 2
    dec = _decoder(True, False)  # untied: the output layer is vocab-parallel too (61 -> 62 rows)
    mega = MegatronTrainer(arch_from_decoder(dec.config), dec.state_dict(), cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()
    lp = mega.compute_logprobs(b)
    b.old_logprobs = off_policy(lp, b)
    metrics = mega.train_step(b, functools.partial(ppo_clip, cfg=cfg.algorithm))
    grads = mega.to_hf({n: p.grad for n, p in mega.model.named_parameters()})
    weights = mega.weights()
    if dist.get_rank() == 0:
        rows = int(mega.model.embedding.word_embeddings.weight.shape[0])
        torch.save({"logprobs": lp, "metrics": metrics, "grads": grads, "weights": dict(weights), "shard_rows": rows}, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
