"""``train.compile`` with the Megatron trainer: each compiled TransformerLayer is one graph.

A graph break inside a compiled layer (megatron-core's ``warnings.warn`` in every
RowParallelLinear forward was one) leaves the rest of the layer to eager mode, which on the GPU
loses the fusions that ``train.compile`` is for. Recompiles per pack (the first layer's input
strides, the number of samples in a pack) cost compile time on every new shape and, past
dynamo's recompile limit, fall back to eager as well.
"""

from __future__ import annotations

import functools

import torch
from megatron_helpers import VOCAB, batch
from test_megatron_trainer import FP32, KERNELS, _config, _decoder

from miles_core.algorithms.losses import ppo_clip
from miles_core.train.batch import make_train_batch
from miles_core.train.megatron.arch import arch_from_decoder
from miles_core.types import Sample


def _other_batch():
    """Four samples (the first batch has three), other lengths."""
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    b = make_train_batch([Sample("", ids(p), ids(r), "", [0.0] * r) for p, r in ((4, 3), (6, 5), (2, 2), (9, 1))], pad_id=0)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.old_logprobs = b.rollout_logprobs.clone()
    return b


def test_compiled_layers_have_no_graph_break_or_recompile(megatron_cpu, monkeypatch):
    from torch._dynamo.utils import counters

    from miles_core.train.megatron.trainer import MegatronTrainer

    # dynamo's graph capture is what is tested; aot_eager skips inductor's slow C++ codegen on CPU
    monkeypatch.setattr(torch.nn.Module, "compile", functools.partialmethod(torch.nn.Module.compile, backend="aot_eager"))
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    cfg = _config("token_mean")
    cfg.train.compile = True
    cfg.train.attention = "padded"  # the layout of train.attention=cudnn off CUDA
    cfg.train.micro_batch_size = 4  # one pack per batch
    dec = _decoder(True, True)
    mega = MegatronTrainer(arch_from_decoder(dec.config), dec.state_dict(), cfg, torch.device("cpu"), FP32, KERNELS)
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    b = batch()
    b.old_logprobs = b.rollout_logprobs.clone()
    mega.train_step(b, loss_fn)  # forward and backward through both compiled layers
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1  # the second layer reuses the first one's graph (same input strides)
    mega.train_step(_other_batch(), loss_fn)  # more samples, other lengths: no new graph
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == graphs


def test_spec_rewrite_enters_partial_builders():
    """megatron-core 0.19 builds the MLP through ``functools.partial(MLP.as_mlp_submodule,
    submodules=MLPSubmodules(...))``; the RowParallelLinear inside it must be replaced too (the
    first rewrite walked dataclasses only, and on the H200 ``linear_fc2`` kept its graph break)."""
    import dataclasses

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from miles_core.train.megatron.build import _replace_module
    from miles_core.train.megatron.layers import GroupedRowParallelLinear

    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    spec = ModuleSpec(module=MLP, submodules=functools.partial(dict, 1, submodules=subs, other=RowParallelLinear))
    out = _replace_module(spec, RowParallelLinear, GroupedRowParallelLinear)
    builder = out.submodules
    assert isinstance(builder, functools.partial) and builder.func is dict and builder.args == (1,)
    assert builder.keywords["submodules"].linear_fc2 is GroupedRowParallelLinear
    assert builder.keywords["submodules"].linear_fc1 is ColumnParallelLinear
    assert builder.keywords["other"] is GroupedRowParallelLinear
    assert dataclasses.is_dataclass(builder.keywords["submodules"])
    assert spec.submodules.keywords["submodules"].linear_fc2 is RowParallelLinear  # the input is left as it was
