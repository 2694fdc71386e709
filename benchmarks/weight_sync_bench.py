"""Weight-transport and recovery times: one launched `miles serve` engine per model size, each
transport pushing a full new version (push start -> every engine reports the version).

Models: the quickstart's (0.4M parameters) and a random ~100M-parameter decoder (fp32 on CPU,
bf16 on GPU). Transports: disk (safetensors folder + /update_weights_from_disk), distributed
(torch.distributed broadcast, gloo on CPU / nccl on GPU, 256 MB buckets), sglang_tensor (base64
tensors in /update_weights_from_tensor, 32 MB buckets), and in-process (BuiltinEngine, for
scale). Recovery: SIGKILL the engine, time until it serves the last pushed version again.

CPU:            python benchmarks/weight_sync_bench.py
one H200:       python benchmarks/weight_sync_bench.py --device cuda --dist-backend gloo
two H200s:      python benchmarks/weight_sync_bench.py --device cuda:0 --engine-device cuda:1   (NCCL)
If env OUT is set, the table is also written to $OUT/weight_sync_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer  # noqa: E402
from miles_core.models.checkpoint import save_hf_folder  # noqa: E402
from miles_core.models.decoder import Decoder, DecoderConfig  # noqa: E402
from miles_core.plugins.manager import MilesPlugins  # noqa: E402
from miles_core.rollout.engine import BuiltinEngine  # noqa: E402
from miles_core.rollout.sglang.backend import SglangBackend  # noqa: E402
from miles_core.rollout.sglang.config import SglangConfig  # noqa: E402
from miles_core.sync.disk import DiskTransport  # noqa: E402
from miles_core.sync.distributed import DistributedTransport  # noqa: E402
from miles_core.sync.tensor import TensorTransport  # noqa: E402

SIZES = {
    "quickstart (0.4M)": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "random 100M": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=3072),
}


def bench(name: str, arch: dict, device: str, root: Path, repeats: int, engine_device: str, dist_backend: str) -> list[dict]:
    tok = CharTokenizer()
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, **arch))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    folder = root / name.split()[0]
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), folder, {CHAR_TOKENIZER_FILE: tok.to_json()})
    cfg = SglangConfig(num_engines=1, server_args={"device": engine_device, "dtype": "bf16" if device.startswith("cuda") else "fp32"})
    backend = SglangBackend(cfg, tok, folder, root / f"work-{name.split()[0]}")
    state = {k: v.to(device) for k, v in model.state_dict().items()}
    rows = []
    transports = {
        "disk": DiskTransport(root / f"weights-{name.split()[0]}"),
        "distributed": DistributedTransport(256 << 20, dist_backend),
        "sglang_tensor": TensorTransport(32 << 20),
    }
    try:
        for tname, tr in transports.items():
            times = []
            for _ in range(repeats):
                v = backend.weight_version + 1
                t0 = time.perf_counter()
                tr.push(state, v, backend)
                assert backend.engine_versions() == [v]
                times.append(time.perf_counter() - t0)
            rows.append({"model": name, "params": params, "transport": tname, "push_s": min(times), "first_s": times[0]})
        engine = BuiltinEngine(model, tok, torch.device(engine_device))
        t0 = time.perf_counter()
        engine.update_weights(state, 1)
        rows.append({"model": name, "params": params, "transport": "in_process (builtin)", "push_s": time.perf_counter() - t0, "first_s": None})
        pid = backend.engines[0].server.proc.pid
        os.kill(pid, signal.SIGKILL)
        while backend.monitor.recoveries == []:
            time.sleep(0.05)
        assert backend.engine_versions() == [backend.weight_version]
        rows.append({"model": name, "params": params, "transport": "recovery (SIGKILL -> serving)", "push_s": backend.monitor.recoveries[0].seconds, "first_s": None})
    finally:
        backend.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-device", default=None, help="the engine's device (default: --device); NCCL needs another GPU")
    ap.add_argument("--dist-backend", default="auto", help="auto (nccl for CUDA tensors), gloo, nccl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(SIZES))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            rows += bench(name, SIZES[name], args.device, Path(tmp), args.repeats, args.engine_device or args.device, args.dist_backend)
    print(f"{'model':20} {'params':>12} {'transport':32} {'best s':>8} {'first s':>8}")
    for r in rows:
        first = f"{r['first_s']:.3f}" if r["first_s"] is not None else "-"
        print(f"{r['model']:20} {r['params']:>12,} {r['transport']:32} {r['push_s']:8.3f} {first:>8}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "weight_sync_bench.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
