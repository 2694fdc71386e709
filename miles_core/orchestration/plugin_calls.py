"""Components a plugin registered, called so that what they raise or return wrongly names them.

A task's methods, an advantage estimator, a policy loss: an exception out of one is a PluginError naming the
component and its plugin (one line from the CLI), not a bare traceback out of the run; an estimator or loss that
returns the wrong type or shape is refused the same way.
"""

from __future__ import annotations

import numbers
import random

import torch

from miles_core.data.base import Task
from miles_core.errors import MilesUserError, PluginError
from miles_core.types import AdvantageInputs, AdvantageOutputs, LossInputs, LossOutput


def component_name(registry, name: str) -> str:
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
