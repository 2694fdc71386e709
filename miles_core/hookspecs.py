"""The contract between Miles and its plugins: every hook, in one module.

A plugin is a module or object with functions marked ``@hookimpl`` whose names match the specs
below; a third-party plugin is a package that names it under ``[project.entry-points.miles]``.
The core's own components are plugins too (``miles_core.plugins.builtin``).

Two kinds of hooks:

* **Registration hooks** (``miles_register_<things>(registry)``) are called once per run, when
  the plugin manager builds its registries. A plugin calls ``registry.add(name, component)``.
  Every plugin's implementation is called; a name registered by two plugins is an error that
  names both. The component types are documented on each hook; a component of the wrong kind (not
  callable, a signature that cannot take the documented arguments by position, not an instance
  of the documented class) is refused by ``registry.add`` with a PluginError naming the plugin.
* **Lifecycle hooks** are called by the RL loop at fixed points. Every implementation is called
  (in pluggy's order: last registered first) and return values are ignored, except where a hook
  is marked ``firstresult``: there the first non-``None`` answer wins.

A function is an implementation only when marked ``@hookimpl`` (an unmarked function named like a
hook is an error). An exception raised by an implementation stops the run with a PluginError that
names the plugin and the hook (a :class:`miles_core.errors.MilesUserError` is passed on as it is).

Call sites never spell hook names as strings: they go through :class:`miles_core.plugins.manager.MilesPlugins`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from miles_core.context import RunContext
    from miles_core.kernels.base import KernelImpl
    from miles_core.plugins.registry import Registry
    from miles_core.types import Sample

PROJECT = "miles"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class MilesSpecs:
    # ------------------------------------------------------------------ registration
    @hookspec
    def miles_register_tasks(self, registry: Registry) -> None:
        """Register prompt tasks: ``registry.add(name, factory)``.

        ``factory(cfg: miles_core.data.config.DataConfig) -> miles_core.data.base.Task``: ``cfg`` is
        the config's whole ``data`` section; the task's own options are the mapping
        ``cfg.task_options`` (``data.task_options``). A task makes prompts with labels
        (``eval_prompts()``, ``train_prompts(rng)``), scores responses (``score(response, label)``,
        its verifier: a score >= 1.0 counts as correct) and may give a reference answer for the
        supervised warm-up (``reference(prompt)``). Selected by ``data.task``. A task that reads
        its prompts from a file may set ``data_fingerprint`` (a dict identifying that file), which a
        resumed run checks against its checkpoint's. A method that raises (its stream too, when drawn
        from) stops the run with a PluginError naming the task, the plugin and the method (a
        :class:`miles_core.errors.MilesUserError`, such as a DataError, is passed on as it is).
        """

    @hookspec
    def miles_register_rewards(self, registry: Registry) -> None:
        """Register reward functions: ``registry.add(name, fn)``.

        ``fn(sample: miles_core.types.Sample) -> float`` (or an awaitable of one): any finite real
        number (int, float, or a numpy scalar such as ``np.float32``; not a bool); anything else
        stops the run with an error naming the reward and the sample. Selected by ``reward.name``;
        ``reward.name=task`` uses the task's own verifier and ``reward.name=module:function``
        imports a function, so a reward named ``task`` or with a ``:`` in its name is refused.
        """

    @hookspec
    def miles_register_rollout_backends(self, registry: Registry) -> None:
        """Register rollout backends: ``registry.add(name, factory)``.

        ``factory(ctx: RunContext, model: torch.nn.Module) -> miles_core.rollout.base.RolloutBackend``.
        ``model`` is the policy at weight version 0; the backend keeps its own copy. Selected by
        ``rollout.backend``.
        """

    @hookspec
    def miles_register_trainers(self, registry: Registry) -> None:
        """Register trainer backends: ``registry.add(name, factory)``.

        ``factory(ctx: RunContext, model: torch.nn.Module) -> miles_core.train.base.Trainer``.
        Selected by ``train.backend``.
        """

    @hookspec
    def miles_register_advantage_estimators(self, registry: Registry) -> None:
        """Register advantage estimators: ``registry.add(name, fn)``.

        ``fn(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs``
        (``miles_core.types``, ``miles_core.algorithms.config``), called with both by position,
        once per RL step; ``advantages`` is ``[N, T]``, zero where ``response_mask`` is. Selected by
        ``algorithm.advantage_estimator``. An estimator whose baseline is the prompt's group of
        samples (its advantages are 0 for a group of one) sets ``fn.needs_groups = True``; a run
        with ``rollout.n_samples_per_prompt=1``, or with ``rollout.temperature=0`` on the ``builtin`` or
        ``sglang`` backend (identical samples), is then refused with a ConfigError. ``inputs.old_logprobs``
        is ``None`` in a default run (``train.old_logprobs=auto``: the training forward stands in for them); an
        estimator that reads them sets ``fn.needs_old_logprobs = True``, and the run then computes them.
        """

    @hookspec
    def miles_register_policy_losses(self, registry: Registry) -> None:
        """Register policy losses: ``registry.add(name, fn)``.

        ``fn(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput``, called with both by
        position, once per micro-batch. ``LossOutput.loss`` is the per-token loss ``[N, T]`` (the
        trainer aggregates it, ``algorithm.loss_agg``); ``LossOutput.metrics`` holds floats, not
        tensors. Selected by ``algorithm.policy_loss``; the loss named ``sft`` serves the supervised
        warm-up.
        """

    @hookspec
    def miles_register_weight_transports(self, registry: Registry) -> None:
        """Register weight transports: ``registry.add(name, factory)``.

        ``factory(ctx: RunContext) -> miles_core.sync.base.WeightTransport``. Selected by
        ``sync.transport``.
        """

    @hookspec
    def miles_register_precision_recipes(self, registry: Registry) -> None:
        """Register precision recipes: ``registry.add(name, recipe)``.

        ``recipe: miles_core.precision.base.PrecisionRecipe``. Selected by ``train.precision``.
        """

    @hookspec
    def miles_register_kernels(self, registry: Registry) -> None:
        """Register kernel implementations: ``registry.add(name, impl)``.

        ``impl: miles_core.kernels.base.KernelImpl`` (the op it serves, the platforms it runs
        on, a priority). Several implementations of one op may be registered under different
        names; :meth:`miles_kernel_select` and the priorities decide which one serves.
        """

    @hookspec
    def miles_register_platforms(self, registry: Registry) -> None:
        """Register hardware platforms: ``registry.add(name, platform)``.

        ``platform: miles_core.platforms.Platform``. ``platform=auto`` picks the available one
        with the highest priority.
        """

    @hookspec
    def miles_register_model_families(self, registry: Registry) -> None:
        """Register model families: ``registry.add(name, family)``.

        ``family: miles_core.models.base.ModelFamily`` builds a torch module from a model config
        and maps HF checkpoint names. Selected by ``model.family`` (or from an HF config's
        ``model_type``).
        """

    # ------------------------------------------------------------------ selection
    @hookspec(firstresult=True)
    def miles_kernel_select(self, op: str, platform: str, candidates: list[KernelImpl]) -> KernelImpl | None:
        """Choose the implementation that serves ``op`` on ``platform``; first non-None wins.

        ``candidates`` are the registered implementations of ``op`` that run on ``platform``,
        highest priority first. Return one of them, or ``None`` to leave the choice to the priorities.
        """

    # ------------------------------------------------------------------ lifecycle
    @hookspec
    def miles_run_start(self, ctx: RunContext) -> None:
        """Called once, after every component is built and before the supervised warm-up and the first rollout."""

    @hookspec
    def miles_after_rollout(self, ctx: RunContext, step: int, samples: list[Sample]) -> None:
        """Called after each step's samples are generated and rewarded, before training."""

    @hookspec
    def miles_after_train_step(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        """Called after each RL step's training (its ``train.updates_per_rollout`` optimizer steps; not
        after the supervised warm-up's steps) with that step's metrics so far; a plugin may add keys,
        which are logged with the step."""

    @hookspec
    def miles_after_weight_sync(self, ctx: RunContext, version: int) -> None:
        """Called after the rollout backend holds weight version ``version``."""

    @hookspec
    def miles_run_end(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        """Called once when the run ends (normally or not); ``summary['status']`` says which. A failed run's
        ``summary`` holds only its status. An exception raised here while the run is failing is logged, not
        raised: the run's own error is the one reported."""
