"""Trainer guards: a step whose gradient is NaN or infinite is skipped (the weights and the optimizer's moments stay as
they were); run.mode=sft keeps no KL reference."""

import torch
from trainer_helpers import make_trainer, policy_loss, random_batch, tiny_decoder

from miles_core.types import LossOutput


def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights():
    """A loss that blew up on one batch (inf logits, a plugin's division by zero) gave NaN gradients, and the step
    wrote NaN into every weight and into Adam's moments: every later step, and the saved model, were NaN."""
    trainer = make_trainer(tiny_decoder())
    loss = policy_loss(trainer)

    def blown_up(inputs):
        out = loss(inputs)
        return LossOutput(out.loss * float("nan"), out.metrics)

    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    m = trainer.train_step(random_batch(), blown_up)
    assert m["grad_nonfinite_skipped"] == 1.0 and m["grad_norm"] != m["grad_norm"]
    assert all(torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
    m = trainer.train_step(random_batch(), loss)  # the next batch trains as if the bad one had never come
    assert m["grad_nonfinite_skipped"] == 0.0 and m["grad_norm"] > 0
    after = trainer.policy.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values()) and any(not torch.equal(before[k], after[k]) for k in before)


def test_run_mode_sft_keeps_no_kl_reference():
    """With algorithm.kl_coef > 0 (a recipe shared with the RL run), run.mode=sft built a frozen copy of the policy for
    a KL it never computes: a second model in memory, and in every checkpoint."""
    assert make_trainer(tiny_decoder(), "algorithm.kl_coef=0.1", "run.mode=sft").ref is None
    assert make_trainer(tiny_decoder(), "algorithm.kl_coef=0.1").ref is not None  # RL: the KL reference
    assert make_trainer(tiny_decoder(), "run.mode=sft").ref is None
