"""Build every component of a run from its config and the plugin registries.

``miles validate`` calls this and stops; ``miles run`` then hands the result to the loop.
"""

from __future__ import annotations

import functools
import numbers
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles_core.config.schema import MilesConfig
from miles_core.context import RunContext
from miles_core.data.base import Task
from miles_core.data.jsonl import JsonlTask
from miles_core.data.sft import read_sft_examples
from miles_core.data.synthetic import ReverseTask
from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer, HFTokenizer, load_tokenizer
from miles_core.errors import ConfigError, DataError, MilesUserError, PluginError
from miles_core.kernels.base import Kernels
from miles_core.models.base import ModelFamily
from miles_core.models.checkpoint import load_hf_folder
from miles_core.models.gguf import SMOLLM2_NAMES, gguf_file, load_gguf
from miles_core.models.decoder import DecoderConfig
from miles_core.orchestration.checkpoint import (check_data_fingerprint, check_mode, find_checkpoint, read_loop_state,
                                                 sft_data_fingerprint)
from miles_core.orchestration.placement import check_placement
from miles_core.platforms import select_platform
from miles_core.plugins.manager import MilesPlugins
from miles_core.rewards.custom import check_reward_fn, load_reward_path
from miles_core.rewards.base import RewardFn
from miles_core.types import AdvantageInputs, AdvantageOutputs, LossInputs, LossOutput, Sample


@dataclass
class Components:
    ctx: RunContext
    task: Task
    family: ModelFamily
    model: nn.Module  # the initial policy (the trainer and the engine each take their own copy)
    reward_fn: RewardFn
    reward_name: str
    advantage_estimator: Any
    policy_loss: Any
    sft_loss: Any
    backend_factory: Any
    trainer_factory: Any
    transport: Any
    teacher: nn.Module | None = None  # on-policy distillation teacher (algorithm.teacher_checkpoint)
    estimator_needs_old_logprobs: bool = False  # the estimator reads them (``needs_old_logprobs``): never left None
    # run.mode=sft's (prompt, response) examples from data.train_path, read (and every line checked) at build
    sft_examples: list[Sample] | None = None


def model_source(cfg: MilesConfig) -> str | None:
    """The HF folder to build the model from: run.load (a resumed --save folder's newest
    checkpoint, or an HF folder), else model.hf_checkpoint."""
    ckpt = find_checkpoint(cfg.run.load)
    if ckpt is not None:
        return str(ckpt / "hf")
    return cfg.run.load or cfg.model.hf_checkpoint


def build_model(cfg: MilesConfig, plugins: MilesPlugins, tokenizer) -> tuple[nn.Module, ModelFamily]:
    families = plugins.registries.model_families
    source = model_source(cfg)
    if source:
        return load_hf_folder(Path(source), families)
    m = cfg.model
    family = families.get(m.family, key="model.family")
    dcfg = DecoderConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        rope_theta=m.rope_theta,
        qk_norm=family.qk_norm,
        tie_word_embeddings=m.tie_word_embeddings,
        max_position_embeddings=m.max_seq_len,
    )
    return family.build(dcfg), family


def resolve_reward(cfg: MilesConfig, plugins: MilesPlugins, task: Task) -> tuple[RewardFn, str]:
    name = cfg.reward.name
    if name == "task":
        return (lambda s: task.score(s.response, s.label)), f"task:{cfg.data.task}"
    if ":" in name or ("." in name and name not in plugins.registries.rewards):  # slime's module.function too
        return load_reward_path(name), name
    return check_reward_fn(plugins.registries.rewards.get(name, key="reward.name"), name), name


def apply_resume(cfg: MilesConfig) -> None:
    """``--resume``: continue from the newest checkpoint in run.save (run.load resumes a --save folder)."""
    if not cfg.run.resume:
        return
    if find_checkpoint(cfg.run.save) is None:
        raise ConfigError(f"--resume: '{cfg.run.save}' holds no checkpoint (no 'latest' file); run without --resume to start fresh")
    cfg.run.load = cfg.run.save


def check_run_folders(cfg: MilesConfig) -> None:
    """The folders a run writes must be folders, or be creatable: one that is a file (or under one) failed only when
    first written, for run.save after the whole run's training, with NotADirectoryError. The folder of saved
    rollouts to train on must be there."""
    for key in ("run.save", "run.save_rollouts", "run.output_dir"):
        path = getattr(cfg.run, key.split(".")[1])
        if not path:
            continue
        existing = Path(path)
        while not existing.exists() and existing != existing.parent:  # the nearest part of the path that is there
            existing = existing.parent
        if existing.exists() and not existing.is_dir():
            raise ConfigError(f"{key} '{path}': '{existing}' is a file, not a folder")
    if cfg.run.load_rollouts and not Path(cfg.run.load_rollouts).is_dir():  # else found at step 1, after the warm-up
        raise DataError(f"run.load_rollouts: '{cfg.run.load_rollouts}' does not exist (save rollouts there with --save-rollouts)")


def check_resume_data(cfg: MilesConfig, task: Task) -> None:
    """A resumed RL run replays the prompt stream from its checkpoint's position, which is exact only over the data
    the checkpoint was saved with: checked here, before any engine or trainer is built (``miles validate`` too).
    run.mode=rollout takes only the checkpoint's weights; sft continues its own stream of examples (data.train_path's
    pairs, or the task's reference answers), checked the same way; run.load_rollouts trains on saved samples,
    drawing no prompts."""
    ckpt = find_checkpoint(cfg.run.load)
    if ckpt is None or cfg.run.mode == "rollout":
        return
    state = read_loop_state(ckpt)
    if cfg.run.mode == "sft":  # its own checkpoints continue its example stream; an RL one gives it only weights
        if state.mode == "sft":
            check_data_fingerprint(ckpt, state.data_fingerprint, sft_data_fingerprint(cfg.data, task), cfg.data.allow_changed_on_resume)
        return
    check_mode(ckpt, state, "rl")
    if cfg.run.load_rollouts:
        return
    check_data_fingerprint(ckpt, state.data_fingerprint, getattr(task, "data_fingerprint", None), cfg.data.allow_changed_on_resume)


def check_char_alphabet(made: Task, task: Task, tokenizer: CharTokenizer, sft_examples: list[Sample] | None = None) -> None:
    """The tiny models' character tokenizer encodes a character outside its alphabet as <unk> and decodes none back: a
    prompt with one is trained on as <unk>, and a reference answer with one no response can spell (reward 0 throughout,
    no error). Checked at start-up: the reverse task's alphabet, the JSONL task's training prompts, and every task's
    held-out prompts with their answers (labels that are text), and run.mode=sft's (prompt, response) examples."""
    checks: list[tuple[str, str, str]] = []  # (where, what, text)
    if isinstance(made, ReverseTask):
        checks.append((f"data.task_options.alphabet {made.alphabet!r}", "", made.alphabet))
    prompts = [*(made.train if isinstance(made, JsonlTask) else []), *task.eval_prompts()]
    for i, p in enumerate(prompts):
        where = p.source or f"held-out prompt {i} of task '{made.name}'"
        checks.append((where, f": the prompt {p.text!r}", p.text))
        if isinstance(p.label, str):  # the answer; not task.reference(p), which may draw (a flawed teacher's demo_noise)
            checks.append((where, f": the answer {p.label!r}", p.label))
    for s in sft_examples or []:
        checks.append((s.metadata["source"], f": the prompt {s.prompt!r}", s.prompt))
        checks.append((s.metadata["source"], f": the response {s.response!r}", s.response))
    known = set(tokenizer.alphabet)
    for where, what, text in checks:
        unknown = sorted(set(text) - known)
        if unknown:
            error = ConfigError if not what else DataError
            raise error(f"{where}{what} has characters the built-in character tokenizer does not: "
                        f"{', '.join(map(repr, unknown))} (its alphabet: {tokenizer.alphabet!r}); they would be read as "
                        "<unk> and no response could spell them: use those characters only, or an HF model "
                        "(model.hf_checkpoint) whose tokenizer has them")


def check_tokenizer_tokens(cfg: MilesConfig, tokenizer, source: str) -> None:
    """The special tokens a run writes into its samples: an SFT response ends with the eos, and training batches are
    padded with the pad token (or the eos). An HF tokenizer may name neither (and no config file an eos id): None in
    the token ids failed later in make_train_batch, with no word of the tokenizer."""
    sft = "run.mode=sft" if cfg.run.mode == "sft" else "train.sft_warmup_steps" if cfg.train.sft_warmup_steps else None
    if tokenizer.eos_token_id is None and sft:
        raise ConfigError(f"the tokenizer of '{source}' has no eos token (its tokenizer_config.json names no eos_token, "
                          f"config.json and generation_config.json no eos_token_id): {sft} ends every response with it; "
                          "set eos_token in tokenizer_config.json")
    if tokenizer.pad_token_id is None and cfg.run.mode != "rollout":
        raise ConfigError(f"the tokenizer of '{source}' has neither a pad nor an eos token: training batches are padded "
                          "with one; set pad_token or eos_token in its tokenizer_config.json")


def build(cfg: MilesConfig, plugins: MilesPlugins, output_dir: Path | None) -> Components:
    regs = plugins.registries
    check_run_folders(cfg)
    apply_resume(cfg)
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    if cfg.run.num_threads > 0:
        torch.set_num_threads(cfg.run.num_threads)
    platform, device = select_platform(regs.platforms, cfg.run.device)
    check_precision(cfg.train.precision, regs.precision_recipes, device)  # before a model is loaded
    source = model_source(cfg)
    gguf = gguf_file(source)  # model.hf_checkpoint=smollm2 or a .gguf path: model and tokenizer from one file
    if gguf is not None:
        gguf_model, gguf_family, hf_tok = load_gguf(gguf, regs.model_families)
        tokenizer = HFTokenizer.wrap(hf_tok)
    else:
        tokenizer = load_tokenizer(Path(source)) if source else CharTokenizer()
    check_tokenizer_tokens(cfg, tokenizer, str(gguf or source))
    kernels = Kernels(plugins, platform.name)
    ctx = RunContext(cfg, plugins, tokenizer, device, platform.name, kernels, output_dir)
    task_factory = regs.tasks.get(cfg.data.task, key="data.task")
    what = _component(regs.tasks, cfg.data.task)
    made = plugin_call(what, task_factory, cfg.data)
    task = PluginTask(made, what)
    if not task.eval_prompts():
        raise ConfigError(f"task '{cfg.data.task}' has no held-out prompts (set data.eval_path)")
    check_resume_data(cfg, task)
    # read here, not when the loop first draws an example (after the engines start and the step-0 eval): a bad line
    # fails at start-up and in `miles validate`
    sft_examples = (read_sft_examples(cfg.data.train_path, cfg.data.prompt_key, cfg.data.response_key, tokenizer)
                    if cfg.run.mode == "sft" and cfg.data.train_path else None)
    peak = cfg.train.sft_lr or cfg.train.lr
    if cfg.run.mode == "sft" and cfg.train.lr_decay == "cosine" and cfg.train.min_lr > peak:
        raise ConfigError(f"train.min_lr ({cfg.train.min_lr}) must not exceed train.sft_lr ({peak}): run.mode=sft's cosine "
                          "decays from train.sft_lr to train.min_lr")
    if isinstance(tokenizer, CharTokenizer):
        check_char_alphabet(made, task, tokenizer, sft_examples)
    reward_fn, reward_name = resolve_reward(cfg, plugins, made)  # reward.name=task: the reward runner names the sample
    model, family = (gguf_model, gguf_family) if gguf is not None else build_model(cfg, plugins, tokenizer)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the model's vocab ({model.config.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size})")
    algo = cfg.algorithm
    estimator = regs.advantage_estimators.get(algo.advantage_estimator, key="algorithm.advantage_estimator")
    loss = regs.policy_losses.get(algo.policy_loss, key="algorithm.policy_loss")
    needs_sft = cfg.train.sft_warmup_steps or cfg.run.mode == "sft"
    sft = regs.policy_losses.get("sft", key="train.sft_warmup_steps") if needs_sft else None
    check_algorithm(cfg, estimator)
    check_placement(cfg)  # here too, so miles validate refuses what miles run would refuse at its start
    teacher = load_teacher(cfg, families=regs.model_families, vocab_size=model.config.vocab_size, tokenizer=tokenizer)
    return Components(
        ctx=ctx,
        task=task,
        family=family,
        model=model,
        reward_fn=reward_fn,
        reward_name=reward_name,
        advantage_estimator=functools.partial(checked_estimator, estimator, _component(regs.advantage_estimators, algo.advantage_estimator)),
        policy_loss=functools.partial(checked_loss, loss, algo, _component(regs.policy_losses, algo.policy_loss)),
        sft_loss=None if sft is None else functools.partial(checked_loss, sft, algo, _component(regs.policy_losses, "sft")),
        backend_factory=regs.rollout_backends.get(cfg.rollout.backend, key="rollout.backend"),
        trainer_factory=regs.trainers.get(cfg.train.backend, key="train.backend"),
        transport=regs.weight_transports.get(cfg.sync.transport, key="sync.transport")(ctx),
        teacher=teacher,
        estimator_needs_old_logprobs=getattr(estimator, "needs_old_logprobs", False),
        sft_examples=sft_examples,
    )


def check_precision(name: str, recipes, device: torch.device) -> None:
    """``train.precision=name`` must be able to run on ``device``: refused here, not by its kernels at the first step."""
    recipe = recipes.get(name, key="train.precision")
    why = plugin_call(f"unavailable of {_component(recipes, name)}", recipe.unavailable, device)
    if why:
        raise ConfigError(f"train.precision={name} cannot run on {device}: {why}")


def _component(registry, name: str) -> str:
    return f"{registry.kind} '{name}' (plugin '{registry.entry(name).plugin}')"


def plugin_call(what: str, fn, *args):
    """``fn(*args)``, where ``fn`` is a component a plugin registered (``what`` names both): what it raises is a PluginError
    naming them, as a hook that raises is, not a bare traceback out of the run; a MilesUserError goes on as it is."""
    try:
        return fn(*args)
    except MilesUserError:
        raise
    except Exception as exc:
        raise PluginError(f"{what} raised {type(exc).__name__}: {exc}") from exc


class PluginTask:
    """The task a plugin's factory made, its methods called through plugin_call: one that raises (its score in an eval
    or a step's metrics, its prompts, its reference answers) is a PluginError naming the task, its plugin and the
    method, not a bare traceback out of the run. Anything else (``name``, ``data_fingerprint``) is the task's own."""

    def __init__(self, task: Task, what: str) -> None:
        self._task, self._what = task, what

    def __getattr__(self, name: str):
        if name == "_task":  # not set yet (a copy being made): not the task's
            raise AttributeError(name)
        return getattr(self._task, name)

    def _call(self, method: str, *args):
        return plugin_call(f"{method} of {self._what}", getattr(self._task, method), *args)

    def eval_prompts(self):
        return self._call("eval_prompts")

    def score(self, response: str, label: object) -> float:
        return self._call("score", response, label)

    def reference(self, prompt):
        return self._call("reference", prompt)

    def train_prompts(self, rng: random.Random):
        """The task's stream, as it is. A generator's code runs when it is drawn from, not when called, so each prompt
        is drawn through plugin_call too; the call itself is made here, at once, as the task's own would be."""
        what = f"train_prompts of {self._what}"
        return _drawn(what, plugin_call(what, lambda: iter(self._task.train_prompts(rng))))


def _drawn(what: str, stream):
    end = object()
    while (prompt := plugin_call(what, next, stream, end)) is not end:
        yield prompt


def checked_estimator(fn, what: str, inputs: AdvantageInputs, cfg) -> AdvantageOutputs:
    """``fn(inputs, cfg)``, refused with one line naming ``what`` unless it returns AdvantageOutputs of [N, T]."""
    out = plugin_call(what, fn, inputs, cfg)
    adv = getattr(out, "advantages", None) if isinstance(out, AdvantageOutputs) else None
    if not isinstance(adv, torch.Tensor):
        raise PluginError(f"{what} returned a {type(out).__name__}; an estimator returns miles_core.types.AdvantageOutputs")
    if adv.shape != inputs.response_mask.shape:
        raise PluginError(f"{what} returned advantages of shape {tuple(adv.shape)}; expected [N, T] = {tuple(inputs.response_mask.shape)}")
    return out


def checked_loss(fn, cfg, what: str, inputs: LossInputs) -> LossOutput:
    """``fn(inputs, cfg)`` (cfg by position, as the hookspec documents), refused with one line naming ``what``
    unless it returns a LossOutput with a per-token [N, T] loss and float metrics."""
    out = plugin_call(what, fn, inputs, cfg)
    if not isinstance(out, LossOutput) or not isinstance(out.loss, torch.Tensor):
        raise PluginError(f"{what} returned a {type(out).__name__}; a policy loss returns miles_core.types.LossOutput")
    if out.loss.shape != inputs.response_mask.shape:
        raise PluginError(f"{what} returned a loss of shape {tuple(out.loss.shape)}; expected per-token [N, T] = {tuple(inputs.response_mask.shape)}")
    for k, v in out.metrics.items():
        if not isinstance(v, numbers.Real):
            raise PluginError(f"{what} returned the metric '{k}' as a {type(v).__name__}; LossOutput.metrics holds floats (float(x))")
    return out


def check_algorithm(cfg: MilesConfig, estimator=None) -> None:
    """Checks of the algorithm section that need other sections (and the estimator's ``needs_groups``)."""
    a, r = cfg.algorithm, cfg.rollout
    groups = cfg.run.mode != "sft" and getattr(estimator, "needs_groups", False)  # its baseline is the prompt's group
    if cfg.run.mode != "sft" and r.n_samples_per_prompt < 2:
        # a group of one sample has no baseline: every advantage would be 0 and nothing would be learned
        if groups:
            raise ConfigError(
                f"algorithm.advantage_estimator={a.advantage_estimator} compares the samples of a prompt with each other: "
                f"it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}"
            )
        if a.dynamic_sampling:
            raise ConfigError("algorithm.dynamic_sampling drops groups whose rewards are all equal, which a group of one "
                              f"always is: it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}")
    if groups and r.temperature == 0 and r.backend in ("builtin", "sglang"):
        # greedy samples of one prompt are one sample n times (a plugin's backend, an agent's say, may still vary them)
        raise ConfigError(
            f"algorithm.advantage_estimator={a.advantage_estimator} compares the samples of a prompt with each other, and "
            f"rollout.temperature=0 makes them identical (every advantage 0): sample with rollout.temperature > 0"
        )
    if a.dynamic_sampling and cfg.orchestration.schedule == "async":  # here, not when the loop makes the schedule (after the warm-up)
        raise ConfigError("orchestration.schedule=async does not support algorithm.dynamic_sampling yet")
    if a.overlong_buffer >= r.max_response_len:
        raise ConfigError(
            f"algorithm.overlong_buffer ({a.overlong_buffer}) must be below rollout.max_response_len ({r.max_response_len})"
        )


def load_teacher(cfg: MilesConfig, families, vocab_size: int, tokenizer=None) -> nn.Module | None:
    if not cfg.algorithm.needs_teacher or cfg.run.mode != "rl":  # sft and rollout score no teacher
        return None
    source = cfg.algorithm.teacher_checkpoint
    if source.lower() in SMOLLM2_NAMES or source.lower().endswith(".gguf"):  # model.hf_checkpoint takes one; a teacher not
        raise ConfigError(f"algorithm.teacher_checkpoint: '{source}' is a GGUF checkpoint; the teacher is read from an "
                          "HF safetensors folder (config.json and *.safetensors): give one")
    path = Path(source)
    try:
        teacher, _ = load_hf_folder(path, families)
    except ConfigError as exc:
        raise ConfigError(f"algorithm.teacher_checkpoint: {exc}") from None
    if teacher.config.vocab_size != vocab_size:
        raise ConfigError(
            f"algorithm.teacher_checkpoint: the teacher's vocab ({teacher.config.vocab_size}) differs from the policy's "
            f"({vocab_size}); distillation needs the same tokenizer"
        )
    if tokenizer is not None:
        check_teacher_tokenizer(path, tokenizer)
    return teacher


_TOKENIZER_FILES = (CHAR_TOKENIZER_FILE, "tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _id_to_token(tokenizer) -> dict[int, str]:
    if isinstance(tokenizer, CharTokenizer):
        return {**dict(enumerate(CharTokenizer.SPECIALS)), **{i: ch for ch, i in tokenizer._to_id.items()}}
    return {i: t for t, i in tokenizer.tok.get_vocab().items()}


def check_teacher_tokenizer(path: Path, tokenizer) -> None:
    """The teacher's tokenizer (when its folder has one) must spell every id that both tokenizers have as the policy's
    does: distillation compares the logprobs of the same ids, and a vocabulary of the same size may still number its
    tokens otherwise (another alphabet's order, another BPE)."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return  # nothing to compare with: the sizes were checked
    try:
        theirs = load_tokenizer(path)
    except ConfigError as exc:
        raise ConfigError(f"algorithm.teacher_checkpoint: {exc}") from None
    if not isinstance(tokenizer, (CharTokenizer, HFTokenizer)):
        return  # a plugin's tokenizer: no vocabulary to read
    if type(theirs) is not type(tokenizer):
        raise ConfigError(f"algorithm.teacher_checkpoint: the tokenizer of '{path}' ({type(theirs).__name__}) is not "
                          f"the policy's ({type(tokenizer).__name__}); distillation needs the same tokenizer")
    mine, other = _id_to_token(tokenizer), _id_to_token(theirs)
    differ = sorted(i for i in mine.keys() & other.keys() if mine[i] != other[i])
    if differ:
        i = differ[0]
        raise ConfigError(f"algorithm.teacher_checkpoint: the tokenizer of '{path}' spells {len(differ)} token ids otherwise "
                          f"than the policy's (id {i}: {other[i]!r} there, {mine[i]!r} in the policy's); distillation "
                          "compares the logprobs of the same ids and needs the same tokenizer")


def tokenizer_files(tokenizer) -> dict[str, str | bytes]:
    """Files to save beside a checkpoint so that it reloads with the same tokenizer."""
    if isinstance(tokenizer, CharTokenizer):
        return {CHAR_TOKENIZER_FILE: tokenizer.to_json()}
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.files()
    return {}
