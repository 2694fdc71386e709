"""The models beside the policy (miles_core/orchestration/aux_models.py): the distillation teacher, checked and
built at start-up."""

from pathlib import Path

import torch

from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
from miles_core.models.checkpoint import save_hf_state
from miles_core.orchestration.aux_models import build_aux_models
from miles_core.orchestration.build import build
from miles_core.plugins.manager import MilesPlugins
from miles_core.testing.contracts import tiny_config
from miles_core.train.batch import make_train_batch
from miles_core.types import Sample


def save_teacher(tmp_path: Path, tokenizer_file: str | None = None, seed: int = 1) -> Path:
    """A tiny model of tiny_config's shape with its own random weights, saved as an HF folder (the default character
    tokenizer's file beside it, unless ``tokenizer_file`` gives another)."""
    c = build(tiny_config(tmp_path), MilesPlugins(autoload=False), None)  # build seeds the model with run.seed
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in c.model.state_dict().items()}
    dest = tmp_path / f"teacher{seed}"
    save_hf_state(state, c.model.config, c.family, dest,
                  {CHAR_TOKENIZER_FILE: tokenizer_file or CharTokenizer().to_json()})
    return dest


def _batch(tok) -> object:
    samples = [Sample("ab?", tok.encode("ab?"), tok.encode("ba") + [tok.eos_token_id], "ba", [], "ba", group_id=0, index=0),
               Sample("cde?", tok.encode("cde?"), tok.encode("edc"), "edc", [], "edc", group_id=1, index=1)]
    return make_train_batch(samples, tok.pad_token_id)


def test_teacher_keeps_no_reference_copy_of_its_own(tmp_path):
    """The KL reference is the policy's (the trainer's ``ref``); the teacher is scored, never KL-regularised. Built
    by the same trainer factory under the run's config, with kl_coef > 0 the teacher's trainer also deep-copied the
    whole teacher as a "reference" that nothing ever read: a second teacher in memory."""
    teacher = save_teacher(tmp_path)
    cfg = tiny_config(tmp_path, "algorithm.advantage_estimator=distill", f"algorithm.teacher_checkpoint={teacher}",
                      "algorithm.kl_coef=0.1")
    c = build(cfg, MilesPlugins(autoload=False), None)
    trainer = c.trainer_factory(c.ctx, c.model)
    aux = build_aux_models(c, trainer)
    assert trainer.ref is not None  # the policy keeps its KL reference
    assert aux.teacher.ref is None
    assert cfg.algorithm.kl_coef == 0.1  # the run's config is left as it was
    batch = _batch(c.ctx.tokenizer)
    lp_teacher, lp_policy = aux.teacher.compute_logprobs(batch), trainer.compute_logprobs(batch)
    assert not torch.allclose(lp_teacher, lp_policy)  # the teacher's own weights
    # and they are the teacher's logprobs: a trainer built on the teacher's folder by itself gives the same numbers
    alone = build(tiny_config(tmp_path, f"model.hf_checkpoint={teacher}"), MilesPlugins(autoload=False), None)
    assert torch.equal(lp_teacher, alone.trainer_factory(alone.ctx, alone.model).compute_logprobs(batch))
