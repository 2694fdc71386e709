"""The trainer's HF export loads in transformers and gives the same logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from miles_core.plugins.manager import MilesPlugins

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_trainer, policy_loss, random_batch, tiny_decoder  # noqa: E402


@pytest.mark.parametrize("tie", [True, False])
def test_export_loads_in_transformers_with_same_logits(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    trainer = make_trainer(tiny_decoder(tie=tie))
    batch = random_batch(4)
    trainer.train_step(batch, policy_loss(trainer))  # export trained (not initial) weights
    family = MilesPlugins().registries.model_families.get("qwen3", key="model.family")
    trainer.export_hf(family, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    ids = batch.input_ids[:2, :8]
    with torch.no_grad():
        ours = trainer.model.lm_head(trainer.model(ids))
        theirs = hf(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
