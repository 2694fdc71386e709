"""Advantage estimators against values worked out by hand."""

import math

import pytest
import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.distill import add_distillation, distill
from miles_core.algorithms.gae import gae, ppo
from miles_core.algorithms.grpo import grpo
from miles_core.algorithms.reinforce import reinforce_plus_plus, reinforce_plus_plus_baseline
from miles_core.algorithms.returns import discounted_returns, token_rewards
from miles_core.algorithms.rloo import rloo
from miles_core.errors import ConfigError
from miles_core.testing.contracts import check_advantage_estimator
from miles_core.types import AdvantageInputs

T = torch.tensor


def inputs(rewards, groups, mask, **kw):
    return AdvantageInputs(rewards=T(rewards), group_ids=T(groups), response_mask=T(mask, dtype=torch.float32), **kw)


UNEVEN = dict(rewards=[1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.7], groups=[0, 0, 0, 1, 1, 2, 2, 3],
              mask=[[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])


def per_sample(adv, mask):
    """The one value each sample's tokens carry (checks that it is constant over the mask)."""
    m = T(mask, dtype=torch.float32)
    vals = (adv * m).sum(-1) / m.sum(-1)
    assert torch.allclose(adv, vals[:, None] * m)
    return vals


def test_grpo_uneven_groups_all_equal_and_singleton():
    out = grpo(inputs(**UNEVEN), AlgorithmConfig())
    a = per_sample(out.advantages, UNEVEN["mask"])
    s3 = 1 / math.sqrt(3)  # group [1,0,0]: mean 1/3, unbiased var 1/3
    expected = [(2 / 3) / s3, (-1 / 3) / s3, (-1 / 3) / s3, 1 / math.sqrt(2), -1 / math.sqrt(2), 0, 0, 0]
    assert torch.allclose(a, T(expected), atol=1e-5)


def test_dr_grpo_does_not_divide_by_std():
    a = per_sample(grpo(inputs(**UNEVEN), AlgorithmConfig(normalize_std=False)).advantages, UNEVEN["mask"])
    assert torch.allclose(a, T([2 / 3, -1 / 3, -1 / 3, 0.5, -0.5, 0, 0, 0]), atol=1e-6)


def test_rloo_leave_one_out():
    a = per_sample(rloo(inputs(**UNEVEN), AlgorithmConfig()).advantages, UNEVEN["mask"])
    # group [1,0,0]: 1 - 0, 0 - (1+0)/2, ...; group [1,0]: +-1; equal group and singleton: 0
    assert torch.allclose(a, T([1.0, -0.5, -0.5, 1.0, -1.0, 0, 0, 0]), atol=1e-6)


def test_reinforce_pp_returns_and_batch_whitening():
    x = inputs([1.0, 0.0], [0, 1], [[1, 1, 1], [1, 1, 0]])
    adv = reinforce_plus_plus(x, AlgorithmConfig()).advantages
    # returns [[1,1,1],[0,0,-]]: mean 0.6, population std sqrt(0.24)
    s = math.sqrt(0.24)
    assert torch.allclose(adv, T([[0.4 / s] * 3, [-0.6 / s, -0.6 / s, 0]]), atol=1e-5)


def test_discounted_returns_with_gamma_and_mask_gap():
    r = T([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    m = T([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    out = discounted_returns(r, m, 0.5)
    assert torch.allclose(out, T([[0.25, 0.5, 1.0], [1.0, 0.0, 2.0]]))


def test_reinforce_pp_baseline_centres_by_group_then_scales():
    x = inputs([1.0, 0.0], [0, 0], [[1, 1, 1], [1, 1, 0]])
    adv = reinforce_plus_plus_baseline(x, AlgorithmConfig()).advantages
    # centred rewards +-0.5 -> returns [[.5,.5,.5],[-.5,-.5]]; mean 0.1, std sqrt(0.24); no re-centring
    s = math.sqrt(0.24)
    assert torch.allclose(adv, T([[0.5 / s] * 3, [-0.5 / s, -0.5 / s, 0]]), atol=1e-5)


def test_all_equal_rewards_give_zero_advantages_everywhere():
    x = inputs([1.0, 1.0, 1.0], [0, 0, 0], [[1, 1], [1, 0], [1, 1]])
    for fn in (grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline):
        out = fn(x, AlgorithmConfig())
        if fn is reinforce_plus_plus:  # returns are all 1: whitening centres them to 0
            assert torch.allclose(out.advantages, torch.zeros(3, 2), atol=1e-4)
        else:
            assert torch.equal(out.advantages, torch.zeros(3, 2)), fn.__name__


def test_all_equal_group_of_inexact_rewards_gives_exactly_zero():
    # 0.7 is not a binary fraction: in float32 sum(7 * [0.7]) / 7 != 0.7, so the group's "std" was rounding
    # noise (~7e-8) and (r - mean) / (std + 1e-6) gave every sample of the group +0.056 (0.106 for G=16)
    rewards = [0.7] * 7 + [1.0, 0.0]
    groups = [0] * 7 + [1, 1]
    mask = [[1, 1]] * 9
    a = per_sample(grpo(inputs(rewards, groups, mask), AlgorithmConfig()).advantages, mask)
    assert torch.equal(a[:7], torch.zeros(7))
    assert torch.allclose(a[7:], T([1 / math.sqrt(2), -1 / math.sqrt(2)]), atol=1e-5)
    # REINFORCE++-baseline divides the group-centred rewards by the batch std: the noise alone gave +-6.0
    x = inputs([0.7] * 7 + [0.9] * 7, [0] * 7 + [1] * 7, [[1, 1]] * 14)
    assert torch.equal(reinforce_plus_plus_baseline(x, AlgorithmConfig()).advantages, torch.zeros(14, 2))
    # RLOO's leave-one-out baseline in float32 was (sum - r) / (G - 1) with a rounded sum: -7.5e-9, not 0
    x = inputs([0.1] * 3 + [0.7] * 2, [0, 0, 0, 1, 1], [[1, 1]] * 5)
    assert torch.equal(rloo(x, AlgorithmConfig()).advantages, torch.zeros(5, 2))


def test_batch_whitening_of_equal_inexact_returns_gives_exactly_zero():
    # every return is 0.1 (gamma 1, no KL) over 8 tokens: in float32 their mean is not 0.1, the population std
    # is rounding noise (~1e-8), and dividing by std + 1e-8 gave every token -0.427 instead of 0
    mask = [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    adv = reinforce_plus_plus(inputs([0.1] * 3, [0, 1, 2], mask), AlgorithmConfig()).advantages
    assert torch.equal(adv, torch.zeros(3, 3))


def test_kl_in_reward_enters_each_token():
    mask = [[1, 1], [1, 0]]
    old = T([[-1.0, -1.0], [-1.0, 0.0]])
    ref = T([[-2.0, -1.5], [-1.0, 0.0]])  # k1 = old - ref = [[1, .5], [0, -]]
    x = inputs([1.0, 0.0], [0, 0], mask, old_logprobs=old, ref_logprobs=ref)
    cfg = AlgorithmConfig(kl_coef=0.1, kl_mode="reward")  # kl_estimator=auto: k1 as a reward
    assert cfg.kl_estimator_used == "k1"
    assert torch.allclose(token_rewards(x, cfg), T([[-0.1, 1 - 0.05], [0.0, 0.0]]))
    # k3 = exp(-d) - 1 + d: e^-1 + 0 = 0.3679 and e^-.5 - .5 = 0.1065, when asked for by name
    k3 = AlgorithmConfig(kl_coef=0.1, kl_mode="reward", kl_estimator="k3")
    assert torch.allclose(token_rewards(x, k3), T([[-0.03679, 1 - 0.01065], [0.0, 0.0]]), atol=1e-5)
    assert AlgorithmConfig(kl_coef=0.1).kl_estimator_used == "k3"  # auto as a loss term
    # GRPO uses the sequence sums: 1 - 0.15 and 0 -> centred +-0.425
    a = per_sample(grpo(x, AlgorithmConfig(kl_coef=0.1, kl_mode="reward", kl_estimator="k1", normalize_std=False)).advantages, mask)
    assert torch.allclose(a, T([0.425, -0.425]))
    # kl_mode=loss leaves the rewards alone
    assert torch.allclose(token_rewards(x, AlgorithmConfig(kl_coef=0.1)), T([[0.0, 1.0], [0.0, 0.0]]))


def test_kl_in_reward_without_reference_is_a_config_error():
    x = inputs([1.0, 0.0], [0, 0], [[1], [1]])
    with pytest.raises(ConfigError, match="kl_mode=reward"):
        grpo(x, AlgorithmConfig(kl_coef=0.1, kl_mode="reward"))


def test_gae_by_hand():
    r = T([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    v = T([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7]])
    m = T([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.5)
    # row 0: deltas .1 .1 .3 -> A = .225 .25 .3; row 1 skips the masked middle token: A0 = (.7-.5) + .5*.3
    assert torch.allclose(adv, T([[0.225, 0.25, 0.3], [0.35, 0.0, 0.3]]), atol=1e-6)
    assert torch.allclose(ret, T([[0.725, 0.85, 1.0], [0.85, 0.0, 1.0]]), atol=1e-6)
    adv, _ = gae(r[:1], v[:1], m[:1], gamma=0.9, lam=1.0)  # lam=1: A_t = G_t - V_t
    assert torch.allclose(adv, T([[0.81 - 0.5, 0.9 - 0.6, 1.0 - 0.7]]), atol=1e-6)


def test_ppo_estimator_whitens_and_returns_targets():
    x = inputs([1.0, 0.0], [0, 1], [[1, 1, 1], [1, 1, 0]], values=T([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0]]))
    out = ppo(x, AlgorithmConfig(gamma=1.0, lam=0.5))
    m = x.response_mask
    assert torch.allclose((out.advantages * m).sum() / m.sum(), T(0.0), atol=1e-6)
    assert torch.allclose(out.returns[0], T([0.725, 0.85, 1.0]), atol=1e-6)
    assert out.returns[1, 2] == 0 and out.advantages[1, 2] == 0
    with pytest.raises(ConfigError, match="critic"):
        ppo(inputs([1.0], [0], [[1]]), AlgorithmConfig())


def test_distill_reverse_kl_advantage_alone_and_added():
    old = T([[-1.0, -2.0], [-0.5, 0.0]])
    teacher = T([[-0.5, -3.0], [-0.5, 0.0]])
    x = inputs([1.0, 0.0], [0, 0], [[1, 1], [1, 0]], old_logprobs=old, teacher_logprobs=teacher)
    assert torch.allclose(distill(x, AlgorithmConfig()).advantages, T([[0.5, -1.0], [0.0, 0.0]]))
    cfg = AlgorithmConfig(distill_coef=0.5, normalize_std=False, teacher_checkpoint="t")
    out = add_distillation(grpo(x, cfg), x, cfg)
    assert torch.allclose(out.advantages, T([[0.5 + 0.25, 0.5 - 0.5], [-0.5, 0.0]]))


def test_distill_takes_the_kl_penalty_in_reward_mode():
    """kl_mode=reward puts -kl_coef * kl_t in each token's reward; distillation's per-token advantage is that reward
    (no discounting), so it carries the penalty; the reference was built and scored, and then ignored."""
    old, teacher = T([[-1.0, -2.0], [-0.5, 0.0]]), T([[-0.5, -3.0], [-0.5, 0.0]])
    ref = T([[-1.5, -1.0], [-0.5, 0.0]])
    x = inputs([0.0, 0.0], [0, 0], [[1, 1], [1, 0]], old_logprobs=old, teacher_logprobs=teacher, ref_logprobs=ref)
    cfg = AlgorithmConfig(advantage_estimator="distill", kl_coef=0.1, kl_mode="reward", teacher_checkpoint="t")
    # k1 (auto in reward mode): old - ref = [[0.5, -1.0], [0, -]]
    assert torch.allclose(distill(x, cfg).advantages, T([[0.5 - 0.05, -1.0 + 0.1], [0.0, 0.0]]))
    cfg.kl_mode = "loss"  # then it is a loss term (regularizers.py), not in the advantage
    assert torch.allclose(distill(x, cfg).advantages, T([[0.5, -1.0], [0.0, 0.0]]))


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("fn", [grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline])
def test_an_empty_batch_gives_empty_advantages(fn, normalize_std):
    x = AdvantageInputs(rewards=torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.long), response_mask=torch.zeros(0, 3))
    assert fn(x, AlgorithmConfig(normalize_std=normalize_std)).advantages.shape == (0, 3)


@pytest.mark.parametrize("fn", [grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline])
def test_estimators_meet_the_plugin_contract(fn):
    check_advantage_estimator(fn)
