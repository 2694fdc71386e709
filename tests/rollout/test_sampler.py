"""The vectorised sampler: its draws follow the filtered softmax, per-row parameters, seeds."""

import math
import os
import subprocess
import sys

import pytest
import torch

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.sampler import SamplingTensors, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draw(params: SamplingParams, n: int = 6000):
    rows = [params] * n
    st = SamplingTensors.build(rows, list(range(n)), "cpu")  # n different seeds, one draw each
    tok, lp, top = sample(LOGITS.expand(n, -1).clone(), st, torch.zeros(n, dtype=torch.long))
    return tok, lp, top


def freq(tok):
    return torch.bincount(tok, minlength=len(LOGITS)).float() / len(tok)


def test_draws_follow_softmax_with_temperature():
    tok, lp, _ = draw(SamplingParams(temperature=0.7))
    p = torch.softmax(LOGITS / 0.7, -1)
    se = torch.sqrt(p * (1 - p) / len(tok))
    assert torch.all((freq(tok) - p).abs() < 4 * se + 1e-3)
    assert torch.allclose(lp, torch.log(p)[tok], atol=1e-6)  # logprob under softmax(z / T), before filters


def test_a_small_positive_temperature_samples_rather_than_decoding_greedily():
    """T = 0.0005: the draw is the argmax all but surely, but its logprob is under softmax(z / T) (about 0), as the
    trainer recomputes it, not under softmax(z) as for T = 0."""
    tok, lp, _ = draw(SamplingParams(temperature=0.0005), n=8)
    assert tok.tolist() == [0] * 8 and lp.abs().max() < 1e-6
    tok, lp, _ = draw(SamplingParams(temperature=0), n=8)
    assert tok.tolist() == [0] * 8 and torch.allclose(lp, torch.log_softmax(LOGITS, -1)[0].expand(8))


def test_top_k_top_p_min_p_restrict_the_support():
    tok, _, _ = draw(SamplingParams(temperature=1.0, top_k=2))
    assert set(tok.tolist()) == {0, 1}
    p = torch.softmax(LOGITS, -1)  # [0.61, 0.22, 0.14, ...]: top_p 0.8 keeps 0, 1 (0.61 < 0.8) and 2 (0.83 >= 0.8)
    tok, _, _ = draw(SamplingParams(temperature=1.0, top_p=0.8))
    assert set(tok.tolist()) == {0, 1, 2}
    kept = p[:3] / p[:3].sum()
    assert torch.all((freq(tok)[:3] - kept).abs() < 0.03)
    tok, _, _ = draw(SamplingParams(temperature=1.0, min_p=0.3))  # p >= 0.3 * 0.61 = 0.18: tokens 0, 1
    assert set(tok.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    """The cut at the boundary: a set whose mass equals top_p exactly is enough (probabilities 1/2, 1/4, 1/8, 1/8 are exact
    in float32, so the boundary is hit exactly)."""
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0]) * math.log(2)
    assert torch.softmax(logits, -1).tolist() == [0.5, 0.25, 0.125, 0.125]
    for top_p, support in ((0.5, {0}), (0.75, {0, 1}), (0.76, {0, 1, 2, 3})):  # 2 and 3 are tied: both or neither
        st = SamplingTensors.build([SamplingParams(temperature=1.0, top_p=top_p)] * 2000, list(range(2000)), "cpu")
        tok, _, _ = sample(logits.expand(2000, -1).clone(), st, torch.zeros(2000, dtype=torch.long))
        assert set(tok.tolist()) == support, top_p


def test_filters_combine_min_p_does_not_widen_top_k_or_top_p():
    """top-k, top-p and min-p together keep the intersection: min-p only ever removes more."""
    tok, _, _ = draw(SamplingParams(temperature=1.0, top_k=1, min_p=0.01))
    assert set(tok.tolist()) == {0}
    tok, _, _ = draw(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05))  # top_p alone: {0}; min_p alone: 0..4
    assert set(tok.tolist()) == {0}
    tok, _, _ = draw(SamplingParams(temperature=1.0, top_k=4, min_p=0.3))  # min_p alone: {0, 1}
    assert set(tok.tolist()) == {0, 1}
    # top-p applies to the top-k survivors renormalised (HF's order): with top_k 2, token 0 has 0.61 / 0.83 = 0.73 >= 0.7
    tok, _, _ = draw(SamplingParams(temperature=1.0, top_k=2, top_p=0.7))
    assert set(tok.tolist()) == {0}


def test_a_row_without_top_p_keeps_its_whole_support_beside_rows_that_filter():
    """top_p = 1 cuts nothing. The fp32 cumulative sum of a large vocabulary's sorted probabilities reaches 1.0 before its
    last tokens, and the top-p test (mass before a token < top_p) dropped them (here ~2,300 of 49,152, ~2e-6 of the mass)
    from a row with no top-p batched with a row that filters, or with a top-k: its draws depended on its batch."""
    from miles_core.rollout.engine_core.sampler import _threshold

    torch.manual_seed(0)
    z = torch.randn(1, 49152) * 3
    for own in (SamplingParams(), SamplingParams(top_k=49152)):
        for other in (SamplingParams(top_p=0.9), SamplingParams(top_k=10), SamplingParams()):
            st = SamplingTensors.build([own, other], [1, 2], "cpu")
            assert _threshold(torch.cat([z, z]), st)[0] <= z.min()
    st = SamplingTensors.build([SamplingParams(top_p=0.9)], [1], "cpu")  # a top-p row is still cut
    assert _threshold(z, st)[0] > z.min()


def test_greedy_rows_and_sampled_rows_in_one_batch_and_seeds():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    st = SamplingTensors.build(params, [1, 2, 2], "cpu")
    logits = torch.randn(3, 50)
    logits[1:] = logits[1]
    tok, lp, top = sample(logits, st, torch.tensor([0, 5, 5]))
    assert tok[0] == logits[0].argmax()
    assert tok[1] == tok[2]  # same seed, same position, same logits: the same draw
    st2 = SamplingTensors.build(params[1:2], [2], "cpu")
    alone, _, _ = sample(logits[1:2], st2, torch.tensor([5]))
    assert alone[0] == tok[1]  # independent of the rest of the batch
    other, _, _ = sample(logits[1:2].expand(64, -1), SamplingTensors.build(params[1:2] * 64, list(range(64)), "cpu"), torch.full((64,), 5))
    assert len(set(other.tolist())) > 5


def test_top_logprobs():
    st = SamplingTensors.build([SamplingParams(temperature=0, top_logprobs=3)], [0], "cpu")
    tok, lp, top = sample(LOGITS[None], st, torch.zeros(1, dtype=torch.long))
    ref = torch.log_softmax(LOGITS, -1)
    assert top.indices[0].tolist() == [0, 1, 2]
    assert torch.allclose(top.values[0], ref[:3]) and math.isclose(lp.item(), ref[0].item(), rel_tol=1e-6)


def test_top_logprobs_in_a_batch_cover_the_row_asking_the_most():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, top_logprobs=3), SamplingParams(temperature=1.0, top_logprobs=1)]
    st = SamplingTensors.build(params, [0, 1, 2], "cpu")
    _, _, top = sample(LOGITS.expand(3, -1).clone(), st, torch.zeros(3, dtype=torch.long))
    assert top.indices.tolist() == [[0, 1, 2]] * 3
    assert torch.allclose(top.values[1], torch.log_softmax(LOGITS, -1)[:3])


def test_triton_paged_decode_matches_torch_in_interpreter():
    code = r"""
import os, torch
from miles_core.rollout.engine_core import triton_decode as td
from miles_core.rollout.engine_core.attention import decode_attention_torch
if not td.available():
    print("SKIP"); raise SystemExit
torch.manual_seed(0)
kc, vc = torch.randn(64 * 4, 2, 16), torch.randn(64 * 4, 2, 16)
bt = torch.randint(1, 64, (3, 8), dtype=torch.int32)
ctx = torch.tensor([5, 29, 0])
q = torch.randn(3, 4, 16)
ref = decode_attention_torch(q, kc, vc, bt, ctx, 4, 32)
for splits in (1, 3):
    out = td.paged_decode(q, kc, vc, bt, ctx, 4, splits, block_n=8)
    assert (out[:2] - ref[:2]).abs().max() < 1e-5, splits
    assert out[2].abs().max() == 0
print("OK")
"""
    _run_interpreted(code)


def test_triton_sampler_matches_torch_in_interpreter():
    """The fused GPU sampling pass (triton_sample) against the torch sampler, under the interpreter:
    greedy, plain temperature, top-k/top-p and min-p rows in one batch, fp32 and bf16 logits, with
    the vocabulary in one chunk per row, in a few, and in one per block (the merge kernel)."""
    code = r"""
import torch
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core import triton_sample as ts
from miles_core.rollout.engine_core.sampler import SamplingTensors, _threshold, sample
if not ts.available():
    print("SKIP"); raise SystemExit
torch.manual_seed(0)
params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.05)] * 4
st = SamplingTensors.build(params, list(range(100, 120)), "cpu")
counters = torch.arange(20) * 7
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(20, 5000) * 3).to(dtype)  # V not a multiple of the kernel's 2048 block
    tok, lp, _ = sample(logits, st, counters)
    temp = torch.where(st.temperature <= 0, torch.ones_like(st.temperature), st.temperature)
    lo = _threshold(logits.float() / temp[:, None], st)
    for chunks in (1, 2, 3):  # one vocabulary chunk per row, a few, one per 2048-token block
        got, glp = ts.sample_rows(logits, st.temperature, lo, st.seeds, counters, True, chunks=chunks, block=2048)
        assert got.tolist() == tok.tolist(), (dtype, chunks, got.tolist(), tok.tolist())
        assert (glp - lp).abs().max() < 1e-5, (glp - lp).abs().max()
    # no filter (lo None): the rows that use none agree with the torch sampler
    plain = torch.tensor([p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0 for p in params])
    got, _ = ts.sample_rows(logits, st.temperature, None, st.seeds, counters, True)
    assert got[plain].tolist() == tok[plain].tolist()
    g2, _ = ts.sample_rows(logits[:4:4], st.temperature[:1], lo[:1], st.seeds[:1], counters[:1], False)
    assert g2.item() == logits[0].float().argmax().item()
print("OK")
"""
    _run_interpreted(code)


def test_triton_sampler_advances_the_decode_state_in_interpreter():
    """With ``Advance`` (a decode step captured whole in a CUDA graph) the merge kernel writes each real
    row's token and logprob into its window column ``counters - counters0``, and moves that row's token,
    position, context length and counter on by one; a padding row (context 0) keeps its state. Two steps
    in a row, under the interpreter."""
    code = r"""
import torch
from miles_core.rollout.engine_core import triton_sample as ts
if not ts.available():
    print("SKIP"); raise SystemExit
torch.manual_seed(0)
b, k, vocab = 4, 3, 5000
temp = torch.tensor([0.0, 1.0, 0.7, 0.0])
seeds = torch.tensor([5, 6, 7, 8])
counters = torch.tensor([10, 0, 3, 0])
adv = ts.Advance(tokens=torch.tensor([1, 2, 3, 0]), positions=torch.tensor([40, 50, 60, 0]),
                 ctx_lens=torch.tensor([41, 51, 61, 0], dtype=torch.int32), counters0=counters.clone(),
                 out_tokens=torch.full((b, k), -1), out_logprobs=torch.zeros(b, k))
for step in range(2):
    z = torch.randn(b, vocab)
    ref_tok, ref_lp = ts.sample_rows(z, temp, None, seeds, counters.clone(), True)
    tok, lp = ts.sample_rows(z, temp, None, seeds, counters, True, advance=adv)
    assert tok.tolist() == ref_tok.tolist() and torch.equal(lp, ref_lp)
    assert adv.out_tokens[:3, step].tolist() == tok[:3].tolist(), (step, adv.out_tokens)
    assert torch.equal(adv.out_logprobs[:3, step], lp[:3])
    assert adv.tokens[:3].tolist() == tok[:3].tolist()
    assert adv.positions.tolist() == [41 + step, 51 + step, 61 + step, 0]
    assert adv.ctx_lens.tolist() == [42 + step, 52 + step, 62 + step, 0]
    assert counters.tolist() == [11 + step, 1 + step, 4 + step, 0]
assert adv.out_tokens[3].tolist() == [-1, -1, -1] and adv.tokens[3].item() == 0 and adv.out_tokens[:, 2].tolist() == [-1] * 4
print("OK")
"""
    _run_interpreted(code)


def _run_interpreted(code: str) -> None:
    """Run ``code`` under the Triton interpreter in a subprocess (it is chosen when triton is imported); it prints
    OK, or SKIP without triton."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    if "SKIP" in res.stdout:
        pytest.skip("triton is not installed")
    assert "OK" in res.stdout
