"""On a CUDA GPU (megatron-core 0.19 on the H200): the Megatron trainer against the torch trainer.

fp32: same logprobs and loss as the torch trainer to 1e-4 (TF32 is off; cuBLAS and SDPA kernels
differ from the CPU's). bf16 autocast: logprobs within 5e-2 of the fp32 torch trainer's.
"""

from __future__ import annotations

import functools

import pytest
import torch
from megatron_helpers import batch, hf_model, hf_response_logprobs
from test_megatron_trainer import KERNELS, _config, _decoder

from miles_core.algorithms.losses import ppo_clip
from miles_core.precision.base import PrecisionRecipe
from miles_core.train.megatron.arch import arch_from_decoder, arch_from_hf
from miles_core.train.torch_trainer import TorchTrainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", [PrecisionRecipe("fp32"), PrecisionRecipe("bf16", torch.float32, torch.bfloat16)])
def test_gpu_matches_torch_trainer(precision):
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    cfg = _config("token_mean")
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    ref = TorchTrainer(dec, cfg, dev, PrecisionRecipe("fp32"), KERNELS)
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, dev, precision, KERNELS)
    b = batch()
    lp_t, lp_m = ref.compute_logprobs(b), mega.compute_logprobs(b)
    tol = 1e-4 if precision.compute_dtype is None else 5e-2
    torch.testing.assert_close(lp_m, lp_t, atol=tol, rtol=0)
    b.old_logprobs = lp_t
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    m_t, m_m = ref.train_step(b, loss_fn), mega.train_step(b, loss_fn)
    assert m_m["loss"] == pytest.approx(m_t["loss"], abs=tol)
    assert m_m["grad_norm"] == pytest.approx(m_t["grad_norm"], rel=1e-3 if precision.compute_dtype is None else 5e-2)


def test_gpu_moe_matches_transformers():
    from miles_core.config.schema import MilesConfig
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3_moe")
    b = batch()
    ref = hf_response_logprobs(model, b)
    mega = MegatronTrainer(arch_from_hf(model.config.to_dict()), model.state_dict(), MilesConfig(), torch.device("cuda"),
                           PrecisionRecipe("fp32"), KERNELS)
    torch.testing.assert_close(mega.compute_logprobs(b), ref, atol=1e-4, rtol=0)
