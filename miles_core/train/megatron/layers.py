"""Megatron layers that the local layer spec (:func:`miles_core.train.megatron.build.layer_spec`) uses
in place of megatron-core's own, so that a compiled TransformerLayer has no graph break."""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear


class GroupedRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` handing its own TP group to the GEMM.

    ``RowParallelLinear.forward`` (megatron-core 0.16 and 0.19) passes ``tp_group=None`` to
    ``linear_with_grad_accumulation_and_async_allreduce``, which looks the default group up
    through ``get_tensor_model_parallel_group_if_none`` and, on rank 0, calls ``warnings.warn``
    there in every forward. Dynamo cannot trace ``warnings.warn``: under ``train.compile`` it
    cut each compiled TransformerLayer at both row-parallel GEMMs (attention output and MLP down
    projection), inside Megatron's activation-offloading context manager, where dynamo cannot
    resume after a break, so most of the layer ran eagerly. The group handed over here is the
    one the layer resolved in ``__init__``; a row-parallel GEMM communicates over neither (it
    runs no sequence-parallel gather nor dgrad all-reduce), so the numbers are unchanged.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)
