"""Wrapping the policy for training: activation checkpointing and FSDP2 sharding.

FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder block is one unit (its parameters
are all-gathered for its forward and backward and resharded after), the root holds the
embedding, final norm and LM head (tied or not). Under the bf16 recipe the units compute in
bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) while the sharded fp32
parameters stay the optimizer's master weights.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(decoder: nn.Module) -> None:
    """Recompute each block in backward instead of keeping its activations.

    The block's ``forward`` is replaced on the instance (names and state dict are unchanged);
    FSDP's hooks stay on ``__call__`` around it, so recomputation runs on gathered parameters.
    """
    for block in decoder.model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def shard(root: nn.Module, decoder: nn.Module, compute_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype else MixedPrecisionPolicy()
    for block in decoder.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(root, mp_policy=mp)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor; a collective when sharded."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
