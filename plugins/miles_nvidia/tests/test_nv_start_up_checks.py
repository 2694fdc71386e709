"""A precision recipe selected where it cannot run is refused as the run starts (build: ``miles run`` and
``miles validate``), with one ConfigError naming ``train.precision`` and why, not a Triton error at the first step."""

from __future__ import annotations

import pytest
import torch

from miles_core.config.loader import load_config
from miles_core.errors import ConfigError
from miles_core.orchestration.build import build
from nvidia_helpers import plugins

TINY = ["model.hidden_size=128", "model.num_layers=1", "model.intermediate_size=256", "data.num_eval=4"]


def _fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    """Stands in for a CUDA GPU of this compute capability, hardware that is not here: torch's CUDA queries are
    patched, so that ``run.device=cuda`` selects the cuda platform; nothing is put on the device by build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _build(*overrides: str):
    return build(load_config(None, [*TINY, *overrides]), plugins(), None)


def test_fp8_on_a_gpu_older_than_sm89_is_refused_at_start_up(monkeypatch):
    """An A100 (sm_80) has no e4m3 in Triton ("type fp8e4nv not supported in this architecture" at the first
    forward's quantiser): the run must stop before it starts, naming the key."""
    _fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(ConfigError, match=r"train\.precision=fp8 .*compute capability 8\.9.*sm_80"):
        _build("run.device=cuda", "train.precision=fp8")


def test_fp8_is_accepted_on_sm89_and_sm90_and_on_cpu(monkeypatch):
    """Ada (sm_89) and Hopper (sm_90) have e4m3; the CPU runs the torch emulation (the documented reference)."""
    assert _build("run.device=cpu", "train.precision=fp8").ctx.device.type == "cpu"
    for cap in ((8, 9), (9, 0)):
        with monkeypatch.context() as m:
            _fake_gpu(m, cap)
            assert _build("run.device=cuda", "train.precision=fp8").ctx.device.type == "cuda"


def test_batch_invariant_mode_on_cpu_without_the_triton_interpreter_is_refused(monkeypatch):
    """The mode's kernels are Triton kernels: on CPU tensors outside the interpreter it sends every op back to
    torch, so the recipe (fp32 weights, no autocast) ran the whole run in plain fp32, neither bf16 nor
    batch-invariant (nothing kept rollout and training logprobs bitwise equal), and said nothing. Under
    TRITON_INTERPRET=1 it runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"train\.precision=bf16_batch_invariant cannot run on cpu: .*TRITON_INTERPRET=1"):
        _build("run.device=cpu", "train.precision=bf16_batch_invariant")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _build("run.device=cpu", "train.precision=bf16_batch_invariant").ctx.device.type == "cpu"


def test_without_triton_the_plugin_registers_no_kernels_and_refuses_its_recipes():
    """``pip install --no-deps`` (the README's command) or a CPU-only torch leaves Triton out. The registration
    hooks imported it, so every miles command (the CPU quickstart included, and ``miles plugins``) failed with
    "plugin 'miles_nvidia' raised ModuleNotFoundError: No module named 'triton'". Now the core's kernels serve,
    the transports stay, and train.precision=fp8 or bf16_batch_invariant is refused as the run starts.
    In a subprocess whose import system refuses ``triton`` (it is installed here)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = r"""
import json, sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
sys.meta_path.insert(0, NoTriton())
from miles_core.config.loader import load_config
from miles_core.errors import ConfigError
from miles_core.orchestration.build import build
from nvidia_helpers import plugins
from test_nv_start_up_checks import TINY
pm = plugins()
regs = pm.registries
out = {"kernels": regs.kernels.by_plugin("miles_nvidia"), "transports": regs.weight_transports.by_plugin("miles_nvidia"),
       "fp32": str(build(load_config(None, [*TINY, "train.precision=fp32"]), pm, None).ctx.device)}
for name in ("fp8", "bf16_batch_invariant"):
    try:
        build(load_config(None, [*TINY, "train.precision=" + name]), pm, None)
        out[name] = "built"
    except ConfigError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=here)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["kernels"] == [] and out["transports"] == ["cuda_ipc", "cuda_ipc_fp8", "nccl"] and out["fp32"] == "cpu"
    for name in ("fp8", "bf16_batch_invariant"):
        assert out[name].startswith(f"train.precision={name} cannot run on cpu: ") and "Triton" in out[name], out[name]


def test_a_triton_older_than_the_plugin_asks_for_is_treated_as_missing(monkeypatch):
    """Stands in for an installed Triton 3.1 (pyproject asks >= 3.2): its version string is patched."""
    import triton

    monkeypatch.setattr(triton, "__version__", "3.1.0")
    regs = plugins().registries
    assert regs.kernels.by_plugin("miles_nvidia") == []
    with pytest.raises(ConfigError, match=r"train\.precision=fp8 cannot run on cpu: .*Triton 3\.1\.0 is older than 3\.2"):
        _build("run.device=cpu", "train.precision=fp8")


@pytest.mark.parametrize("transport", ["cuda_ipc", "cuda_ipc_fp8", "nccl"])
@pytest.mark.parametrize("backend", ["builtin", "sglang"])
def test_engine_process_transports_with_a_core_rollout_backend_are_refused_at_start_up(transport, backend):
    """The plugin's transports hand weights to an engine in another process (IpcEngineProxy, a broadcast receiver);
    the core's backends are neither. miles validate said ok and miles run went through the SFT warm-up and the
    first step before the first weight sync raised; now build refuses the pair, naming both keys."""
    with pytest.raises(ConfigError, match=rf"sync\.transport={transport} .*rollout\.backend={backend}"):
        _build("run.device=cpu", f"sync.transport={transport}", f"rollout.backend={backend}")
