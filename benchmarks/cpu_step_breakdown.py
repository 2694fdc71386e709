"""Where a CPU decode step's time goes: the built-in engine on ``rollout_bench.py``'s CPU model (quickstart size,
fp32, 128-token prompts, 256 new tokens, greedy), with wall-clock timers around each call of its decode window
and of its prefill.

The timers wrap, from outside, the names the engine calls (``torch.mm`` / ``torch.addmm`` as ``cpu_decode`` and
``cpu_layers`` see them, the C kernels' methods, the sampler, ``EngineCore._prefill``), so the engine's code runs
as it is; each timer adds ~0.2 µs per call. Prints microseconds per decode step, per phase (window, prefill: the
prefill's time spread over the decode steps, as a run pays it) and call kind, averaged over ``--runs`` timed runs
(each after a warm-up run, as rollout_bench does)::

    python benchmarks/cpu_step_breakdown.py --batch 64 [--cpu-kernels torch] [--step-by-step] [--max-batched-tokens N]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout_bench as rb  # noqa: E402

from miles_core.rollout.engine_core import core as core_mod  # noqa: E402
from miles_core.rollout.engine_core import cpu_decode, cpu_layers  # noqa: E402


def timed(fn, acc: dict, key: str, phase: list | None = None):
    """``fn`` with its wall time added to ``acc[key]``, or to ``acc[phase[0] + key]`` (the phase the call ran in)."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[(phase[0] if phase else "") + key] += time.perf_counter() - t0
        return out

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--preset", choices=("cpu", "smollm2"), default="cpu", help="rollout_bench.py's model and shape")
    ap.add_argument("--cpu-kernels", choices=rb.CPU_KERNELS, default="auto")
    ap.add_argument("--step-by-step", action="store_true", help="no window in one call (cpu_layers.window_group)")
    ap.add_argument("--max-batched-tokens", type=int, default=16384, help="prompt tokens per prefill step (rollout_bench.py: 16384)")
    args = ap.parse_args()
    a = argparse.Namespace(**rb.PRESETS[args.preset])
    model = rb.cpu_model(args.preset)
    cfg = rb.EngineConfig(max_num_seqs=args.batch, max_model_len=a.prompt_len + a.new_tokens + 16, max_batched_tokens=args.max_batched_tokens,
                          cpu_kernels=args.cpu_kernels)
    core = rb.EngineCore(model, cfg)
    core._cpu.whole_window = not args.step_by_step

    acc: dict = collections.defaultdict(float)
    steps, phase = [0], ["window: "]
    # the window's view of torch: mm / addmm / bmm / baddbmm timed, the rest as is
    fake_torch = types.ModuleType("torch")
    fake_torch.__dict__.update(torch.__dict__)
    for name in ("mm", "addmm", "baddbmm", "bmm", "softmax"):
        setattr(fake_torch, name, timed(getattr(torch, name), acc, f"torch.{name}", phase))
    cpu_decode.torch = cpu_layers.torch = fake_torch
    window = cpu_decode.CpuDecoder.window

    def time_native(dec) -> None:
        if dec._native not in (False, None) and not hasattr(dec._native, "_timed"):
            for name in ("rmsnorm", "attn_step", "silu_mul", "prefill_rope", "prefill_attn", "gemm", "decode_step", "decode_window",
                         "logits", "sample", "pack"):
                setattr(dec._native, name, timed(getattr(dec._native, name), acc, f"native {name}", phase))
            dec._native._timed = True

    def window_timed(self, reqs, tokens, pos0, block_tables, steps_, sample):
        time_native(self)
        steps[0] += steps_
        t0 = time.perf_counter()
        if not isinstance(sample, cpu_decode.NativeDraw):  # the C sampler's draws may run inside decode_window
            sample = timed(sample, acc, "sampling", phase)
        out = window(self, reqs, tokens, pos0, block_tables, steps_, sample)
        acc["window: all"] += time.perf_counter() - t0
        return out

    prefill = core_mod.EngineCore._prefill

    def prefill_timed(self, plan):
        self._cpu._window_statics()  # loads the kernels
        time_native(self._cpu)
        phase[0] = "prefill: "
        t0 = time.perf_counter()
        try:
            return prefill(self, plan)
        finally:
            acc["prefill: all"] += time.perf_counter() - t0
            phase[0] = "window: "

    cpu_decode.CpuDecoder.window = window_timed
    core_mod.EngineCore._prefill = prefill_timed

    prompts = torch.randint(1, a.vocab, (args.batch, a.prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
    rb.bench_engine(core, prompts, a.new_tokens, torch.device("cpu"))
    acc.clear()
    steps[0] = 0
    total = 0.0
    for _ in range(args.runs):
        dt, _ = rb.bench_engine(core, prompts, a.new_tokens, torch.device("cpu"))
        total += dt
    # bench_engine runs a warm-up before each timed run: the timers saw 2 * runs runs
    per_step = {k: v / steps[0] * 1e6 for k, v in acc.items()}
    kernels = "native (cpu_native.c)" if core._cpu._native else "torch"
    print(f"CPU decode step breakdown: batch {args.batch}, {torch.get_num_threads()} threads, window kernels {kernels}, "
          f"engine {args.batch * a.new_tokens * args.runs / total:,.0f} tok/s over {args.runs} timed runs")
    print(f"{'call':>34} | {'us per decode step':>18}")
    for ph in ("window: ", "prefill: "):  # the prefill's time spread over the decode steps, as the run pays it
        parts = sorted(((k, v) for k, v in per_step.items() if k.startswith(ph) and k != ph + "all"), key=lambda kv: -kv[1])
        print(f"{ph + 'all':>34} | {per_step.get(ph + 'all', 0.0):18.1f}")
        for k, v in parts:
            print(f"{'  ' + k:>34} | {v:18.1f}")
        rest = per_step.get(ph + "all", 0.0) - sum(v for _, v in parts)
        print(f"{'  ' + ph + 'the rest (Python, etc.)':>34} | {rest:18.1f}")


if __name__ == "__main__":
    main()
