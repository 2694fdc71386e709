import pytest

pytest.importorskip("megatron.core")

import megatron_cpu_patch as cpu_patch  # noqa: E402  (this folder is on sys.path: no __init__.py)


@pytest.fixture(scope="session")
def megatron_cpu():
    """megatron-core on this CPU-only torch: the CUDA redirects of cpu_patch, for the session."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    mp = pytest.MonkeyPatch()
    cpu_patch.apply(mp)
    yield
    mp.undo()
