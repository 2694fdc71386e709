import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_cli(*args: str, env: dict | None = None, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `miles` command line in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "miles_cli.main", *args],
        capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def one_thread():
    """The CI machines have 2 cores shared by many tests: tiny tensors are fastest on one thread.
    A folder's conftest makes it autouse for its tests."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
