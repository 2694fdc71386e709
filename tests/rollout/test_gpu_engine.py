"""GPU paths of the engine (skipped without CUDA): CUDA-graph decode and the Triton paged-decode
kernel against the eager torch path on the same model."""

import pytest
import torch

from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore

pytestmark = pytest.mark.gpu


def model(dtype):
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=512))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    return m.to("cuda", dtype)


def run(m, **cfg):
    core = EngineCore(m, EngineConfig(block_size=16, decode_steps=4, num_blocks=256, max_model_len=512, **cfg))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 3, 64)]
    reqs = [core.add_request(p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))[0] for p in prompts]
    while core.has_unfinished():
        core.step()
    return core, reqs


def test_cuda_graphs_match_eager_fp32():
    m = model(torch.float32)
    core, graphed = run(m)
    assert core.runner.use_graphs and core.runner.graphs
    _, eager = run(m, cuda_graphs=False)
    for a, b in zip(graphed, eager):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_triton_decode_matches_torch_bf16():
    m = model(torch.bfloat16)
    core, fast = run(m)
    assert core.runner.use_triton, "the Triton kernel failed its self-check"
    _, ref = run(m, cuda_graphs=False, triton_decode=False)
    same = sum(x == y for a, b in zip(fast, ref) for x, y in zip(a.output_ids, b.output_ids))
    assert same >= 0.9 * sum(len(a.output_ids) for a in fast)
    first = torch.tensor([a.logprobs[0] for a in fast]), torch.tensor([b.logprobs[0] for b in ref])
    assert torch.allclose(*first, atol=5e-2)
