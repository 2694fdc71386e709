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
