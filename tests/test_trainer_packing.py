"""Packing, token-budget micro-batches, exact gradient accumulation, AC, bf16, LR schedule."""

from __future__ import annotations

import sys
from pathlib import Path

import math

import pytest
import torch

from miles_core.algorithms.mismatch import mismatch_metrics
from miles_core.config.loader import load_config
from miles_core.train.lr import lr_at
from miles_core.train.packing import micro_batch_plan, pack, shard_samples, split_by_tokens

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_trainer, policy_loss, random_batch, tiny_decoder  # noqa: E402


def _alone_logprobs(model, batch):
    """Reference: every sample through the decoder on its own, full log_softmax."""
    out = torch.zeros(batch.response_mask.shape)
    for i in range(batch.num_samples):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        ids = batch.input_ids[i : i + 1, : p + r]
        logits = model.lm_head(model(ids))[0].float()
        logp = torch.log_softmax(logits, -1)[p - 1 : p + r - 1]
        out[i, :r] = logp.gather(1, ids[0, p:, None]).squeeze(1)
    return out


def test_pack_layout_hand_worked():
    batch = random_batch(3)
    mb = pack(batch, [0, 2])
    lens = (batch.prompt_lens + batch.response_lens).tolist()
    assert mb.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[2]]
    assert mb.positions[0, lens[0]].item() == 0  # positions restart per sample
    p0 = int(batch.prompt_lens[0])
    assert mb.hidden_idx[0].item() == p0 - 1 and mb.targets[0].item() == batch.input_ids[0, p0].item()
    assert split_by_tokens([5, 5, 5, 9, 1], [0, 1, 2, 3, 4], 10) == [[0, 1], [2], [3, 4]]
    assert split_by_tokens([12, 3], [0, 1], 10) == [[0], [1]]  # a long sample goes alone
    assert shard_samples([9, 1, 5, 5], 2) == [[0, 1], [2, 3]]


def test_segment_attention_impls_match_block_diagonal_mask():
    from miles_core.train.packing import SegmentAttention

    torch.manual_seed(0)
    bounds = [0, 3, 10, 11, 15, 20, 26]
    q, k, v = (torch.randn(1, 2, 26, 8, requires_grad=True) for _ in range(3))
    seg = torch.repeat_interleave(torch.arange(6), torch.tensor([b - a for a, b in zip(bounds, bounds[1:])]))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(26, 26, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for impl in ("sdpa", "padded", "cudnn"):  # cudnn: on CPU tensors the padded path
        got = SegmentAttention(torch.tensor(bounds, dtype=torch.int32), 7, impl)(q, k, v)
        assert torch.allclose(got, want, atol=1e-6), impl
        (g,) = torch.autograd.grad(got.sum(), q)
        (g_want,) = torch.autograd.grad(want.sum(), q, retain_graph=True)
        assert torch.allclose(g, g_want, atol=1e-5), impl


def test_packed_logprobs_match_each_sample_alone():
    model = tiny_decoder()
    batch = random_batch(6)
    assert len(micro_batch_plan(batch, 1, 20)[0]) > 1
    for budget, attention in ((20, "sdpa"), (1000, "padded")):
        trainer = make_trainer(model, f"train.max_tokens_per_micro_batch={budget}", f"train.attention={attention}")
        got = trainer.compute_logprobs(batch)
        want = _alone_logprobs(trainer.model, batch)
        assert torch.allclose(got, want * batch.response_mask, atol=2e-6), (attention, (got - want).abs().max())


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum"])
def test_gradient_accumulation_is_exact(agg):
    batch = random_batch(6)
    results = []
    for budget in (1000, 9):  # one micro-batch vs. one sample per micro-batch
        trainer = make_trainer(tiny_decoder(), f"train.max_tokens_per_micro_batch={budget}", f"algorithm.loss_agg={agg}")
        m = trainer.train_step(batch, policy_loss(trainer))
        # gradients, not weights: Adam's first step is ~lr * sign(g), which amplifies rounding
        results.append((m, {k: p.grad.clone() for k, p in trainer.model.named_parameters()}))
    (m1, g1), (m2, g2) = results
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert m1.keys() == m2.keys()
    for k in m1:  # the loss's metrics are token-weighted over the micro-batches
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7), k


def test_gspo_clip_metrics_do_not_depend_on_the_micro_batch_split():
    """GSPO clips whole sequences; its clip_frac is the fraction of response tokens in clipped sequences (as
    ppo_clip's counts tokens), so that the trainer's token-weighted sum over micro-batches is the batch's own."""
    batch = random_batch(8)
    batch.old_logprobs = torch.full_like(batch.rollout_logprobs, -5.0) * batch.response_mask  # sequence ratios ~3
    metrics = []
    for budget in (1000, 9, 14):
        trainer = make_trainer(tiny_decoder(), f"train.max_tokens_per_micro_batch={budget}", "algorithm.policy_loss=gspo",
                               "algorithm.eps_clip=0.05", "algorithm.clip_c=2.0")
        metrics.append(trainer.train_step(batch, policy_loss(trainer)))
    mask = batch.response_mask
    lp = make_trainer(tiny_decoder()).compute_logprobs(batch)
    s = (((lp - batch.old_logprobs) * mask).sum(-1) / mask.sum(-1)).exp()
    adv = (batch.advantages * mask).sum(-1) / mask.sum(-1)
    token_frac = lambda seqs: float((seqs[:, None] * mask).sum() / mask.sum())
    clip, dual = token_frac((adv > 0) & (s > 1.05)), token_frac((adv < 0) & (s > 2.0))
    assert 0 < clip < 1 and 0 < dual < 1
    for m in metrics:
        assert m["clip_frac"] == pytest.approx(clip, rel=1e-5)
        assert m["dual_clip_frac"] == pytest.approx(dual, rel=1e-5)


def test_varlen_attention_where_it_cannot_run_is_refused_at_start_up():
    """train.attention=varlen (flash-attention, CUDA in bf16/fp16) on a CPU trainer (or in fp32) failed at the first
    packed forward with "Could not run 'aten::_flash_attention_forward' with arguments from the 'CPU' backend"."""
    from miles_core.errors import ConfigError

    for precision in ("fp32", "bf16"):
        with pytest.raises(ConfigError, match="train.attention=varlen needs .*CUDA.*; set train.attention=auto"):
            make_trainer(tiny_decoder(), "train.attention=varlen", f"train.precision={precision}")


def test_activation_checkpointing_same_gradients():
    batch = random_batch(4)
    grads = []
    for ac in ("false", "true"):
        trainer = make_trainer(tiny_decoder(), f"train.activation_checkpointing={ac}", "train.grad_clip=0")
        trainer.train_step(batch, policy_loss(trainer))
        grads.append(trainer.model.model.layers[0].mlp.up_proj.weight.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_bf16_keeps_fp32_master_weights_and_tracks_fp32():
    batch = random_batch(4)
    losses, dtypes = {}, {}
    for prec in ("fp32", "bf16"):
        trainer = make_trainer(tiny_decoder(), f"train.precision={prec}")
        loss = policy_loss(trainer)
        def seen(module, args, out, prec=prec):  # records, returns None (the output stands)
            dtypes.setdefault(prec, out.dtype)

        hook = trainer.model.model.layers[0].mlp.up_proj.register_forward_hook(seen)
        lp = trainer.compute_logprobs(batch)
        hook.remove()
        losses[prec] = lp
        trainer.train_step(batch, loss)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert dtypes == {"fp32": torch.float32, "bf16": torch.bfloat16}  # the layers' matmuls run in bf16 under the recipe
    assert (losses["fp32"] - losses["bf16"]).abs().max() < 0.05  # bf16 matmuls: ~1e-2 logprob error


def test_lr_schedule_hand_worked():
    cfg = load_config(None, ["train.lr=1.0", "train.lr_warmup_steps=2", "train.lr_decay=cosine",
                             "train.lr_decay_steps=4", "train.min_lr=0.1"]).train
    got = [lr_at(s, cfg, total_steps=100) for s in range(8)]
    want = [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55, 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1, 0.1]
    assert got == pytest.approx(want)
    trainer = make_trainer(tiny_decoder(), "train.lr=1.0", "train.lr_warmup_steps=2")
    batch = random_batch(2)
    assert [trainer.train_step(batch, policy_loss(trainer))["lr"] for _ in range(3)] == [0.5, 1.0, 1.0]


def test_cosine_without_decay_steps_spans_the_rest_of_the_run():
    # lr_decay_steps=0: the cosine runs over total_steps - warm-up, and total_steps counts every update
    cfg = load_config(None, ["train.lr=1.0", "train.lr_warmup_steps=2", "train.lr_decay=cosine", "train.min_lr=0.1"]).train
    assert [lr_at(s, cfg, total_steps=6) for s in range(2, 7)] == pytest.approx(
        [1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55, 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1])
    trainer = make_trainer(tiny_decoder(), "train.lr=1.0", "train.lr_decay=cosine", "run.num_rollout=2", "train.updates_per_rollout=2")
    batch = random_batch(2)
    got = [trainer.train_step(batch, policy_loss(trainer))["lr"] for _ in range(4)]
    assert got == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2])


def test_grad_clip_scales_the_gradient_to_the_max_norm():
    batch = random_batch(4)
    batch.advantages = batch.advantages * 100  # a grad norm well above 1
    for clip in (1e-3, 0.0):
        trainer = make_trainer(tiny_decoder(), f"train.grad_clip={clip}")
        m = trainer.train_step(batch, policy_loss(trainer))
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters() if p.grad is not None]))
        assert m["grad_norm"] > 2.0  # the norm before clipping is reported
        assert after.item() == pytest.approx(clip if clip > 0 else m["grad_norm"], rel=1e-4)


def test_micro_batch_size_caps_the_samples_per_forward():
    batch = random_batch(6)
    for mbs, calls_want in ((2, 3), (4, 2), (64, 1)):
        trainer = make_trainer(tiny_decoder(), "train.max_tokens_per_micro_batch=1000", f"train.micro_batch_size={mbs}")
        calls = []
        hook = trainer.model.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
        trainer.compute_logprobs(batch)
        hook.remove()
        assert len(calls) == calls_want, mbs


def test_rollout_temperature_scales_the_logits():
    batch = random_batch(4)
    model = tiny_decoder()
    t2 = make_trainer(model, "rollout.temperature=2.0")
    lp_t2 = t2.compute_logprobs(batch)
    assert torch.allclose(lp_t2, t2.compute_logprobs(batch, temperature=2.0))
    assert not torch.allclose(lp_t2, t2.compute_logprobs(batch, temperature=1.0), atol=1e-3)
    t0 = make_trainer(model, "rollout.temperature=0")  # greedy sampling: the policy is scored at temperature 1
    assert torch.allclose(t0.compute_logprobs(batch), t2.compute_logprobs(batch, temperature=1.0))


def test_entropy_metric_is_the_token_mean_over_micro_batches():
    batch = random_batch(6)
    for budget in (1000, 9):
        trainer = make_trainer(tiny_decoder(), f"train.max_tokens_per_micro_batch={budget}")
        want, n = 0.0, 0
        with torch.no_grad():
            for i in range(batch.num_samples):
                p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
                logits = trainer.model.lm_head(trainer.model(batch.input_ids[i : i + 1, : p + r]))[0].float()[p - 1 : p + r - 1]
                logp = torch.log_softmax(logits, -1)
                want += float(-(logp.exp() * logp).sum(-1).mul(batch.response_mask[i, :r]).sum())
                n += int(batch.response_mask[i, :r].sum())
        m = trainer.train_step(batch, policy_loss(trainer))
        assert m["entropy"] == pytest.approx(want / n, rel=1e-5), budget


def test_trainer_checkpoint_round_trip_and_reference_mismatch(tmp_path):
    from miles_core.errors import ConfigError

    batch = random_batch(4)
    src = make_trainer(tiny_decoder(), "algorithm.kl_coef=0.05", "train.lr_warmup_steps=3")
    src.train_step(batch, policy_loss(src))
    src.save(tmp_path / "ck")
    dst = make_trainer(tiny_decoder(seed=5), "algorithm.kl_coef=0.05", "train.lr_warmup_steps=3")
    dst.load(tmp_path / "ck")
    assert dst.step == 1
    for (k, a), b in zip(src.model.state_dict().items(), dst.model.state_dict().values()):
        assert torch.equal(a, b), k
    no_ref = make_trainer(tiny_decoder(), "train.lr_warmup_steps=3")
    with pytest.raises(ConfigError, match="with a reference model"):
        no_ref.load(tmp_path / "ck")


def test_on_policy_old_logprobs_match_a_separate_pass():
    batch = random_batch(6)
    results = []
    for budget, separate in ((1000, True), (1000, False), (9, False)):
        trainer = make_trainer(tiny_decoder(), f"train.max_tokens_per_micro_batch={budget}", "train.grad_clip=0")
        b = batch.select(torch.arange(batch.num_samples))
        b.old_logprobs = trainer.compute_logprobs(b) if separate else None  # None: taken from the training forward
        m = trainer.train_step(b, policy_loss(trainer))
        results.append((m, {k: p.grad.clone() for k, p in trainer.model.named_parameters()}))
    (_, g_sep), (m1, g1), (m2, g2) = results
    assert any(g.abs().max() > 1e-4 for g in g1.values())
    for k in g_sep:  # the detached forward has the separate pass's gradient
        assert torch.allclose(g1[k], g_sep[k], rtol=1e-4, atol=1e-6), k
        assert torch.allclose(g2[k], g_sep[k], rtol=1e-4, atol=1e-6), k
    # the batch's own mismatch, as the loop reports it after a separate pass (was: mismatch_kl and mismatch_k1 twice
    # that, counted once by the trainer and again by the loss's mismatch_weights)
    old, rollout, mask = make_trainer(tiny_decoder()).compute_logprobs(batch), batch.rollout_logprobs, batch.response_mask
    want = {**mismatch_metrics(old, rollout, mask), "mismatch_abs": float(((rollout - old).abs() * mask).sum() / mask.sum())}
    for m in (m1, m2):  # token-weighted over the micro-batches
        for k in ("mismatch_kl", "mismatch_k1", "mismatch_abs"):
            assert m[k] == pytest.approx(want[k], rel=1e-4), k
    assert want["mismatch_abs"] > 0.1 and want["mismatch_kl"] > 0.1


def test_train_batch_has_rollout_logprobs_only_when_every_sample_has_them():
    """A sample without the engine's logprobs (saved rollouts with ``"rollout_logprobs": []``, a backend that gives
    none) got zeros, which the mismatch metrics and TIS/MIS then read as probability 1: the batch has none instead."""
    from miles_core.train.batch import make_train_batch
    from miles_core.types import Sample

    full = [Sample("", [1, 2], [3, 4], "", [-0.5, -1.5]), Sample("", [1], [5], "", [-0.25]), Sample("", [1], [], "", [])]
    batch = make_train_batch(full, pad_id=0)
    assert torch.equal(batch.rollout_logprobs, torch.tensor([[-0.5, -1.5], [-0.25, 0.0], [0.0, 0.0]]))
    assert batch.select(torch.tensor([1])).rollout_logprobs.tolist() == [[-0.25, 0.0]]
    missing = make_train_batch([*full, Sample("", [1], [6, 7], "", [])], pad_id=0)
    assert missing.rollout_logprobs is None and missing.select(torch.tensor([0, 3])).rollout_logprobs is None


@pytest.mark.parametrize("separate", [True, False])
def test_a_batch_without_rollout_logprobs_trains_without_mismatch_metrics_or_correction(separate):
    from miles_core.errors import DataError

    batch = random_batch(6)
    batch.rollout_logprobs = None
    trainer = make_trainer(tiny_decoder(), "train.max_tokens_per_micro_batch=9")
    batch.old_logprobs = trainer.compute_logprobs(batch) if separate else None
    m = trainer.train_step(batch, policy_loss(trainer))
    assert m["loss"] != 0.0 and not {"mismatch_kl", "mismatch_k1", "mismatch_abs", "mismatch_weight_mean"} & set(m)
    tis = make_trainer(tiny_decoder(), "algorithm.mismatch_correction=tis")
    before = {k: v.clone() for k, v in tis.model.state_dict().items()}
    with pytest.raises(DataError, match="algorithm.mismatch_correction=tis needs the rollout engine's per-token logprobs"):
        tis.train_step(batch, policy_loss(tis))
    for k, v in tis.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_logprobs_are_zero_off_the_loss_mask_and_max_seqlen_is_the_longest_sample():
    batch = random_batch(6)
    lens = (batch.prompt_lens + batch.response_lens).tolist()
    longest = max(range(6), key=lambda i: lens[i])
    other = min(range(6), key=lambda i: lens[i])
    assert lens[other] < lens[longest]
    assert pack(batch, [longest, other]).max_seqlen == lens[longest]
    batch.response_mask[0, 0] = 0.0  # a token the loss mask leaves out (e.g. a tool's output)
    trainer = make_trainer(tiny_decoder())
    lp = trainer.compute_logprobs(batch)
    assert lp[0, 0] == 0.0 and (lp[batch.response_mask > 0] < 0).all()


def test_empty_responses_train_on_nothing():
    from miles_core.train.batch import make_train_batch
    from miles_core.types import Sample

    batch = make_train_batch([Sample("", [3, 4, 5], [], "", []), Sample("", [6, 7], [], "", [])], pad_id=0)
    assert batch.response_mask.shape == (2, 1) and batch.response_mask.sum() == 0  # one padded column, masked out
    trainer = make_trainer(tiny_decoder())
    lp = trainer.compute_logprobs(batch)
    assert lp.shape == (2, 1) and torch.equal(lp, torch.zeros(2, 1))
    batch.old_logprobs = lp
    m = trainer.train_step(batch, policy_loss(trainer))
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0
    # one empty response among others: a micro-batch of it alone adds nothing (was: backward of a loss with no graph)
    g = torch.Generator().manual_seed(0)
    samples = [Sample("", [3, 4, 5], [6, 7], "", [-1.0, -1.0]), Sample("", [6, 7], [], "", []), Sample("", [8], [9, 10, 11], "", [-2.0] * 3)]
    batch = make_train_batch(samples, pad_id=0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    results = []
    for mbs in (1, 3):
        trainer = make_trainer(tiny_decoder(), f"train.micro_batch_size={mbs}")
        batch.old_logprobs = trainer.compute_logprobs(batch)
        m = trainer.train_step(batch, policy_loss(trainer))
        results.append((m, [p.grad.clone() for p in trainer.model.parameters()]))
    (m1, g1), (m3, g3) = results
    assert m1["grad_norm"] > 0.1 and m1["loss"] == pytest.approx(m3["loss"], abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g3))


def test_a_sample_the_trainer_cannot_align_is_refused_naming_it():
    """A response without a prompt token before it took its first logprob from the hidden state of the sample packed
    before it (another sample's context, silently) or failed with "index out of range" when first in its pack; a loss
    mask or engine logprobs of another length than the response failed in tensor assignment ("expanded size")."""
    from miles_core.errors import DataError
    from miles_core.train.batch import make_train_batch
    from miles_core.types import Sample

    ok = Sample("", [1, 2], [3, 4], "", [-1.0, -1.0])
    bad = {
        "has no prompt token": Sample("", [], [5, 6], "", [-1.0, -1.0], index=7),
        "loss_mask has 3 values for 2 response tokens": Sample("", [1], [5, 6], "", [-1.0, -1.0], index=7, loss_mask=[1, 0, 1]),
        "rollout_logprobs has 1 values for 2 response tokens": Sample("", [1], [5, 6], "", [-1.0], index=7),
    }
    for why, sample in bad.items():
        with pytest.raises(DataError, match=f"sample 7 .*{why}"):
            make_train_batch([ok, sample], pad_id=0)
    make_train_batch([ok, Sample("", [], [], "", [])], pad_id=0)  # nothing to predict: nothing to align


def test_seq_sum_divides_by_the_generation_budget_not_the_longest_response():
    """Dr.GRPO's seq_sum divides every sequence's token sum by one constant, the generation budget: with the batch's
    longest response as the divisor a step's loss (and gradient) scale followed that one sample's length."""
    batch = random_batch(6)
    width, tokens, seqs = batch.response_mask.shape[1], int(batch.response_mask.sum()), batch.num_samples
    assert width < 20
    losses = {}
    for agg in ("token_mean", "seq_sum"):
        trainer = make_trainer(tiny_decoder(), f"algorithm.loss_agg={agg}", "rollout.max_response_len=20")
        losses[agg] = trainer.train_step(batch, policy_loss(trainer))["loss"]
    # the same per-token losses (same weights, same batch): sum = token_mean * tokens
    assert losses["seq_sum"] == pytest.approx(losses["token_mean"] * tokens / (seqs * 20), rel=1e-5)
