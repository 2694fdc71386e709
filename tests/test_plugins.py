"""The plugin system: built-ins as plugins, blocking, entry points, validation, tracing."""

import json

import pytest

from miles_core.errors import PluginError
from miles_core.hookspecs import hookimpl
from miles_core.plugins.builtin import BUILTIN_PLUGINS
from miles_core.plugins.manager import MilesPlugins


def test_builtins_register_their_components():
    pm = MilesPlugins(autoload=False)
    assert [n for n, _ in BUILTIN_PLUGINS] == pm.plugin_names()
    regs = pm.registries
    assert "grpo" in regs.advantage_estimators and "ppo_clip" in regs.policy_losses
    assert pm.registries.rollout_backends.entry("builtin").plugin == "miles.rollout"
    assert pm.registries.tasks.entry("reverse").plugin == "miles.tasks"
    assert pm.registries.weight_transports.entry("in_process").plugin == "miles.sync"
    info = {i.name: i for i in pm.info()}
    assert "grpo" in info["miles.algorithms"].registered["advantage_estimators"]
    assert regs.kernels.entry("logprobs.torch").plugin == "miles.kernels"
    assert pm.registries.platforms.entry("cpu").plugin == "miles.platforms"  # miles_register_platforms
    assert pm.registries.kernels.entry("logprobs.torch").value.op == "logprobs"
    assert "miles_register_policy_losses" in info["miles.algorithms"].hooks


def test_blocking_a_builtin_removes_what_it_registered():
    pm = MilesPlugins(blocked=["miles.rewards"], autoload=False)
    assert "miles.rewards" not in pm.plugin_names()
    assert "exact_match" not in pm.registries.rewards
    assert len(pm.registries.rewards) == 0
    with pytest.raises(PluginError, match="unknown reward 'exact_match'"):
        pm.registries.rewards.get("exact_match")


def test_duplicate_name_names_both_plugins():
    class Clash:
        @hookimpl
        def miles_register_advantage_estimators(self, registry):
            registry.add("grpo", lambda inputs, cfg: None)

    pm = MilesPlugins(autoload=False, extra_plugins=[("my-plugin", Clash())])
    with pytest.raises(PluginError) as exc:
        pm.registries
    assert "miles.algorithms" in str(exc.value) and "my-plugin" in str(exc.value)


def test_one_plugin_registering_a_name_twice_is_not_told_to_block_one_of_them():
    # the message read "registered twice: by plugin 'twice' and by plugin 'twice'; block one of them with -p no:NAME",
    # and blocking the one plugin removes both
    class Twice:
        @hookimpl
        def miles_register_rewards(self, registry):
            registry.add("mine", lambda sample: 1.0)
            registry.add("mine", lambda sample: 0.0)

    pm = MilesPlugins(autoload=False, extra_plugins=[("twice", Twice())])
    with pytest.raises(PluginError, match=r"^plugin 'twice' registered the reward 'mine' twice; register each under its own name$"):
        pm.registries


def test_hookimpl_without_spec_is_rejected():
    class Typo:
        @hookimpl
        def miles_register_reward(self, registry):  # missing the "s"
            pass

    with pytest.raises(PluginError, match="Typo|typo-plugin"):
        MilesPlugins(autoload=False, extra_plugins=[("typo-plugin", Typo())])


def test_lifecycle_hooks_reach_plugins():
    seen = []

    class Listener:
        @hookimpl
        def miles_after_weight_sync(self, ctx, version):
            seen.append(version)

    pm = MilesPlugins(autoload=False, extra_plugins=[("listener", Listener())])
    pm.after_weight_sync(None, 3)
    assert seen == [3]


def test_kernel_select_hook_overrides_priorities():
    from miles_core.kernels.base import KernelImpl, Kernels

    def mine(*a, **k):
        return "mine"

    class Chooser:
        @hookimpl
        def miles_register_kernels(self, registry):
            registry.add("logprobs.low", KernelImpl("logprobs", mine, ("cpu",), priority=-5))

        @hookimpl
        def miles_kernel_select(self, op, platform, candidates):
            return next((c for c in candidates if c.fn is mine), None)

    plain = Kernels(MilesPlugins(autoload=False), "cpu")
    assert plain["logprobs"] is not mine  # the higher-priority reference wins without the hook
    chosen = Kernels(MilesPlugins(autoload=False, extra_plugins=[("chooser", Chooser())]), "cpu")
    assert chosen["logprobs"] is mine


def test_tracing_prints_hook_calls(capsys):
    pm = MilesPlugins(autoload=False, trace=True)
    pm.registries
    err = capsys.readouterr().err
    assert "miles_register_advantage_estimators" in err


def test_plugins_json_cli(cli):
    out = cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    data = {p["name"]: p for p in json.loads(out.stdout)}
    assert data["miles.tasks"]["registered"]["tasks"] == ["addition", "jsonl", "reasoning_gym", "reverse"]
    assert data["miles.tasks"]["builtin"] is True
    blocked = {p["name"]: p for p in json.loads(cli("plugins", "--json", "-p", "no:miles.tasks").stdout)}
    assert "miles.tasks" not in blocked
    assert all("tasks" not in p["registered"] for p in blocked.values())


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv("MILES_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = MilesPlugins()
    assert pm.plugin_names() == [n for n, _ in BUILTIN_PLUGINS]


def _registries_error(plugin) -> str:
    pm = MilesPlugins(autoload=False, extra_plugins=[("bad-plugin", plugin)])
    with pytest.raises(PluginError) as exc:
        pm.registries
    return str(exc.value)


def test_registration_hook_that_raises_names_the_plugin():
    class Raises:
        @hookimpl
        def miles_register_rewards(self, registry):
            raise RuntimeError("no config file")

    msg = _registries_error(Raises())
    assert "bad-plugin" in msg and "miles_register_rewards" in msg and "RuntimeError: no config file" in msg


def test_registered_component_of_the_wrong_kind_names_the_plugin():
    class NotCallable:
        @hookimpl
        def miles_register_advantage_estimators(self, registry):
            registry.add("three", 3.0)

    class WrongArity:  # a weight transport factory takes the RunContext
        @hookimpl
        def miles_register_weight_transports(self, registry):
            registry.add("mine", lambda: None)

    class NotARecipe:
        @hookimpl
        def miles_register_precision_recipes(self, registry):
            registry.add("half", "float16")

    msg = _registries_error(NotCallable())
    assert "bad-plugin" in msg and "advantage estimator 'three'" in msg and "not callable" in msg
    msg = _registries_error(WrongArity())
    assert "bad-plugin" in msg and "weight transport 'mine'" in msg and "signature" in msg
    msg = _registries_error(NotARecipe())
    assert "bad-plugin" in msg and "precision recipe 'half'" in msg and "PrecisionRecipe" in msg


def test_reward_names_that_reward_name_cannot_select_are_refused():
    # reward.name=task is the task's verifier and reward.name=a:b is a module path: a plugin's reward
    # under such a name would never run (the run silently used another reward)
    for name in ("task", "my:reward"):
        class Named:
            @hookimpl
            def miles_register_rewards(self, registry, name=name):
                registry.add(name, lambda sample: 1.0)

        msg = _registries_error(Named())
        assert "bad-plugin" in msg and f"'{name}'" in msg


def _built(tmp_path, plugin, *overrides):
    from miles_core.orchestration.build import build
    from miles_core.testing.contracts import tiny_config

    pm = MilesPlugins(autoload=False, extra_plugins=[("my-algo", plugin)])
    return build(tiny_config(tmp_path, *overrides), pm, None)


def _loss_inputs():
    import torch

    from miles_core.types import LossInputs

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    return LossInputs(torch.full((2, 3), -1.0, requires_grad=True), torch.full((2, 3), -1.1), torch.ones(2, 3) * mask, mask)


def test_policy_loss_gets_cfg_by_position_as_documented(tmp_path):
    # the hookspec documents fn(inputs, cfg); a loss whose second parameter has another name ran in the
    # contract check (which passes it by position) and then failed in the run (which passed cfg=)
    from miles_core.types import LossOutput

    class Loss:
        @hookimpl
        def miles_register_policy_losses(self, registry):
            registry.add("pg", lambda inputs, config: LossOutput(-inputs.advantages * inputs.logprobs, {"n": 1.0}))

    c = _built(tmp_path, Loss(), "algorithm.policy_loss=pg")
    assert c.policy_loss(_loss_inputs()).metrics == {"n": 1.0}


def test_estimator_and_loss_that_return_the_wrong_thing_name_the_plugin(tmp_path):
    import torch

    from miles_core.types import AdvantageInputs, AdvantageOutputs, LossOutput

    class Algo:
        @hookimpl
        def miles_register_advantage_estimators(self, registry):
            registry.add("bare_tensor", lambda inputs, cfg: inputs.rewards[:, None] * inputs.response_mask)
            registry.add("per_sample", lambda inputs, cfg: AdvantageOutputs(inputs.rewards))

        @hookimpl
        def miles_register_policy_losses(self, registry):
            registry.add("bare_tensor", lambda inputs, cfg: -inputs.advantages * inputs.logprobs)
            registry.add("tensor_metric", lambda inputs, cfg: LossOutput(-inputs.logprobs, {"m": inputs.logprobs.mean()}))

    mask = torch.ones(2, 3)
    adv_inputs = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    for name, what in [("bare_tensor", "Tensor"), ("per_sample", "shape")]:
        c = _built(tmp_path, Algo(), f"algorithm.advantage_estimator={name}")
        with pytest.raises(PluginError) as exc:
            c.advantage_estimator(adv_inputs, c.ctx.config.algorithm)
        assert f"advantage estimator '{name}'" in str(exc.value) and "my-algo" in str(exc.value) and what in str(exc.value)
    for name, what in [("bare_tensor", "Tensor"), ("tensor_metric", "'m'")]:
        c = _built(tmp_path, Algo(), f"algorithm.policy_loss={name}")
        with pytest.raises(PluginError) as exc:
            c.policy_loss(_loss_inputs())
        assert f"policy loss '{name}'" in str(exc.value) and "my-algo" in str(exc.value) and what in str(exc.value)


def test_task_factory_estimator_and_loss_that_raise_name_the_plugin(tmp_path):
    # a plugin's hooks that raise are one line naming the plugin (exit 2), but its task factory (miles validate too),
    # estimator and loss ended the run on a bare traceback (exit 1) that named neither the component nor the plugin
    import torch

    from miles_core.types import AdvantageInputs

    class Broken:
        @hookimpl
        def miles_register_tasks(self, registry):
            registry.add("needs_file", lambda cfg: cfg.task_options["path"])

        @hookimpl
        def miles_register_advantage_estimators(self, registry):
            registry.add("typo", lambda inputs, cfg: inputs.reward)

        @hookimpl
        def miles_register_policy_losses(self, registry):
            registry.add("typo", lambda inputs, cfg: inputs.logprob)

    with pytest.raises(PluginError, match=r"^task 'needs_file' \(plugin 'my-algo'\) raised KeyError: 'path'$"):
        _built(tmp_path, Broken(), "data.task=needs_file")
    c = _built(tmp_path, Broken(), "algorithm.advantage_estimator=typo", "algorithm.policy_loss=typo")
    adv_inputs = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 3))
    with pytest.raises(PluginError, match=r"^advantage estimator 'typo' \(plugin 'my-algo'\) raised AttributeError: .*'reward'"):
        c.advantage_estimator(adv_inputs, c.ctx.config.algorithm)
    with pytest.raises(PluginError, match=r"^policy loss 'typo' \(plugin 'my-algo'\) raised AttributeError: .*'logprob'"):
        c.policy_loss(_loss_inputs())


class _FlakyTaskPlugin:
    """Registers the task 'flaky': the reverse task, whose method ``method`` raises ``error`` (train_prompts when its
    stream is first drawn from, as a generator's does; ``score_train`` scores the eval prompts and raises on others)."""

    def __init__(self, method: str, error: Exception) -> None:
        self.method, self.error = method, error

    @hookimpl
    def miles_register_tasks(self, registry):
        from miles_core.data.synthetic import ReverseTask

        plugin = self

        class Flaky(ReverseTask):
            name = "flaky"

            def eval_prompts(self):
                if plugin.method == "eval_prompts":
                    raise plugin.error
                return super().eval_prompts()

            def train_prompts(self, rng):
                if plugin.method == "train_prompts":
                    raise plugin.error
                yield from super().train_prompts(rng)

            def score(self, response, label):
                if plugin.method == "score" or (plugin.method == "score_train" and label not in {p.label for p in self._eval}):
                    raise plugin.error
                return super().score(response, label)

            def reference(self, prompt):
                if plugin.method == "reference":
                    raise plugin.error
                return super().reference(prompt)

        registry.add("flaky", lambda cfg: Flaky(cfg.num_eval))


@pytest.mark.parametrize("method,where", [
    ("eval_prompts", ()),                                    # build's check that there are held-out prompts
    ("train_prompts", ()),                                   # raised when the stream is first drawn from, at step 1
    ("reference", ("train.sft_warmup_steps=1",)),            # the warm-up's reference answers
    ("score", ()),                                           # evaluate, before the reward
    ("score_train", ("reward.name=exact_match",)),           # rl_step's train_accuracy
    ("score_train", ("reward.name=exact_match", "run.mode=rollout")),  # rollout_metrics
])
def test_a_task_method_that_raises_names_the_task_its_plugin_and_the_method(tmp_path, method, where):
    # the task factory that raised was one line naming the task and plugin, but the task's own methods that raised
    # (its score in evaluate and the step's metrics, its prompts, its reference answers) ended the run on a bare
    # traceback (exit 1) naming neither
    from miles_core.orchestration.build import build
    from miles_core.orchestration.loop import run_loop
    from miles_core.testing.contracts import tiny_config

    pm = MilesPlugins(autoload=False, extra_plugins=[("my-task", _FlakyTaskPlugin(method, ValueError("no luck")))])
    name = method.removesuffix("_train")
    with pytest.raises(PluginError, match=rf"^{name} of task 'flaky' \(plugin 'my-task'\) raised ValueError: no luck$"):
        c = build(tiny_config(tmp_path, "data.task=flaky", "run.num_rollout=1", "run.num_threads=1", *where), pm, tmp_path)
        run_loop(c, lambda record: None)


def test_a_task_s_own_errors_and_its_stream_go_on_as_they_are(tmp_path):
    # a task that refuses its data with a DataError is already one line: it is not wrapped; the stream drawn through
    # the task's methods serves the task's own prompts
    import itertools
    import random

    from miles_core.data.synthetic import ReverseTask
    from miles_core.errors import DataError

    plugin = _FlakyTaskPlugin("train_prompts", DataError("data/train.jsonl:3: no 'question'"))
    c = _built(tmp_path, plugin, "data.task=flaky")
    with pytest.raises(DataError, match=r"^data/train.jsonl:3: no 'question'$"):
        next(c.task.train_prompts(random.Random(0)))
    c = _built(tmp_path, _FlakyTaskPlugin("none", ValueError()), "data.task=flaky")
    drawn = [(p.text, p.label) for p in itertools.islice(c.task.train_prompts(random.Random(0)), 20)]
    own = [(p.text, p.label) for p in itertools.islice(ReverseTask(8).train_prompts(random.Random(0)), 20)]
    assert drawn == own and c.task.name == "flaky" and c.task.score("ab", "ab") == 1.0


def test_a_task_method_that_raises_is_one_line_at_the_cli(tmp_path, cli):
    # miles run: a plugin's task whose training stream raised ended on a traceback with exit 1
    import os

    _fake_dist(tmp_path, "hunt_flaky", {"flaky": "hunt_flaky_mod"})
    (tmp_path / "hunt_flaky_mod.py").write_text(
        "from miles_core.data.synthetic import ReverseTask\n"
        "from miles_core.hookspecs import hookimpl\n\n"
        "class Flaky(ReverseTask):\n"
        "    def train_prompts(self, rng):\n"
        "        raise KeyError('shard_0')\n"
        "        yield\n\n"
        "@hookimpl\n"
        "def miles_register_tasks(registry):\n"
        "    registry.add('flaky', lambda cfg: Flaky(cfg.num_eval))\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = cli("run", "data.task=flaky", "run.num_rollout=1", "data.num_eval=8", "rollout.batch_size=4",
              "model.hidden_size=32", "model.num_layers=1", "rollout.max_response_len=4", "run.num_threads=1",
              f"run.output_dir={tmp_path / 'runs'}", env=env)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "train_prompts of task 'flaky' (plugin 'flaky') raised KeyError: 'shard_0'" in out.stderr


def test_kernel_select_must_choose_among_the_candidates():
    from miles_core.kernels.base import Kernels

    class Chooser:
        @hookimpl
        def miles_kernel_select(self, op, platform, candidates):
            return lambda *a, **k: None  # a function, not one of the candidates

    with pytest.raises(PluginError, match="miles_kernel_select.*'logprobs'.*chooser"):
        Kernels(MilesPlugins(autoload=False, extra_plugins=[("chooser", Chooser())]), "cpu")


def test_lifecycle_hook_that_raises_names_the_plugin():
    class Quiet:
        @hookimpl
        def miles_after_weight_sync(self, ctx, version):
            pass

    class Broken:
        @hookimpl
        def miles_after_weight_sync(self, ctx, version):
            raise KeyError("wandb_run")

    pm = MilesPlugins(autoload=False, extra_plugins=[("broken", Broken()), ("quiet", Quiet())])
    with pytest.raises(PluginError) as exc:
        pm.after_weight_sync(None, 3)
    assert "plugin 'broken'" in str(exc.value) and "miles_after_weight_sync" in str(exc.value)
    assert "KeyError" in str(exc.value) and "wandb_run" in str(exc.value)


def _fake_dist(site, dist: str, entry_points: dict[str, str]) -> None:
    """An installed distribution (dist-info only) whose [miles] entry points name modules written beside it."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[miles]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for module in entry_points.values():
        (site / f"{module}.py").write_text("")


def test_two_packages_with_one_plugin_name_is_an_error(tmp_path, monkeypatch):
    # the second package's plugin was skipped without a word (only the first one's hooks ran)
    _fake_dist(tmp_path, "hunt_first", {"scorer": "hunt_first_mod"})
    _fake_dist(tmp_path, "hunt_second", {"scorer": "hunt_second_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as exc:
        MilesPlugins(autoload=True)
    msg = str(exc.value)
    assert "'scorer'" in msg and "hunt_first" in msg and "hunt_second" in msg


def test_package_plugin_named_like_a_builtin_is_an_error(tmp_path, monkeypatch):
    _fake_dist(tmp_path, "hunt_impostor", {"miles.rewards": "hunt_impostor_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="'miles.rewards'.*built-in.*hunt_impostor"):
        MilesPlugins(autoload=True)


def test_two_plugin_names_for_one_module_is_one_line_naming_both(tmp_path, monkeypatch):
    # two entry points (a renamed one left behind by an older install, or two packages) naming one module: pluggy's
    # ValueError was passed on with its dump of every registered plugin, and did not say which package held the module
    _fake_dist(tmp_path, "hunt_old", {"scorer_old": "hunt_shared_mod"})
    _fake_dist(tmp_path, "hunt_new", {"scorer": "hunt_shared_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as exc:
        MilesPlugins(autoload=True)
    msg = str(exc.value)
    assert "'scorer_old'" in msg and "'scorer'" in msg and "hunt_old" in msg and "hunt_new" in msg, msg
    assert "hunt_shared_mod" in msg and "miles.rewards" not in msg and "\n" not in msg, msg
    assert {"scorer", "scorer_old"} & set(MilesPlugins(blocked=["scorer_old"]).plugin_names()) == {"scorer"}
    # the same object given twice as an extra plugin
    plugin = object()
    with pytest.raises(PluginError, match=r"^plugin 'b' is the module or object already loaded as plugin 'a'; "):
        MilesPlugins(autoload=False, extra_plugins=[("a", plugin), ("b", plugin)])
    assert MilesPlugins(["b"], autoload=False, extra_plugins=[("a", plugin), ("b", plugin)]).plugin_names()[-1] == "a"


def test_a_plugin_that_fails_to_import_is_listed_by_miles_plugins(tmp_path, cli):
    # one installed plugin whose import fails stopped every command, miles plugins too: it printed only that error,
    # so the command that lists what is installed listed nothing, and the error did not say how to run without it
    import os

    _fake_dist(tmp_path, "hunt_broken", {"broken": "hunt_broken_mod"})
    (tmp_path / "hunt_broken_mod.py").write_text("import hunt_missing_dependency\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = cli("plugins", "--json", env=env)
    assert out.returncode == 2
    assert "miles.tasks" in {p["name"] for p in json.loads(out.stdout)}
    assert "plugin 'broken' (hunt_broken_mod) failed to import" in out.stderr and "-p no:broken" in out.stderr
    out = cli("validate", "run.num_rollout=1", env=env)
    assert out.returncode == 2 and "-p no:broken" in out.stderr and "Traceback" not in out.stderr
    assert cli("plugins", "-p", "no:broken", env=env).returncode == 0


def test_blocking_a_name_no_plugin_has_is_an_error(tmp_path, monkeypatch):
    # -p no:miles.reward (a typo) blocked nothing and the run went on with the plugin it meant to block
    with pytest.raises(PluginError, match="no:miles.reward\\b.*did you mean 'miles.rewards'"):
        MilesPlugins(blocked=["miles.reward"], autoload=False)
    _fake_dist(tmp_path, "hunt_blockme", {"blockme": "hunt_blockme_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "blockme" not in MilesPlugins(blocked=["blockme"]).plugin_names()  # an installed plugin's name is known


def test_invalid_hookimpl_is_one_line_naming_the_plugin_and_argument():
    class WrongArg:
        @hookimpl
        def miles_register_rewards(self, reg):
            pass

    with pytest.raises(PluginError) as exc:
        MilesPlugins(autoload=False, extra_plugins=[("wrong-arg", WrongArg())])
    assert "wrong-arg" in str(exc.value) and "'reg'" in str(exc.value) and "\n" not in str(exc.value)


def test_hook_function_without_the_marker_is_an_error():
    # pluggy ignores a function that is not marked @hookimpl: the plugin loaded and registered nothing
    class Unmarked:
        def miles_register_rewards(self, registry):
            registry.add("unmarked", lambda sample: 1.0)

    with pytest.raises(PluginError, match="unmarked-plugin.*miles_register_rewards.*@hookimpl"):
        MilesPlugins(autoload=False, extra_plugins=[("unmarked-plugin", Unmarked())])


def test_miles_plugins_says_when_a_plugin_implements_no_hook(tmp_path, cli):
    # an entry point naming the package (miles_reward_example) instead of its hook module (miles_reward_example.plugin)
    # loads a module with no hooks: the plugin does nothing, and `miles plugins` said "(lifecycle hooks only)"
    import os

    _fake_dist(tmp_path, "hunt_nohooks", {"nohooks": "hunt_nohooks_mod"})
    (tmp_path / "hunt_listener_mod.py").write_text(
        "from miles_core.hookspecs import hookimpl\n\n@hookimpl\ndef miles_run_start(ctx):\n    pass\n"
    )
    (tmp_path / "hunt_nohooks-1.0.dist-info" / "entry_points.txt").write_text(
        "[miles]\nnohooks = hunt_nohooks_mod\nlistener = hunt_listener_mod\nidle = hunt_idle_mod\n"
    )
    (tmp_path / "hunt_idle_mod.py").write_text(  # registers only when its dependency is there, and it is not
        "from miles_core.hookspecs import hookimpl\n\n@hookimpl\ndef miles_register_rewards(registry):\n    pass\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "200"}
    out = cli("plugins", env=env)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if "│" in line}
    assert "(no hooks: it does nothing)" in rows["nohooks"] and "lifecycle" not in rows["nohooks"], rows
    assert "(lifecycle hooks only)" in rows["listener"], rows
    assert "(registered nothing)" in rows["idle"], rows
    assert "nohooks hooks: (none)" in out.stdout and "listener hooks: miles_run_start" in out.stdout


def test_a_plugin_whose_registration_raises_is_reported_after_the_others_are_listed():
    """keep_broken (miles plugins) covered plugins that fail to import, not one whose registration hook raises: that
    error stopped the listing, so the command that shows what is installed showed nothing."""

    class Raises:
        @hookimpl
        def miles_register_rewards(self, registry):
            raise RuntimeError("needs a licence server")

    class Fine:
        @hookimpl
        def miles_register_rewards(self, registry):
            registry.add("fine_reward", lambda s: 1.0)

    pm = MilesPlugins(autoload=False, extra_plugins=[("raises", Raises()), ("fine", Fine())], keep_broken=True)
    infos = {i.name: i for i in pm.info()}
    assert "fine_reward" in infos["fine"].registered["rewards"] and "miles.tasks" in infos
    assert pm.broken == {"raises": "plugin 'raises' raised RuntimeError: needs a licence server (in miles_register_rewards)"}
    with pytest.raises(PluginError, match="plugin 'raises' raised RuntimeError"):  # elsewhere it is still an error
        MilesPlugins(autoload=False, extra_plugins=[("raises", Raises())]).registries
