"""Vectorised sampling: every row of the batch has its own temperature, top-k, top-p, min-p, seed.

For row ``b`` with logits ``z`` [V] and temperature ``T > 0``::

    s      = z / T
    keep   = top-k(s) ∩ top-p(softmax(s)) ∩ {p >= min_p * max p}   (each filter off by default)
    token  = argmax_v (s_v + g_v) over keep,   g_v = -log(-log u_v)    (Gumbel-max = a draw from softmax(s|keep))
    logp   = log_softmax(s)[token]              (before the filters: the distribution the trainer recomputes)

``T == 0`` is greedy: ``token = argmax z`` and ``logp = log_softmax(z)[token]``.

The uniforms ``u`` come from a counter-based hash of (request seed, output position, vocab id)
rather than a stateful generator, so a request's draws do not depend on which other requests
share its batch, and a seeded request is reproducible. Departure from exact top-p: tokens tied
with the last kept logit are kept too (the cut is a threshold on the logit).

On CUDA (with Triton), the draw, the argmax and the log-sum-exp run in one fused pass per row
(:mod:`.triton_sample`); the filters' threshold, when a row uses one, is still found in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_core.rollout.engine_core import triton_sample
from miles_core.rollout.engine_core.host import to_device

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 32-bit values held in int64 (products stay below 2**59: no overflow)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_hash(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B] seeds, [B] output positions -> [B] int64 hash state (< 2**32) of each row's draw."""
    return _mix32(_mix32(seeds & _M32) ^ (counters & _M32) ^ ((seeds >> 32) & _M32) * 0x1B873593 & _M32)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds, [B] output positions -> [B, V] float32 uniforms in (0, 1)."""
    row = row_hash(seeds, counters)
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _mix32((row[:, None] + v[None, :] * 0x2545F49) & _M32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, as device tensors."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    any_sampled: bool  # host flags: skip work no row needs
    any_top_p_or_k: bool
    any_min_p: bool
    max_top_logprobs: int

    @classmethod
    def build(cls, params: list, seeds: list[int], device) -> SamplingTensors:
        device = torch.device(device)
        temps = [p.temperature for p in params]
        return cls(
            temperature=to_device(temps, torch.float32, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.int64, device),
            min_p=to_device([p.min_p for p in params], torch.float32, device),
            seeds=to_device(seeds, torch.int64, device),
            any_sampled=any(t > 0 for t in temps),
            any_top_p_or_k=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[rows], self.top_p[rows], self.top_k[rows], self.min_p[rows], self.seeds[rows],
            self.any_sampled, self.any_top_p_or_k, self.any_min_p, self.max_top_logprobs,
        )


def _threshold(s: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B] lower bound on the kept scaled logits ``s`` (top-k, then top-p, then min-p; -inf = keep all)."""
    lo = torch.full((s.shape[0],), float("-inf"), device=s.device)
    if st.any_top_p_or_k:
        vocab = s.shape[-1]
        srt = torch.sort(s, dim=-1, descending=True).values
        k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
        rank = torch.arange(vocab, device=s.device)
        # top-k first, then top-p on the renormalised survivors (the order HF's warpers use)
        masked = srt.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(masked, -1)
        # top_p 1 cuts nothing: the fp32 cumulative sum reaches 1.0 before a large vocabulary's last tokens
        keep = (rank[None, :] < k[:, None]) & (((probs.cumsum(-1) - probs) < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0))
        n_keep = keep.sum(-1).clamp(min=1)
        lo = srt.gather(-1, (n_keep - 1)[:, None]).squeeze(-1)
    if st.any_min_p:  # the top token always survives the filters above: their max is s.max()
        cut = s.amax(-1) + torch.log(st.min_p.clamp(min=1e-30))
        lo = torch.where(st.min_p > 0, torch.maximum(lo, cut), lo)
    return lo


def sample(logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor):
    """``logits`` [B, V], ``counters`` [B] int64 (output position of the token drawn).

    Returns (tokens [B] int64, logprobs [B] float32, top logprobs (values [B, k], ids [B, k]) or None).
    """
    if logits.is_cuda and st.max_top_logprobs == 0 and triton_sample.available():
        lo = None
        if st.any_top_p_or_k or st.any_min_p:
            temp = torch.where(st.temperature <= 0, torch.ones_like(st.temperature), st.temperature)
            lo = _threshold(logits.float() / temp[:, None], st)
        tok, lp = triton_sample.sample_rows(logits, st.temperature, lo, st.seeds, counters, st.any_sampled)
        return tok, lp, None
    return sample_torch(logits, st, counters)


def sample_torch(logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor):
    """:func:`sample` in plain torch (the reference; the path on CPU and for top logprobs)."""
    z = logits.float()
    token = z.argmax(-1)
    if not st.any_sampled:  # all greedy: temperature 1 everywhere, skip the division (exact: z / 1 == z)
        logp_all = torch.log_softmax(z, -1)
    else:
        greedy = st.temperature <= 0
        temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
        s = z / temp[:, None]
        logp_all = torch.log_softmax(s, -1)
        filt = s
        if st.any_top_p_or_k or st.any_min_p:
            filt = s.masked_fill(s < _threshold(s, st)[:, None], float("-inf"))
        u = uniform_noise(st.seeds, counters, s.shape[-1])
        drawn = (filt - torch.log(-torch.log(u))).argmax(-1)
        token = torch.where(greedy, token, drawn)
    logp = logp_all.gather(-1, token[:, None]).squeeze(-1)
    top = None
    if st.max_top_logprobs > 0:
        top = torch.topk(logp_all, st.max_top_logprobs, dim=-1)
    return token, logp, top
