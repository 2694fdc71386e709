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

Shapes: ``z`` [B, V] (any float dtype, unit last stride); ``temperature`` [B] fp32; ``lo`` [B] fp32
or None (no filter); ``seeds``, ``counters`` [B] int64. Returns (tokens [B] int64, logprobs [B] fp32).
"""

from __future__ import annotations

import torch

try:  # triton is optional (the torch path is the reference)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


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
    def _sample_merge_kernel(PM, PL, PB, PS, PI, TOK, LP, C: tl.constexpr, CP: tl.constexpr):
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
        tl.store(TOK + b, tl.load(PI + b * C + k).to(tl.int64))
        tl.store(LP + b, tl.load(PS + b * C + k) - lse)


BLOCK = 2048


def num_chunks(batch: int, vocab: int, num_sms: int) -> int:
    """Vocabulary chunks per row: about four programs per SM over the batch, at most one per BLOCK."""
    return max(1, min(-(-4 * num_sms // max(1, batch)), -(-vocab // BLOCK), 64))


def sample_rows(z: torch.Tensor, temperature: torch.Tensor, lo: torch.Tensor | None, seeds: torch.Tensor, counters: torch.Tensor,
                sampled: bool, num_sms: int | None = None, chunks: int | None = None, block: int = BLOCK,
                num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``sampled=False`` when every row is greedy (no noise computed). ``chunks``,
    ``block``, ``num_warps``: the launch (default: :func:`num_chunks`'s, ``BLOCK``, 8 warps); benchmarks compare them."""
    b, vocab = z.shape
    z = z if z.stride(-1) == 1 else z.contiguous()
    tok = torch.empty(b, dtype=torch.int64, device=z.device)
    lp = torch.empty(b, dtype=torch.float32, device=z.device)
    if not b:
        return tok, lp
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(z.device).multi_processor_count if z.is_cuda else 4
    c = chunks or num_chunks(b, vocab, num_sms)
    chunk = -(-(-(-vocab // c)) // block) * block  # a whole number of blocks
    c = -(-vocab // chunk)
    f32 = dict(dtype=torch.float32, device=z.device)
    pm, pl, pb, ps = (torch.empty(b, c, **f32) for _ in range(4))
    pi = torch.empty(b, c, dtype=torch.int32, device=z.device)
    _sample_chunk_kernel[(b, c)](z, temperature, lo if lo is not None else temperature, seeds, counters, pm, pl, pb, ps, pi,
                                 vocab, z.stride(0), chunk, SAMPLED=sampled, HAS_LO=lo is not None, C=c, BLOCK=block, num_warps=num_warps)
    _sample_merge_kernel[(b,)](pm, pl, pb, ps, pi, tok, lp, C=c, CP=triton.next_power_of_2(c), num_warps=1)
    return tok, lp
