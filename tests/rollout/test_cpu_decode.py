"""The CPU decode window (engine.cpu_decode_window, the CPU default) against the generic eager path
(runner.decode over the paged cache): the same tokens, logprobs within 1e-5, the same MoE routing;
its kept K/V buffer reused across windows, sized once or grown under the memory budget; the K/V it writes back to the pages right."""

import pytest
import torch
from helpers import load_miles, make_hf_model, tiny

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore


def run(model, window: bool, script, **cfg):
    """``script``: a list of (prompt, params) added at once, then stepped to the end; returns the requests."""
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_decode_window=window, **cfg))
    reqs = [core.add_request(p, params)[0] for p, params in script[:2]]
    core.step()  # the first two prefill, then decode; the rest join mid-flight (the window's batch changes)
    core.step()
    reqs += [core.add_request(p, params)[0] for p, params in script[2:]]
    while core.has_unfinished():
        core.step()
    return reqs, core


def model_for(kernels: str, seed: int):
    """``kernels`` "torch": the torch ops of the window (head_dim 8); "native": its fused C kernels (head_dim 16),
    skipped where they cannot be built (no C compiler)."""
    if kernels == "native":
        from miles_core.rollout.engine_core.cpu_native import NativeBuildError, build

        try:
            build()
        except NativeBuildError as e:
            pytest.skip(f"cpu_native.c not built: {e}")
        return tiny(seed, head_dim=16)
    return tiny(seed)


def cap_of(kernels: str, columns: int) -> int:
    """The buffer's capacity for ``columns``: the fused kernels' keys come in blocks of 16 columns."""
    return -(-columns // 16) * 16 if kernels == "native" else columns


def assert_same(got, ref):
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert g.finish_reason == r.finish_reason
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


P = [[3, 9, 27, 11, 40, 2, 8, 13, 50, 7], [4, 4, 61, 20, 33], [70, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15], [5, 6]]


def test_window_matches_generic_path_greedy_sampled_stops_and_joins():
    model = tiny()
    greedy = SamplingParams(max_new_tokens=17, temperature=0)
    ref0, _ = run(model, False, [(P[0], greedy)])
    stop_tok = ref0[0].output_ids[6]  # ends P[0]'s twin mid-window: the batch shrinks
    script = [
        (P[0], greedy),
        (P[1], SamplingParams(max_new_tokens=23, temperature=0.9, seed=11)),
        (P[2], SamplingParams(max_new_tokens=9, temperature=1.0, top_k=5, top_p=0.8, seed=3)),
        (P[0], SamplingParams(max_new_tokens=17, temperature=0, stop_token_ids=[stop_tok])),
        (P[3], SamplingParams(max_new_tokens=30, temperature=0.7, seed=2, top_logprobs=3)),
    ]
    got, _ = run(model, True, script)
    ref, _ = run(model, False, script)
    assert_same(got, ref)
    assert got[3].finish_reason == "stop" and len(got[3].output_ids) == ref0[0].output_ids.index(stop_tok) + 1
    assert len({t for r in got for t in r.output_ids}) > 5  # not a degenerate one-token model
    for g, r in zip(got[4].top_logprobs, ref[4].top_logprobs):
        assert [i for i, _ in g] == [i for i, _ in r]
        assert torch.allclose(torch.tensor([v for _, v in g]), torch.tensor([v for _, v in r]), atol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_buffer_is_kept_across_windows_and_sized_once(kernels):
    model = model_for(kernels, 1)
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_kernels=kernels))
    gathers, caps = [], []
    gather, reset = core._cpu._gather, core._cpu.reset
    core._cpu._gather = lambda *a: (gathers.append(a[2:4]), gather(*a))[1]  # spies: the gathers from pages,
    core._cpu.reset = lambda: (caps.append(core._cpu.mask.shape[-1]), reset())[1]  # the capacity when freed
    params = SamplingParams(max_new_tokens=60, temperature=0.8, seed=4)
    group = core.add_request(P[1], params, n=2)
    while core.has_unfinished():
        core.step()
    # ~20 windows, one batch: the second sample is forked from the first when it draws its first
    # token, so both decode together from the first window: 1 gather, not 20, sized for what the
    # rows can still decode (max position, tokens left) and never regrown
    n = len(P[1])
    assert gathers == [(n, 60)]
    # freed at the end, no larger than the generation plus a page of rounding and a window of overrun
    assert core._cpu.k is None and n + 60 <= caps[0] <= cap_of(kernels, n + 60 + 4 + 3)
    assert (core._cpu._native is not None) == (kernels == "native")  # the path under test ran
    ref, _ = run(model, False, [(P[1], SamplingParams(max_new_tokens=60, temperature=0.8, seed=4 + i)) for i in range(2)])
    assert_same(group, ref)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_rows_that_finish_leave_the_buffer_without_a_gather(kernels):
    """Requests ending at different times (length, a stop token): the rows left are selected from the
    kept buffer, not gathered from the pages again; tokens and logprobs as the generic path's."""
    model = model_for(kernels, 1)
    script = [(P[0], SamplingParams(max_new_tokens=5, temperature=0.8, seed=1)),
              (P[1], SamplingParams(max_new_tokens=20, temperature=0.8, seed=2)),
              (P[2], SamplingParams(max_new_tokens=11, temperature=0, ignore_eos=True)),
              (P[3], SamplingParams(max_new_tokens=14, temperature=0.9, seed=3))]
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_kernels=kernels))
    gathers, keeps = [], []
    gather, keep = core._cpu._gather, core._cpu._keep_rows
    core._cpu._gather = lambda *a: (gathers.append(a[0].shape[0]), gather(*a))[1]
    core._cpu._keep_rows = lambda reqs, pos: (lambda ok: (keeps.append(len(reqs)) if ok else None, ok)[1])(keep(reqs, pos))
    got = [core.add_request(p, params)[0] for p, params in script]
    while core.has_unfinished():
        core.step()
    # one gather; the batch then shrank three times: the torch layout selects the rows left, the kernels' layout
    # (rows addressed by index) just leaves the finished rows where they are
    assert gathers == [4] and keeps == ([3, 2, 1] if kernels == "torch" else [])
    ref = []
    for p, params in script:
        ref += run(model, False, [(p, params)])[0]
    assert_same(got, ref)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_buffer_grows_when_the_memory_budget_cuts_it(kernels):
    """A long prompt beside a short one, both decoding ~60 tokens: the buffer's first size is cut
    to the paged cache's slots per row, then it doubles; tokens and logprobs as the generic path's."""
    model = model_for(kernels, 1)
    script = [(list(range(1, 41)), SamplingParams(max_new_tokens=55, temperature=0.8, seed=1)),
              (P[1], SamplingParams(max_new_tokens=60, temperature=0.8, seed=2))]
    cfg = dict(num_blocks=40, max_model_len=128)  # ~170 slots: ~85 per row, of which the context takes 40
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_kernels=kernels, **cfg))
    caps = []
    ensure = core._cpu._ensure_room
    core._cpu._ensure_room = lambda k: (ensure(k), caps.append(core._cpu.mask.shape[-1]))[0]
    got = [core.add_request(p, params)[0] for p, params in script]
    while core.has_unfinished():
        core.step()
    first = cap_of(kernels, 40 + (core.runner.kv.shape[2] // 2 - 40) + 3)  # t0 + the budget's columns (< 60) + a window
    assert caps[0] == first and max(caps) > first  # cut, then grown
    ref, _ = run(model, False, script, **cfg)
    assert_same(got, ref)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_decoded_kv_written_back_to_pages(kernels):
    """A prompt that extends a finished request's prompt + output reuses the pages its decode windows
    wrote (prefix cache); its tokens must equal a run that computes everything afresh."""
    model = model_for(kernels, 2)
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_kernels=kernels))
    (a,) = core.add_request(P[0], SamplingParams(max_new_tokens=14, temperature=0))
    while core.has_unfinished():
        core.step()
    longer = P[0] + a.output_ids[:12]
    (b,) = core.add_request(longer, SamplingParams(max_new_tokens=8, temperature=0))
    while core.has_unfinished():
        core.step()
    assert b.num_cached == 20  # 5 full pages, 2 of them written by decode windows
    fresh = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, prefix_caching=False))
    (c,) = fresh.add_request(longer, SamplingParams(max_new_tokens=8, temperature=0))
    while fresh.has_unfinished():
        fresh.step()
    assert b.output_ids == c.output_ids
    assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_window_matches_generic_path_qk_norm_and_moe(family, tmp_path):
    make_hf_model(family, tmp_path)
    model = load_miles(tmp_path)
    script = [(P[0], SamplingParams(max_new_tokens=10, temperature=0)), (P[1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=9)),
              (P[2], SamplingParams(max_new_tokens=7, temperature=0))]
    got, _ = run(model, True, script)
    ref, _ = run(model, False, script)
    assert_same(got, ref)
    if family == "qwen3_moe":
        for g, r in zip(got, ref):
            assert torch.equal(torch.cat(g.routed_experts), torch.cat(r.routed_experts))


def test_stand_in_ops_are_bit_identical_to_the_reference_ops():
    """The window swaps the reference rmsnorm (fp32) and rope for fewer-call forms; they must give the same bits."""
    from miles_core.kernels.rmsnorm import rmsnorm_torch
    from miles_core.kernels.rope import rope_torch
    from miles_core.rollout.engine_core.cpu_decode import _rms_norm_fp32, _rope_rolled

    g = torch.Generator().manual_seed(0)
    for b, hidden in ((1, 128), (7, 32), (64, 1024)):
        x = torch.randn(b, hidden, generator=g) * torch.rand(b, 1, generator=g) * 20
        w = torch.randn(hidden, generator=g)
        assert torch.equal(_rms_norm_fp32(x, w, 1e-6), rmsnorm_torch(x, w, 1e-6))
    for b, heads, d in ((1, 6, 32), (9, 3, 8), (16, 24, 128)):
        x = torch.randn(b, heads, 1, d, generator=g) * 5
        freqs = torch.rand(b, 1, 1, d // 2, generator=g) * 300
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()
        signed = sin * torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])
        assert torch.equal(_rope_rolled(x, cos, signed), rope_torch(x, cos, sin))


def test_window_with_a_non_reference_rope_op_and_in_bf16():
    """A model holding another rope op gets it called as is (no rolled stand-in); bf16 runs the
    softmax in fp32 like the generic path. In bf16 the two paths round differently, so a tiny random
    model's greedy choice can flip at a near-tie: the tokens must agree up to the first difference (with
    logprobs within 0.1), and where they differ both paths' chosen (top) logprobs must be within 0.1 of
    each other, i.e. a tie up to bf16 rounding (on 2026-12-04's CI machine one sequence flipped at token 6
    of 12, with torch 2.13's CPU bf16 GEMMs)."""
    from miles_core.kernels.rope import rope_torch

    model = tiny(3)
    calls = []
    model.use_kernels({"rope": lambda x, c, s: (calls.append(1), rope_torch(x, c, s))[1]})
    script = [(P[0], SamplingParams(max_new_tokens=9, temperature=0)), (P[1], SamplingParams(max_new_tokens=8, temperature=0.8, seed=1))]
    got, _ = run(model, True, script)
    n_window = len(calls)
    ref, _ = run(model, False, script)
    assert n_window > 0 and len(calls) > n_window
    assert_same(got, ref)
    half = tiny(3).to(torch.bfloat16)
    greedy = [(p, SamplingParams(max_new_tokens=12, temperature=0)) for p in (P[0], P[1])]
    got, _ = run(half, True, greedy)
    ref, _ = run(half, False, greedy)
    for g, r in zip(got, ref):
        assert len(g.output_ids) == len(r.output_ids) == 12
        same = next((i for i, (a, b) in enumerate(zip(g.output_ids, r.output_ids)) if a != b), 12)
        assert same >= 3, (g.output_ids, r.output_ids)  # not a different model: the first tokens agree
        assert torch.allclose(torch.tensor(g.logprobs[: same + 1]), torch.tensor(r.logprobs[: same + 1]), atol=0.1, rtol=0)


def serve_two_at_a_time(model, script: list, window: bool, spy: bool = False):
    """``script``'s requests served 2 at a time (max_num_seqs); with ``spy`` (the kernels' layout) also recorded: the
    rows of each new buffer gathered for the batch, the buffer rows each join's context was gathered into, and each
    extension of the filled columns as (filled, wanted)."""
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, max_num_seqs=2, cpu_decode_window=window))
    gathers, placed, fills = [], [], []
    if spy:
        dec, nat = core._cpu, core._cpu._lib()
        gather, into_rows, fill = dec._gather, nat.gather, dec._fill_to
        dec._gather = lambda *a: (gathers.append(a[0].shape[0]), gather(*a))[1]
        nat.gather = lambda kv, tables, page, slot, *a: (placed.append(slot.tolist()), into_rows(kv, tables, page, slot, *a))[1]
        dec._fill_to = lambda top: (fills.append((dec.used, top)), fill(top))[1]
    reqs = [core.add_request(p, params)[0] for p, params in script]
    while core.has_unfinished():
        core.step()
    return reqs, gathers, placed, fills


def test_requests_joining_take_the_rows_of_finished_ones_without_a_gather():
    """Kernels' layout, 2 rows at a time (max_num_seqs): as each request finishes the next waiting one is prefilled
    and takes the finished one's buffer row (its context gathered into that row alone, its mask row reset), with
    no new buffer gathered for the batch; tokens and logprobs as the generic path's."""
    model = model_for("native", 1)
    # the first joiner's prompt (10 tokens) is longer than the 2 of the row it takes, whose mask hid columns 2..15
    script = [(P[3], SamplingParams(max_new_tokens=6, temperature=0.8, seed=1)),
              (P[2], SamplingParams(max_new_tokens=25, temperature=0.8, seed=2)),
              (P[0], SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True)),
              (P[1], SamplingParams(max_new_tokens=12, temperature=0.9, seed=3)),
              ([8, 1, 9], SamplingParams(max_new_tokens=7, temperature=0.7, seed=4))]

    got, gathers, placed, _ = serve_two_at_a_time(model, script, True, spy=True)
    ref, *_ = serve_two_at_a_time(model, script, False)
    assert_same(got, ref)
    assert gathers == [2]  # the first batch's buffer only
    assert placed[0] == [0, 1] and len(placed) == 4 and all(len(s) == 1 for s in placed[1:])  # three joined a free row


def test_a_joining_request_with_a_longer_context_extends_the_buffer_without_a_gather():
    """Kernels' layout, 2 rows at a time: a request whose prompt (25 tokens) is longer than the buffer's filled columns
    joins into a finished row; the filled columns are extended to its context (zeroed and masked for the other row)
    instead of a new buffer being gathered for the batch; tokens and logprobs as the generic path's."""
    model = model_for("native", 1)
    long_prompt = [(7 * i + 3) % 70 + 1 for i in range(25)]
    script = [([5, 6], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)),
              ([8, 1, 9], SamplingParams(max_new_tokens=20, temperature=0.8, seed=2, ignore_eos=True)),
              (long_prompt, SamplingParams(max_new_tokens=10, temperature=0.9, seed=5, ignore_eos=True))]

    got, gathers, _, fills = serve_two_at_a_time(model, script, True, spy=True)
    ref, *_ = serve_two_at_a_time(model, script, False)
    assert_same(got, ref)
    assert [len(r.output_ids) for r in got] == [4, 20, 10]
    assert gathers == [2]  # the first batch's buffer only
    assert any(top > used for used, top in fills), fills  # the long prompt's context went past the filled columns
