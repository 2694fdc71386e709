"""Overlapped decode windows (``EngineConfig.overlap_windows``): the next window of an unchanged
batch is launched before the last one is read. The tokens must be the ones a window-by-window run
gives, whatever happens in between: stops inside a window, aborts and arrivals while a window is
in flight, length limits. Tiny random decoder, fp32, the generic eager decode path on CPU (the CPU
decode window never runs ahead; the GPU path is checked in test_gpu_engine.py)."""

import torch

from helpers import tiny

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore

PROMPTS = [[3, 9, 27, 11, 40, 2, 8, 13, 50, 7], [4, 4, 61, 20, 33], [70, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15]]


def engine(overlap: bool, **kw):
    cfg = dict(block_size=4, decode_steps=3, cpu_decode_window=False, overlap_windows=overlap, prefix_caching=False)
    cfg.update(kw)
    return EngineCore(tiny(), EngineConfig(**cfg))


def drain(core):
    while core.has_unfinished():
        core.step()


def run(overlap: bool, params_list, **kw):
    core = engine(overlap, **kw)
    reqs = [core.add_request(p, params)[0] for p, params in zip(PROMPTS, params_list)]
    drain(core)
    return core, reqs


def test_same_tokens_with_stops_lengths_and_sampling():
    greedy = run(False, [SamplingParams(max_new_tokens=30, temperature=0)] * 3)[1]
    stop = greedy[0].output_ids[10]  # ends request 0 inside its fourth window
    params = [SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[stop]),
              SamplingParams(max_new_tokens=17, temperature=1.0, seed=11),  # length limit mid-window (17 = 5 * 3 + 2)
              SamplingParams(max_new_tokens=25, temperature=0.7, top_p=0.9, seed=5)]
    off_core, off = run(False, params)
    on_core, on = run(True, params)
    assert off_core.windows_ahead == 0 and on_core.windows_ahead > 0
    assert off[0].finish_reason == "stop" and len(off[0].output_ids) < 30
    for a, b in zip(off, on):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)
    assert on_core.blocks.num_free == off_core.blocks.num_free  # the window run past a stop left no page behind


def test_abort_while_a_window_is_in_flight():
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    ref = run(False, [params] * 3)[1]
    core = engine(True)
    reqs = [core.add_request(p, params)[0] for p in PROMPTS]
    while core.windows_ahead < 2:
        core.step()
    assert core._inflight is not None
    core.abort(reqs[1].request_id)
    outs = core.step()
    assert any(o.request is reqs[1] and o.finished for o in outs)
    cut = len(reqs[1].output_ids)
    drain(core)
    assert reqs[1].finish_reason == "abort" and 0 < cut < 40 and len(reqs[1].output_ids) == cut
    assert reqs[1].output_ids == ref[1].output_ids[:cut]
    for i in (0, 2):
        assert reqs[i].output_ids == ref[i].output_ids and reqs[i].finish_reason == "length"
    assert core.blocks.num_free == core.blocks.num_blocks - 1  # every page back (page 0 is padding)


def test_arrival_ends_the_run_ahead_and_is_served():
    params = SamplingParams(max_new_tokens=24, temperature=0.9, seed=2)
    core = engine(True)
    a, b = (core.add_request(p, params)[0] for p in PROMPTS[:2])
    while core.windows_ahead < 1:
        core.step()
    ahead = core.windows_ahead
    c = core.add_request(PROMPTS[2], params)[0]
    core.step()  # hands out the window in flight without launching another: c waits for its prefill
    assert core.windows_ahead == ahead and core._inflight is None
    drain(core)
    for req, prompt in ((a, PROMPTS[0]), (b, PROMPTS[1]), (c, PROMPTS[2])):
        solo = engine(False)
        (r,) = solo.add_request(prompt, params)
        drain(solo)
        assert req.output_ids == r.output_ids


def test_weight_update_waits_for_the_window_in_flight():
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    core = engine(True)
    (r,) = core.add_request(PROMPTS[0], params)
    while core._inflight is None:
        core.step()
    before = len(r.output_ids)
    w = core.model.model.norm.weight
    update = {"model.norm.weight": torch.linspace(-3.0, 3.0, w.numel()).to(w)}  # not a uniform scale: greedy choices change
    core.update_weights(update)
    k = len(r.output_ids)
    assert core._inflight is None and k > before  # the window was handed out first
    drain(core)
    assert len(r.output_ids) == 30
    # the same as a window-by-window engine whose weights change after the same k tokens
    ref_core = engine(False)
    (ref,) = ref_core.add_request(PROMPTS[0], params)
    while len(ref.output_ids) < k:
        ref_core.step()
    assert len(ref.output_ids) == k
    ref_core.update_weights(update)
    drain(ref_core)
    assert r.output_ids == ref.output_ids and r.logprobs == ref.logprobs
    assert r.output_ids != run(False, [params])[1][0].output_ids  # and the update did change what came after
