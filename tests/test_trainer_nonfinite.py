"""A step whose gradient is NaN or infinite is skipped: the weights and the optimizer's moments stay as they were."""

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
