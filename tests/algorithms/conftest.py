import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The CI machines have 2 cores shared by many tests: tiny tensors are fastest on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
