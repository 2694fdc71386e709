"""GPU weight sync (skipped without CUDA): a `miles serve` engine on the GPU loads weights by
disk and by distributed broadcast -- NCCL between two GPUs (trainer tensors on cuda:0, engine on
cuda:1), gloo from CUDA tensors on one -- and then answers greedily as an in-process engine with
the same weights on its device does."""

import pytest
import torch
from sync_helpers import save, tiny_model

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import BuiltinEngine
from miles_core.rollout.sglang.backend import SglangBackend
from miles_core.rollout.sglang.config import SglangConfig
from miles_core.sync.disk import DiskTransport
from miles_core.sync.distributed import DistributedTransport
from miles_core.types import Prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [Prompt(t) for t in ("abc?", "dd?", "eab?", "c?")]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def ids(backend):
    return [s.response_ids for s in backend.generate(PROMPTS, GREEDY)]


def run_case(tmp_path, engine_device: str, transport, trainer_device: str):
    model, tok = tiny_model(0)
    cfg = SglangConfig(num_engines=1, server_args={"device": engine_device, "dtype": "fp32"})
    backend = SglangBackend(cfg, tok, save(model, tok, tmp_path / "initial"), tmp_path / "work")
    try:
        new, _ = tiny_model(5)
        state = {k: v.to(trainer_device) for k, v in new.state_dict().items()}
        transport.push(state, 1, backend)
        assert backend.engine_versions() == [1]
        assert ids(backend) == ids(BuiltinEngine(new, tok, torch.device(engine_device)))
    finally:
        backend.shutdown()


def test_disk_to_gpu_engine(tmp_path):
    run_case(tmp_path, "cuda:0", DiskTransport(tmp_path / "w"), "cuda:0")


def test_gloo_from_cuda_tensors_one_gpu(tmp_path):
    run_case(tmp_path, "cuda:0", DistributedTransport(1 << 16, "gloo"), "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_two_gpus(tmp_path):
    run_case(tmp_path, "cuda:1", DistributedTransport(1 << 16, "nccl"), "cuda:0")
