"""`miles run | plugins | validate | serve`.

Every user error (config, data, reward code, plugins) is printed as one line and exits with 2.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
from importlib import resources
from pathlib import Path

import click
from rich.console import Console

from miles_core.errors import MilesUserError

QUICKSTART = "quickstart"


def _blocked(values: tuple[str, ...]) -> list[str]:
    out = []
    for v in values:
        if not v.startswith("no:"):
            raise MilesUserError(f"-p {v}: only blocking is supported, as -p no:NAME")
        out.append(v[3:])
    return out


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MilesUserError as exc:
            Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper


def _recipe_path(recipe: str | None, overrides: list[str]) -> tuple[Path, list[str]]:
    """RECIPE is optional: a first argument that looks like an override belongs to the overrides, unless it is a file
    or folder (a run named kl=0.01 saves its config as runs/kl=0.01-<stamp>/config.yaml)."""
    if recipe is not None and ("=" in recipe or recipe.startswith("--")) and not Path(recipe).exists():
        overrides = [recipe, *overrides]
        recipe = None
    if recipe is None or recipe == QUICKSTART:
        return Path(str(resources.files("miles_core.recipes") / "quickstart.yaml")), overrides
    return Path(recipe), overrides


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="miles")
def main() -> None:
    """Miles: RL post-training for language models."""


_plugin_opt = click.option("-p", "plugin_opts", multiple=True, metavar="no:NAME", help="Block a plugin (repeatable).")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_plugin_opt
@user_errors
def run(recipe, overrides, plugin_opts):
    """Run RECIPE (a YAML file; default: the CPU quickstart) with key=value overrides.

    The common slime flags work too: --num-rollout 10 --lr 1e-6 --rollout-batch-size 32 ...
    """
    from miles_core.config.loader import load_config
    from miles_core.orchestration.run import run as run_recipe
    from miles_core.plugins.manager import MilesPlugins

    path, overrides = _recipe_path(recipe, list(overrides))
    plugins = MilesPlugins(blocked=_blocked(plugin_opts))
    cfg = load_config(path, overrides)
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the run stops its launched engines (and Ray) on the way out
    try:
        run_recipe(cfg, plugins)
    except KeyboardInterrupt as exc:
        # the shell's convention, 128 + the signal: a scheduler tells a cancelled run from a failed one (click's own
        # "Aborted!" exits 1, as a failure does)
        sig = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        Console(stderr=True).print(f"interrupted ({signal.Signals(sig).name}): the run stopped; its checkpoints and "
                                   "metrics so far are kept", highlight=False, soft_wrap=True)
        sys.exit(128 + sig)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt (the same cleanup) that remembers its signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    raise Terminated(signum)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_plugin_opt
@user_errors
def validate(recipe, overrides, plugin_opts):
    """Build everything RECIPE needs (config, plugins, data, reward, model) without running.

    Takes the same overrides and flags as miles run (--num-rollout 10, --rollout.top_p 0.9, ...).
    """
    from miles_core.config.loader import load_config
    from miles_core.orchestration.build import build
    from miles_core.plugins.manager import MilesPlugins

    path, overrides = _recipe_path(recipe, list(overrides))
    plugins = MilesPlugins(blocked=_blocked(plugin_opts))
    cfg = load_config(path, overrides)
    c = build(cfg, plugins, None)
    n = sum(p.numel() for p in c.model.parameters())
    click.echo(
        f"ok: {path} — task {cfg.data.task} ({len(c.task.eval_prompts())} eval prompts), reward {c.reward_name}, "
        f"{cfg.algorithm.advantage_estimator}/{cfg.algorithm.policy_loss}, model {c.family.name} {n:,} params on {c.ctx.device}"
    )


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_plugin_opt
@user_errors
def plugins(as_json, plugin_opts):
    """List the loaded plugins, their versions, hooks and what each registered.

    A plugin that fails to import is reported after the others are listed (exit 2), not instead of them."""
    from miles_core.errors import PluginError
    from miles_core.observe.view import plugins_table
    from miles_core.plugins.manager import MilesPlugins

    pm = MilesPlugins(blocked=_blocked(plugin_opts), keep_broken=True)
    infos = pm.info()
    if as_json:
        click.echo(json.dumps([i.as_dict() for i in infos], indent=2))
    else:
        console = Console()
        console.print(plugins_table(infos))
        for info in infos:
            console.print(f"[bold]{info.name}[/] hooks: {', '.join(info.hooks) or '(none)'}")
    if pm.broken:
        raise PluginError("; ".join(pm.broken.values()))


@main.command()
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=30000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N")
@click.option("--dtype", default="auto", show_default=True, help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(min=1), help="Sequences decoded at once.")
@click.option("--max-model-len", default=8192, show_default=True, type=int)
@click.option("--max-request-bytes", default=64 << 20, show_default=True, type=click.IntRange(min=1), help="Larger request bodies get 413.")
@click.option("--seed", default=0, show_default=True, type=int)
@_plugin_opt
@user_errors
def serve(model, host, port, device, dtype, max_num_seqs, max_model_len, max_request_bytes, seed, plugin_opts):
    """Serve MODEL (an HF safetensors folder or a .gguf file) over SGLang's HTTP protocol."""
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.serve.app import build_server

    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    srv = build_server(model, host, port, device, dtype, cfg, seed, max_request_bytes, MilesPlugins(blocked=_blocked(plugin_opts)))
    click.echo(f"miles serve: {model} on http://{host}:{srv.port}", err=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.shutdown()


if __name__ == "__main__":  # pragma: no cover
    main()
