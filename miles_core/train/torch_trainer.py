"""The torch trainer: AdamW on the shared decoder, one process or several ranks with FSDP2.

Per optimizer step (:meth:`TorchTrainer.train_step`), every rank receives the same global batch
and plans the same split: samples are assigned to ranks balancing tokens, each rank's share is
packed into micro-batches of at most ``train.max_tokens_per_micro_batch`` tokens (and
``train.micro_batch_size`` samples), and ranks with fewer micro-batches run empty ones so every
rank makes the same collectives. Each micro-batch's loss is aggregated against the *global*
token/sequence counts (algorithms/aggregate.py) and multiplied by the world size (FSDP averages
gradients over ranks), so the summed gradient is exactly that of the whole batch at once,
whatever the split. Then the global grad norm is clipped and AdamW steps with the scheduled LR.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from miles_core.algorithms.aggregate import agg_length, aggregate_loss
from miles_core.config.schema import MilesConfig
from miles_core.errors import ConfigError
from miles_core.kernels.base import Kernels
from miles_core.precision.base import PrecisionRecipe
from miles_core.train import checkpoint as ckpt
from miles_core.train.base import LossFn, keeps_reference, no_response_tokens, step_if_finite, use_configured_hyperparameters
from miles_core.train.distributed import all_reduce_sum, init_from_env
from miles_core.train.fsdp import checkpoint_blocks, full_tensor, shard
from miles_core.train.lr import lr_at
from miles_core.train.on_policy import on_policy_old
from miles_core.train.packing import PackedMicroBatch, SegmentAttention, micro_batch_plan, pack, varlen_unavailable
from miles_core.types import LossInputs, TrainBatch


class PolicyForward(nn.Module):
    """Decoder + LM head -> logprobs and entropy of the response tokens of a packed micro-batch.

    The LM head is applied inside ``forward`` so that FSDP has gathered it; the [tokens, vocab]
    logits are handled by the kernel op "logprobs" in chunks.
    """

    def __init__(self, decoder: nn.Module, logprobs_op, cfg: MilesConfig, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.decoder = decoder
        self.logprobs_op = logprobs_op
        self.attention = cfg.train.attention
        self.chunk_size = cfg.train.logprob_chunk_size
        self.compute_dtype = compute_dtype

    def forward(self, mb: PackedMicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        attn = SegmentAttention(mb.cu_seqlens, mb.max_seqlen, self.attention)
        hidden = self.decoder(mb.input_ids, mb.positions, attn)[0]  # [S, H]
        h = hidden.index_select(0, mb.hidden_idx)  # [M, H]
        if self.compute_dtype is not None:
            h = h.to(self.compute_dtype)
        weight = self.decoder.lm_head.weight
        if h.shape[0] == 0:
            return no_response_tokens(hidden, weight)
        return self.logprobs_op(h, weight, mb.targets, temperature=temperature, chunk_size=self.chunk_size)


class TorchTrainer:
    on_policy_old_logprobs = True  # train_step accepts batch.old_logprobs=None (Trainer.train_step)

    def __init__(self, model: nn.Module, cfg: MilesConfig, device: torch.device, precision: PrecisionRecipe, kernels: Kernels):
        self.cfg = cfg
        self.dist, self.device = init_from_env(device)
        self.precision = precision
        t = cfg.train
        if t.attention == "varlen" and (why := varlen_unavailable(self.device, precision.compute_dtype)):
            raise ConfigError(f"train.attention=varlen needs flash-attention varlen (CUDA, bf16/fp16, torch >= 2.10) and "
                              f"{why}; set train.attention=auto (or sdpa, padded)")
        self.model = precision.prepare_model(model).to(self.device).train()  # the decoder (HF names)
        if hasattr(self.model, "use_kernels") and not t.compile:  # the registry's rmsnorm/rope/swiglu, as in the engine
            self.model.use_kernels(kernels)
        ref = copy.deepcopy(self.model).eval().requires_grad_(False) if keeps_reference(cfg) else None
        if t.compile:  # each block in place (parameter names unchanged); one graph serves every block
            for block in getattr(getattr(self.model, "model", None), "layers", []):
                block.compile(dynamic=True)
        if t.activation_checkpointing:
            checkpoint_blocks(self.model)
        op = kernels["logprobs"]
        self.policy = PolicyForward(self.model, op, cfg, precision.compute_dtype)
        self.ref = None if ref is None else PolicyForward(ref, op, cfg, precision.compute_dtype)
        if self.dist.enabled:
            shard(self.policy, self.model, precision.compute_dtype)
            if self.ref is not None:
                shard(self.ref, ref, precision.compute_dtype)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
        )
        self.step = 0  # scheduled optimizer steps taken (the LR scheduler's state)
        self.total_steps = cfg.run.num_rollout * t.updates_per_rollout

    # ------------------------------------------------------------------ forward passes
    def _temperature(self) -> float:
        temp = self.cfg.rollout.temperature
        return temp if temp > 0 else 1.0

    def _autocast(self):
        # under FSDP the mixed-precision policy casts the parameters; autocast is for one process
        return self.precision.autocast(self.device) if not self.dist.enabled else torch.autocast(self.device.type, enabled=False)

    def _my_micro_batches(self, batch: TrainBatch) -> list[list[int] | None]:
        """This rank's micro-batches; ``None`` = an empty one to keep the ranks in step."""
        t = self.cfg.train
        plan = micro_batch_plan(batch, self.dist.world_size, t.max_tokens_per_micro_batch)
        plan = [[g[i : i + t.micro_batch_size] for g in groups for i in range(0, len(g), t.micro_batch_size)] for groups in plan]
        count = max(len(groups) for groups in plan)
        mine: list[list[int] | None] = list(plan[self.dist.rank])
        return mine + [None] * (count - len(mine))

    def _forward(self, module: PolicyForward, batch: TrainBatch, group: list[int] | None, temperature: float):
        """(logprobs, entropy) [n, T] of the samples ``group`` (zeros off the responses)."""
        mb = pack(batch, [0] if group is None else group).to(self.device)  # None: a stand-in sample
        with self._autocast(), self.precision.kernel_mode(self.device):  # a plugin may swap kernels here
            lp, ent = module(mb, temperature)
        n, t_max = len(mb.sample_idx), batch.response_mask.shape[1]
        zeros = torch.zeros(n, t_max, device=self.device)
        return zeros.index_put((mb.rows, mb.cols), lp), zeros.index_put((mb.rows, mb.cols), ent)

    @torch.no_grad()
    def _logprobs(self, module: PolicyForward, batch: TrainBatch, temperature: float | None) -> torch.Tensor:
        temperature = self._temperature() if temperature is None else temperature
        out = torch.zeros(batch.response_mask.shape, device=self.device)
        for group in self._my_micro_batches(batch):
            lp, _ = self._forward(module, batch, group, temperature)
            if group is not None:
                idx = torch.tensor(group, device=self.device)
                out[idx] = lp * batch.response_mask[group].to(self.device)
        return all_reduce_sum(out).cpu()  # each row was filled by exactly one rank

    def compute_logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        """Old-policy pass: [N, T] logprobs under the current weights, no grad."""
        return self._logprobs(self.policy, batch, temperature)

    def compute_ref_logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        """Reference pass: [N, T] logprobs under the frozen copy of the initial weights."""
        if self.ref is None:
            raise ConfigError("reference logprobs need a reference model: set algorithm.kl_coef > 0")
        return self._logprobs(self.ref, batch, temperature)

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Make the KL reference a frozen copy of the current weights (no-op without a reference)."""
        if self.ref is not None:
            for dst, src in zip(self.ref.parameters(), self.policy.parameters(), strict=True):
                dst.copy_(src)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float | None = None, lr: float | None = None) -> dict[str, float]:
        """One optimizer step. ``lr`` overrides the schedule (and does not advance it)."""
        temperature = self._temperature() if temperature is None else temperature
        cfg, dev, world = self.cfg, self.device, self.dist.world_size
        if lr is None:
            lr = lr_at(self.step, cfg.train, self.total_steps)
            self.step += 1
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = int(batch.response_mask.sum())
        num_seqs, max_len = batch.num_samples, agg_length(cfg, batch)
        sums: dict[str, float] = defaultdict(float)
        for group in self._my_micro_batches(batch):
            logp, ent = self._forward(self.policy, batch, group, temperature)
            if group is None:
                (logp.sum() * 0.0).backward()
                continue
            mb = batch.select(torch.tensor(group))
            mask = mb.response_mask.to(dev)
            old, old_metrics = on_policy_old(logp * mask, mb, mask)
            inputs = LossInputs(
                logprobs=logp * mask,
                old_logprobs=old,
                advantages=mb.advantages.to(dev),
                response_mask=mask,
                rollout_logprobs=None if mb.rollout_logprobs is None else mb.rollout_logprobs.to(dev),
                ref_logprobs=None if mb.ref_logprobs is None else mb.ref_logprobs.to(dev),
                entropy=ent * mask,
                teacher_logprobs=None if mb.teacher_logprobs is None else mb.teacher_logprobs.to(dev),
            )
            out = loss_fn(inputs)
            loss = aggregate_loss(out.loss, mask, cfg.algorithm, num_tokens, num_seqs, max_len)
            (loss * world).backward()
            sums["loss"] += float(loss.detach())
            share = float(mask.sum()) / max(num_tokens, 1)
            for k, v in {**old_metrics, **out.metrics}.items():  # mismatch_kl: the loss's, if it has one, not twice
                sums[k] += v * share
            sums["entropy"] += float((ent.detach() * mask).sum()) / max(num_tokens, 1)
        metrics = self._reduce_metrics(sums)
        clip = cfg.train.grad_clip
        params = [p for p in self.policy.parameters() if p.grad is not None]
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        skipped = step_if_finite(self.optimizer, grad_norm)  # the same norm on every rank: all skip, or none
        return {**metrics, "grad_norm": grad_norm, "lr": lr, "grad_nonfinite_skipped": skipped}

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        if not self.dist.enabled:
            return {"loss": 0.0, **sums}
        keys: list = [None] * self.dist.world_size
        dist.all_gather_object(keys, sorted(sums))
        names = sorted({k for ks in keys for k in ks} | {"loss"})
        values = all_reduce_sum(torch.tensor([sums.get(k, 0.0) for k in names], dtype=torch.float64))
        return dict(zip(names, values.tolist()))

    # ------------------------------------------------------------------ weights and checkpoints
    def weights(self) -> Mapping[str, torch.Tensor]:
        """Full (unsharded) tensors, HF names; under FSDP every rank gathers them."""
        return {k: full_tensor(v).detach() for k, v in self.model.state_dict().items()}

    def save(self, path: Path) -> None:
        """Sharded checkpoint (torch.distributed.checkpoint) of model, optimizer, scheduler step
        and reference model into ``path``; call on every rank. The loop makes it atomic."""
        ckpt.save_trainer(Path(path), self)

    def load(self, path: Path) -> None:
        ckpt.load_trainer(Path(path), self)
        use_configured_hyperparameters(self.optimizer, self.cfg.train.lr, self.cfg.train)

    def export_hf(self, family, dest: Path, extra_files: dict[str, str] | None = None) -> None:
        """Write the policy as an HF safetensors folder (rank 0 writes; every rank gathers)."""
        from miles_core.models.checkpoint import save_hf_state

        state = {k: v.cpu() for k, v in self.weights().items()}
        if self.dist.is_main:
            save_hf_state(state, self.model.config, family, Path(dest), extra_files)
        if self.dist.enabled:
            dist.barrier()
