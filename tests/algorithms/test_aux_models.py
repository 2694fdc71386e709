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


def test_teacher_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    """Distillation compares the teacher's and the student's logprobs of the same token ids, which mean the same
    text only under one tokenizer. The start-up check compared the vocabulary sizes alone: a teacher whose tokenizer
    spells its ids otherwise (here a character tokenizer with the letters in another order) was accepted, and every
    advantage compared the logprob of one character with that of another."""
    import pytest

    from miles_core.errors import ConfigError

    alphabet = CharTokenizer().alphabet
    shuffled = alphabet[::-1]
    assert len(shuffled) == len(alphabet) and shuffled != alphabet
    other = save_teacher(tmp_path, CharTokenizer(shuffled).to_json())
    cfg = tiny_config(tmp_path, "algorithm.advantage_estimator=distill", f"algorithm.teacher_checkpoint={other}")
    with pytest.raises(ConfigError, match=rf"algorithm\.teacher_checkpoint: the tokenizer of '{other}' .* the policy's"):
        build(cfg, MilesPlugins(autoload=False), None)
    same = save_teacher(tmp_path, seed=2)  # the same tokenizer: accepted
    build(tiny_config(tmp_path, "algorithm.advantage_estimator=distill", f"algorithm.teacher_checkpoint={same}"),
          MilesPlugins(autoload=False), None)


def _word_level(path: Path, words: list[str]) -> Path:
    """An HF tokenizer folder numbering ``words`` in their order (``<eos>`` first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eos>", *words])}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return path


def test_hf_teacher_tokenizer_must_number_the_ids_as_the_policys(tmp_path):
    import pytest

    from miles_core.data.tokenizer import load_tokenizer
    from miles_core.errors import ConfigError
    from miles_core.orchestration.teacher import check_teacher_tokenizer

    policy = load_tokenizer(_word_level(tmp_path / "policy", ["one", "two", "three"]))
    check_teacher_tokenizer(_word_level(tmp_path / "same", ["one", "two", "three"]), policy)
    check_teacher_tokenizer(_word_level(tmp_path / "more", ["one", "two", "three", "four"]), policy)  # ids added past the policy's
    check_teacher_tokenizer(tmp_path / "no_tokenizer_files", policy)  # nothing to compare with
    swapped = _word_level(tmp_path / "swapped", ["one", "three", "two"])
    with pytest.raises(ConfigError, match=r"spells 2 token ids otherwise than the policy's \(id 2: 'three' there, 'two' in the policy's\)"):
        check_teacher_tokenizer(swapped, policy)
    with pytest.raises(ConfigError, match=r"\(CharTokenizer\) is not the policy's \(HFTokenizer\)"):
        check_teacher_tokenizer(save_teacher(tmp_path), policy)


def test_no_teacher_is_loaded_where_nothing_is_distilled(tmp_path):
    """run.mode=sft trains on demonstrations and run.mode=rollout trains nothing: neither scores a teacher (the loop
    builds the aux models for RL only), but build loaded the whole teacher for them whenever the config named one
    (a recipe shared by the SFT and RL stages): its weights held in memory for the whole run, unused."""
    teacher = save_teacher(tmp_path)
    distill = ["algorithm.advantage_estimator=distill", f"algorithm.teacher_checkpoint={teacher}"]
    for mode in ("sft", "rollout"):
        c = build(tiny_config(tmp_path, f"run.mode={mode}", *distill), MilesPlugins(autoload=False), None)
        assert c.teacher is None, mode
    assert build(tiny_config(tmp_path, *distill), MilesPlugins(autoload=False), None).teacher is not None


def test_gguf_teacher_is_refused_with_what_to_give_instead(tmp_path):
    """The teacher is read from an HF safetensors folder only. A .gguf teacher_checkpoint (or ``smollm2``, which
    model.hf_checkpoint accepts) was refused with the policy's message, "is a file; give the HF folder that holds it
    (or a .gguf file)": it told the user to give what they had given."""
    import pytest

    from miles_core.errors import ConfigError

    gguf = tmp_path / "teacher.gguf"
    gguf.write_bytes(b"GGUF")
    for value in (str(gguf), "smollm2"):
        cfg = tiny_config(tmp_path, "algorithm.advantage_estimator=distill", f"algorithm.teacher_checkpoint={value}")
        with pytest.raises(ConfigError) as err:
            build(cfg, MilesPlugins(autoload=False), None)
        msg = str(err.value)
        assert msg.startswith(f"algorithm.teacher_checkpoint: '{value}' is a GGUF checkpoint"), msg
        assert "HF safetensors folder" in msg and "or a .gguf" not in msg, msg
