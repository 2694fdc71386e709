"""Where the time goes: torch.profiler and cProfile tables for the engine's decode and a train step.

    python benchmarks/profile_gpu.py engine --batch 64 --new-tokens 64
    python benchmarks/profile_gpu.py train
    python benchmarks/profile_gpu.py train --backend megatron

Prints the top ops by device time and by host time, and the top Python functions (cProfile,
cumulative), for one timed run after a warm-up. Same models as rollout_bench.py / train_bench.py
(Qwen3-0.6B shape, random bf16 weights).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _tables(prof, py: cProfile.Profile, dt: float, label: str) -> None:
    print(f"\n=== {label}: {dt * 1e3:.1f} ms wall ===")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=22))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12))
    s = io.StringIO()
    pstats.Stats(py, stream=s).sort_stats("cumulative").print_stats(28)
    print(s.getvalue()[-6000:])


KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "splitk", "_gated_kernel", "sm90_xmma", "ampere")), ("attention", ("_decode_kernel", "flash", "attention")),
         ("norm", ("rmsnorm",)), ("rope", ("rope",)), ("swiglu", ("swiglu",)), ("index / KV write", ("index",)),
         ("copy / cast", ("copy", "elementwise")), ("sampling / softmax", ("softmax", "argmax", "sample", "topk", "sort")))


def kernel_summary(prof, per: int, label: str) -> None:
    """Device time and kernel count per ``label`` (e.g. per decode step), by kind of kernel."""
    rows: dict[str, list[float]] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if not t or e.key.startswith("aten::") or e.key.startswith("cuda"):
            continue
        kind = next((k for k, pats in KINDS if any(p in e.key.lower() for p in pats)), "other")
        r = rows.setdefault(kind, [0.0, 0])
        r[0] += t
        r[1] += e.count
    total = sum(r[0] for r in rows.values())
    print(f"\n{'kernel kind':<20} {'µs per ' + label:>16} {'kernels per ' + label:>20}")
    for kind, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        print(f"{kind:<20} {t / per:>16.1f} {n / per:>20.1f}")
    print(f"{'total':<20} {total / per:>16.1f} {sum(r[1] for r in rows.values()) / per:>20.1f}")


def device_kernels(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel the profiler saw on the device, by start time."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
            out.append((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.name()))
    return sorted(out)


def timeline(kernels: list[tuple[float, float, str]], per: int, label: str, top: int = 8) -> None:
    """GPU busy time against the span from the first kernel to the last, per ``label``, and where the idle
    time falls: the gaps between a kernel's end (the latest end so far) and the next start, summed by the
    (kernel before, kernel after) pair. Kernels that overlap (PDL) count once in the busy time."""
    if not kernels:
        return
    busy = idle = 0.0
    end = kernels[0][0]
    prev = "(start)"
    gaps: dict[tuple[str, str], list[float]] = {}
    for s, e, name in kernels:
        if s > end:
            idle += s - end
            g = gaps.setdefault((prev[:40], name[:40]), [0.0, 0])
            g[0] += s - end
            g[1] += 1
        busy += max(0.0, e - max(s, end))
        if e >= end:
            end, prev = e, name
    span = end - kernels[0][0]
    print(f"\nGPU timeline: span {span / per:.1f} µs per {label}, busy {busy / per:.1f} ({busy / span:.1%}), idle {idle / per:.1f}")
    print(f"{'idle µs per ' + label:>18} {'gaps':>6}  kernel before -> kernel after")
    for (a, b), (t, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / per:>18.1f} {n:>6}  {a} -> {b}")


def _timed(fn, dev):
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    py = cProfile.Profile()
    with profile(activities=acts) as prof:
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t0 = time.perf_counter()
        py.enable()
        fn()
        py.disable()
        torch.cuda.synchronize() if dev.type == "cuda" else None
        dt = time.perf_counter() - t0
    return prof, py, dt


def engine(args, dev) -> None:
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.rollout.base import SamplingParams
    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.rollout.engine_core.core import EngineCore
    from train_bench import PRESETS

    torch.manual_seed(0)
    from miles_core.kernels.base import Kernels
    from miles_core.plugins.manager import MilesPlugins

    model = Decoder(DecoderConfig(**PRESETS["qwen3-0.6b"])).to(dev, torch.bfloat16)
    if not args.reference_kernels:
        model.use_kernels(Kernels(MilesPlugins(), dev.type))
    cfg = EngineConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 16, kv_memory_fraction=0.3,
                       fused_kernels=not args.no_fused, splitk_gemm=not args.no_splitk,
                       gated_gemm=not args.no_gated, pdl=not args.no_pdl)
    core = EngineCore(model, cfg)
    prompts = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True)

    def run():
        core.flush_cache()  # each run prefills its prompts (no prefix-cache hits from the run before)
        for p in prompts:
            core.add_request(p, params)
        while core.has_unfinished():
            core.step()

    run()
    run()
    prof, py, dt = _timed(run, dev)
    print(f"engine: batch {args.batch}, {args.new_tokens} new tokens, graphs {core.runner.use_graphs}, triton {core.runner.use_triton}, "
          f"fused {core.runner.fused_kernels}: "
          f"{args.batch * args.new_tokens / dt:.0f} tok/s, {dt / args.new_tokens * 1e3:.2f} ms per decode step (prefill included)")
    _tables(prof, py, dt, "engine")
    if dev.type == "cuda":
        kernel_summary(prof, args.new_tokens, "step")
        timeline(device_kernels(prof), args.new_tokens, "step")


def train(args, dev) -> None:
    from miles_core.config.loader import load_config
    from miles_core.context import RunContext
    from miles_core.kernels.base import Kernels
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.plugins.manager import MilesPlugins
    from train_bench import PRESETS, make_batch

    torch.manual_seed(0)
    model = Decoder(DecoderConfig(**PRESETS["qwen3-0.6b"]))
    cfg = load_config(None, [f"train.backend={args.backend}", "train.precision=bf16", "train.max_tokens_per_micro_batch=8192", "train.micro_batch_size=1000000",
                             "train.lr=0.00001", *args.overrides])
    plugins = MilesPlugins()
    ctx = RunContext(cfg, plugins, None, dev, dev.type, Kernels(plugins, dev.type))
    trainer = plugins.registries.trainers.get(args.backend)(ctx, model)
    loss_fn = functools.partial(plugins.registries.policy_losses.get("ppo_clip"), cfg=cfg.algorithm)
    batch = make_batch(4, 4096, 256, model.config.vocab_size, 0)
    trainer.train_step(batch, loss_fn)
    trainer.train_step(batch, loss_fn)
    prof, py, dt = _timed(lambda: trainer.train_step(batch, loss_fn), dev)
    print(f"train: 16384 tokens in {dt * 1e3:.0f} ms ({16384 / dt:.0f} tok/s)")
    _tables(prof, py, dt, "train step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["engine", "train"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--backend", default="torch", help="train: a registered trainer (torch, megatron)")
    ap.add_argument("--no-splitk", action="store_true", help="engine: o_proj/down_proj through cuBLAS at decode, not the split-K Triton GEMM")
    ap.add_argument("--no-gated", action="store_true", help="engine: gate/up through cuBLAS + a SwiGLU kernel at decode, not the gated Triton GEMM")
    ap.add_argument("--no-pdl", action="store_true", help="engine: no programmatic dependent launch / weight prefetch in the decode step")
    ap.add_argument("--no-fused", action="store_true", help="engine: without the fused Triton layer kernels")
    ap.add_argument("--reference-kernels", action="store_true", help="engine: the core's torch ops, not the registry's")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    {"engine": engine, "train": train}[args.what](args, dev)


if __name__ == "__main__":
    main()
