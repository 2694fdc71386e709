"""The torch trainer: one process, AdamW, micro-batches with exact gradient accumulation."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from miles_core.algorithms.aggregate import aggregate_loss
from miles_core.config.schema import MilesConfig
from miles_core.kernels.base import Kernels
from miles_core.precision.base import PrecisionRecipe
from miles_core.train.base import LossFn
from miles_core.types import LossInputs, TrainBatch


class TorchTrainer:
    def __init__(self, model: nn.Module, cfg: MilesConfig, device: torch.device, precision: PrecisionRecipe, kernels: Kernels):
        self.cfg = cfg
        self.device = device
        self.precision = precision
        self.logprobs_op = kernels["logprobs"]
        self.model = precision.prepare_model(model).to(device).train()
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
        )

    # ------------------------------------------------------------------ logprobs
    def _temperature(self) -> float:
        temp = self.cfg.rollout.temperature
        return temp if temp > 0 else 1.0

    def response_logprobs(self, mb: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy), each [n, T], for the response tokens of a micro-batch."""
        with self.precision.kernel_mode(self.device):
            return self._response_logprobs(mb, temperature)

    def _response_logprobs(self, mb: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        length = int((mb.prompt_lens + mb.response_lens).max())
        ids = mb.input_ids[:, :length].to(dev)
        n, t_max = mb.response_mask.shape
        with self.precision.autocast(dev):
            hidden = self.model(ids)  # [n, L, H]
        # hidden state at position p predicts token p + 1
        idx = (mb.prompt_lens.to(dev)[:, None] - 1 + torch.arange(t_max, device=dev)).clamp(max=length - 2)
        h = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        targets = ids.gather(1, idx + 1)
        weight = self.model.lm_head.weight
        lp, ent = self.logprobs_op(h.reshape(n * t_max, -1).to(weight.dtype), weight, targets.reshape(-1), temperature=temperature)
        mask = mb.response_mask.to(dev)
        return lp.view(n, t_max) * mask, ent.view(n, t_max) * mask

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        temperature = self._temperature() if temperature is None else temperature
        mbs = self.cfg.train.micro_batch_size
        out = [
            self.response_logprobs(batch.select(slice(i, i + mbs)), temperature)[0].cpu()
            for i in range(0, batch.num_samples, mbs)
        ]
        return torch.cat(out)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float | None = None, lr: float | None = None) -> dict[str, float]:
        temperature = self._temperature() if temperature is None else temperature
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr if lr is not None else cfg.train.lr
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = int(batch.response_mask.sum())
        num_seqs = batch.num_samples
        max_len = batch.response_mask.shape[1]
        mbs = cfg.train.micro_batch_size
        sums: dict[str, float] = defaultdict(float)
        total_loss = 0.0
        dev = self.device
        for start in range(0, num_seqs, mbs):
            mb = batch.select(slice(start, start + mbs))
            logp, ent = self.response_logprobs(mb, temperature)
            mask = mb.response_mask.to(dev)
            inputs = LossInputs(
                logprobs=logp,
                old_logprobs=mb.old_logprobs.to(dev),
                advantages=mb.advantages.to(dev),
                response_mask=mask,
                rollout_logprobs=mb.rollout_logprobs.to(dev),
                ref_logprobs=None if mb.ref_logprobs is None else mb.ref_logprobs.to(dev),
                entropy=ent,
                teacher_logprobs=None if mb.teacher_logprobs is None else mb.teacher_logprobs.to(dev),
            )
            out = loss_fn(inputs)
            loss = aggregate_loss(out.loss, mask, cfg.algorithm, num_tokens, num_seqs, max_len)
            loss.backward()
            total_loss += float(loss.detach())
            share = float(mask.sum()) / max(num_tokens, 1)
            for k, v in out.metrics.items():
                sums[k] += v * share
            sums["entropy"] += float((ent.detach() * mask).sum()) / max(num_tokens, 1)
        clip = cfg.train.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        return {"loss": total_loss, "grad_norm": float(grad_norm), **sums}

    # ------------------------------------------------------------------ weights
    def weights(self) -> Mapping[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, path: Path) -> None:
        from miles_core.models.checkpoint import atomic_dir

        def write(tmp: Path) -> None:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, tmp / "trainer.pt")

        atomic_dir(Path(path), write)

    def load(self, path: Path) -> None:
        state = torch.load(Path(path) / "trainer.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
