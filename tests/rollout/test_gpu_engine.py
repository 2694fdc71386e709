"""GPU paths of the engine (skipped without CUDA): CUDA-graph decode and the Triton paged-decode
kernel against the eager torch path on the same model."""

import pytest
import torch

from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore

pytestmark = pytest.mark.gpu


def model(dtype, qk_norm=False, seed=0):
    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=512,
                              qk_norm=qk_norm))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    return m.to("cuda", dtype)


def run(m, **cfg):
    core = EngineCore(m, EngineConfig(block_size=16, decode_steps=4, num_blocks=256, max_model_len=512, **cfg))
    return core, generate(core)


def generate(core):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 3, 64)]
    reqs = [core.add_request(p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))[0] for p in prompts]
    while core.has_unfinished():
        core.step()
    return reqs


def test_weights_updated_released_and_resumed_match_a_fresh_engine():
    """The colocated-training cycle on the production GPU path (bf16, CUDA graphs, the fused Triton kernels,
    overlapped windows): weights copied in place under captured graphs, then released (off the GPU) and
    resumed, generate bit for bit what a fresh engine built on the same weights generates."""
    m = model(torch.bfloat16, qk_norm=True)
    core, first = run(m)
    assert core.runner.use_graphs and core.runner.use_triton and core.runner.fused_kernels
    new = model(torch.bfloat16, qk_norm=True, seed=1)
    _, want = run(new)
    outputs = lambda reqs: [(r.output_ids, r.logprobs) for r in reqs]  # noqa: E731
    assert outputs(want) != outputs(first)
    core.update_weights(new.state_dict(), version=2)
    assert outputs(generate(core)) == outputs(want)
    held = torch.cuda.memory_allocated()
    kv_bytes = core.runner.kv.numel() * core.runner.kv.element_size()
    core.release_memory()
    weight_bytes = sum(p.numel() * p.element_size() for p in new.parameters())
    assert core.runner.kv is None and all(p.device.type == "cpu" for p in core.model.parameters())
    assert held - torch.cuda.memory_allocated() >= weight_bytes + kv_bytes  # nothing still holds the fused weights
    core.resume_memory()
    again = generate(core)
    assert outputs(again) == outputs(want) and all(r.weight_version == 2 for r in again)
    core.update_weights(model(torch.bfloat16, qk_norm=True).state_dict(), version=3)  # back to the first weights
    assert outputs(generate(core)) == outputs(first)


def test_cuda_graphs_match_eager_fp32():
    m = model(torch.float32)
    core, graphed = run(m)
    assert core.runner.use_graphs and core.runner.step_graphs
    _, eager = run(m, cuda_graphs=False)
    for a, b in zip(graphed, eager):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_triton_decode_fp32_matches_torch():
    """An fp32 engine decodes through the Triton kernel too (IEEE dots, not tf32): same greedy tokens
    as the torch decode path, logprobs within 1e-4."""
    m = model(torch.float32)
    core, fast = run(m)
    assert core.runner.use_triton, "the Triton kernel failed its self-check"
    _, ref = run(m, cuda_graphs=False, triton_decode=False)
    for a, b in zip(fast, ref):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def _teacher_forced_error(m32, reqs) -> torch.Tensor:
    """|reported logprob - fp32 full-forward logprob| of every generated token, for these sequences."""
    errs = []
    for r in reqs:
        ids = torch.tensor(r.prompt_ids + r.output_ids, device="cuda")[None]
        with torch.no_grad():
            logp = torch.log_softmax(m32.lm_head(m32(ids)).float()[0], -1)
        n = len(r.prompt_ids)
        ref = logp[n - 1 : -1].gather(1, ids[0, n:, None]).squeeze(1)
        errs.append((torch.tensor(r.logprobs, device="cuda") - ref).abs())
    return torch.cat(errs)


def test_triton_decode_matches_torch_bf16():
    """Greedy bf16 sequences of two kernels diverge at near-tied logits (random weights), so both paths
    are checked on their own sequences against an fp32 full forward pass of the same weights: the
    Triton kernel must be as accurate as the torch decode path."""
    import copy

    m = model(torch.bfloat16)
    core, fast = run(m)
    assert core.runner.use_triton, "the Triton kernel failed its self-check"
    _, ref = run(m, cuda_graphs=False, triton_decode=False)
    m32 = copy.deepcopy(m).float()
    err_fast, err_ref = _teacher_forced_error(m32, fast), _teacher_forced_error(m32, ref)
    assert float(err_fast.mean()) <= 1.5 * float(err_ref.mean()) + 1e-3, (float(err_fast.mean()), float(err_ref.mean()))
    assert float(err_fast.mean()) < 2e-2 and float(err_fast.max()) < 0.25
    first = torch.tensor([a.logprobs[0] for a in fast]), torch.tensor([b.logprobs[0] for b in ref])
    assert torch.allclose(*first, atol=5e-2)  # the first token comes from the same prefill


@pytest.mark.parametrize("qk_norm,splitk,gated,pdl", [(True, False, False, False), (False, False, False, True), (True, True, False, False),
                                                     (True, True, True, False), (True, True, True, True), (False, True, True, True)])
def test_fused_layer_kernels_match_unfused(qk_norm, splitk, gated, pdl):
    """The fused layer kernels (triton_fused.py, on by default on a GPU; optionally with the split-K
    GEMM, the gated gate/up GEMM and programmatic dependent launch with the weight prefetch, which adds
    the Triton q/k/v GEMM) against the same engine without them: fp32 greedy tokens identical and logprobs within 1e-4; bf16 as accurate as the
    unfused path against an fp32 full forward (its own sequences, see the test above)."""
    import copy

    from miles_core.rollout.engine_core import triton_pdl

    if pdl and not triton_pdl.supported(torch.device("cuda")):
        pytest.skip("PDL needs sm90+ and a Triton with griddepcontrol")
    m = model(torch.float32, qk_norm)
    core, fused = run(m, splitk_gemm=splitk, gated_gemm=gated, pdl=pdl)
    assert core.runner.fused_kernels and core.runner.use_graphs and core.runner.splitk == splitk and core.runner.gated == gated
    assert core.runner.pdl == pdl
    _, ref = run(m, fused_kernels=False)
    for a, b in zip(fused, ref):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    m = model(torch.bfloat16, qk_norm)
    _, fused = run(m, splitk_gemm=splitk, gated_gemm=gated, pdl=pdl)
    _, ref = run(m, fused_kernels=False)
    m32 = copy.deepcopy(m).float()
    err_fused, err_ref = _teacher_forced_error(m32, fused), _teacher_forced_error(m32, ref)
    assert float(err_fused.mean()) <= 1.5 * float(err_ref.mean()) + 1e-3, (float(err_fused.mean()), float(err_ref.mean()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_matches_one_batch(dtype):
    """Decode steps as two half-batches on two streams (``split_decode_rows``, branches of the captured graph)
    against one batch: fp32 greedy tokens identical and logprobs within 1e-4 (the halves' GEMMs may tile
    differently); bf16 as close to an fp32 full forward as the one-batch path."""
    import copy

    m = model(dtype, qk_norm=True)
    split_core, split = run(m, split_decode_rows=2)
    assert split_core.runner.use_graphs and split_core.runner._side_stream is not None  # the halves ran
    one_core, one = run(m)
    assert one_core.runner._side_stream is None
    if dtype == torch.float32:
        for a, b in zip(split, one):
            assert a.output_ids == b.output_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    else:
        m32 = copy.deepcopy(m).float()
        err_split, err_one = _teacher_forced_error(m32, split), _teacher_forced_error(m32, one)
        assert float(err_split.mean()) <= 1.5 * float(err_one.mean()) + 1e-3, (float(err_split.mean()), float(err_one.mean()))


def test_fused_triton_sampler_matches_torch_on_gpu():
    """The fused sampling pass (triton_sample) against the torch sampler on CUDA at Qwen3's vocabulary:
    greedy rows always agree; sampled rows may only differ where the last-bit rounding of the logs
    changes a near tie, so at least 99% of the draws agree; logprobs within 1e-4."""
    from miles_core.rollout.engine_core.sampler import SamplingTensors, sample, sample_torch

    torch.manual_seed(0)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, min_p=0.02)] * 52
    st = SamplingTensors.build(params, list(range(len(params))), "cuda")
    counters = torch.arange(len(params), device="cuda") * 3
    logits = (torch.randn(len(params), 151936, device="cuda") * 2).to(torch.bfloat16)
    tok, lp, _ = sample(logits, st, counters)
    ref, rlp, _ = sample_torch(logits, st, counters)
    greedy = st.temperature <= 0
    assert torch.equal(tok[greedy], ref[greedy])
    assert float((tok == ref).float().mean()) >= 0.99
    same = tok == ref
    assert float((lp[same] - rlp[same]).abs().max()) < 1e-4


def test_overlapped_windows_match_window_by_window_on_gpu():
    """Overlapped decode windows on the CUDA-graph path (bf16, the fused kernels): the window launched
    ahead reads its tokens, positions and pages from the device, and its outputs come back through
    pinned memory behind an event. Same tokens and logprobs bit for bit as reading each window first,
    with a stop token ending one request inside a window and sampled rows."""
    m = model(torch.bfloat16, qk_norm=True)
    _, greedy = run(m, overlap_windows=False)
    stop = greedy[1].output_ids[9]

    def go(overlap):
        core = EngineCore(m, EngineConfig(block_size=16, decode_steps=4, num_blocks=256, max_model_len=512, overlap_windows=overlap))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 3, 64)]
        params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
                  SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=[stop]),
                  SamplingParams(max_new_tokens=37, temperature=1.0, seed=3)] * 2
        reqs = [core.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
        while core.has_unfinished():
            core.step()
        return core, reqs

    off_core, off = go(False)
    on_core, on = go(True)
    assert off_core.windows_ahead == 0 and on_core.windows_ahead > 0 and on_core.runner.use_graphs
    assert off[1].finish_reason == "stop"
    for a, b in zip(off, on):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs


def test_step_graphs_with_sampling_match_the_step_by_step_path_on_gpu():
    """A whole decode step (sampling, the next token, position, context, counter) as one graph replay
    (``graph_sampling``) against sampling outside the graph: the same tokens (greedy and seeded sampled rows,
    a stop token inside a window, overlapped windows), logprobs within 1e-5 (the sampler's reductions may run
    over a padded bucket). Windows with a top-p row keep the sampler outside the graph."""
    m = model(torch.bfloat16, qk_norm=True)
    _, greedy = run(m, graph_sampling=False)
    stop = greedy[1].output_ids[9]

    def go(params, **cfg):
        core = EngineCore(m, EngineConfig(block_size=16, decode_steps=4, num_blocks=256, max_model_len=512, **cfg))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 3, 64)]
        reqs = [core.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
        while core.has_unfinished():
            core.step()
        return core, reqs

    params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=[stop]),
              SamplingParams(max_new_tokens=37, temperature=1.0, seed=3)] * 2
    off_core, off = go(params, graph_sampling=False)
    on_core, on = go(params)
    assert not off_core.runner.step_graphs and on_core.runner.step_graphs and on_core.windows_ahead > 0
    assert off[1].finish_reason == "stop" and on[1].finish_reason == "stop"
    for a, b in zip(off, on):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    top_p = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)] + params[:5]
    core, _ = go(top_p)
    assert core.runner.graphs  # the windows with the top-p row (the others, once it has ended, use step graphs)


def test_decode_window_launch_never_waits_for_the_device():
    """Enqueueing a decode window (page tables, sampling state, the steps, the copies back) must not
    synchronize the stream, or the host cannot enqueue window N+1 while window N runs: under
    ``torch.cuda.set_sync_debug_mode("error")`` any synchronizing call in ``_launch`` raises. (Graphs are
    captured in a first run; capturing synchronizes.)"""
    m = model(torch.bfloat16, qk_norm=True)
    core, first = run(m)
    launch = core._launch

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    core._launch = strict
    core.flush_cache()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 3, 64)]
    reqs = [core.add_request(p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))[0] for p in prompts]
    while core.has_unfinished():
        core.step()
    assert core.windows_ahead > 0
    assert [r.output_ids for r in reqs] == [r.output_ids for r in first]
