"""The Megatron trainer against the torch trainer (same weights, same batch) and against transformers (MoE)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from megatron_helpers import VOCAB, batch, hf_model, hf_response_logprobs

from miles_core.algorithms.aggregate import aggregate_loss
from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.losses import ppo_clip
from miles_core.config.schema import MilesConfig
from miles_core.kernels.logprobs import logprobs_torch
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.precision.base import PrecisionRecipe
from miles_core.train.megatron import convert
from miles_core.train.megatron.arch import arch_from_decoder, arch_from_hf
from miles_core.train.megatron.logprobs import vocab_parallel_logprobs
from miles_core.train.torch_trainer import TorchTrainer
from miles_core.types import LossInputs
from torch.overrides import TorchFunctionMode

KERNELS = {"logprobs": logprobs_torch}
FP32 = PrecisionRecipe("fp32")


def _config(loss_agg: str) -> MilesConfig:
    cfg = MilesConfig()
    cfg.train.micro_batch_size = 2  # 3 samples -> two micro-batches, exercising accumulation
    cfg.train.lr = 1e-2
    cfg.train.grad_clip = 0.5  # small enough that clipping is active
    cfg.rollout.temperature = 0.8
    cfg.algorithm = AlgorithmConfig(loss_agg=loss_agg)
    return cfg


def off_policy(logprobs: torch.Tensor, b) -> torch.Tensor:
    """Old-policy logprobs off by a seeded amount, so that the PPO ratio is not 1 and clipping is active."""
    return (logprobs + 0.3 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(2))) * b.response_mask


def _decoder(qk_norm: bool, tied: bool) -> Decoder:
    torch.manual_seed(0)
    dec = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=48, qk_norm=qk_norm, tie_word_embeddings=tied))
    with torch.no_grad():
        for name, p in dec.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return dec


@pytest.mark.parametrize("qk_norm,tied,loss_agg", [(True, True, "token_mean"), (False, False, "seq_mean_token_mean")])
def test_same_logprobs_loss_and_update_as_torch_trainer(megatron_cpu, qk_norm, tied, loss_agg):
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config(loss_agg)
    dec = _decoder(qk_norm, tied)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    torch_tr = TorchTrainer(dec, cfg, torch.device("cpu"), FP32, KERNELS)
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()

    lp_t, lp_m = torch_tr.compute_logprobs(b), mega.compute_logprobs(b)
    assert lp_t.abs().max() > 1.0
    torch.testing.assert_close(lp_m, lp_t, atol=1e-5, rtol=0)

    b.old_logprobs = off_policy(lp_t, b)
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    m_t = torch_tr.train_step(b, loss_fn)
    m_m = mega.train_step(b, loss_fn)
    assert m_t["clip_frac"] > 0
    assert m_t["grad_norm"] > cfg.train.grad_clip  # the clip really scaled the gradient
    for key in ("loss", "grad_norm", "clip_frac", "approx_kl", "entropy"):
        assert m_m[key] == pytest.approx(m_t[key], abs=1e-5, rel=1e-5), key

    # the clipped gradients, in HF names, agree to fp32 rounding
    grads_t = {n: p.grad for n, p in torch_tr.model.named_parameters()}
    grads_m = _megatron_grads(mega)
    for k, g in grads_t.items():
        torch.testing.assert_close(grads_m[k], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"grad {k}: {m}")

    after_t = torch_tr.weights()
    after_m = mega.weights()
    assert set(after_m) == set(after_t)
    moved = max(float((after_t[k] - state[k]).abs().max()) for k in after_t)
    assert moved > 5e-3  # the step moved the weights (lr 1e-2) ...
    # ... and both trainers moved them the same way. Adam's first step is ~lr * g / (|g| + eps), which amplifies
    # fp32 rounding where |g| is tiny (an element there came to 8.2e-5 apart, 2026-12-07): elements with
    # |g| > 1e-4 must agree to 1% of one step (1e-4); the rest to within one full step each way (2 lr).
    lr, firm_count = cfg.train.lr, 0
    for k in after_t:
        firm = grads_t.get(k, grads_t["model.embed_tokens.weight"]).abs() > 1e-4  # lm_head: tied to the embedding
        firm_count += int(firm.sum())
        torch.testing.assert_close(after_m[k][firm], after_t[k][firm], atol=1e-4, rtol=0, msg=lambda m: f"{k}: {m}")
        assert (after_m[k] - after_t[k]).abs().max() <= 2 * lr + 1e-6, k
    assert firm_count > 0.5 * sum(int((g != 0).sum()) for g in grads_t.values())  # most updated elements checked tightly


def test_a_non_integer_rope_base_gives_the_torch_trainers_logprobs(megatron_cpu):
    """rotary_base was passed to Megatron as int(rope_theta): a base of 2.5 ran as 2, so the Megatron trainer computed
    other logprobs than the torch trainer and the engine for the same weights."""
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dec = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=48, rope_theta=2.5))
    with torch.no_grad():
        for name, p in dec.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    cfg = _config("token_mean")
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    lp_t = TorchTrainer(dec, cfg, torch.device("cpu"), FP32, KERNELS).compute_logprobs(batch())
    lp_m = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS).compute_logprobs(batch())
    assert lp_t.abs().max() > 1.0
    torch.testing.assert_close(lp_m, lp_t, atol=1e-5, rtol=0)


def _megatron_grads(trainer) -> dict[str, torch.Tensor]:
    return trainer.to_hf({n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None})


def test_moe_train_step_matches_transformers(megatron_cpu):
    """Qwen3-MoE: one SFT step of the Megatron trainer equals the same step taken by hand on the
    transformers model (same logprobs, aggregation, clipping and AdamW), router and experts included."""
    from miles_core.algorithms.losses import sft
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    cfg.rollout.temperature = 1.0
    model = hf_model("qwen3_moe")
    arch = arch_from_hf(model.config.to_dict())
    mega = MegatronTrainer(arch, model.state_dict(), cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()
    loss_fn = functools.partial(sft, cfg=cfg.algorithm)
    metrics = mega.train_step(b, loss_fn)

    # the reference step on transformers
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay)
    model.train()
    lp = hf_response_logprobs(model, b)
    out = loss_fn(LossInputs(lp, b.old_logprobs, b.advantages, b.response_mask))
    loss = aggregate_loss(out.loss, b.response_mask, cfg.algorithm, int(b.response_mask.sum()), b.num_samples, b.response_mask.shape[1])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), t.grad_clip)
    before = convert.split_fused_experts({n: p.detach().clone() for n, p in model.named_parameters()})
    opt.step()
    assert metrics["loss"] == pytest.approx(float(loss), abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    ref_grads = convert.split_fused_experts({n: p.grad for n, p in model.named_parameters()})
    got_grads = _megatron_grads(mega)
    for k, g in ref_grads.items():
        torch.testing.assert_close(got_grads[k], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"grad {k}: {m}")
    ref = convert.split_fused_experts(dict(model.state_dict()))
    got = mega.weights()
    # Adam's first step is lr * g / (|g| + eps), whose slope in g is lr * eps / (|g| + eps)^2: where
    # 0 < |g| < 1e-6 (router entries and rarely routed expert rows reach 1e-8), gradients that agree
    # to the bound above may still step differently, even in sign. Those few entries are held to the
    # size of one step; every other entry (zero gradients of unrouted experts included) to 2% of one.
    held = total = 0
    for k, v in ref.items():
        settled = (ref_grads[k].abs() > 1e-6) | (ref_grads[k] == 0)
        torch.testing.assert_close(got[k][settled], v[settled], atol=2e-4, rtol=0, msg=lambda m: f"{k}: {m}")
        decay = t.lr * t.weight_decay * before[k].abs()
        assert bool(((got[k] - before[k]).abs() <= t.lr * 1.001 + decay).all()), k
        held, total = held + int(settled.sum()), total + settled.numel()
    assert held > 0.99 * total, (held, total)


def test_vocab_parallel_logprobs_equals_reference_at_tp1(megatron_cpu):
    """At one TP rank the reductions are identities: values and gradients equal logprobs_torch;
    a padded vocab row (index >= vocab_size) is masked out."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(7, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 6, (10,), generator=g)
    lp, ent = vocab_parallel_logprobs(h, w, y, vocab_start=0, vocab_size=6, temperature=0.7, chunk_size=4)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp2, ent2 = logprobs_torch(h2, w2[:6], y, temperature=0.7)
    torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent2, atol=1e-5, rtol=0)
    (lp.sum() + 0.5 * ent.sum()).backward()
    (lp2.sum() + 0.5 * ent2.sum()).backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=0)  # row 6 (padding) gets no gradient
    assert float(w.grad[6].abs().sum()) == 0.0


def test_registered_as_megatron_trainer(megatron_cpu, miles_plugins, tmp_path):
    """The plugin registers "megatron"; its factory builds from the run's Decoder, and
    save/load restores the model and optimizer."""
    from types import SimpleNamespace

    torch.set_num_threads(1)
    factory = miles_plugins.registries.trainers.get("megatron")
    cfg = _config("token_mean")
    cfg.train.backend = "megatron"
    cfg.validate()
    dec = _decoder(True, True)
    ctx = SimpleNamespace(config=cfg, plugins=miles_plugins, device=torch.device("cpu"), kernels=KERNELS)
    tr = factory(ctx, dec)
    b = batch()
    before = tr.compute_logprobs(b)
    tr.save(tmp_path / "ckpt")
    b.old_logprobs = before
    tr.train_step(b, functools.partial(ppo_clip, cfg=cfg.algorithm))
    assert not torch.allclose(tr.compute_logprobs(b), before)
    tr.load(tmp_path / "ckpt")
    torch.testing.assert_close(tr.compute_logprobs(b), before, atol=0, rtol=0)


def test_lr_schedule_is_followed_and_resumed(megatron_cpu, tmp_path):
    """train.lr_warmup_steps / lr_decay=cosine set the LR of each step as in the torch trainer (train/lr.py); the
    schedule's step count is saved with the checkpoint; an explicit lr (SFT warm-up) neither uses nor advances it."""
    from miles_core.train.lr import lr_at
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    cfg.train.lr_warmup_steps, cfg.train.lr_decay, cfg.train.min_lr, cfg.run.num_rollout = 2, "cosine", 1e-3, 5
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()
    b.old_logprobs = mega.compute_logprobs(b)
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    want = [lr_at(s, cfg.train, 5) for s in range(4)]
    assert want == pytest.approx([5e-3, 1e-2, 1e-2, 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi / 3))])
    for s in range(3):
        m = mega.train_step(b, loss_fn)
        assert mega.optimizer.param_groups[0]["lr"] == pytest.approx(want[s]) and m["lr"] == pytest.approx(want[s])
    assert mega.train_step(b, loss_fn, lr=0.5)["lr"] == 0.5  # an SFT step: its own LR, the schedule stays
    mega.save(tmp_path / "ck")
    resumed = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    resumed.load(tmp_path / "ck")
    for tr in (mega, resumed):
        m = tr.train_step(b, loss_fn)
        assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(want[3]) and m["lr"] == pytest.approx(want[3])
    cfg.train.weight_decay, cfg.train.adam_beta1 = 0.25, 0.5  # a resume given other optimizer settings uses them
    changed = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    changed.load(tmp_path / "ck")
    assert {(g["weight_decay"], g["betas"][0]) for g in changed.optimizer.param_groups} == {(0.25, 0.5)}


def test_unsupported_parallelism_is_a_config_error():
    from miles_core.errors import ConfigError

    cfg = MilesConfig()
    cfg.train.backend = "megatron"
    cfg.train.megatron.pipeline_parallel = 2
    with pytest.raises(ConfigError, match="train.megatron.pipeline_parallel"):
        cfg.validate()


@pytest.mark.parametrize("overrides", [{"attention": "padded"}, {"attention": "sdpa", "compile": True}])
def test_attention_choice_and_compiled_layers_match_eager(megatron_cpu, overrides, monkeypatch):
    """``train.attention`` and ``train.compile`` reach the Megatron trainer (the pack's attention is
    the torch trainer's SegmentAttention; each TransformerLayer compiled in place) and change
    nothing but rounding: logprobs and the gradient equal the default eager trainer's.
    Here dynamo traces the layers through the ``aot_eager`` backend (inductor's C++ codegen takes
    over 2 minutes on 2 cores); the H200 benchmark runs them through inductor."""
    from miles_core.train.megatron.trainer import MegatronTrainer

    monkeypatch.setattr(torch.nn.Module, "compile", functools.partialmethod(torch.nn.Module.compile, backend="aot_eager"))
    torch.set_num_threads(1)
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    b = batch()
    b.old_logprobs = b.rollout_logprobs.clone()
    results = []
    for opts in ({}, overrides):
        cfg = _config("token_mean")
        for k, v in opts.items():
            setattr(cfg.train, k, v)
        mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
        if opts.get("compile"):
            assert all(layer._compiled_call_impl is not None for layer in mega.model.decoder.layers)
        lp = mega.compute_logprobs(b)
        m = mega.train_step(b, functools.partial(ppo_clip, cfg=cfg.algorithm))
        results.append((lp, m, _megatron_grads(mega)))
    (lp0, m0, g0), (lp1, m1, g1) = results
    assert lp0.abs().max() > 1.0
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    assert m1["loss"] == pytest.approx(m0["loss"], abs=1e-6)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-6, rtol=1e-4, msg=lambda m: f"grad {k}: {m}")


def test_a_micro_batch_of_empty_responses_adds_nothing(megatron_cpu):
    from miles_core.train.batch import make_train_batch
    from miles_core.train.megatron.trainer import MegatronTrainer
    from miles_core.types import Sample

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    cfg.train.micro_batch_size = 1
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    torch_tr = TorchTrainer(dec, cfg, torch.device("cpu"), FP32, KERNELS)
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    b = make_train_batch([Sample("", [3, 4, 5], [6, 7], "", [0.0] * 2), Sample("", [6, 7], [], "", []),
                          Sample("", [8], [9, 10, 11], "", [0.0] * 3)], pad_id=0)
    b.advantages = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(0)) * b.response_mask
    b.old_logprobs = off_policy(torch_tr.compute_logprobs(b), b)
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    m_t, m_m = torch_tr.train_step(b, loss_fn), mega.train_step(b, loss_fn)
    assert m_t["grad_norm"] > 0.1
    for key in ("loss", "grad_norm"):
        assert m_m[key] == pytest.approx(m_t[key], abs=1e-5, rel=1e-5), key


def test_kl_reference_is_saved_and_resumed(megatron_cpu, tmp_path):
    """With algorithm.kl_coef > 0 the frozen reference goes into the checkpoint, as in the torch trainer: a
    trainer built for a resume (the loop then calls no reset_reference) scores the reference of the saved run,
    and a checkpoint saved without a reference is refused by a run that needs one."""
    from miles_core.errors import ConfigError
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    cfg.algorithm.kl_coef = 0.5
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    mega.reset_reference()
    b = batch()
    b.old_logprobs = mega.compute_logprobs(b)
    b.ref_logprobs = ref = mega.compute_ref_logprobs(b)
    mega.train_step(b, functools.partial(ppo_clip, cfg=cfg.algorithm))
    policy = mega.compute_logprobs(b)
    assert (policy - ref).abs().max() > 1e-3  # the policy left its reference
    mega.save(tmp_path / "ck")

    resumed = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    resumed.load(tmp_path / "ck")
    torch.testing.assert_close(resumed.compute_ref_logprobs(b), ref, atol=0, rtol=0)
    torch.testing.assert_close(resumed.compute_logprobs(b), policy, atol=0, rtol=0)

    no_kl = _config("token_mean")
    plain = MegatronTrainer(arch_from_decoder(dec.config), state, no_kl, torch.device("cpu"), FP32, KERNELS)
    plain.save(tmp_path / "plain")
    with pytest.raises(ConfigError, match="algorithm.kl_coef"):
        resumed.load(tmp_path / "plain")


class _RoundedMatmuls(TorchFunctionMode):
    """A plugin's kernel swap: linears and matmuls on bf16-rounded inputs (as a bf16 GEMM with fp32 accumulation)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            args = tuple(a.to(torch.bfloat16).float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class _RoundingRecipe(PrecisionRecipe):
    def kernel_mode(self, device: torch.device):
        return _RoundedMatmuls()


def test_precision_kernel_mode_wraps_the_forward_as_in_torch_trainer(megatron_cpu):
    """A precision recipe's kernel_mode (how a plugin's recipe such as bf16_batch_invariant swaps kernels) is
    entered around the Megatron forward as around the torch trainer's: same logprobs, loss and entropy. (Not the
    gradients: megatron-core's linears are autograd Functions with their own backward, which the mode does not
    round; the torch trainer's backward goes through the rounding.)"""
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    recipe = _RoundingRecipe("rounded")
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    torch_tr = TorchTrainer(dec, cfg, torch.device("cpu"), recipe, KERNELS)
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), recipe, KERNELS)
    fp32 = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()
    lp_t = torch_tr.compute_logprobs(b)
    assert (lp_t - fp32.compute_logprobs(b)).abs().max() > 1e-3  # the mode changes the numbers
    torch.testing.assert_close(mega.compute_logprobs(b), lp_t, atol=1e-6, rtol=0)
    b.old_logprobs = off_policy(lp_t, b)
    loss_fn = functools.partial(ppo_clip, cfg=cfg.algorithm)
    m_t, m_m = torch_tr.train_step(b, loss_fn), mega.train_step(b, loss_fn)
    for key in ("loss", "entropy", "clip_frac"):
        assert m_m[key] == pytest.approx(m_t[key], abs=1e-6, rel=1e-6), key


def test_logprob_chunk_size_reaches_the_logprobs_op(megatron_cpu):
    """train.logprob_chunk_size (rows of [tokens, vocab] logits made at once: the trainer's peak memory) is passed
    to the kernel registry's logprobs op by the Megatron trainer as by the torch trainer."""
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    cfg.train.logprob_chunk_size = 3
    seen: dict[str, list[int]] = {"torch": [], "megatron": []}

    def recording(name):
        def op(hidden, weight, targets, *, temperature=1.0, chunk_size=1024):
            seen[name].append(chunk_size)
            return logprobs_torch(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)

        return {"logprobs": op}

    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    torch_tr = TorchTrainer(dec, cfg, torch.device("cpu"), FP32, recording("torch"))
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, recording("megatron"))
    b = batch()
    torch.testing.assert_close(mega.compute_logprobs(b), torch_tr.compute_logprobs(b), atol=1e-5, rtol=0)
    assert seen["torch"] and set(seen["torch"]) == {3}
    assert seen["megatron"] and set(seen["megatron"]) == {3}


def test_moe_aux_loss_does_not_depend_on_the_micro_batch_split(megatron_cpu):
    """train.megatron.moe_aux_loss_coeff: megatron-core adds each micro-batch's load-balancing loss to the gradient
    at its backward scale; the trainer weighs it by the micro-batch's share of the packed tokens, so that (as the
    policy loss, aggregated over the global batch) the gradient is that of the whole batch at once. Three copies of
    one sample route alike in every micro-batch, so one micro-batch of three and three of one give one aux loss."""
    from miles_core.algorithms.losses import sft
    from miles_core.train.batch import make_train_batch
    from miles_core.train.megatron.trainer import MegatronTrainer
    from miles_core.types import Sample

    torch.set_num_threads(1)
    model = hf_model("qwen3_moe")
    arch = arch_from_hf(model.config.to_dict())
    sample = Sample("", [3, 14, 15, 9, 26], [5, 35, 8, 9, 7, 9], "", [0.0] * 6)
    b = make_train_batch([sample] * 3, pad_id=0)
    grads = {}
    for coeff, mbs in ((0.0, 3), (0.5, 3), (0.5, 1)):
        cfg = _config("token_mean")
        cfg.rollout.temperature = 1.0
        cfg.train.micro_batch_size = mbs
        cfg.train.megatron.moe_aux_loss_coeff = coeff
        mega = MegatronTrainer(arch, model.state_dict(), cfg, torch.device("cpu"), FP32, KERNELS)
        mega.train_step(b, functools.partial(sft, cfg=cfg.algorithm))
        grads[coeff, mbs] = _megatron_grads(mega)
    router = "model.layers.0.mlp.gate.weight"
    assert (grads[0.5, 3][router] - grads[0.0, 3][router]).abs().max() > 1e-3  # the aux loss is active
    for k, g in grads[0.5, 3].items():
        torch.testing.assert_close(grads[0.5, 1][k], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"grad {k}: {m}")


def test_a_checkpoint_of_the_other_backend_is_a_config_error(megatron_cpu, tmp_path):
    """Resuming with another train.backend than the run that saved: each trainer names the backend that wrote the
    checkpoint (a ConfigError, one line), not a FileNotFoundError traceback or 'point run.load at a --save folder'."""
    from miles_core.errors import ConfigError
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    dec = _decoder(True, True)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    torch_tr = TorchTrainer(dec, cfg, torch.device("cpu"), FP32, KERNELS)
    mega = MegatronTrainer(arch_from_decoder(dec.config), state, cfg, torch.device("cpu"), FP32, KERNELS)
    torch_tr.save(tmp_path / "torch")
    mega.save(tmp_path / "megatron")
    with pytest.raises(ConfigError, match="train.backend=torch"):
        mega.load(tmp_path / "torch")
    with pytest.raises(ConfigError, match="train.backend=megatron"):
        torch_tr.load(tmp_path / "megatron")
