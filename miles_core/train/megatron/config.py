"""``train.megatron.*``: the parallel layout and model-build options of the Megatron trainer."""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass
class MegatronConfig:
    tensor_parallel: int = 1  # TP: attention heads, MLP columns and the vocab split over ranks
    pipeline_parallel: int = 1  # PP: must be 1 for now (the trainer runs no pipeline schedule)
    context_parallel: int = 1  # CP: must be 1 for now (sequences are not split over ranks)
    expert_parallel: int = 1  # EP: MoE experts split over ranks
    sequence_parallel: bool = False  # Megatron sequence parallelism (needs tensor_parallel > 1)
    transformer_engine: str = "auto"  # "auto" (TE spec when importable), "on", "off" (local spec)
    moe_token_dispatcher: str = "allgather"  # "allgather" or "alltoall" (alltoall needs CUDA)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss; 0 trains on the policy loss alone
    recompute: bool = False  # full activation recomputation of every layer
    seed: int = 1234  # Megatron's model-parallel RNG seed (CUDA only)

    def validate(self) -> None:
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.megatron.{key} must be >= 1, got {getattr(self, key)}")
        if self.pipeline_parallel != 1:
            raise ConfigError("train.megatron.pipeline_parallel > 1 is not supported yet by the Megatron trainer; set it to 1")
        if self.context_parallel != 1:
            raise ConfigError("train.megatron.context_parallel > 1 is not supported yet by the Megatron trainer; set it to 1")
        if self.transformer_engine not in ("auto", "on", "off"):
            raise ConfigError(f"train.megatron.transformer_engine must be auto, on or off, got '{self.transformer_engine}'")
        if self.moe_token_dispatcher not in ("allgather", "alltoall"):
            raise ConfigError(f"train.megatron.moe_token_dispatcher must be allgather or alltoall, got '{self.moe_token_dispatcher}'")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("train.megatron.sequence_parallel needs train.megatron.tensor_parallel > 1")
