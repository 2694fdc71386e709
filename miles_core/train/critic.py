"""The PPO critic: a value model with its own optimizer, used only when ``advantage_estimator=ppo``.

The value model is a copy of the policy's decoder body (initialised from the policy's weights)
with a scalar head, V(s_t) = w . h_t + b, where h_t is the final hidden state at the position
that predicts response token t (the state before the action y_t). The head starts at zero, so
the first values are 0.

Value loss with clipping (as in PPO implementations for LLMs, e.g. Ouyang et al. 2022), over the
response tokens, with V_old the values at rollout time and R the returns (GAE targets):

    V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2),   aggregated as the mean over all tokens

Shapes: ``compute_values(batch)`` -> [N, T] (zero on padding); ``train_step`` reads
``batch.returns`` and ``batch.values`` [N, T].
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from miles_core.config.schema import MilesConfig
from miles_core.train.base import step_if_finite, use_configured_hyperparameters
from miles_core.types import TrainBatch


class Critic:
    def __init__(self, policy: nn.Module, cfg: MilesConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.body = copy.deepcopy(policy).float().to(device).train()
        self.body.lm_head = nn.Identity()  # the body's forward returns hidden states; no logits needed
        hidden = self.body.config.hidden_size
        self.head = nn.Linear(hidden, 1).to(device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        t = cfg.train
        params = list(self.body.parameters()) + list(self.head.parameters())
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.algorithm.critic_lr or t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
        )

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        dev = self.device
        length = int((mb.prompt_lens + mb.response_lens).max())
        ids = mb.input_ids[:, :length].to(dev)
        t_max = mb.response_mask.shape[1]
        hidden = self.body(ids)  # [n, L, H]
        idx = (mb.prompt_lens.to(dev)[:, None] - 1 + torch.arange(t_max, device=dev)).clamp(max=length - 1)
        h = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.head(h).squeeze(-1) * mb.response_mask.to(dev)

    def state_dict(self) -> dict:
        """Value model, head and optimizer: what a checkpoint keeps so that a resumed run continues the critic."""
        return {"body": self.body.state_dict(), "head": self.head.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.body.load_state_dict(state["body"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optim"])
        use_configured_hyperparameters(self.optimizer, self.cfg.algorithm.critic_lr or self.cfg.train.lr, self.cfg.train)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        mbs = self.cfg.train.micro_batch_size
        return torch.cat([self._values(batch.select(slice(i, i + mbs))).cpu() for i in range(0, batch.num_samples, mbs)])

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the clipped value loss over ``batch`` (micro-batched)."""
        if batch.returns is None or batch.values is None:
            raise ValueError("the critic trains on batch.returns and batch.values (set by the ppo estimator)")
        clip = self.cfg.algorithm.value_clip
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = max(float(batch.response_mask.sum()), 1.0)
        mbs = self.cfg.train.micro_batch_size
        total, clipped_tokens, sq_err = 0.0, 0.0, 0.0
        for start in range(0, batch.num_samples, mbs):
            mb = batch.select(slice(start, start + mbs))
            mask = mb.response_mask.to(self.device)
            ret, old = mb.returns.to(self.device), mb.values.to(self.device)
            v = self._values(mb)
            v_clip = old + (v - old).clamp(-clip, clip)
            loss_unclipped, loss_clipped = (v - ret) ** 2, (v_clip - ret) ** 2
            per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
            loss = (per_token * mask).sum() / num_tokens
            loss.backward()
            total += float(loss.detach())
            clipped_tokens += float(((loss_clipped > loss_unclipped).float() * mask).sum())
            sq_err += float(((old - ret) ** 2 * mask).sum())
        grad_clip = self.cfg.train.grad_clip
        params = [p for p in list(self.body.parameters()) + list(self.head.parameters()) if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")))
        skipped = step_if_finite(self.optimizer, grad_norm)
        mask = batch.response_mask
        ret_var = float(((batch.returns - (batch.returns * mask).sum() / num_tokens) ** 2 * mask).sum() / num_tokens)
        return {
            "value_loss": total,
            "value_clip_frac": clipped_tokens / num_tokens,
            "value_grad_norm": grad_norm,
            "value_grad_nonfinite_skipped": skipped,
            # 1 - MSE(V_old, R) / Var(R): how much of the return the rollout-time values explained
            "value_explained_var": 1.0 - (sq_err / num_tokens) / max(ret_var, 1e-8),
        }
