"""Reference op "logprobs": per-token log-probabilities and entropy from hidden states.

For hidden states ``h`` [M, H], the LM head ``W`` [V, H], targets ``y`` [M] and a temperature
``tau``, with ``z = h W^T / tau`` (fp32) and ``lse = logsumexp(z)``:

    logp_j = z_{j, y_j} - lse_j
    H_j    = -sum_v p_jv log p_jv,        p = softmax(z)

Backward (the gradient flows to ``h`` and ``W``), per row, for upstream grads ``a`` (logp) and
``b`` (entropy):

    dL/dz = a * (onehot(y) - p) - b * p * (log p + H)

Memory: the logits are made ``chunk_size`` rows at a time, in forward and again in backward
(recomputed), so the full fp32 [M, V] tensor never exists; forward keeps only ``lse`` and ``H``
([M] each). The peak extra memory is about two fp32 [chunk_size, V] buffers plus the weight
gradient, instead of several fp32 [M, V] tensors for a plain ``log_softmax``
(tests/test_logprobs_memory.py measures both). Matmuls run in the dtype of ``hidden`` (the
trainer passes bf16 under the bf16 recipe); softmax, lse and entropy are always fp32.

A hardware plugin may register a faster implementation of the same op (same signature and
result) through ``miles_register_kernels``.
"""

from __future__ import annotations

import torch


def _logits(h: torch.Tensor, w: torch.Tensor, inv_temp: float) -> torch.Tensor:
    z = (h @ w.t()).float()
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp: float, chunk_size: int):
        w = weight.to(hidden.dtype)
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        for a in range(0, m, chunk_size):
            b = min(a + chunk_size, m)
            z = _logits(hidden[a:b], w, inv_temp)  # [C, V]
            lse[a:b] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[a:b, None])  # z is now log p
            logp[a:b] = z.gather(1, targets[a:b, None]).squeeze(1)
            p = z.exp()
            ent[a:b] = -(p[:, None, :] @ z[:, :, None]).view(-1)  # a bmm: no [C, V] temporary
            del z, p
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_temp, ctx.chunk_size = inv_temp, chunk_size
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk_size
        w = weight.to(hidden.dtype)
        m = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_logp = torch.zeros(m, device=hidden.device) if g_logp is None else g_logp.float()
        g_ent = torch.zeros(m, device=hidden.device) if g_ent is None else g_ent.float()
        for a in range(0, m, chunk):
            b = min(a + chunk, m)
            logq = _logits(hidden[a:b], w, inv_temp)
            logq.sub_(lse[a:b, None])  # log p
            p = logq.exp()
            # dz = -b * p * (log p + H) - a * p + a * onehot
            dz = logq.add_(ent[a:b, None]).mul_(p).mul_(-g_ent[a:b, None])
            dz.addcmul_(p, g_logp[a:b, None], value=-1.0)
            del p
            dz.scatter_add_(1, targets[a:b, None], g_logp[a:b, None])
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            dz = dz.to(hidden.dtype)
            if need_h:
                grad_h[a:b] = dz @ w
            if need_w:
                grad_w.add_(dz.t() @ hidden[a:b])
            del dz
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [M, H], ``weight`` [V, H] (the LM head), ``targets`` [M] int64.

    Returns ``(logprobs [M], entropy [M])`` in fp32, of ``softmax(hidden @ weight.T / temperature)``.
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    if hidden.device.type not in ("cpu", "cuda"):  # e.g. meta (memory accounting) or a plugin's device
        return _ChunkedLogprobs.apply(hidden, weight, targets, 1.0 / temperature, chunk_size)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _ChunkedLogprobs.apply(hidden, weight, targets, 1.0 / temperature, chunk_size)


def logprobs_naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0):
    """The plain formula over the full [M, V] fp32 logits (for tests and the memory table)."""
    logits = (hidden @ weight.to(hidden.dtype).t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent
