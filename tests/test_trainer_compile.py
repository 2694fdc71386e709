"""``train.compile``: each decoder block under torch.compile gives the eager trainer's numbers."""

import torch

from trainer_helpers import make_trainer, policy_loss, random_batch, tiny_decoder


def test_compiled_blocks_match_eager():
    batch = random_batch()
    eager = make_trainer(tiny_decoder())
    compiled = make_trainer(tiny_decoder(), "train.compile=true")
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None for b in compiled.model.model.layers)
    torch.testing.assert_close(compiled.compute_logprobs(batch), eager.compute_logprobs(batch), atol=1e-5, rtol=1e-5)
    for _ in range(2):  # forward, backward and the optimizer step; the second step sees the moved weights
        m_e, m_c = eager.train_step(batch, policy_loss(eager)), compiled.train_step(batch, policy_loss(compiled))
        assert abs(m_e["loss"] - m_c["loss"]) < 1e-5 and abs(m_e["grad_norm"] - m_c["grad_norm"]) < 1e-4 * max(1.0, m_e["grad_norm"])
    for (name, a), b in zip(eager.weights().items(), compiled.weights().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
