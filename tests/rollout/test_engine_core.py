"""Scheduling behaviour of the engine core: continuous batching, prefix sharing, chunked prefill,
preemption, abort, weights and memory. A tiny random Llama-style decoder, fp32 on CPU."""

import pytest
import torch

from helpers import tiny

from miles_core.errors import DataError, MilesUserError
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.blocks import BlockManager
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core.request import Request, Status


def engine(model=None, **kw):
    cfg = dict(block_size=4, decode_steps=3)
    cfg.update(kw)
    return EngineCore(model or tiny(), EngineConfig(**cfg))


def drain(core):
    while core.has_unfinished():
        core.step()


P1 = [3, 9, 27, 11, 40, 2, 8, 13, 50, 7]
P2 = [4, 4, 61, 20, 33]
P3 = [70, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15]
SAMPLED = SamplingParams(max_new_tokens=14, temperature=1.0, seed=123)


def alone(prompt, params, **kw):
    core = engine(prefix_caching=False, **kw)
    (r,) = core.add_request(prompt, params)
    drain(core)
    return r


def test_requests_arriving_mid_flight_match_one_at_a_time():
    core = engine()
    a = core.add_request(P1, SAMPLED)[0]
    core.step()  # prefill of a
    core.step()  # a decodes
    b = core.add_request(P2, SamplingParams(max_new_tokens=9, temperature=0.8, seed=7))[0]
    core.step()
    c = core.add_request(P3, SamplingParams(max_new_tokens=11, temperature=0))[0]
    drain(core)
    for req, prompt in ((a, P1), (b, P2), (c, P3)):
        ref = alone(prompt, req.params)
        assert req.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(req.logprobs), torch.tensor(ref.logprobs), atol=1e-5)


def test_group_shares_prompt_pages_and_matches_unshared():
    prompt = list(range(1, 23))  # 22 tokens: 5 full pages of 4
    core = engine()
    group = core.add_request(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=5), n=4)
    core.step()
    # the followers are forked from the leader when it draws its first token: none recomputes any of
    # the prompt; its 5 full pages are shared, its partial 6th page copied
    assert all(len(r.output_ids) == 1 for r in group)
    assert all(r.block_ids[:5] == group[0].block_ids[:5] and r.block_ids[5] != group[0].block_ids[5] for r in group[1:])
    drain(core)
    assert [r.num_cached for r in group] == [0, 22, 22, 22]
    outs = [r.output_ids for r in group]
    assert len({tuple(o) for o in outs}) > 1  # the samples differ (seeds 5, 6, 7, 8)
    for i, r in enumerate(group):
        ref = alone(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=5 + i))
        assert r.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(ref.logprobs), atol=1e-5)


def test_fork_waits_for_pages_and_survives_a_leader_that_ends_at_once():
    prompt = list(range(1, 18))  # 17 tokens: 4 full pages of 4 and one partial
    core = engine(num_blocks=7, max_model_len=20)
    assert core.blocks.num_free == 6
    group = core.add_request(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=3), n=3)
    core.step()  # the leader's prefill takes 5 pages; one follower forks onto the last free one, the other waits
    assert [r.status for r in group] == [Status.RUNNING, Status.RUNNING, Status.WAITING] and core.blocks.num_free == 0
    drain(core)
    assert [r.num_cached for r in group] == [0, 17, 16]  # the late one: the 4 full pages, through the prefix cache
    for i, r in enumerate(group):
        ref = alone(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=3 + i))
        assert r.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(ref.logprobs), atol=1e-5)
    # one new token each: the leader finishes on its first token, after its followers were forked from its pages
    core = engine()
    free0 = core.blocks.num_free
    group = core.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, seed=9), n=3)
    core.step()
    assert all(r.finished and len(r.output_ids) == 1 for r in group) and not core.has_unfinished()
    assert [r.output_ids for r in group] == [alone(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, seed=9 + i)).output_ids for i in range(3)]
    assert core.blocks.num_free == free0


def test_shared_pages_are_refcounted_and_freed():
    core = engine(num_blocks=40)
    free0 = core.blocks.num_free
    group = core.add_request(list(range(1, 18)), SamplingParams(max_new_tokens=10, temperature=0), n=3)
    core.step()  # the leader's prefill: 17 tokens -> 5 pages; the followers forked: its 4 full pages + one page each
    assert core.blocks.num_free == free0 - 5 - 2
    shared = group[0].block_ids[:4]
    assert all(r.block_ids[:4] == shared for r in group)
    assert all(core.blocks.ref[b] == 3 for b in shared)
    drain(core)
    assert core.blocks.num_free == free0  # everything back (cached pages stay evictable)
    assert core.flush_cache() and not core.blocks.cached


def _computed(blocks, ids, name=None):
    """A request given pages for ``ids`` by ``blocks`` (a BlockManager), all of them computed and committed."""
    r = Request(name or str(ids), list(ids), SamplingParams(), 0, frozenset())
    assert blocks.admit(r, r.num_tokens)
    r.num_computed = r.num_tokens
    blocks.commit(r)
    return r


def _cached_pages(blocks):
    return sorted(key[1] for key in blocks.cached)


def test_eviction_takes_the_least_recently_freed_page_and_a_prefix_tail_first():
    blocks = BlockManager(num_blocks=5, block_size=2)  # pages 1..4
    a = _computed(blocks, [1, 2, 3, 4, 5])  # pages [1 2] [3 4] cached, [5] partial
    blocks.free_request(a)
    b = _computed(blocks, [7, 8, 9])
    blocks.free_request(b)
    assert _cached_pages(blocks) == [(1, 2), (3, 4), (7, 8)] and blocks.num_free == 4
    c = Request("c", [20, 21, 22], SamplingParams(), 0, frozenset())
    assert blocks.admit(c, 3)  # 2 pages: the one free page and one evicted
    # a's pages were freed before b's, and a's tail before its head: [3 4] goes, a's first page stays usable
    assert _cached_pages(blocks) == [(1, 2), (7, 8)]
    blocks.free_request(c)
    again = Request("a2", [1, 2, 3, 4, 5], SamplingParams(), 0, frozenset())
    assert blocks.admit(again, 5) and again.num_cached == 2


def test_admission_does_not_count_the_prefix_pages_it_reuses_as_free():
    blocks = BlockManager(num_blocks=4, block_size=2)  # pages 1..3
    a = _computed(blocks, [1, 2, 3, 4, 5])
    blocks.free_request(a)  # [1 2] [3 4] evictable, the partial page free: 3 pages free
    assert blocks.num_free == 3
    b = Request("b", [1, 2, 3, 4, 9, 9, 9], SamplingParams(), 0, frozenset())
    # reuses the 2 cached pages and needs 2 more, but only 1 page is free besides them
    assert not blocks.admit(b, 7)
    assert b.block_ids == [] and blocks.num_free == 3 and _cached_pages(blocks) == [(1, 2), (3, 4)]
    c = Request("c", [1, 2, 3, 4, 9], SamplingParams(), 0, frozenset())
    assert blocks.admit(c, 5) and c.num_cached == 4
    assert len(set(c.block_ids)) == 3 and blocks.num_free == 0


def test_pages_needed_for_a_number_of_tokens():
    blocks = BlockManager(num_blocks=9, block_size=4)
    r = Request("r", [1, 2, 3], SamplingParams(), 0, frozenset())
    assert [blocks.blocks_needed(r, n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert blocks.grow(r, 8) and len(r.block_ids) == 2 and blocks.num_free == 6
    assert blocks.blocks_needed(r, 8) == 0 and blocks.grow(r, 9) and len(r.block_ids) == 3


def test_the_same_prefix_computed_twice_is_cached_once_and_every_page_comes_back():
    blocks = BlockManager(num_blocks=5, block_size=2)
    a = Request("a", [1, 2, 3], SamplingParams(), 0, frozenset())
    b = Request("b", [1, 2, 3], SamplingParams(), 0, frozenset())
    assert blocks.admit(a, 3) and blocks.admit(b, 3)  # both before either is computed: no sharing
    for r in (a, b):
        r.num_computed = 3
        blocks.commit(r)
    assert blocks.cached == {(0, (1, 2)): a.block_ids[0]} and blocks.key_of[b.block_ids[0]] is None
    blocks.free_request(a)
    blocks.free_request(b)
    assert blocks.num_free == 4
    big = Request("big", list(range(10, 18)), SamplingParams(), 0, frozenset())
    assert blocks.admit(big, 8) and sorted(big.block_ids) == [1, 2, 3, 4] and not blocks.cached


def test_flush_forgets_every_prefix_and_pages_come_back_free():
    blocks = BlockManager(num_blocks=5, block_size=2)
    done = _computed(blocks, [1, 2, 3])
    blocks.free_request(done)
    held = _computed(blocks, [5, 6, 7])  # in use during the flush
    blocks.flush()
    assert not blocks.cached and blocks.num_free == 2
    blocks.free_request(held)
    assert blocks.num_free == 4 and not blocks.evictable
    big = Request("big", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), 0, frozenset())
    assert blocks.admit(big, 8) and big.num_cached == 0 and sorted(big.block_ids) == [1, 2, 3, 4]


def test_chunked_prefill_and_preemption_give_the_same_tokens():
    params = SamplingParams(max_new_tokens=20, temperature=0.7, seed=3)
    refs = [alone(p, params).output_ids for p in (P1, P2, P3)]
    core = engine(max_batched_tokens=3, num_blocks=12, max_model_len=40)  # tiny: forces chunks and preemption
    reqs = [core.add_request(p, params)[0] for p in (P1, P2, P3)]
    preempted = 0
    while core.has_unfinished():
        before = {r.request_id for r in core.scheduler.waiting}
        core.step()
        preempted += len({r.request_id for r in core.scheduler.waiting} - before)
    assert preempted > 0
    assert [r.output_ids for r in reqs] == refs


def test_preemption_takes_the_most_recently_admitted_request():
    params = SamplingParams(max_new_tokens=20, temperature=0.7, seed=3)
    core = engine(max_batched_tokens=3, num_blocks=12, max_model_len=40)
    sched, preempt, victims = core.scheduler, core.scheduler.preempt, []

    def spy(req):
        victims.append((req, list(sched.running)))  # the running list is in admission order
        preempt(req)

    sched.preempt = spy
    for p in (P1, P2, P3):
        core.add_request(p, params)
    drain(core)
    assert any(len(running) > 1 for _, running in victims)
    assert all(victim is running[-1] for victim, running in victims)


def test_a_prefill_step_is_followed_by_a_decode_step_while_a_long_prompt_is_chunked():
    core = engine(max_batched_tokens=4)
    kinds = []
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        kinds.append(type(plan).__name__)
        return plan

    core.scheduler.schedule = spy
    (a,) = core.add_request(P2, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    while not a.output_ids:
        core.step()
    (b,) = core.add_request(P3, SamplingParams(max_new_tokens=3, temperature=0))  # 13 tokens: chunks of 4, 4, 4, 1
    kinds.clear()
    for _ in range(8):  # a's prefill was the last step: a decodes, then b's chunks alternate with a's windows
        core.step()
    assert kinds == ["DecodePlan", "PrefillPlan"] * 4
    assert len(b.output_ids) == 1 and len(a.output_ids) == 1 + 4 * 3


def test_a_request_that_does_not_fit_holds_back_the_ones_behind_it():
    core = engine(num_blocks=7, max_model_len=20)  # 6 pages of 4 tokens
    assert core.blocks.num_free == 6
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    (a,) = core.add_request(list(range(1, 17)), greedy)  # 4 pages
    (b,) = core.add_request(list(range(30, 42)), greedy)  # 3 pages: waits for a
    (c,) = core.add_request([60, 61, 62], greedy)  # 1 page would fit, but c came after b
    core.step()
    assert [r.status for r in (a, b, c)] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    drain(core)
    for r in (a, b, c):
        assert r.finished and r.output_ids == alone(r.prompt_ids, greedy).output_ids


def test_abort_running_request():
    core = engine()
    (r,) = core.add_request(P1, SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
    core.step()
    core.step()
    assert 0 < len(r.output_ids) < 50
    assert core.abort(r.request_id)
    outs = core.step()
    assert outs[0].finished and r.finish_reason == "abort"
    assert not core.has_unfinished() and core.blocks.num_free == core.blocks.num_blocks - 1


def test_abort_waiting_request_and_fork_without_a_free_row():
    core = engine(max_num_seqs=1)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    (a,) = core.add_request(P1, greedy)
    (b,) = core.add_request(P2, greedy)
    core.step()
    assert b.status is Status.WAITING and core.abort(b.request_id)
    drain(core)
    assert a.output_ids == alone(P1, greedy).output_ids
    assert b.output_ids == [] and b.finish_reason == "abort" and not core.scheduler.waiting
    # a group larger than the rows: the leader and one follower run, the last waits for a row
    core = engine(max_num_seqs=2)
    sampled = SamplingParams(max_new_tokens=4, temperature=1.0, seed=2)
    group = core.add_request(P3, sampled, n=3)
    core.step()
    assert [r.status for r in group] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    drain(core)
    for i, r in enumerate(group):
        assert r.output_ids == alone(P3, SamplingParams(max_new_tokens=4, temperature=1.0, seed=2 + i)).output_ids


def test_stop_token_and_stop_string_and_length():
    ref = alone(P1, SamplingParams(max_new_tokens=12, temperature=0)).output_ids
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    r = alone(P1, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop_tok]))
    assert r.output_ids == ref[: first + 1] and r.finish_reason == "stop" and r.matched_stop == stop_tok
    core = EngineCore(tiny(), EngineConfig(block_size=4, decode_steps=4), detokenize=lambda ids: "".join(chr(97 + t % 26) for t in ids))
    text = "".join(chr(97 + t % 26) for t in ref)
    target = text[5:7]
    (s,) = core.add_request(P1, SamplingParams(max_new_tokens=12, temperature=0, stop=[target]))
    drain(core)
    assert s.finish_reason == "stop" and s.matched_stop == target
    assert s.output_ids == ref[: text.index(target) + 2]
    eos = EngineCore(tiny(), EngineConfig(block_size=4), eos_token_ids=[ref[2]])
    (e,) = eos.add_request(P1, SamplingParams(max_new_tokens=12, temperature=0))
    (ig,) = eos.add_request(P1, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    drain(eos)
    assert e.output_ids == ref[: ref.index(ref[2]) + 1] and ig.output_ids == ref and ig.finish_reason == "length"


def test_update_weights_in_place_from_tensors_and_disk(tmp_path):
    """Weights copied in place; on CPU (head_dim 16: the C kernels run) the GEMM weights' panel copies, built by the
    first generation, are remade from the new weights."""
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.plugins.manager import MilesPlugins

    core = engine(model=tiny(0, head_dim=16))
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    (first,) = core.add_request(P1, greedy)
    drain(core)
    before = first.output_ids
    if core._cpu._native:
        *_, nplan = core._cpu._window_statics()
        assert all(layer.panels is not None for layer in nplan)
    ptr = core.model.lm_head.weight.data_ptr()
    core.update_weights(tiny(1, head_dim=16).state_dict(), version=7)
    assert core.model.lm_head.weight.data_ptr() == ptr  # in place (CUDA graphs stay valid)
    (r,) = core.add_request(P1, greedy)
    drain(core)
    e_core = engine(model=tiny(1, head_dim=16))
    (e,) = e_core.add_request(P1, greedy)
    drain(e_core)
    assert r.output_ids == e.output_ids != before and r.weight_version == 7
    save_hf_folder(tiny(0, head_dim=16), MilesPlugins().registries.model_families.get("llama"), tmp_path / "ckpt")
    core.update_weights_from_disk(tmp_path / "ckpt", version=8)
    (back,) = core.add_request(P1, greedy)
    drain(core)
    assert back.output_ids == before and back.weight_version == 8
    with pytest.raises(MilesUserError, match="unknown parameter"):
        core.update_weights({"nope": torch.zeros(1)})
    other = tiny(1, head_dim=16).state_dict()
    with pytest.raises(MilesUserError, match="model.norm.weight' has shape"):  # the first tensor fits, the second not
        core.update_weights({"lm_head.weight": other["lm_head.weight"], "model.norm.weight": torch.zeros(3)})
    (still,) = core.add_request(P1, greedy)  # a refused update leaves every weight as it was
    drain(core)
    assert still.output_ids == before and still.weight_version == 8


def test_release_and_resume_memory_keep_outputs():
    core = engine()
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    (a,) = core.add_request(P2, greedy)
    drain(core)
    core.release_memory()
    assert core.runner.kv is None
    with pytest.raises(MilesUserError, match="released"):
        core.add_request(P2, greedy)
    core.resume_memory()
    (b,) = core.add_request(P2, greedy)
    drain(core)
    assert a.output_ids == b.output_ids


def test_rejects_bad_requests():
    core = engine(max_model_len=32)
    with pytest.raises(DataError, match="empty"):
        core.add_request([], SamplingParams())
    with pytest.raises(DataError, match="max_model_len"):
        core.add_request(list(range(40)), SamplingParams())
    with pytest.raises(DataError, match="input_ids"):
        core.add_request([1, 999], SamplingParams())
    # top logprobs past the vocabulary would make the step's top-k fail, and every request in that step with it
    with pytest.raises(DataError, match=r"top_logprobs must be in \[0, 80\], got 81"):
        core.add_request([1, 2], SamplingParams(top_logprobs=81))
    (r,) = core.add_request([1, 2], SamplingParams(max_new_tokens=2, temperature=0, top_logprobs=80))
    drain(core)
    assert [len(row) for row in r.top_logprobs] == [80, 80]
    # so would a seed past 64 bits (the n samples take seed, seed + 1, ...)
    with pytest.raises(DataError, match="seed must be a 64-bit integer"):
        core.add_request([1, 2], SamplingParams(seed=1 << 70))
    with pytest.raises(DataError, match=r"with n=2: at most 2\*\*63 - 2"):
        core.add_request([1, 2], SamplingParams(seed=(1 << 63) - 1), n=2)
    assert not core.requests
    group = core.add_request([1, 2], SamplingParams(max_new_tokens=2, seed=(1 << 63) - 2), n=2) + core.add_request([3], SamplingParams(max_new_tokens=2, seed=-(1 << 63)))
    drain(core)
    assert all(len(r.output_ids) == 2 for r in group)


def test_min_p_past_one_is_refused_and_one_keeps_the_top_token():
    """min_p > 1 cut every token (the cut sits above the top probability): the draw then took token 0 whatever its
    probability, silently. It is refused when the request is added; min_p 1 keeps the top token only (greedy)."""
    core = engine()
    with pytest.raises(DataError, match=r"min_p must be in \[0, 1\], got 1.5"):
        core.add_request(P1, SamplingParams(min_p=1.5))
    with pytest.raises(DataError, match=r"min_p must be in \[0, 1\], got -0.1"):
        core.add_request(P1, SamplingParams(min_p=-0.1))
    assert not core.requests
    (top,) = core.add_request(P1, SamplingParams(max_new_tokens=8, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True))
    drain(core)
    assert top.output_ids == alone(P1, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)).output_ids


def test_an_empty_stop_string_or_a_bare_string_is_refused():
    """'' is in every text: an empty stop string ended every response at its first token (finish_reason 'stop',
    matched ''), and trim_stop cut its text to ''. It is refused when the request is added, naming its position."""
    core = EngineCore(tiny(), EngineConfig(block_size=4), detokenize=lambda ids: "".join(chr(97 + t % 26) for t in ids))
    with pytest.raises(DataError, match=r"stop strings must be non-empty \(stop\[1\] is ''\)"):
        core.add_request(P1, SamplingParams(stop=["q", ""]))
    # a string, not a list, was taken character by character: stop='</answer>' ended a response at its first 'a'
    with pytest.raises(DataError, match=r"stop must be a list of strings, got the string '</answer>'"):
        core.add_request(P1, SamplingParams(stop="</answer>"))
    assert not core.requests
    (r,) = core.add_request(P1, SamplingParams(max_new_tokens=6, temperature=0, stop=["#"], ignore_eos=True))
    drain(core)
    assert len(r.output_ids) == 6 and r.finish_reason == "length"


def test_a_response_ends_at_max_model_len():
    core = engine(max_model_len=24)
    long = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
    group = core.add_request(P1, long) + core.add_request(P3, long)
    drain(core)
    assert [len(r.prompt_ids) + len(r.output_ids) for r in group] == [24, 24]
    assert all(r.finish_reason == "length" for r in group)
    ref = engine(max_model_len=512)  # the same tokens as without the cap, up to it
    (free,) = ref.add_request(P1, long)
    drain(ref)
    assert free.output_ids[:14] == group[0].output_ids


def test_a_model_s_shorter_context_bounds_the_scheduler_s_windows_and_pages():
    """The model's max_position_embeddings caps max_model_len for the scheduler too: sizing windows and pages by the
    larger setting, a request near its end asked for pages past it, and in the smallest pool preempted itself forever."""
    model = tiny()
    model.config.max_position_embeddings = 32
    core = engine(model=model, decode_steps=24, max_model_len=256, num_blocks=2)
    assert core.max_model_len == 32 and core.blocks.num_blocks == 10  # the pool holds the longest sequence, 32 tokens
    (r,) = core.add_request(list(range(1, 21)), SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))
    for _ in range(20):
        if not core.has_unfinished():
            break
        core.step()
    assert r.finish_reason == "length" and r.num_tokens == 32


def test_a_failing_step_ends_every_request_and_the_engine_goes_on():
    from miles_core.rollout.engine_core.threaded import ThreadedEngine

    core = engine()
    threaded = ThreadedEngine(core)
    try:
        greedy = SamplingParams(max_new_tokens=6, temperature=0)
        threaded.pause()
        handles = [threaded.submit(p, greedy, None) for p in (P1, P2)]
        step = core.step
        # a device failure cannot happen on CPU: the next step is made to raise instead
        core.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        threaded.resume()
        for reqs, sink in handles:
            out = sink.get(timeout=30)
            assert out.finished and out.request.finish_reason == "abort"
            assert out.request.matched_stop == "engine error: device lost"
        assert not core.requests
        core.step = step
        (r,), sink = threaded.submit(P2, greedy, None)
        while not sink.get(timeout=30).finished:
            pass
        assert r.output_ids == alone(P2, greedy).output_ids
    finally:
        threaded.shutdown()


def test_fused_projections_are_views_and_match_separate_gemms():
    core = engine(model=tiny(0))
    run, layer = core.runner, core.model.model.layers[0]
    assert len(run.qkv) == 2 and run.qkv[0].shape == (4 * 8 + 2 * 2 * 8, 32)
    # the parameters are row slices of the fused tensors: an in-place update lands in both
    assert layer.self_attn.k_proj.weight.data_ptr() == run.qkv[0][32:].data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() == run.gate_up[0][64:].data_ptr()
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    (fused,) = core.add_request(P3, sampled)
    drain(core)
    ref = EngineCore(tiny(0), EngineConfig(block_size=4, decode_steps=3, exact_attention=True))  # no fusion
    assert ref.runner.qkv == []
    (sep,) = ref.add_request(P3, sampled)
    drain(ref)
    assert fused.output_ids == sep.output_ids
    assert max(abs(a - b) for a, b in zip(fused.logprobs, sep.logprobs)) < 1e-5
    core.release_memory(("weights",))
    assert run.qkv == []
    core.resume_memory(("weights",))
    assert layer.self_attn.q_proj.weight.data_ptr() == run.qkv[0].data_ptr()


def test_decode_window_is_no_longer_than_the_rows_need():
    core = engine(decode_steps=8)
    plans = []
    decode = core.scheduler._decode
    core.scheduler._decode = lambda reqs: plans.append(decode(reqs)) or plans[-1]
    a = core.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0))[0]
    b = core.add_request([4, 5], SamplingParams(max_new_tokens=12, temperature=0))[0]
    drain(core)
    # after the prefill's token: a needs 3 more, b 11: one window of 8 (a ends inside it), then b's last 3
    assert [p.steps for p in plans] == [8, 3]
    assert len(a.output_ids) == 4 and len(b.output_ids) == 12


def test_a_decode_window_takes_no_pages_past_a_request_s_final_length():
    core = engine(decode_steps=8)
    held = []
    decode = core.scheduler._decode

    def spy(reqs):
        plan = decode(reqs)
        held.append([len(r.block_ids) for r in (a, b)])
        return plan

    core.scheduler._decode = spy
    a = core.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0))[0]
    b = core.add_request([4, 5], SamplingParams(max_new_tokens=12, temperature=0))[0]
    drain(core)
    # the first window runs 8 steps for b; a ends at 7 tokens and only ever needs the K/V of 6: 2 pages, not 3
    assert held[0] == [2, 3]


def test_stop_strings_are_checked_on_the_output_s_tail_only():
    """A stop string is found however far into the output it comes, and each check decodes a bounded tail of the
    output (4 tokens per stop character + 8), not all of it: a long response's checks stay linear in its length."""
    ref = alone(P1, SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True)).output_ids
    text = "".join(chr(97 + t % 26) for t in ref)
    decoded: list[int] = []

    def detok(ids):
        decoded.append(len(ids))
        return "".join(chr(97 + t % 26) for t in ids)

    target = text[100:103]
    first = text.index(target)
    core = EngineCore(tiny(), EngineConfig(block_size=4, decode_steps=4), detokenize=detok)
    (s,) = core.add_request(P1, SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True, stop=[target, "#"]))
    (never,) = core.add_request(P1, SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True, stop=["a#b"]))
    drain(core)
    assert s.finish_reason == "stop" and s.matched_stop == target and s.output_ids == ref[: first + 3]
    assert never.finish_reason == "length" and never.output_ids == ref
    assert max(decoded) == 4 * 3 + 8 and len(decoded) == first + 3 + 120


def test_split_decode_rows_is_checked_and_only_splits_on_the_graph_path():
    """``engine.split_decode_rows``: negative refused at validation; on CPU (no CUDA graphs) no step splits."""
    from miles_core.errors import ConfigError

    with pytest.raises(ConfigError, match="split_decode_rows"):
        EngineConfig(split_decode_rows=-1).validate()
    core = engine(split_decode_rows=2)
    assert not core.runner.split_at(64)


def test_decode_rows_in_two_halves_give_the_one_batch_tokens():
    """The split decode's slicing (runner._decode_rows over rows [0, h) and [h, B) of the static buffers: tokens,
    positions, block tables, context lengths) on CPU's torch path, the halves run one after the other (the two
    CUDA streams of runner._decode_halves need a GPU: tests/rollout/test_gpu_engine.py): the same greedy tokens
    as one batch, logprobs within 1e-5."""
    def generate(split):
        core = engine(cpu_decode_window=False, cpu_kernels="torch")
        run = core.runner
        run.begin_window = lambda *a: None  # the eager window gathers every row's K/V; the halves read the pages
        if split:
            def halves(bs, max_ctx):
                h = -(-bs // 2)
                calls.append(bs)
                return run.model.lm_head(torch.cat([run._decode_rows(0, h, max_ctx)[0], run._decode_rows(h, bs, max_ctx)[0]]))
            run.split_at = lambda bs: bs >= 2
            run._decode_halves = halves
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (5, 12, 7, 20, 3)]
        reqs = [core.add_request(p, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0] for p in prompts]
        drain(core)
        return reqs

    calls = []
    one, two = generate(False), generate(True)
    assert calls and 5 in calls  # the five rows went through the halves
    for a, b in zip(one, two):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_a_stop_string_that_is_a_special_token_stops_on_it():
    """The engine's text leaves special tokens out (skip_special_tokens), so stop=["<|im_end|>"] never matched: the
    response ran on to max_new_tokens past the turn's end. A stop string that spells a special token now stops on its
    id. The model's rows of one token it emits greedily and of <|im_end|> are swapped, so that it emits <|im_end|>."""
    from miles_core.data.tokenizer import HFTokenizer
    from miles_core.testing.tokenizers import byte_level_bpe

    tok = HFTokenizer.wrap(byte_level_bpe("the quick brown fox jumps over the lazy dog", ("<|endoftext|>", "<|im_end|>"),
                                          "<|endoftext|>", repeat=10))
    end = tok.special_token_id("<|im_end|>")
    assert end is not None and tok.special_token_id("fox") is None and tok.decode([end]) == ""
    model = tiny(vocab=tok.vocab_size)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop=["<|im_end|>"])
    prompt = [p for p in P1 if p != end]
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3), detokenize=tok.decode)
    (ref,) = core.add_request(prompt, greedy)
    drain(core)
    t = ref.output_ids[2]
    assert t not in prompt and t not in ref.output_ids[:2] and end not in prompt + ref.output_ids[:3]
    with torch.no_grad():  # tied embeddings: a relabelling of the two tokens
        w = model.lm_head.weight
        w[[t, end]] = w[[end, t]]
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3), detokenize=tok.decode, special_token_id=tok.special_token_id)
    (req,) = core.add_request(prompt, greedy)
    drain(core)
    assert req.output_ids == ref.output_ids[:2] + [end] and req.finish_reason == "stop"
