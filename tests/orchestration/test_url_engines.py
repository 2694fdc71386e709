"""Runs against rollout engines given by URL (``rollout.sglang.urls``): an in-process `miles serve`
that the run did not launch, and that may hold weights the trainer does not."""

import pytest
import torch

from miles_core.hookspecs import hookimpl
from miles_core.models.checkpoint import save_hf_folder
from miles_core.orchestration.build import build, tokenizer_files
from miles_core.orchestration.loop import run_loop
from miles_core.plugins.manager import MilesPlugins
from miles_core.serve.app import build_server
from miles_core.testing.contracts import tiny_config


class Versions:
    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.steps = getattr(self, "steps", {})
        self.steps[step] = {s.weight_version for s in samples}


@pytest.fixture
def served_run(tmp_path):
    """A built tiny run whose engine is a `miles serve` started on the trainer's initial model."""
    cfg = tiny_config(tmp_path, "rollout.backend=sglang", "rollout.sglang.urls=[http://127.0.0.1:9]", "run.num_rollout=1")
    rec = Versions()
    c = build(cfg, MilesPlugins(autoload=False, extra_plugins=[("versions", rec)]), tmp_path / "out")
    path = tmp_path / "served"
    save_hf_folder(c.model, c.family, path, tokenizer_files(c.ctx.tokenizer))
    srv = build_server(str(path), port=0, device="cpu")
    srv.start()
    cfg.rollout.sglang.urls = [f"http://127.0.0.1:{srv.port}"]
    yield c, srv, rec
    srv.shutdown()


@pytest.mark.parametrize("left_version", [5, 0])
def test_a_server_left_with_another_runs_weights_gets_the_trainers(served_run, left_version):
    # the server was given weights by an earlier run (version 5, or 0 like the trainer's): the first step must not
    # sample from them
    c, srv, rec = served_run
    torch.manual_seed(1)
    other = {k: torch.randn_like(v) for k, v in c.model.state_dict().items()}
    srv.engine.call(lambda core: core.update_weights(other, left_version))
    records = []
    summary, _ = run_loop(c, records.append)
    assert summary["status"] == "completed"
    assert rec.steps[1] == {0}  # sampled with the trainer's initial weights (v0), not the leftover ones
    step1 = next(r for r in records if r["step"] == 1)
    assert step1["mismatch_kl"] < 1e-3  # the engine's logprobs are the trainer's own
