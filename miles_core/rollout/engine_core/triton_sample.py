"""The sampler's last step in one Triton pass per row, for the GPU (see :mod:`.sampler` for the math).

For row ``b`` with logits ``z`` [V], temperature ``T`` (0 = greedy, computed with ``T = 1``), a lower
bound ``lo`` on the kept scaled logits (top-k/top-p/min-p, ``-inf`` when off) and the row's hash
state ``r`` (from the request seed and output position)::

    s      = z / T
    token  = argmax_v s_v                                     (greedy)
           = argmax_{v : s_v >= lo} s_v - log(-log u_v)       (sampled; u_v = hash(r, v), Gumbel-max)
    logp   = s_token - logsumexp(s)

The torch path materialises ``s``, the noise and ``log_softmax(s)`` as [B, V] fp32 tensors (and the
noise hash as int64), about 20 passes over [B, V]; this kernel reads ``z`` once and keeps everything
else in registers (online max / sum-exp, Milakov & Gimelshein 2018). Same hash, same uniforms; the
logs and the log-sum-exp may round differently from torch's in the last bit, so a draw can differ
from the torch path's only where two candidates tie to within that rounding.

Shapes: ``z`` [B, V] (any float dtype, unit last stride); ``temperature``, ``lo`` [B] fp32;
``row_hash`` [B] int64 (< 2**32). Returns (tokens [B] int64, logprobs [B] fp32).
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
    def _sample_kernel(Z, TEMP, LO, ROW, TOK, LP, V, s_z, SAMPLED: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        t = tl.load(TEMP + b)
        greedy = t <= 0.0
        t = tl.where(greedy, 1.0, t)
        lo = tl.load(LO + b)
        row = tl.load(ROW + b).to(tl.uint32)
        m = float("-inf")
        l = 0.0
        best = float("-inf")  # best score so far (s for greedy, s + gumbel for sampled)
        best_s = 0.0  # its s
        best_i = 0
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mask = v < V
            s = tl.load(Z + b * s_z + v, mask=mask, other=float("-inf")).to(tl.float32) / t
            # online log-sum-exp over every token
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
        tl.store(TOK + b, best_i.to(tl.int64))
        tl.store(LP + b, best_s - (m + tl.log(l)))


def sample_rows(z: torch.Tensor, temperature: torch.Tensor, lo: torch.Tensor, row_hash: torch.Tensor,
                sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``sampled=False`` when every row is greedy (no noise computed)."""
    b, vocab = z.shape
    z = z if z.stride(-1) == 1 else z.contiguous()
    tok = torch.empty(b, dtype=torch.int64, device=z.device)
    lp = torch.empty(b, dtype=torch.float32, device=z.device)
    if b:
        _sample_kernel[(b,)](z, temperature, lo, row_hash, tok, lp, vocab, z.stride(0), SAMPLED=sampled, BLOCK=2048,
                             num_warps=8)
    return tok, lp
