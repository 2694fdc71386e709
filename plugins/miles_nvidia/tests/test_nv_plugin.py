"""The plugin through the hooks: what it registers and which kernel serves each op per platform."""

import pytest

from miles_core.kernels.base import Kernels
from miles_core.kernels.logprobs import logprobs_torch
from nvidia_helpers import plugins


def test_registrations_and_selection():
    pm = plugins()
    regs = pm.registries
    assert {"fp8", "bf16_batch_invariant"} <= set(regs.precision_recipes.names())
    assert {"nccl", "cuda_ipc", "cuda_ipc_fp8"} <= set(regs.weight_transports.names())
    cpu, cuda = Kernels(pm, "cpu").chosen(), Kernels(pm, "cuda").chosen()
    assert set(cpu) == set(cuda) == {"logprobs", "rmsnorm", "swiglu", "rope"}
    assert cpu["logprobs"].fn is logprobs_torch  # the core's reference serves the CPU
    assert all(impl.fn.__module__.startswith("miles_nvidia.kernels") for impl in cuda.values())
    info = {i.name: i for i in pm.info()}["miles_nvidia"]
    assert info.registered["kernels"] == ["logprobs.triton", "rmsnorm.triton", "rope.triton", "swiglu.triton"]


def test_blocking_the_plugin_falls_back_to_the_core():
    import miles_nvidia.plugin
    from miles_core.plugins.manager import MilesPlugins

    pm = MilesPlugins(blocked=["miles_nvidia"], autoload=False, extra_plugins=[("miles_nvidia", miles_nvidia.plugin)])
    assert Kernels(pm, "cuda").chosen()["logprobs"].fn is logprobs_torch
    assert "fp8" not in pm.registries.precision_recipes


def test_transports_refuse_the_in_process_engine():
    from miles_core.errors import ConfigError
    from miles_nvidia.sync.transports import IpcTransport, NcclTransport

    for t in (IpcTransport(), NcclTransport()):
        with pytest.raises(ConfigError, match="in_process"):
            t.push({}, 1, object())
