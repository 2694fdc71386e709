"""The parts of one decode step, timed alone on the GPU: the paged attention kernel's launch
variants, the step's GEMMs and the split-K kernel for the narrow ones (o_proj, down_proj), each
replayed from a CUDA graph (28 calls, one per layer, as in a step) so that launch overhead is what a
captured step pays.

    python benchmarks/decode_parts.py              # Qwen3-0.6B shape, batch 64 and 256, context 256

Prints µs per call and the HBM bandwidth it reaches (bytes it must read / time).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_core.rollout.engine_core import triton_decode, triton_gemm  # noqa: E402


def graph_time(fn, calls: int = 28, reps: int = 20) -> float:
    """Mean µs per ``fn()`` call, from a CUDA graph of ``calls`` calls replayed ``reps`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)


def attention(batches, ctx: int, heads=16, kv_heads=8, d=128, page=16) -> None:
    """The paged decode kernel by launch (splits, block_n, warps); the engine's launch is marked."""
    dev = torch.device("cuda")
    print(f"\npaged decode attention, context {ctx}, {heads} heads / {kv_heads} KV heads, head dim {d}, page {page}")
    print(f"{'batch':>5} {'splits':>6} {'block_n':>7} {'warps':>5} {'µs':>8} {'TB/s':>6}")
    for b in batches:
        pages = ctx // page
        s = b * pages + 1
        kc = torch.randn(s * page, kv_heads, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = (1 + torch.randperm(b * pages, device=dev, dtype=torch.int32)).view(b, pages)
        cl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(b, heads, d, device=dev, dtype=torch.bfloat16)
        kv_bytes = 2 * b * ctx * kv_heads * d * 2
        best = None
        default = triton_decode.num_splits(b, kv_heads, torch.cuda.get_device_properties(dev).multi_processor_count)
        for splits, bn, w in itertools.product(sorted({1, 2, default}), (16, 32, 64), (4, 8)):
            try:
                t = graph_time(lambda: triton_decode.paged_decode(q, kc, vc, bt, cl, page, splits, bn, w))
            except Exception as exc:  # a config that does not compile (shared memory)
                print(f"{b:>5} {splits:>6} {bn:>7} {w:>5}   failed: {type(exc).__name__}")
                continue
            tag = " (engine)" if (splits, bn, w) == (default, triton_decode.BLOCK_N, triton_decode.NUM_WARPS) else ""
            print(f"{b:>5} {splits:>6} {bn:>7} {w:>5} {t:>8.1f} {kv_bytes / t / 1e6:>6.2f}{tag}")
            if best is None or t < best[0]:
                best = (t, (splits, bn, w))
        if best is not None:
            print(f"  best at batch {b}: {best[0]:.1f} µs, (splits, block_n, warps) = {best[1]}")


def prologue(batches, ctx: int, heads=16, kv_heads=8, d=128, page=16) -> None:
    """The q/k/v prologue (q/k norm, rotary, K/V write) as its own kernel before the paged attention,
    against ``triton_decode.paged_decode_qkv``, which runs it inside the attention kernel."""
    from miles_core.rollout.engine_core import triton_fused

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"\nprologue + paged attention vs the fused kernel, context {ctx} (the new token's included), bf16")
    print(f"{'batch':>5} {'splits':>6} {'prologue':>9} {'attention':>9} {'both':>8} {'fused':>8}")
    for b in batches:
        pages = -(-ctx // page)
        kc = torch.randn((b * pages + 1) * page, kv_heads, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = (1 + torch.randperm(b * pages, device=dev, dtype=torch.int32)).view(b, pages)
        cl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        pos = cl.long() - 1
        qkv = torch.randn(b, (heads + 2 * kv_heads) * d, device=dev, dtype=torch.bfloat16)
        qw, kw = (1 + 0.1 * torch.randn(d, device=dev)).to(torch.bfloat16), (1 + 0.1 * torch.randn(d, device=dev)).to(torch.bfloat16)
        cos, sin = torch.randn(2, ctx + 1, d, device=dev, dtype=torch.bfloat16)
        splits = triton_decode.num_splits(b, kv_heads, sms)
        q = triton_fused.qkv_prologue(qkv, heads, kv_heads, d, qw, kw, 1e-6, pos, cos, sin, kc, vc, block_tables=bt, page=page)
        t_pro = graph_time(lambda: triton_fused.qkv_prologue(qkv, heads, kv_heads, d, qw, kw, 1e-6, pos, cos, sin, kc, vc,
                                                             block_tables=bt, page=page))
        t_att = graph_time(lambda: triton_decode.paged_decode(q, kc, vc, bt, cl, page, splits))
        t_both = graph_time(lambda: triton_decode.paged_decode(
            triton_fused.qkv_prologue(qkv, heads, kv_heads, d, qw, kw, 1e-6, pos, cos, sin, kc, vc, block_tables=bt, page=page),
            kc, vc, bt, cl, page, splits))
        t_fused = graph_time(lambda: triton_decode.paged_decode_qkv(qkv, heads, qw, kw, 1e-6, pos, cos, sin, kc, vc, bt, cl, page, splits))
        print(f"{b:>5} {splits:>6} {t_pro:>9.1f} {t_att:>9.1f} {t_both:>8.1f} {t_fused:>8.1f}")


def launches(batches, hidden=1024, heads=16, kv_heads=8, d=128, inter=3072) -> None:
    """The engine's Triton GEMMs at decode (``triton_gemm.gemm`` for q/k/v, ``gated_gemm`` for gate/up +
    SwiGLU) over their tile sizes and pipeline depths; the engine's current launch is marked."""
    dev = torch.device("cuda")
    print(f"\nTriton decode GEMMs by launch (bf16; the engine's launch marked *)\n{'batch':>5} {'gemm':>8} {'block_n':>7} "
          f"{'block_k':>7} {'stages':>6} {'µs':>8} {'TB/s':>6}")
    for b in batches:
        x = torch.randn(b, hidden, device=dev, dtype=torch.bfloat16)
        for name, n in (("qkv", (heads + 2 * kv_heads) * d), ("gate_up", 2 * inter)):
            w = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16) * 0.02
            nbytes = (n * hidden + b * hidden + b * n) * 2
            best = None
            for bn, bk, st in itertools.product((16, 32, 64), (64, 128), (3, 4)):
                try:
                    if name == "qkv":
                        t = graph_time(lambda: triton_gemm.splitk_gemm(x, w, 1, bn, bk, num_stages=st, out_dtype=x.dtype))
                    else:
                        t = graph_time(lambda: triton_gemm.gated_gemm(x, w, bn, bk, num_stages=st))
                except Exception as exc:  # a config that does not compile (shared memory)
                    print(f"{b:>5} {name:>8} {bn:>7} {bk:>7} {st:>6}   failed: {type(exc).__name__}")
                    continue
                mark = "*" if (bn, bk, st) == (32, 64, 4) else ""  # both GEMMs' launch in the engine
                print(f"{b:>5} {name:>8} {bn:>7} {bk:>7} {st:>6} {t:>8.1f} {nbytes / t / 1e6:>6.2f} {mark}")
                if best is None or t < best[0]:
                    best = (t, (bn, bk, st))
            print(f"  best at batch {b}, {name}: {best[0]:.1f} µs, (block_n, block_k, stages) = {best[1]}")


def gemms(batches, hidden=1024, heads=16, kv_heads=8, d=128, inter=3072, vocab=151936) -> None:
    dev = torch.device("cuda")
    shapes = {"qkv": ((heads + 2 * kv_heads) * d, hidden), "o": (hidden, heads * d), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter), "lm_head": (vocab, hidden)}
    print(f"\nGEMMs (F.linear, bf16, cuBLAS as torch picks it)\n{'batch':>5} {'gemm':>8} {'N x K':>14} {'µs':>8} {'TB/s':>6}")
    for b in batches:
        total = 0.0
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
            t = graph_time(lambda: F.linear(x, w), calls=1 if name == "lm_head" else 28)
            total += t * (1 if name == "lm_head" else 28)
            print(f"{b:>5} {name:>8} {f'{n}x{k}':>14} {t:>8.1f} {(n * k + b * k + b * n) * 2 / t / 1e6:>6.2f}")
        print(f"  batch {b}: {total / 1e3:.3f} ms of GEMM per decode step (28 layers + lm_head)")


def splitk(batches, hidden=1024, heads=16, kv_heads=8, d=128, inter=3072, names=("o", "down")) -> None:
    """cuBLAS against triton_gemm's split-K kernel for the GEMMs whose output is only ``hidden`` wide.
    Splits: choose_split's and its half and double; the partials' sum over splits (``partial.sum(0)``,
    which the consumer kernel will fuse with the residual add and the norm) is timed alone. TB/s counts
    the bytes a GEMM must move (weight + x + a bf16 output), the same for both, not the fp32 partials."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    every = {"o": (hidden, heads * d), "down": (hidden, inter), "qkv": ((heads + 2 * kv_heads) * d, hidden), "gate_up": (2 * inter, hidden)}
    shapes = {name: every[name] for name in names}
    print(f"\nsplit-K GEMM (triton_gemm, fp32 partials [split, M, N], {sms} SMs) against cuBLAS F.linear, bf16")
    print(f"{'batch':>5} {'gemm':>5} {'split':>5} {'block_n':>7} {'block_k':>7} {'µs':>8} {'TB/s':>6} {'sum µs':>7} "
          f"{'total':>8} {'TB/s':>6}")
    for b in batches:
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
            nbytes = (n * k + b * k + b * n) * 2
            ref = F.linear(x, w).float()
            t = graph_time(lambda: F.linear(x, w))
            tb = nbytes / t / 1e6
            print(f"{b:>5} {name:>5} {'cuBLAS':>21} {t:>8.1f} {tb:>6.2f} {'':>7} {t:>8.1f} {tb:>6.2f}")
            best, best_total = None, None
            for bn, bk in itertools.product((32, 64), (64, 128)):
                s0 = triton_gemm.choose_split(n, k, sms, bn, bk)
                kb = -(-k // bk)
                for split in sorted({max(1, s0 // 2), s0, min(kb, 2 * s0)}):
                    try:
                        part = triton_gemm.splitk_gemm(x, w, split, bn, bk, num_warps=4)
                        err = ((part.sum(0) - ref).abs().max() / ref.abs().max()).item()
                        t = graph_time(lambda: triton_gemm.splitk_gemm(x, w, split, bn, bk, num_warps=4))
                        ts = graph_time(lambda: part.sum(0))
                    except Exception as exc:  # a config that does not compile (shared memory)
                        print(f"{b:>5} {name:>5} {split:>5} {bn:>7} {bk:>7}   failed: {type(exc).__name__}")
                        continue
                    tag = " (choose_split)" if split == s0 else ""
                    tag += f"  WRONG: max error {err:.2e} of max |y|" if err > 1e-2 else ""
                    print(f"{b:>5} {name:>5} {split:>5} {bn:>7} {bk:>7} {t:>8.1f} {nbytes / t / 1e6:>6.2f} {ts:>7.1f} "
                          f"{t + ts:>8.1f} {nbytes / (t + ts) / 1e6:>6.2f}{tag}")
                    if err <= 1e-2:
                        if best is None or t < best[0]:
                            best = (t, ts, (split, bn, bk))
                        if best_total is None or t + ts < best_total[0] + best_total[1]:
                            best_total = (t, ts, (split, bn, bk))
            for what, r in (("kernel", best), ("kernel + sum", best_total)):
                if r is not None:
                    print(f"  best {what} at batch {b}, {name}: {r[0]:.1f} + {r[1]:.1f} µs sum, "
                          f"(split, block_n, block_k) = {r[2]}")


def sampler(batches, vocab=151936) -> None:
    """The sampler's fused pass (triton_sample.sample_rows, greedy and sampled) over bf16 logits, by launch:
    vocabulary chunks per row, block, warps; the engine's launch (triton_sample.launch) is marked."""
    from miles_core.rollout.engine_core import triton_sample

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"\nsampler (bf16 logits, vocab {vocab}; µs per step, TB/s of the logits read)")
    print(f"{'batch':>5} {'mode':>7} {'chunks':>6} {'block':>6} {'warps':>5} {'µs':>8} {'TB/s':>6}")
    for b in batches:
        z = torch.randn(b, vocab, device=dev, dtype=torch.bfloat16)
        temp = torch.full((b,), 0.8, device=dev)
        seeds = torch.arange(b, device=dev, dtype=torch.int64)
        ctr = torch.zeros(b, device=dev, dtype=torch.int64)
        for sampled in (False, True):
            default = triton_sample.launch(b, vocab, sampled)
            t_in = temp if sampled else torch.zeros_like(temp)
            ref = triton_sample.sample_rows(z, t_in, None, seeds, ctr, sampled)
            best = None
            for c, blk, w in itertools.product(sorted({default[0], 16, 32, 64}), (1024, 2048, 4096), (4, 8)):
                got = triton_sample.sample_rows(z, t_in, None, seeds, ctr, sampled, chunks=c, block=blk, num_warps=w)
                ok = torch.equal(got[0], ref[0])
                t = graph_time(lambda: triton_sample.sample_rows(z, t_in, None, seeds, ctr, sampled, chunks=c, block=blk, num_warps=w), calls=8)
                mark = " (engine)" if (c, blk, w) == default else ""
                print(f"{b:>5} {'sampled' if sampled else 'greedy':>7} {c:>6} {blk:>6} {w:>5} {t:>8.1f} {z.numel() * 2 / t / 1e6:>6.2f}{mark}"
                      + ("" if ok else "  TOKENS DIFFER"))
                if ok and (best is None or t < best[0]):
                    best = (t, (c, blk, w))
            print(f"  best at batch {b}, {'sampled' if sampled else 'greedy'}: {best[0]:.1f} µs, (chunks, block, warps) = {best[1]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--attention-batches", default="64", help="batches of the attention sweep")
    ap.add_argument("--parts", default="gemms,splitk,attention", help="of gemms, splitk, attention, prologue, launches, sampler")
    ap.add_argument("--splitk-shapes", default="o,down", help="of o, down, qkv, gate_up")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    parts = a.parts.split(",")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if "gemms" in parts:
        gemms(batches)
    if "splitk" in parts:
        splitk(batches, names=tuple(a.splitk_shapes.split(",")))
    if "launches" in parts:
        launches(batches)
    if "prologue" in parts:
        prologue(batches, a.ctx)
    if "sampler" in parts:
        sampler(batches)
    if "attention" in parts:
        attention([int(x) for x in a.attention_batches.split(',')], a.ctx)


if __name__ == "__main__":
    main()
