"""Policy losses, KL estimators, mismatch weights and aggregation against hand-worked values."""

import math

import pytest
import torch

from miles_core.algorithms.aggregate import aggregate_loss
from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.gspo import gspo, gspo_token
from miles_core.algorithms.kl import kl_estimate
from miles_core.algorithms.losses import ppo_clip, sft
from miles_core.algorithms.mismatch import mismatch_weights
from miles_core.testing.contracts import check_policy_loss
from miles_core.types import LossInputs

T = torch.tensor
LN = math.log


def loss_inputs(ratios, adv, mask, **kw):
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    logp = (old + torch.log(T(ratios))).requires_grad_(True)
    return LossInputs(logprobs=logp, old_logprobs=old, advantages=T(adv), response_mask=T(mask, dtype=torch.float32), **kw)


def test_ppo_clip_low_high_and_masks():
    x = loss_inputs([[1.5, 0.5, 1.0], [0.7, 9.0, 9.0]], [[1.0, -1.0, 2.0], [1.0, 5.0, 5.0]], [[1, 1, 1], [1, 0, 0]])
    out = ppo_clip(x, AlgorithmConfig(eps_clip=0.2))
    m = x.response_mask
    # 1.5*A=1 clipped to 1.2; 0.5*A=-1 clipped to 0.8; ratio 1 untouched; 0.7*A=1: min(0.7, 0.8) = 0.7
    assert torch.allclose(out.loss * m, T([[-1.2, 0.8, -2.0], [-0.7, 0.0, 0.0]]))
    assert out.metrics["clip_frac"] == pytest.approx(2 / 4)
    high = ppo_clip(x, AlgorithmConfig(eps_clip=0.2, eps_clip_high=0.28))
    assert high.loss[0, 0].item() == pytest.approx(-1.28)
    assert high.loss[0, 1].item() == pytest.approx(0.8)  # the low side is unchanged


def test_dual_clip_bounds_negative_advantages():
    x = loss_inputs([[3.0, 3.0, 0.5]], [[-1.0, 1.0, -1.0]], [[1, 1, 1]])
    plain = ppo_clip(x, AlgorithmConfig())
    dual = ppo_clip(x, AlgorithmConfig(clip_c=2.0))
    assert plain.loss[0, 0].item() == pytest.approx(3.0)
    assert dual.loss[0, 0].item() == pytest.approx(2.0)  # min(3, c * |A|)
    assert dual.loss[0, 1].item() == pytest.approx(-1.2)  # positive advantages are not dual-clipped
    assert dual.loss[0, 2].item() == pytest.approx(0.8)
    assert dual.metrics["dual_clip_frac"] == pytest.approx(1 / 3)
    dual.loss.sum().backward()
    assert x.logprobs.grad[0, 0] == 0  # the bound is a constant


@pytest.mark.parametrize("fn", [ppo_clip, gspo, gspo_token])
def test_a_ratio_past_float_range_stays_finite(fn):
    # sample 0's token moved 99 nats up since the old pass (ratio e^99 = inf in fp32) but its group's rewards were
    # all equal (A = 0): -0 * inf was NaN, and one such token made the whole step's loss NaN. The log ratio is
    # clamped to [-20, 20] before the exp, as verl does (core_algos.compute_policy_loss_vanilla): the token is
    # clipped (A > 0) or bounded (dual clip, A < 0), with no gradient, and finite in every case
    old = T([[-100.0], [-1.0]])
    logp = T([[-1.0], [-1.0]], requires_grad=True)
    x = LossInputs(logprobs=logp, old_logprobs=old, advantages=T([[0.0], [1.0]]), response_mask=torch.ones(2, 1))
    out = fn(x, AlgorithmConfig())
    assert out.loss.tolist() == [[0.0], [-1.0]]
    out.loss.sum().backward()
    assert logp.grad.tolist() == [[0.0], [-1.0]]
    y = LossInputs(logprobs=logp.detach().clone().requires_grad_(True), old_logprobs=old,
                   advantages=T([[-1.0], [1.0]]), response_mask=torch.ones(2, 1))
    dual = fn(y, AlgorithmConfig(clip_c=3.0))
    assert dual.loss.tolist() == [[3.0], [-1.0]]  # min(-A * ratio, -c * A) for A < 0
    dual.loss.sum().backward()
    assert y.logprobs.grad.tolist() == [[0.0], [-1.0]]


def test_approx_kl_metric_is_k2_to_the_old_policy():
    x = loss_inputs([[math.e, 1.0]], [[0.0, 0.0]], [[1, 0]])
    assert ppo_clip(x, AlgorithmConfig()).metrics["approx_kl"] == pytest.approx(0.5)


def test_kl_estimators_by_hand():
    logp, ref, mask = T([[-1.0, -1.0]]), T([[-2.0, 0.0]]), T([[1.0, 0.0]])
    d = 1.0
    assert kl_estimate(logp, ref, mask, "k1").tolist() == [[d, 0.0]]
    assert kl_estimate(logp, ref, mask, "k2").tolist() == [[0.5, 0.0]]
    assert kl_estimate(logp, ref, mask, "k3")[0, 0].item() == pytest.approx(math.exp(-1) - 1 + 1)
    far = kl_estimate(T([[-40.0]]), T([[-5.0]]), T([[1.0]]), "k3_clamped")
    assert far.item() == pytest.approx(10.0)  # k3 itself would be e^35
    near = kl_estimate(T([[-1.0]]), T([[-1.3]]), T([[1.0]]), "k3_clamped")
    assert near.item() == pytest.approx(math.exp(-0.3) - 1 + 0.3, rel=1e-5)


def test_kl_loss_term_and_entropy_bonus():
    ref = T([[-2.0, -1.0]])
    ent = T([[0.5, 1.5]], requires_grad=True)
    x = loss_inputs([[1.0, 1.0]], [[0.0, 0.0]], [[1, 1]], ref_logprobs=ref, entropy=ent)
    out = ppo_clip(x, AlgorithmConfig(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01))
    assert torch.allclose(out.loss, T([[0.1 * 0.5 - 0.005, -0.015]]))
    assert out.metrics["kl_ref"] == pytest.approx(0.25)
    # the gradients: zero advantages leave only the regularizers; d/dlogp of kl_coef * (logp - ref)^2 / 2 is
    # kl_coef * (logp - ref) = [0.1, 0], and the bonus pushes the entropy up at -entropy_coef per token
    out.loss.sum().backward()
    assert torch.allclose(x.logprobs.grad, T([[0.1, 0.0]]))
    assert torch.allclose(ent.grad, T([[-0.01, -0.01]]))
    reward_mode = ppo_clip(x, AlgorithmConfig(kl_coef=0.1, kl_mode="reward"))
    assert torch.allclose(reward_mode.loss, torch.zeros(1, 2))  # the KL is in the advantages then


def test_gspo_sequence_ratio():
    x = loss_inputs([[1.5, 1.0], [0.9, 5.0]], [[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 0]])
    out = gspo(x, AlgorithmConfig())
    # s_0 = exp(mean(log 1.5, 0)) = sqrt(1.5) = 1.2247 -> clipped to 1.2; s_1 = 0.9 (one token)
    assert torch.allclose(out.loss, T([[-1.2, -1.2], [-0.9, 0.0]]), atol=1e-6)
    assert out.metrics["clip_frac"] == pytest.approx(2 / 3)  # the tokens of clipped sequences, as ppo_clip counts


def test_gspo_token_matches_gspo_gradient_with_sequence_advantages():
    cfg = AlgorithmConfig(eps_clip=0.5)
    a, b = (loss_inputs([[1.1, 0.95, 1.0]], [[0.7, 0.7, 0.7]], [[1, 1, 1]]) for _ in range(2))
    la, lb = gspo(a, cfg), gspo_token(b, cfg)
    assert torch.allclose(la.loss, lb.loss, atol=1e-6)  # same value
    aggregate_loss(la.loss, a.response_mask, AlgorithmConfig(loss_agg="seq_mean_token_mean"), 3, 1, 3).backward()
    aggregate_loss(lb.loss, b.response_mask, AlgorithmConfig(loss_agg="seq_mean_token_mean"), 3, 1, 3).backward()
    assert torch.allclose(a.logprobs.grad, b.logprobs.grad, atol=1e-6)
    # the per-token gradient of gspo_token is -A_t * s / |y| with its own advantage
    c = loss_inputs([[1.0, 1.0]], [[1.0, -2.0]], [[1, 1]])
    (gspo_token(c, cfg).loss.sum() / 2).backward()
    assert torch.allclose(c.logprobs.grad, T([[-0.5, 1.0]]))


def test_tis_and_mis_at_token_and_sequence_level():
    old = T([[-1.0, -1.0, -1.0]])
    rollout = T([[-1.0 - LN(3), -1.0 + LN(2), 0.0]])  # w = 3, 0.5, (padding)
    mask = T([[1.0, 1.0, 0.0]])
    w, m = mismatch_weights(old, rollout, mask, AlgorithmConfig(mismatch_correction="tis", mismatch_cap=2.0))
    assert torch.allclose(w, T([[2.0, 0.5, 0.0]]))
    assert m["mismatch_truncated_frac"] == pytest.approx(0.5)
    w, m = mismatch_weights(old, rollout, mask, AlgorithmConfig(mismatch_correction="mis", mismatch_cap=2.0, mismatch_floor=0.4))
    assert torch.allclose(w, T([[0.0, 0.5, 0.0]]))
    assert m["mismatch_masked_frac"] == pytest.approx(0.5)
    w, m = mismatch_weights(old, rollout, mask, AlgorithmConfig(mismatch_correction="mis", mismatch_cap=4.0, mismatch_floor=0.6))
    assert torch.allclose(w, T([[3.0, 0.0, 0.0]]))  # 0.5 is below the floor
    assert m["mismatch_masked_frac"] == pytest.approx(0.5)
    # sequence level: w = 3 * 0.5 = 1.5 for every token
    w, _ = mismatch_weights(old, rollout, mask, AlgorithmConfig(mismatch_correction="tis", mismatch_level="sequence"))
    assert torch.allclose(w, T([[1.5, 1.5, 0.0]]))
    w, _ = mismatch_weights(old, rollout, mask, AlgorithmConfig(mismatch_correction="mis", mismatch_level="sequence", mismatch_cap=1.2))
    assert torch.equal(w, torch.zeros(1, 3))
    off, m = mismatch_weights(old, rollout, mask, AlgorithmConfig())
    assert off is None
    k3 = ((3 - 1 - LN(3)) + (0.5 - 1 - LN(0.5))) / 2  # KL(rollout || old) estimate, w - 1 - log w
    assert m["mismatch_kl"] == pytest.approx(k3, rel=1e-5)


def test_mismatch_kl_is_accurate_for_tiny_differences():
    # engine and trainer a bf16 rounding apart: log w = 1e-4 (or 1e-3) on every token, whose k3 w - 1 - log w is
    # x^2/2 + x^3/6 + ... = 5.0002e-9 (5.0017e-7). exp(x) - 1 - x in fp32 lost every digit: 0.0 (4.77e-7, -5%)
    for x in (1e-4, 1e-3, -1e-3):
        old, rollout = torch.full((4, 64), x), torch.zeros(4, 64)
        k3 = math.expm1(float(old[0, 0])) - float(old[0, 0])
        m = mismatch_weights(old, rollout, torch.ones(4, 64), AlgorithmConfig())[1]
        assert m["mismatch_kl"] == pytest.approx(k3, rel=1e-4)


def test_mismatch_weight_multiplies_the_policy_loss():
    x = loss_inputs([[1.0, 1.0]], [[1.0, 1.0]], [[1, 1]], rollout_logprobs=T([[-1.0 - LN(3), -1.0]]))
    out = ppo_clip(x, AlgorithmConfig(mismatch_correction="tis", mismatch_cap=2.0))
    assert torch.allclose(out.loss, T([[-2.0, -1.0]]))


def test_mismatch_correction_without_rollout_logprobs_is_refused():
    """No engine logprobs (LossInputs.rollout_logprobs None): the correction was skipped without a word."""
    from miles_core.errors import DataError

    x = loss_inputs([[1.0, 1.0]], [[1.0, 1.0]], [[1, 1]])
    assert "mismatch_kl" not in ppo_clip(x, AlgorithmConfig()).metrics
    for loss in (ppo_clip, gspo):
        with pytest.raises(DataError, match="algorithm.mismatch_correction=mis needs the rollout engine's per-token logprobs"):
            loss(x, AlgorithmConfig(mismatch_correction="mis"))


def test_aggregations_and_micro_batch_exactness():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 7.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    agg = lambda kind, l, m, **kw: aggregate_loss(l, m, AlgorithmConfig(loss_agg=kind, **kw), 4, 2, 3).item()
    assert agg("token_mean", loss, mask) == pytest.approx(10 / 4)
    assert agg("seq_mean_token_mean", loss, mask) == pytest.approx((2 + 4) / 2)
    assert agg("seq_sum", loss, mask) == pytest.approx(10 / (2 * 3))
    assert agg("seq_sum", loss, mask, loss_agg_constant=5.0) == pytest.approx(10 / (2 * 5))
    for kind in ("token_mean", "seq_mean_token_mean", "seq_sum"):
        split = agg(kind, loss[:1], mask[:1]) + agg(kind, loss[1:], mask[1:])
        assert split == pytest.approx(agg(kind, loss, mask))


def test_sft_is_masked_nll():
    x = loss_inputs([[1.0, 1.0]], [[0.0, 0.0]], [[1, 0]])
    out = sft(x, AlgorithmConfig())
    assert torch.allclose(out.loss, T([[1.0, 1.0]]))
    assert out.metrics["nll"] == pytest.approx(1.0)


@pytest.mark.parametrize("fn", [ppo_clip, gspo, gspo_token, sft])
def test_losses_meet_the_plugin_contract(fn):
    check_policy_loss(fn)


def test_k3_is_accurate_and_nonnegative_for_tiny_differences():
    """k3 at logprob differences of rounding size, in fp32, against float64: exp(-d) - 1 + d would give
    -1.7e-8 at d = 1e-4 (the true value is 5.0e-9); expm1 keeps it, and it never goes below 0."""
    import torch

    from miles_core.algorithms.kl import kl_estimate

    d = torch.tensor([[1e-4, -3e-5, 1e-7, 0.0, 2.0, -1.0]])
    got = kl_estimate(d, torch.zeros_like(d), torch.ones_like(d), "k3")
    d64 = d.double()
    ref = torch.expm1(-d64) + d64
    assert (got >= 0).all()
    assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-11)  # ~ulp(d) absolute; the old form erred by 2e-8
    clamped = kl_estimate(d, torch.zeros_like(d), torch.ones_like(d), "k3_clamped")
    assert torch.equal(clamped, got)  # nothing here reaches the clamps
