"""orchestration.ray_address: a cluster that is not there is one clear error, not a wait of minutes."""

import glob
import socket
import tempfile
import time

import pytest

from miles_core.errors import MilesUserError
from miles_core.orchestration.build import build
from miles_core.orchestration.placement import make_placement
from miles_core.plugins.manager import MilesPlugins
from miles_core.testing.contracts import tiny_config

ray = pytest.importorskip("ray")


def test_an_address_nothing_answers_is_one_clear_error(tmp_path):
    # ray.init retried the address for about 12 minutes (20 tries of ~35 s) and then raised a ConnectionError
    # traceback; the temp folder made for a local cluster was left behind
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected: orchestration.ray_address is not used")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tiny_config(tmp_path, "orchestration.placement=ray_disaggregated", f"orchestration.ray_address=127.0.0.1:{port}")
    c = build(cfg, MilesPlugins(autoload=False), None)
    before = set(glob.glob(f"{tempfile.gettempdir()}/miles-ray-*"))
    t0 = time.monotonic()
    with pytest.raises(MilesUserError, match=rf"^orchestration.ray_address=127.0.0.1:{port}: nothing answers there"):
        make_placement(c)
    assert time.monotonic() - t0 < 30 and not ray.is_initialized()
    assert set(glob.glob(f"{tempfile.gettempdir()}/miles-ray-*")) == before
