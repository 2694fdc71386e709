"""The Megatron trainer: a megatron-core GPTModel behind the same interface as TorchTrainer.

The loss is computed exactly as in :class:`miles_core.train.torch_trainer.TorchTrainer`: the
hidden state at position p predicts token p + 1, response logprobs come from the kernel
registry's ``logprobs`` op (or its vocab-parallel form when tensor_parallel > 1), the per-token
loss of the algorithm is aggregated with :func:`miles_core.algorithms.aggregate.aggregate_loss`
over the global batch, gradients are accumulated over micro-batches and clipped to
``train.grad_clip`` in global norm. What differs is the forward: each micro-batch is packed into
one row of ``sum(len_i)`` tokens (THD layout, no padding), with sequence boundaries in
Megatron's ``PackedSeqParams`` so that RoPE positions and causal attention restart per sample.

Optimizer: ``torch.optim.AdamW`` over the model's fp32 parameters, on CPU and GPU (megatron-core's
own optimizer wants its DDP wrapper and CUDA; with one data-parallel rank AdamW is the same update),
at the LR of the torch trainer's schedule (:mod:`miles_core.train.lr`; its step count is checkpointed).
Weights leave the trainer in HF names (:mod:`miles_core.train.megatron.convert`), gathered over TP.
Not supported yet: pipeline / context parallelism and data parallelism (world size > TP).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from miles_core.algorithms.aggregate import agg_length, aggregate_loss
from miles_core.config.schema import MilesConfig
from miles_core.errors import ConfigError
from miles_core.kernels.base import Kernels
from miles_core.precision.base import PrecisionRecipe
from miles_core.train.base import LossFn, keeps_reference, no_response_tokens, step_if_finite, use_configured_hyperparameters
from miles_core.train.lr import lr_at
from miles_core.train.megatron import convert
from miles_core.train.megatron.arch import Arch
from miles_core.train.megatron.build import build_gpt, init_parallel, padded_vocab
from miles_core.train.megatron.logprobs import vocab_parallel_logprobs
from miles_core.train.on_policy import on_policy_old
from miles_core.train.packing import SegmentAttention
from miles_core.types import LossInputs, TrainBatch


class MegatronTrainer:
    on_policy_old_logprobs = True  # train_step accepts batch.old_logprobs=None (Trainer.train_step)

    def __init__(self, arch: Arch, hf_state: Mapping[str, torch.Tensor], cfg: MilesConfig, device: torch.device,
                 precision: PrecisionRecipe, kernels: Kernels):
        from megatron.core import parallel_state as ps

        self.cfg, self.arch, self.device, self.precision = cfg, arch, device, precision
        self.mcfg = cfg.train.megatron
        self.mcfg.validate()
        if precision.param_dtype != torch.float32:
            raise ConfigError(f"train.precision '{precision.name}': the Megatron trainer keeps fp32 master weights; use fp32 or bf16")
        self.logprobs_op = kernels["logprobs"]
        if device.type != "cuda":
            try:  # megatron-core creates tensors on torch.cuda.current_device() in places
                torch.cuda.current_device()
            except (AssertionError, RuntimeError):
                raise ConfigError(
                    "train.backend=megatron needs a CUDA device (megatron-core assumes CUDA); use train.backend=torch on CPU"
                ) from None
        init_parallel(self.mcfg, device)
        if device.type == "cuda":
            self.device = device = torch.device("cuda", torch.cuda.current_device())
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.ep = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        if dist.get_world_size() != self.tp:
            raise ConfigError(
                f"the Megatron trainer runs no data parallelism yet: world size {dist.get_world_size()} must equal "
                f"train.megatron.tensor_parallel ({self.tp}) (so expert_parallel must be 1)"
            )
        self.vocab_padded = padded_vocab(arch, self.tp)
        recompute = bool(getattr(cfg.train, "activation_checkpointing", False))  # the torch trainer's switch, when present
        self.model = build_gpt(arch, self.mcfg, device, bf16=precision.compute_dtype == torch.bfloat16, recompute=recompute)
        self.te = self._is_te()
        self.load_hf(hf_state)
        self.model.train()
        if cfg.train.compile:  # each transformer layer in place (state-dict names unchanged), as the torch trainer's blocks
            for layer in self.model.decoder.layers:
                layer.compile(dynamic=True)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
        )
        self.step = 0  # scheduled optimizer steps taken (the LR scheduler's state, saved with the checkpoint)
        self.total_steps = cfg.run.num_rollout * t.updates_per_rollout
        self.reset_reference()  # as the torch trainer's: the initial weights until the loop snapshots RL's start

    # ------------------------------------------------------------------ weights in HF names
    def _is_te(self) -> bool:
        return any(k.endswith("layer_norm_weight") for k in self.model.state_dict())

    def load_hf(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        state = convert.hf_to_megatron(dict(hf_state), self.arch, self.vocab_padded, self.tp, self.tp_rank, self.ep, self.ep_rank)
        if self.te:
            state = convert.to_te_names(state, self.arch)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and k != "output_layer.weight"]
        if missing or unexpected:
            raise ConfigError(f"HF -> Megatron conversion does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}")

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current weights in HF names (full tensors, gathered over tensor-parallel ranks)."""
        local = {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        hf = self.to_hf(local)
        if self.arch.tie_word_embeddings:  # the engine's model has the tied head as its own key
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return hf

    def to_hf(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Any per-parameter tensors of this rank (weights, grads) -> full tensors in HF names."""
        local = convert.from_te_names(local, self.arch)
        if self.arch.tie_word_embeddings:
            local.pop("output_layer.weight", None)
        if self.arch.is_moe:
            local = convert.globalize_experts(local, self.ep_rank, self.arch.num_experts // self.ep)
        if self.tp == 1:
            return convert.megatron_to_hf([local], self.arch)
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        for k in sorted(local):
            parts = [torch.empty_like(local[k]) for _ in range(self.tp)]
            dist.all_gather(parts, local[k].contiguous(), group=self.tp_group)
            for r in range(self.tp):
                shards[r][k] = parts[r]
        return convert.megatron_to_hf(shards, self.arch)

    # ------------------------------------------------------------------ forward
    def _head(self) -> torch.Tensor:
        return self.model.shared_embedding_or_output_weight() if self.arch.tie_word_embeddings else self.model.output_layer.weight

    def _hidden(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Packed forward: (final hidden states [sum len_i, H], packed ids [sum len_i], offsets)."""
        from miles_core.train.megatron.attention import PackedSegments

        dev = self.device
        lens = (mb.prompt_lens + mb.response_lens).tolist()
        ids = torch.cat([mb.input_ids[i, :n] for i, n in enumerate(lens)]).to(dev)
        pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32, device=dev)
        with self.precision.autocast(dev):
            emb = self.model.embedding(input_ids=ids[None], position_ids=pos[None])  # [total, 1, H]
            # a transposed [1, total, H] (stride total * H on the batch dim): with the strides of the layers'
            # own outputs every compiled layer takes the same graph (else dynamo recompiles the first)
            emb = emb[:, 0].unsqueeze(1)
            if self.te:  # TransformerEngine's attention takes THD with the boundaries on the GPU
                psp = PackedSegments(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                                     max_seqlen_kv=max(lens))
                rope = self.model.rotary_pos_emb(max(lens), packed_seq=True)
            else:  # SBHD, batch 1: one RoPE row per token, positions restarting per sample (attention.py)
                segments = SegmentAttention(cu, max(lens), self.cfg.train.attention, bounds=offsets)
                psp = PackedSegments(qkv_format="sbhd", segments=segments)
                rope = self.model.rotary_pos_emb(max(lens)).index_select(0, pos)
            hidden = self.model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=psp)
        return hidden[:, 0], ids, offsets

    def response_logprobs(self, mb: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy), each [n, T], for the response tokens of a micro-batch (zeros off the mask).
        The forward (model and logprob op) runs inside the precision recipe's kernel_mode, as in the torch
        trainer: a plugin's recipe (e.g. a batch-invariant mode) swaps its kernels there."""
        with self.precision.kernel_mode(self.device):
            return self._response_logprobs(mb, temperature)

    def _response_logprobs(self, mb: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        hidden, ids, offsets = self._hidden(mb)
        n, t_max = mb.response_mask.shape
        rows, cols, where = [], [], []
        for i in range(n):
            r = int(mb.response_lens[i])
            start = offsets[i] + int(mb.prompt_lens[i]) - 1  # this position predicts the first response token
            rows += [i] * r
            cols += list(range(r))
            where.append(torch.arange(start, start + r))
        where = torch.cat(where).to(dev)
        h = hidden.index_select(0, where)
        targets = ids.index_select(0, where + 1)
        weight = self._head()
        if where.numel() == 0:
            lp, ent = no_response_tokens(hidden, weight)
        elif self.tp == 1:
            # the head's GEMM in the recipe's compute dtype, as in the torch trainer (the op casts the fp32
            # master head to it); fp32 hidden states made the LM head an fp32 GEMM under bf16
            cd = self.precision.compute_dtype or weight.dtype
            lp, ent = self.logprobs_op(h.to(cd), weight[: self.arch.vocab_size], targets, temperature=temperature,
                                       chunk_size=self.cfg.train.logprob_chunk_size)
        else:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            # identity forward, all-reduce backward: each rank's head shard gives a partial dL/dh
            h = copy_to_tensor_model_parallel_region(h)
            lp, ent = vocab_parallel_logprobs(
                h.to(weight.dtype), weight, targets, vocab_start=self.tp_rank * weight.shape[0],
                vocab_size=self.arch.vocab_size, group=self.tp_group, temperature=temperature,
                chunk_size=self.cfg.train.logprob_chunk_size,
            )
        idx = (torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(cols, dtype=torch.long, device=dev))
        mask = mb.response_mask.to(dev)
        logp = torch.zeros(n, t_max, device=dev).index_put(idx, lp)
        entropy = torch.zeros(n, t_max, device=dev).index_put(idx, ent)
        return logp * mask, entropy * mask

    def _temperature(self) -> float:
        temp = self.cfg.rollout.temperature
        return temp if temp > 0 else 1.0

    def micro_batches(self, batch: TrainBatch) -> list[slice]:
        """Consecutive samples, at most ``train.micro_batch_size`` of them and (when the config has
        it) at most ``train.max_tokens_per_micro_batch`` packed tokens; a longer sample goes alone."""
        t = self.cfg.train
        budget = getattr(t, "max_tokens_per_micro_batch", None) or float("inf")
        lens = (batch.prompt_lens + batch.response_lens).tolist()
        out, start, used = [], 0, 0
        for i, n in enumerate(lens):
            if i > start and (i - start >= t.micro_batch_size or used + n > budget):
                out.append(slice(start, i))
                start, used = i, 0
            used += n
        if start < len(lens):
            out.append(slice(start, len(lens)))
        return out

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        temperature = self._temperature() if temperature is None else temperature
        out = [self.response_logprobs(batch.select(sl), temperature)[0].cpu() for sl in self.micro_batches(batch)]
        return torch.cat(out)

    # ------------------------------------------------------------------ training
    # ------------------------------------------------------------------ KL reference
    @torch.no_grad()
    def reset_reference(self) -> None:
        """Snapshot the current weights as the frozen KL reference (only when a KL term needs one)."""
        self._ref = [p.detach().clone() for p in self.model.parameters()] if keeps_reference(self.cfg) else None

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        """Logprobs under the reference snapshot: swap it into the model, score, swap back."""
        if self._ref is None:
            raise ConfigError("reference logprobs need a reference model: set algorithm.kl_coef > 0")
        params = list(self.model.parameters())
        current = [p.detach().clone() for p in params]
        for p, r in zip(params, self._ref, strict=True):
            p.copy_(r)
        try:
            return self.compute_logprobs(batch, temperature)
        finally:
            for p, c in zip(params, current, strict=True):
                p.copy_(c)

    def export_hf(self, family, dest: Path, extra_files: dict[str, str] | None = None) -> None:
        from miles_core.models.checkpoint import save_hf_state

        save_hf_state(dict(self.weights()), self.decoder_config, family, Path(dest), extra_files)

    def _reduce_replicated_grads(self) -> None:
        """Sum over TP ranks the grads of replicated params that each rank only partly sees: the
        q/k layernorms (each rank normalizes its own heads) and, with sequence parallelism, the
        norms that see a slice of the sequence (params Megatron marks ``sequence_parallel``)."""
        if self.tp == 1:
            return
        for name, p in self.model.named_parameters():
            if p.grad is not None and (getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=self.tp_group)

    def _clip(self, max_norm: float) -> float:
        """Global grad norm over all TP ranks (a TP-replicated parameter counts once), then clip."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.tp == 1:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in params:
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq, group=self.tp_group)
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.mul_(coef)
        return norm

    def _set_aux_loss_scale(self, share: float) -> None:
        """megatron-core adds a micro-batch's MoE load-balancing loss (``train.megatron.moe_aux_loss_coeff``) to its
        backward at a process-wide scale, 1 unless set (Megatron's own schedule sets 1 / micro-batches). The
        micro-batch's share of the step's packed tokens keeps the aux gradient independent of the split, as the
        policy loss's is (one scale per backward: set before each)."""
        if self.arch.is_moe:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(share, dtype=torch.float32, device=self.device))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float | None = None, lr: float | None = None) -> dict[str, float]:
        """One optimizer step. ``lr`` overrides the schedule (and does not advance it), as in the torch trainer."""
        temperature = self._temperature() if temperature is None else temperature
        cfg = self.cfg
        if lr is None:
            lr = lr_at(self.step, cfg.train, self.total_steps)
            self.step += 1
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = int(batch.response_mask.sum())
        num_seqs = batch.num_samples
        max_len = agg_length(cfg, batch)
        sums: dict[str, float] = defaultdict(float)
        total_loss = 0.0
        dev = self.device
        packed_tokens = max(int((batch.prompt_lens + batch.response_lens).sum()), 1)
        for sl in self.micro_batches(batch):
            mb = batch.select(sl)
            logp, ent = self.response_logprobs(mb, temperature)
            mask = mb.response_mask.to(dev)
            old, old_metrics = on_policy_old(logp, mb, mask)
            inputs = LossInputs(
                logprobs=logp,
                old_logprobs=old,
                advantages=mb.advantages.to(dev),
                response_mask=mask,
                rollout_logprobs=None if mb.rollout_logprobs is None else mb.rollout_logprobs.to(dev),
                ref_logprobs=None if mb.ref_logprobs is None else mb.ref_logprobs.to(dev),
                entropy=ent,
                teacher_logprobs=None if mb.teacher_logprobs is None else mb.teacher_logprobs.to(dev),
            )
            out = loss_fn(inputs)
            loss = aggregate_loss(out.loss, mask, cfg.algorithm, num_tokens, num_seqs, max_len)
            self._set_aux_loss_scale(int((mb.prompt_lens + mb.response_lens).sum()) / packed_tokens)
            loss.backward()
            total_loss += float(loss.detach())
            share = float(mask.sum()) / max(num_tokens, 1)
            for k, v in {**old_metrics, **out.metrics}.items():  # mismatch_kl: the loss's, if it has one, not twice
                sums[k] += v * share
            sums["entropy"] += float((ent.detach() * mask).sum()) / max(num_tokens, 1)
        self._reduce_replicated_grads()
        clip = cfg.train.grad_clip
        grad_norm = self._clip(clip if clip > 0 else float("inf"))
        skipped = step_if_finite(self.optimizer, grad_norm)  # the norm is reduced over TP ranks: all skip, or none
        return {"loss": total_loss, "grad_norm": grad_norm, "lr": lr, "grad_nonfinite_skipped": skipped, **sums}

    # ------------------------------------------------------------------ checkpoints
    def _file(self) -> str:
        return "trainer.pt" if self.tp == 1 else f"trainer-tp{self.tp_rank}.pt"

    def _state(self) -> dict:
        """Model, optimizer, scheduler step and the KL reference (a resumed run calls no reset_reference)."""
        model = {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        return {"model": model, "optimizer": self.optimizer.state_dict(), "step": self.step, "ref": self._ref}

    def _not_mine(self, path: Path) -> str:
        """Why ``path`` holds no checkpoint file of this rank: another backend's or another TP size's, or none."""
        from miles_core.train.checkpoint import TRAINER_META

        if (path / TRAINER_META).is_file():
            return f"'{path}' was saved by train.backend=torch; resume it with train.backend=torch"
        shards = len(list(path.glob("trainer-tp*.pt"))) or int((path / "trainer.pt").is_file())
        if shards == self.tp:
            return f"'{path}' lacks {self._file()} of its {shards} tensor-parallel shards: an incomplete checkpoint"
        if shards:
            return (f"'{path}' was saved with train.megatron.tensor_parallel={shards}; resume it with that setting "
                    f"(this run has {self.tp})")
        return f"'{path}' is not a trainer checkpoint (no {self._file()}); point run.load at a --save folder"

    def save(self, path: Path) -> None:
        path = Path(path)
        if self.tp == 1:
            from miles_core.models.checkpoint import atomic_dir

            atomic_dir(path, lambda tmp: torch.save(self._state(), tmp / self._file()))
            return
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{self._file()}.tmp"
        torch.save(self._state(), tmp)
        tmp.replace(path / self._file())
        dist.barrier(group=self.tp_group)

    def load(self, path: Path) -> None:
        file = Path(path) / self._file()
        if not file.is_file():
            raise ConfigError(self._not_mine(Path(path)))
        state = torch.load(file, map_location=self.device, weights_only=True)
        saved_ref = state.get("ref")
        if (saved_ref is None) != (self._ref is None):
            raise ConfigError(
                f"'{path}' was saved {'without' if saved_ref is None else 'with'} a reference model; "
                f"resume with the same algorithm.kl_coef (> 0 keeps a reference model)"
            )
        self.model.load_state_dict(state["model"], strict=False)
        if saved_ref is not None:
            with torch.no_grad():
                for r, s in zip(self._ref, saved_ref, strict=True):
                    r.copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])
        use_configured_hyperparameters(self.optimizer, self.cfg.train.lr, self.cfg.train)
        self.step = int(state.get("step", 0))  # a checkpoint from before the schedule was followed: from the start
