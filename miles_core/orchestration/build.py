"""Build every component of a run from its config and the plugin registries.

``miles validate`` calls this and stops; ``miles run`` then hands the result to the loop.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles_core.config.schema import MilesConfig
from miles_core.context import RunContext
from miles_core.data.base import Task
from miles_core.data.sft import read_sft_examples
from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer, HFTokenizer, load_tokenizer
from miles_core.errors import ConfigError
from miles_core.kernels.base import Kernels
from miles_core.models.base import ModelFamily
from miles_core.models.checkpoint import load_hf_folder
from miles_core.models.decoder import DecoderConfig
from miles_core.models.gguf import gguf_file, load_gguf
from miles_core.orchestration.checkpoint import find_checkpoint
from miles_core.orchestration.checks import (check_algorithm, check_char_alphabet, check_precision, check_resume_data,
                                             check_run_folders, check_sft_schedule, check_tokenizer_tokens)
from miles_core.orchestration.placement import check_placement
from miles_core.orchestration.plugin_calls import PluginTask, checked_estimator, checked_loss, component_name, plugin_call
from miles_core.orchestration.teacher import load_teacher
from miles_core.platforms import select_platform
from miles_core.plugins.manager import MilesPlugins
from miles_core.rewards.custom import check_reward_fn, load_reward_path
from miles_core.rewards.base import RewardFn
from miles_core.types import Sample


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
    what = component_name(regs.tasks, cfg.data.task)
    made = plugin_call(what, task_factory, cfg.data)
    task = PluginTask(made, what)
    if not task.eval_prompts():
        raise ConfigError(f"task '{cfg.data.task}' has no held-out prompts (set data.eval_path)")
    check_resume_data(cfg, task)
    # read here, not when the loop first draws an example (after the engines start and the step-0 eval): a bad line
    # fails at start-up and in `miles validate`
    sft_examples = (read_sft_examples(cfg.data.train_path, cfg.data.prompt_key, cfg.data.response_key, tokenizer)
                    if cfg.run.mode == "sft" and cfg.data.train_path else None)
    check_sft_schedule(cfg)
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
        advantage_estimator=functools.partial(checked_estimator, estimator, component_name(regs.advantage_estimators, algo.advantage_estimator)),
        policy_loss=functools.partial(checked_loss, loss, algo, component_name(regs.policy_losses, algo.policy_loss)),
        sft_loss=None if sft is None else functools.partial(checked_loss, sft, algo, component_name(regs.policy_losses, "sft")),
        backend_factory=regs.rollout_backends.get(cfg.rollout.backend, key="rollout.backend"),
        trainer_factory=regs.trainers.get(cfg.train.backend, key="train.backend"),
        transport=regs.weight_transports.get(cfg.sync.transport, key="sync.transport")(ctx),
        teacher=teacher,
        estimator_needs_old_logprobs=getattr(estimator, "needs_old_logprobs", False),
        sft_examples=sft_examples,
    )


def tokenizer_files(tokenizer) -> dict[str, str | bytes]:
    """Files to save beside a checkpoint so that it reloads with the same tokenizer."""
    if isinstance(tokenizer, CharTokenizer):
        return {CHAR_TOKENIZER_FILE: tokenizer.to_json()}
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.files()
    return {}
