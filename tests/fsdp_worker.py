"""Run by tests/test_fsdp.py under torchrun (2 CPU ranks, gloo) and also as one plain process.

Trains the tiny decoder for 3 steps on 3 fixed global batches and writes, from rank 0, the
per-step loss and grad norm, the old-policy logprobs and the final weights; then saves a
sharded checkpoint. Usage: fsdp_worker.py OUT_DIR [extra config overrides...]
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import make_trainer, policy_loss, random_batch, tiny_decoder  # noqa: E402


def run(out: Path, overrides: list[str]) -> None:
    trainer = make_trainer(tiny_decoder(), "train.max_tokens_per_micro_batch=24", "algorithm.kl_coef=0.1", *overrides)
    loss = policy_loss(trainer)
    curve = []
    for step in range(3):
        batch = random_batch(8, seed=10 + step)
        batch.old_logprobs = trainer.compute_logprobs(batch)
        batch.ref_logprobs = trainer.compute_ref_logprobs(batch)
        m = trainer.train_step(batch, loss)
        curve.append({"loss": m["loss"], "grad_norm": m["grad_norm"], "kl_ref": m["kl_ref"], "old_lp_sum": float(batch.old_logprobs.sum()),
                      "sharded": type(trainer.model.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"})
    weights = trainer.weights()
    trainer.save(out / "ckpt")
    if trainer.dist.is_main:
        (out / "curve.json").write_text(json.dumps(curve))
        torch.save({k: v.clone() for k, v in weights.items()}, out / "weights.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(Path(sys.argv[1]), sys.argv[2:])
