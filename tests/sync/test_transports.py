"""Each weight transport against a launched `miles serve` subprocess (and disk also in process):
the weights arrive (greedy output equals an in-process engine holding the same weights, and no
longer equals the old weights' output) and the engine reports the pushed version."""

import threading
import time

import pytest
import torch
from sync_helpers import save, tiny_model

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import BuiltinEngine
from miles_core.rollout.sglang.backend import SglangBackend
from miles_core.rollout.sglang.config import SglangConfig
from miles_core.sync.disk import DiskTransport
from miles_core.sync.distributed import DistributedTransport
from miles_core.sync.tensor import TensorTransport
from miles_core.types import Prompt

PROMPTS = [Prompt(t) for t in ("abc?", "dd?", "eab?", "c?")]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def greedy_ids(backend) -> list[list[int]]:
    return [s.response_ids for s in backend.generate(PROMPTS, GREEDY, n=1)]


def reference(model, tok) -> list[list[int]]:
    return greedy_ids(BuiltinEngine(model, tok, torch.device("cpu")))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, tok = tiny_model(0)
    root = tmp_path_factory.mktemp("transports")
    backend = SglangBackend(SglangConfig(num_engines=1), tok, save(model, tok, root / "initial"), root / "work")
    yield backend, model, tok, root
    backend.shutdown()


def check_push(backend, transport, seed, tok, old):
    new, _ = tiny_model(seed)
    version = backend.weight_version + 1
    t0 = time.perf_counter()
    transport.push(new.state_dict(), version, backend)
    dt = time.perf_counter() - t0
    assert backend.engine_versions() == [version] and backend.weight_version == version  # what a restarted engine loads
    got = greedy_ids(backend)
    assert got == reference(new, tok)
    assert got != old  # the new weights changed the answers, so the equality above means something
    samples = backend.generate(PROMPTS[:1], GREEDY)
    assert samples[0].weight_version == version
    return got, dt


def test_disk_in_process(tmp_path):
    model, tok = tiny_model(0)
    engine = BuiltinEngine(model, tok, torch.device("cpu"))
    old = greedy_ids(engine)
    new, _ = tiny_model(7)
    DiskTransport(tmp_path / "w").push(new.state_dict(), 3, engine)
    assert engine.weight_version == 3
    assert greedy_ids(engine) == reference(new, tok) != old
    for v in (4, 5):
        DiskTransport(tmp_path / "w").push(new.state_dict(), v, engine)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v4", "v5"]  # the two newest are kept


def test_disk_push_below_versions_left_in_the_folder_keeps_its_own(tmp_path):
    # sync.disk_dir is a fixed folder (a shared filesystem that remote engines read) that an earlier run left at v7, v8,
    # or a run resumed from an earlier checkpoint: pruning "the two newest" by number removed the v5 just written, so
    # the engine's load failed
    model, tok = tiny_model(0)
    engine = BuiltinEngine(model, tok, torch.device("cpu"))
    transport = DiskTransport(tmp_path / "w")
    for v in (7, 8):
        transport.push(model.state_dict(), v, engine)
    new, _ = tiny_model(7)
    transport.push(new.state_dict(), 5, engine)
    assert engine.weight_version == 5 and greedy_ids(engine) == reference(new, tok)
    transport.push(new.state_dict(), 6, engine)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v5", "v6"]  # this run's two newest; not the stale v7, v8


def test_disk_http(served):
    backend, model, tok, root = served
    old = greedy_ids(backend)
    got, _ = check_push(backend, DiskTransport(root / "weights"), 11, tok, old)
    assert (root / "weights" / f"v{backend.weight_version}" / "config.json").is_file()  # loadable as a model folder


def test_tensor_http_in_buckets(served):
    backend, model, tok, _ = served
    old = greedy_ids(backend)
    check_push(backend, TensorTransport(bucket_bytes=4096), 12, tok, old)  # ~a dozen buckets


def test_distributed_gloo_over_loopback(served):
    backend, model, tok, _ = served
    old = greedy_ids(backend)
    transport = DistributedTransport(bucket_bytes=8192, backend="gloo")
    got, _ = check_push(backend, transport, 13, tok, old)
    group = transport._name
    check_push(backend, transport, 14, tok, got)  # the second push reuses the group
    assert transport._name == group


def test_distributed_with_sglang_tp_size_on_miles_serve(tmp_path):
    # --sglang-tp-size 2 makes the transport count 2 ranks per engine (SGLang joins one per TP rank); `miles serve`
    # drops tp_size and joins as one rank, so the group waited for a rank that never came: 120 s per try, three tries
    model, tok = tiny_model(0)
    backend = SglangBackend(SglangConfig(num_engines=1, server_args={"tp_size": 2}), tok, save(model, tok, tmp_path / "m"), tmp_path / "w")
    try:
        old = greedy_ids(backend)
        new, _ = tiny_model(13)
        transport = DistributedTransport(bucket_bytes=8192, backend="gloo", ranks_per_engine=2)  # what sync's plugin makes of tp_size=2
        pushed = threading.Event()
        threading.Thread(target=lambda: transport.push(new.state_dict(), 1, backend) or pushed.set(), daemon=True).start()
        assert pushed.wait(15), "the push is still waiting for the weight group"
        assert backend.engine_versions() == [1] and greedy_ids(backend) == reference(new, tok) != old
    finally:
        backend.shutdown()


def test_buckets_fill_up_to_the_byte_bound_in_order():
    from miles_core.sync.buckets import buckets

    f32 = lambda n: torch.zeros(n)  # noqa: E731  4 bytes an element
    w = {"a": f32(2), "b": f32(2), "c": f32(5), "d": f32(1), "e": f32(1), "f": f32(1), "g": f32(1), "h": f32(1),
         "i": torch.zeros(8, dtype=torch.bfloat16)}
    got = [[name for name, _ in b] for b in buckets(w, 16)]
    # a + b fill 16 bytes exactly; c (20 bytes) is larger than a bucket: alone; i (16 bytes of bf16) closes the last
    assert got == [["a", "b"], ["c"], ["d", "e", "f", "g"], ["h"], ["i"]]
    flat = [t for b in buckets(w, 16) for _, t in b]
    assert len(flat) == len(w) and all(x is y for x, y in zip(flat, w.values()))
    assert buckets({}, 16) == []


def test_tensor_encoding_round_trips_views_and_bf16_and_caps_the_bucket():
    import base64

    from miles_core.sync.tensor import TensorTransport, encode

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for t in (base.T, base[:, 1:3], base.to(torch.bfloat16).T):  # views that are not contiguous
        e = encode("w", t)
        raw = bytearray(base64.b64decode(e["data"]))
        back = torch.frombuffer(raw, dtype=getattr(torch, e["dtype"])).reshape(e["shape"])
        assert e["shape"] == list(t.shape) and torch.equal(back, t)
    # base64 makes a bucket 4/3 larger: 32 MB of raw bytes stay under miles serve's default 64 MB request bound
    assert TensorTransport(1 << 30).bucket_bytes == 32 << 20 and TensorTransport(4096).bucket_bytes == 4096


def test_distributed_rejects_builtin_engine():
    from miles_core.errors import ConfigError

    model, tok = tiny_model(0)
    with pytest.raises(ConfigError, match="rollout.backend=sglang"):
        DistributedTransport(1 << 20).push(model.state_dict(), 1, BuiltinEngine(model, tok, torch.device("cpu")))


def test_serve_weight_endpoints_reject_bad_requests(served):
    from miles_core.errors import MilesUserError
    from miles_core.rollout.sglang.http import request

    backend, *_ = served
    url = backend.engine_urls()[0]
    assert request(url + "/get_weight_version") == {"weight_version": str(backend.weight_version)}
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "nope"}
    with pytest.raises(MilesUserError, match=r"HTTP 400.*no weight update group 'nope'"):
        request(url + "/update_weights_from_distributed", body)
    with pytest.raises(MilesUserError, match=r"HTTP 400.*'master_port' is missing"):
        request(url + "/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2})
    with pytest.raises(MilesUserError, match=r"HTTP 400.*has no \*\.safetensors"):
        request(url + "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "9"})
    assert backend.engine_versions() == [backend.weight_version]  # nothing changed
