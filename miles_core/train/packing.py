"""Sequence packing: samples concatenated into one row, no padding.

A packed micro-batch holds ``n`` samples as one sequence of ``S = sum(len_i)`` tokens. Position
ids restart at 0 for each sample and attention is restricted to each sample (block-diagonal
causal), so every sample sees exactly what it would see alone: packing changes no number
beyond float rounding.

Shapes: ``input_ids``/``positions`` [1, S]; ``cu_seqlens`` [n + 1] (sample starts, then S);
``hidden_idx``/``targets`` [M] for the ``M = sum(response_len_i)`` response tokens: the hidden
state at ``hidden_idx[j]`` predicts token ``targets[j]``; ``rows``/``cols`` [M] say where token j
goes in the [n, T] response layout of :class:`TrainBatch`.

Micro-batches are cut by a token budget: samples are taken in order and a micro-batch is closed
when the next sample would exceed ``max_tokens``; a sample longer than the budget goes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from miles_core.kernels.varlen import causal_varlen
from miles_core.types import TrainBatch


@dataclass
class PackedMicroBatch:
    sample_idx: torch.Tensor  # [n] int64, the samples' rows in the global batch
    input_ids: torch.Tensor  # [1, S]
    positions: torch.Tensor  # [1, S]
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    hidden_idx: torch.Tensor  # [M]
    targets: torch.Tensor  # [M]
    rows: torch.Tensor  # [M], in 0..n-1
    cols: torch.Tensor  # [M], in 0..T-1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> "PackedMicroBatch":
        return PackedMicroBatch(
            self.sample_idx, *(t.to(device) for t in (self.input_ids, self.positions, self.cu_seqlens)),
            self.max_seqlen, *(t.to(device) for t in (self.hidden_idx, self.targets, self.rows, self.cols)),
        )


def sample_lengths(batch: TrainBatch) -> list[int]:
    return (batch.prompt_lens + batch.response_lens).tolist()


def pack(batch: TrainBatch, sample_idx: list[int]) -> PackedMicroBatch:
    """Pack the samples ``sample_idx`` of ``batch`` into one row."""
    ids, pos, hidden_idx, targets, rows, cols = [], [], [], [], [], []
    cu = [0]
    offset = 0
    for r, i in enumerate(sample_idx):
        p, t = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        seq = batch.input_ids[i, : p + t]
        ids.append(seq)
        pos.append(torch.arange(p + t))
        j = torch.arange(t)
        hidden_idx.append(offset + p - 1 + j)
        targets.append(seq[p:])
        rows.append(torch.full((t,), r))
        cols.append(j)
        offset += p + t
        cu.append(offset)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    return PackedMicroBatch(
        sample_idx=torch.tensor(sample_idx, dtype=torch.long),
        input_ids=torch.cat(ids)[None],
        positions=torch.cat(pos)[None],
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lens),
        hidden_idx=torch.cat(hidden_idx).long(),
        targets=torch.cat(targets).long(),
        rows=torch.cat(rows).long(),
        cols=torch.cat(cols).long(),
    )


def split_by_tokens(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Cut the samples ``order`` (in that order) into groups of at most ``max_tokens`` tokens."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and used + lengths[i] > max_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        groups.append(cur)
    return groups


def shard_samples(lengths: list[int], world_size: int) -> list[list[int]]:
    """Assign samples to ranks, balancing tokens (longest first, to the least loaded rank).

    Every rank computes the same plan from the same global batch, so no communication is needed.
    """
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


def micro_batch_plan(batch: TrainBatch, world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """plan[rank] = that rank's micro-batches (lists of sample rows). Ranks may differ in count."""
    lengths = sample_lengths(batch)
    return [split_by_tokens(lengths, shard, max_tokens) for shard in shard_samples(lengths, world_size)]


# ---------------------------------------------------------------------- attention over a pack


def varlen_unavailable(device: torch.device, compute_dtype: torch.dtype | None) -> str | None:
    """Why ``train.attention=varlen`` cannot run for a trainer on ``device`` computing in ``compute_dtype``, or None:
    flash-attention varlen takes CUDA tensors in bf16/fp16 only, and needs torch >= 2.10."""
    if device.type != "cuda":
        return f"this trainer runs on {device.type}"
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return "the trainer computes in fp32 (train.precision)"
    if causal_varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None


class SegmentAttention:
    """Causal attention within each packed sample; passed to the decoder as ``attn_mask``.

    ``impl``: ``"sdpa"`` runs causal SDPA on each sample's slice (any device; exact, no [S, S]
    mask); ``"padded"`` scatters the samples into a padded [n, heads, max_len, D] batch for one
    causal SDPA call (right padding is invisible to causal attention; best for many short
    samples); ``"varlen"`` runs flash-attention varlen over the whole pack (CUDA, bf16/fp16);
    ``"cudnn"`` is ``"padded"`` through cuDNN's fused attention (SDPA's cuDNN backend, CUDA; on
    Hopper faster than torch's FlashAttention-2; off CUDA it is plain ``"padded"``);
    ``"auto"`` picks varlen on CUDA in half precision when torch has it, else padded for more
    than 4 samples, else sdpa.
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, impl: str = "auto", bounds: list[int] | None = None) -> None:
        self.cu = cu_seqlens
        self.bounds = cu_seqlens.tolist() if bounds is None else bounds  # host copy (pass it to skip a GPU read)
        self.max_seqlen = max_seqlen
        self.impl = impl
        self.num_segments = len(self.bounds) - 1
        # the padded layout's token slots, built once per pack rather than in every layer (under
        # train.compile a layer then takes them as an input: its graph does not depend on the sample count)
        self.slot = self._slots(cu_seqlens.device) if impl in ("padded", "cudnn") and self.num_segments > 1 else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [1, heads, S, D] (kv heads already repeated to the query heads)
        impl = self.impl
        if impl == "cudnn" and q.is_cuda:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return self._dense(q, k, v)
        if self.num_segments == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.is_cuda and torch.is_autocast_enabled("cuda") and impl != "sdpa":  # the varlen op is not autocast
            dt = torch.get_autocast_dtype("cuda")
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if impl == "auto":
            if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and causal_varlen():
                impl = "varlen"
            else:
                impl = "padded" if self.num_segments > 4 else "sdpa"
        if impl in ("padded", "cudnn"):
            return self._padded(q, k, v)
        if impl == "varlen":
            fn = causal_varlen()
            out = fn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), self.cu.to(q.device), self.max_seqlen)
            return out.transpose(0, 1)[None]
        parts = [  # "sdpa"
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
            for a, b in zip(self.bounds, self.bounds[1:])
        ]
        return torch.cat(parts, dim=2)

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One causal SDPA call: on the pack itself for one sample, else on the padded batch."""
        if torch.is_autocast_enabled("cuda"):  # cuDNN's kernel takes half precision only
            dt = torch.get_autocast_dtype("cuda")
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if self.num_segments == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self._padded(q, k, v)

    def _slots(self, device: torch.device) -> torch.Tensor:
        """Slot of packed token j in the flattened [n * max_len] padded layout."""
        width = self.max_seqlen
        return torch.cat([torch.arange(b - a, device=device) + i * width for i, (a, b) in enumerate(zip(self.bounds, self.bounds[1:]))])

    def _padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, width = self.num_segments, self.max_seqlen
        slot = self.slot if self.slot is not None and self.slot.device == q.device else self._slots(q.device)
        heads, dim = q.shape[1], q.shape[3]

        def to_padded(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(heads, n * width, dim).index_copy(1, slot, x[0])
            return out.view(heads, n, width, dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(to_padded(q), to_padded(k), to_padded(v), is_causal=True)
        return out.transpose(0, 1).reshape(heads, n * width, dim).index_select(1, slot)[None]
