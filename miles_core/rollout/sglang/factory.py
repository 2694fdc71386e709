"""``rollout.backend: sglang``: build the backend from the run (write the initial model for the servers)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from miles_core.rollout.sglang.backend import SglangBackend


def sglang_backend(ctx, model):
    from miles_core.models.checkpoint import save_hf_state
    from miles_core.models.gguf import gguf_file
    from miles_core.orchestration.build import model_source, tokenizer_files

    cfg = ctx.config
    # no output folder (a Ray engine actor): the initial model, pushed weights and server logs go to a temporary one,
    # removed by shutdown() (or here, if the backend cannot start)
    temporary = not ctx.output_dir
    workdir = Path(tempfile.mkdtemp(prefix="miles-sglang-")) if temporary else Path(ctx.output_dir) / "rollout_engines"
    try:
        model_dir = model_source(cfg)
        gguf = gguf_file(model_dir)
        if gguf is not None:  # model.hf_checkpoint=smollm2 names the package's file, which no server knows by that name
            model_dir = str(gguf)
        if not cfg.rollout.sglang.urls and model_dir is None:  # a model built from the recipe: give the servers a folder
            family = ctx.plugins.registries.model_families.get(cfg.model.family, key="model.family")
            model_dir = str(workdir / "initial_model")
            save_hf_state(model.state_dict(), model.config, family, Path(model_dir), tokenizer_files(ctx.tokenizer))
        backend = SglangBackend(cfg.rollout.sglang, ctx.tokenizer, model_dir or "", workdir, model.config.vocab_size,
                                temporary_workdir=temporary)
    except BaseException:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    backend.run_extras = ctx.extras  # shutdown() leaves the run's recovery summary there
    return backend
