"""The sampler's last step in one Triton pass over the logits, for the GPU (see :mod:`.sampler` for the math).

For row ``b`` with logits ``z`` [V], temperature ``T`` (0 = greedy, computed with ``T = 1``), a lower
bound ``lo`` on the kept scaled logits (top-k/top-p/min-p, ``-inf`` when off) and the row's hash
state ``r`` (from the request seed and output position)::

    s      = z / T
    token  = argmax_v s_v                                     (greedy)
           = argmax_{v : s_v >= lo} s_v - log(-log u_v)       (sampled; u_v = hash(r, v), Gumbel-max)
    logp   = s_token - logsumexp(s)

The torch path materialises ``s``, the noise and ``log_softmax(s)`` as [B, V] fp32 tensors (and the
noise hash as int64), about 20 passes over [B, V]; here ``z`` is read once and everything else stays
in registers (online max / sum-exp, Milakov & Gimelshein 2018). Same hash, same uniforms; the logs
and the log-sum-exp may round differently from torch's in the last bit, so a draw can differ from
the torch path's only where two candidates tie to within that rounding.

Two kernels, so that a small batch still fills the GPU: grid ``(B, C)`` splits each row's
vocabulary into ``C`` chunks, and each program keeps its chunk's max ``m_c``, sum ``l_c = sum
exp(s - m_c)`` and best candidate; a second kernel, one program per row, merges them
(``lse = M + log sum_c l_c exp(m_c - M)`` with ``M = max_c m_c``; the best candidate of the
earliest chunk wins ties, so the earliest maximum wins as in ``torch.argmax``). The row's hash
state ``r = row_hash(seed, counter)`` (:func:`.sampler.row_hash`) is computed in the kernel from
the seeds and output positions, in uint32 arithmetic (the torch version masks int64 products to
32 bits: the same values).

With :class:`Advance` the merge kernel also moves the decode step on (the next input token, position,
context length and output counter of each row, and the window's output columns), so that a whole decode
step, sampling included, replays as one CUDA graph (:meth:`.runner.ModelRunner.decode_sample`).

Shapes: ``z`` [B, V] (any float dtype, unit last stride); ``temperature`` [B] fp32; ``lo`` [B] fp32
or None (no filter); ``seeds``, ``counters`` [B] int64. Returns (tokens [B] int64, logprobs [B] fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_core.rollout.engine_core.triton_lib import available, tl, triton  # noqa: F401 (available: this module's API)


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def _row_hash(seed, counter):
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        return _mix32(_mix32(lo) ^ (counter & 0xFFFFFFFF).to(tl.uint32) ^ (hi * 0x1B873593))

    @triton.jit
    def _sample_chunk_kernel(Z, TEMP, LO, SEED, CTR, PM, PL, PB, PS, PI, V, s_z, CHUNK,
                             SAMPLED: tl.constexpr, HAS_LO: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        t = tl.load(TEMP + b)
        greedy = t <= 0.0
        t = tl.where(greedy, 1.0, t)
        if HAS_LO:
            lo = tl.load(LO + b)
        else:
            lo = float("-inf")
        row = _row_hash(tl.load(SEED + b), tl.load(CTR + b))
        m = float("-inf")
        l = 0.0
        best = float("-inf")  # best score so far (s for greedy, s + gumbel for sampled)
        best_s = float("-inf")  # its s
        best_i = 0
        zrow = Z + b.to(tl.int64) * s_z
        start = c * CHUNK
        end = tl.minimum(start + CHUNK, V)
        for v0 in range(start, end, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mask = v < end
            s = tl.load(zrow + v, mask=mask, other=float("-inf")).to(tl.float32) / t
            # online log-sum-exp over the chunk
            m_new = tl.maximum(m, tl.max(s, 0))
            l = l * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(s - m_new), 0.0), 0)
            m = m_new
            if SAMPLED:
                x = _mix32(row + v.to(tl.uint32) * 0x2545F49)
                u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                noisy = s - tl.log(-tl.log(u))
                keep = mask & (s >= lo)
                score = tl.where(greedy, s, tl.where(keep, noisy, float("-inf")))
            else:
                score = s
            score = tl.where(mask, score, float("-inf"))
            blk_best = tl.max(score, 0)
            blk_i = tl.argmax(score, 0)  # first index of the block's maximum
            blk_s = tl.sum(tl.where(v == v0 + blk_i, s, 0.0), 0)
            better = blk_best > best  # strict: the earliest maximum wins, as torch.argmax
            best_i = tl.where(better, v0 + blk_i, best_i)
            best_s = tl.where(better, blk_s, best_s)
            best = tl.where(better, blk_best, best)
        o = b * C + c
        tl.store(PM + o, m)
        tl.store(PL + o, l)
        tl.store(PB + o, best)
        tl.store(PS + o, best_s)
        tl.store(PI + o, best_i)

    @triton.jit
    def _sample_merge_kernel(PM, PL, PB, PS, PI, TOK, LP, TOKENS, POS, CTX, CTR, CTR0, OUT_TOK, OUT_LP, s_out, KMAX,
                             C: tl.constexpr, CP: tl.constexpr, ADVANCE: tl.constexpr):
        b = tl.program_id(0)
        c = tl.arange(0, CP)
        cmask = c < C
        o = b * C + c
        m = tl.load(PM + o, mask=cmask, other=float("-inf"))
        l = tl.load(PL + o, mask=cmask, other=0.0)
        best = tl.load(PB + o, mask=cmask, other=float("-inf"))
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(tl.where(m > float("-inf"), l * tl.exp(m - top), 0.0), 0))
        # the earliest chunk holding the maximum score; a row whose every score is -inf takes chunk 0
        hit = tl.min(tl.where(best == tl.max(best, 0), c, CP), 0)
        k = tl.where(hit < C, hit, 0)
        tok = tl.load(PI + b * C + k).to(tl.int64)
        lp = tl.load(PS + b * C + k) - lse
        tl.store(TOK + b, tok)
        tl.store(LP + b, lp)
        if ADVANCE:  # the decode step's state moves to the next token (rows with context 0 are padding)
            ctx = tl.load(CTX + b)
            if ctx > 0:
                ctr = tl.load(CTR + b)
                j = ctr - tl.load(CTR0 + b)  # the token's column in the window's outputs
                keep = (j >= 0) & (j < KMAX)
                tl.store(OUT_TOK + b.to(tl.int64) * s_out + j, tok, mask=keep)
                tl.store(OUT_LP + b.to(tl.int64) * s_out + j, lp, mask=keep)
                tl.store(TOKENS + b, tok)
                tl.store(POS + b, tl.load(POS + b) + 1)
                tl.store(CTX + b, ctx + 1)
                tl.store(CTR + b, ctr + 1)


# The default launch, from benchmarks/decode_parts.py --parts sampler on the H200 (2026-12-05,
# docs/results/s13/call4_s13a): one block per chunk where the vocabulary allows (at most 64 chunks),
# 4096-wide blocks when greedy and 2048 when sampled, 4 warps from 16 rows up and 8 below. Greedy at batch
# 64: 17.0 µs against 24.3 for the earlier launch (9 chunks of 2048, 8 warps); at 256: 58.9 against 86.1;
# sampled at 64: 41.3 against 47.1.
BLOCK = 2048
MAX_CHUNKS = 64


def launch(batch: int, vocab: int, sampled: bool) -> tuple[int, int, int]:
    """(chunks per row, block, warps) of the default launch (see above)."""
    block = BLOCK if sampled else 2 * BLOCK
    return max(1, min(MAX_CHUNKS, -(-vocab // block))), block, (8 if batch < 16 else 4)


@dataclass
class Advance:
    """The decode step's state that the sampler moves on in place, for a step captured whole in a CUDA
    graph (the runner's static buffers, [B] rows; rows with ``ctx_lens == 0`` are padding and left alone).
    For each other row ``b``, with ``j = counters[b] - counters0[b]``::

        out_tokens[b, j], out_logprobs[b, j] = token, logprob
        tokens[b] = token;  positions[b] += 1;  ctx_lens[b] += 1;  counters[b] += 1

    (``counters`` is the tensor passed to :func:`sample_rows`: the output position its draw hashes.)"""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    ctx_lens: torch.Tensor  # [B] int32
    counters0: torch.Tensor  # [B] int64: each row's counter at the window's first step
    out_tokens: torch.Tensor  # [B, K] int64
    out_logprobs: torch.Tensor  # [B, K] float32


def sample_rows(z: torch.Tensor, temperature: torch.Tensor, lo: torch.Tensor | None, seeds: torch.Tensor, counters: torch.Tensor,
                sampled: bool, chunks: int | None = None, block: int | None = None,
                num_warps: int | None = None, advance: Advance | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``sampled=False`` when every row is greedy (no noise computed). ``chunks``,
    ``block``, ``num_warps``: the launch (default: :func:`launch`'s); benchmarks compare them. ``advance``:
    also move the decode state on (:class:`Advance`)."""
    b, vocab = z.shape
    z = z if z.stride(-1) == 1 else z.contiguous()
    tok = torch.empty(b, dtype=torch.int64, device=z.device)
    lp = torch.empty(b, dtype=torch.float32, device=z.device)
    if not b:
        return tok, lp
    c0, block0, warps0 = launch(b, vocab, sampled)
    c, block, num_warps = chunks or c0, block or block0, num_warps or warps0
    chunk = -(-(-(-vocab // c)) // block) * block  # a whole number of blocks
    c = -(-vocab // chunk)
    f32 = dict(dtype=torch.float32, device=z.device)
    pm, pl, pb, ps = (torch.empty(b, c, **f32) for _ in range(4))
    pi = torch.empty(b, c, dtype=torch.int32, device=z.device)
    _sample_chunk_kernel[(b, c)](z, temperature, lo if lo is not None else temperature, seeds, counters, pm, pl, pb, ps, pi,
                                 vocab, z.stride(0), chunk, SAMPLED=sampled, HAS_LO=lo is not None, C=c, BLOCK=block, num_warps=num_warps)
    a = advance
    if a is not None:
        assert a.out_tokens.stride(1) == 1 and a.out_logprobs.stride() == a.out_tokens.stride(), "outputs: [B, K], rows alike"
        _sample_merge_kernel[(b,)](pm, pl, pb, ps, pi, tok, lp, a.tokens, a.positions, a.ctx_lens, counters, a.counters0,
                                   a.out_tokens, a.out_logprobs, a.out_tokens.stride(0), a.out_tokens.shape[1],
                                   C=c, CP=triton.next_power_of_2(c), ADVANCE=True, num_warps=1)
    else:
        _sample_merge_kernel[(b,)](pm, pl, pb, ps, pi, tok, lp, tok, tok, tok, tok, tok, tok, lp, 0, 0,
                                   C=c, CP=triton.next_power_of_2(c), ADVANCE=False, num_warps=1)
    return tok, lp
