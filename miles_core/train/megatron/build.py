"""Build a megatron-core ``GPTModel`` for an :class:`~miles_core.train.megatron.arch.Arch`.

Works with megatron-core 0.16 (the last release for Python 3.11) and 0.19. Needs
``torch.distributed`` and Megatron's parallel state initialized (:func:`init_parallel`).
Layer spec: TransformerEngine's when TE is importable (``train.megatron.transformer_engine``),
else Megatron's local spec with :class:`SDPACoreAttention` in place of its unfused attention.
MoE (Qwen3-MoE): softmax router with top-k (``moe_router_pre_softmax=False`` keeps the top-k
logits and softmaxes over them, which equals HF's softmax -> top-k -> renormalize when
``norm_topk_prob``; ``pre_softmax=True`` is HF without renormalization), SequentialMLP experts.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from miles_core.errors import ConfigError
from miles_core.train.megatron.arch import Arch
from miles_core.train.megatron.config import MegatronConfig


def init_parallel(mcfg: MegatronConfig, device: torch.device) -> None:
    """Start torch.distributed (a single gloo/nccl rank when not launched by torchrun) and
    Megatron's model-parallel groups, once per process."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:  # launched by torchrun: its rendezvous
            dist.init_process_group(backend)
        else:  # one rank: an in-process store, no port to pick or collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    need = mcfg.tensor_parallel * mcfg.pipeline_parallel * mcfg.context_parallel
    if world % need:
        raise ConfigError(f"world size {world} is not a multiple of train.megatron tensor*pipeline*context parallel ({need})")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=mcfg.tensor_parallel,
            pipeline_model_parallel_size=mcfg.pipeline_parallel,
            context_parallel_size=mcfg.context_parallel,
            expert_model_parallel_size=mcfg.expert_parallel,
        )
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(mcfg.seed)


def use_transformer_engine(mcfg: MegatronConfig) -> bool:
    have = importlib.util.find_spec("transformer_engine") is not None
    if mcfg.transformer_engine == "on" and not have:
        raise ConfigError("train.megatron.transformer_engine=on but transformer_engine is not installed; use auto or off")
    return have and mcfg.transformer_engine != "off"


def padded_vocab(arch: Arch, tp: int) -> int:
    """Megatron's vocab-parallel layers need vocab % tp == 0; extra rows are masked out of the loss."""
    return -(-arch.vocab_size // tp) * tp


def transformer_config(arch: Arch, mcfg: MegatronConfig, device: torch.device, bf16: bool):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        use_cpu_initialization=device.type != "cuda",
        perform_initialization=True,  # (the weights are then overwritten from HF) it also marks TP-split params
        params_dtype=torch.float32,  # fp32 master weights; bf16 compute via autocast
        bf16=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=mcfg.tensor_parallel,
        pipeline_model_parallel_size=mcfg.pipeline_parallel,
        context_parallel_size=mcfg.context_parallel,
        expert_model_parallel_size=mcfg.expert_parallel,
        sequence_parallel=mcfg.sequence_parallel,
    )
    if mcfg.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_router_topk=arch.moe_topk,
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss" if mcfg.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=mcfg.moe_aux_loss_coeff,
            moe_token_dispatcher_type=mcfg.moe_token_dispatcher,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
        )
    return TransformerConfig(**kwargs)


def layer_spec(arch: Arch, te: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec

    experts = arch.num_experts or None
    if te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from miles_core.train.megatron.attention import SDPACoreAttention
    from miles_core.train.megatron.layers import GroupedRowParallelLinear

    attn = spec.submodules.self_attention
    subs = dataclasses.replace(attn.submodules, core_attention=SDPACoreAttention)
    spec.submodules.self_attention = dataclasses.replace(attn, submodules=subs)
    return _replace_module(spec, RowParallelLinear, GroupedRowParallelLinear)


def _replace_module(spec, old: type, new: type):
    """``spec`` (a ModuleSpec tree of dataclasses; megatron-core 0.19 also nests ``functools.partial``
    builders such as ``MLP.as_mlp_submodule``) with every ``old`` class reference replaced by ``new``."""
    if spec is old:
        return new
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *(_replace_module(a, old, new) for a in spec.args),
                                 **{k: _replace_module(v, old, new) for k, v in spec.keywords.items()})
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace_module(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


def _moe_without_te_compat() -> None:
    """megatron-core 0.16 leaves ``moe_utils.te_general_gemm`` undefined (not None) when
    TransformerEngine is missing, so the MoE router raises NameError; 0.19 defines it as None.
    Define it as None the way 0.19 does (only when it is absent)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt(arch: Arch, mcfg: MegatronConfig, device: torch.device, bf16: bool = False, recompute: bool = False):
    """A GPTModel with allocated but not initialized weights (the trainer loads HF weights into it)."""
    from megatron.core.models.gpt import GPTModel

    if arch.is_moe:
        _moe_without_te_compat()

    if recompute and not mcfg.recompute:
        mcfg = dataclasses.replace(mcfg, recompute=True)
    config = transformer_config(arch, mcfg, device, bf16)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, use_transformer_engine(mcfg)),
        vocab_size=padded_vocab(arch, mcfg.tensor_parallel),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # a float: megatron-core computes base ** (2i / D) in fp32; int() dropped its fraction
    )
    return model.to(device)
