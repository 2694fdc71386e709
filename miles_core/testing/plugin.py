"""pytest plugin ``miles``: fixtures for testing Miles plugins, and GPU test skipping.

* ``miles_plugins``: a fresh :class:`MilesPlugins` with entry points loaded.
* ``miles_tiny_config``: a config for a run small enough for a unit test (seconds on CPU).
* ``@pytest.mark.gpu`` tests are skipped when CUDA is not available.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def miles_plugins():
    from miles_core.plugins.manager import MilesPlugins

    return MilesPlugins()


@pytest.fixture
def miles_tiny_config(tmp_path):
    from miles_core.testing.contracts import tiny_config

    return tiny_config(tmp_path)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
