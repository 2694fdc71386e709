"""Run by test_megatron_tp2.py under torchrun with 2 CPU ranks (gloo): the Megatron trainer at
tensor_parallel=2 against the single-process torch trainer. Writes the comparison to argv[1]."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_cpu_patch
from megatron_helpers import batch
from test_megatron_trainer import FP32, KERNELS, _config, _decoder

from miles_core.algorithms.losses import ppo_clip
from miles_core.train.megatron.arch import arch_from_decoder
from miles_core.train.torch_trainer import TorchTrainer


def main(out: str) -> None:
    torch.set_num_threads(1)
    megatron_cpu_patch.apply(pytest.MonkeyPatch())
    from miles_core.train.megatron.trainer import MegatronTrainer

    cfg = _config("token_mean")
    cfg.train.megatron.tensor_parallel = 2
    dec = _decoder(True, False)  # untied: the output layer is vocab-parallel too (61 -> 62 rows)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    torch_tr = TorchTrainer(dec, cfg, torch.device("cpu"), FP32, KERNELS)
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()
    lp_t, lp_m = torch_tr.compute_logprobs(b), mega.compute_logprobs(b)
    b.old_logprobs = (lp_t + 0.3 * torch.randn(lp_t.shape, generator=torch.Generator().manual_seed(2))) * b.response_mask
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    m_t, m_m = torch_tr.train_step(b, loss_fn), mega.train_step(b, loss_fn)
    g_t = {n: p.grad for n, p in torch_tr.model.named_parameters()}
    g_m = mega.to_hf({n: p.grad for n, p in mega.model.named_parameters()})
    w_t, w_m = torch_tr.weights(), mega.weights()
    result = {
        "shard_rows": int(mega.model.embedding.word_embeddings.weight.shape[0]),
        "logprob_diff": float((lp_t - lp_m).abs().max()),
        "logprob_max": float(lp_t.abs().max()),
        "metrics": {k: [m_t[k], m_m[k]] for k in ("loss", "grad_norm", "entropy", "clip_frac")},
        "grad_diff": max(float((g_t[k] - g_m[k]).abs().max()) for k in g_t),
        "grad_max": max(float(g.abs().max()) for g in g_t.values()),
        "weight_diff": max(float((w_t[k] - w_m[k]).abs().max()) for k in w_t),
        "same_keys": sorted(w_t) == sorted(w_m),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
