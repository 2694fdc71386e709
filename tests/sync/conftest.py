import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one thread (tests/conftest.py)."""
