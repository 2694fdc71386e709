"""Continuous batching on CPU: requests of different lengths joining as others finish, the case the decode window's
buffer handling is for. The built-in engine on ``rollout_bench.py``'s CPU model (quickstart size, fp32) serves
``--requests`` sampled requests (prompts of 32-127 tokens, 16-255 new tokens, seeded) ``--max-num-seqs`` at a time,
and prints the wall time of each run and how many times the window gathered a whole new K/V buffer from the pages
(``CpuDecoder._gather``) and how long that took::

    python benchmarks/cpu_join_bench.py [--runs 3] [--cpu-kernels auto|torch] [--step-by-step]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout_bench as rb  # noqa: E402

from miles_core.rollout.base import SamplingParams  # noqa: E402
from miles_core.rollout.engine_core import cpu_decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpu-kernels", choices=rb.CPU_KERNELS, default="auto")
    ap.add_argument("--step-by-step", action="store_true", help="no window in one call (cpu_layers.window_group)")
    args = ap.parse_args()
    a = argparse.Namespace(**rb.PRESETS["cpu"])
    model = rb.cpu_model()
    core = rb.EngineCore(model, rb.EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=512, cpu_kernels=args.cpu_kernels))
    core._cpu.whole_window = not args.step_by_step

    spent = [0.0, 0]
    gather = cpu_decode.CpuDecoder._gather

    def timed_gather(self, *x, **k):
        t0 = time.perf_counter()
        gather(self, *x, **k)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1

    cpu_decode.CpuDecoder._gather = timed_gather
    rng = random.Random(0)
    prompts = [[rng.randrange(1, a.vocab) for _ in range(rng.randrange(32, 128))] for _ in range(args.requests)]
    lengths = [rng.randrange(16, 256) for _ in range(args.requests)]
    print(f"{args.requests} requests, {args.max_num_seqs} at a time, {sum(lengths):,} new tokens; "
          f"CPU kernels {'native' if core._cpu._lib() else 'torch'}, {torch.get_num_threads()} threads")
    for run in range(args.runs + 1):  # the first run warms up
        spent[:] = [0.0, 0]
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            core.add_request(p, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=i))
        while core.has_unfinished():
            core.step()
        dt = time.perf_counter() - t0
        tag = "warm-up" if run == 0 else f"run {run}"
        print(f"{tag:>8}: {dt * 1e3:7.0f} ms, {sum(lengths) / dt:9,.0f} tok/s; buffer gathers {spent[1]:3d}, {spent[0] * 1e3:5.0f} ms")


if __name__ == "__main__":
    main()
