"""miles_nvidia benchmarks on one GPU: prints four tables and writes $OUT/bench_nvidia.json.

1. fused logprob (vocab 151936, 16k tokens): time and peak memory vs torch eager (full logits),
   the core's chunked reference and torch.compile;
2. FP8 blockwise linear vs bf16 on Qwen3-0.6B / Qwen3-8B GEMM shapes (16k tokens);
3. loss after 200 SFT steps at quickstart size, fp8 (each wgrad mode) vs bf16, mean over seeds;
4. batch-invariant mode: engine vs trainer logprobs bitwise on a Qwen3-shaped model, and its cost.

With ``--only parts``: the FP8 backward's GEMMs and dy quantisers alone, at several launch shapes.

Usage: python plugins/miles_nvidia/benchmarks/bench_nvidia.py [--only logprobs,fp8,parts,loss,bi] [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS: dict = {"device": None, "torch": torch.__version__}
SMOKE = {"on": False}  # --smoke: tiny sizes on CPU (Triton interpreter) to check the script itself
DEV = "cuda"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timeit(fn, warmup=2, iters=5) -> float:
    if SMOKE["on"]:
        warmup, iters = 0, 1
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def peak_mb(fn) -> float:
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def table(title, header, rows):
    print(f"\n## {title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(x).ljust(w) for x, w in zip(r, widths)))


# ---------------------------------------------------------------------------------- 1. logprobs
def naive_logprobs(h, w, t):
    logp = F.log_softmax((h @ w.t()).float(), -1)
    return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def bench_logprobs(quick: bool, hiddens=(1024,)):
    from miles_core.kernels.logprobs import logprobs_torch
    from miles_nvidia.kernels.logprobs import logprobs_triton

    m, v = (4096 if quick else 16384), 151936
    if SMOKE["on"]:
        m, v, hiddens = 32, 300, (32,)
    out = []
    for hdim in hiddens:
        h = torch.randn(m, hdim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, hdim, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
        t = torch.randint(0, v, (m,), device=DEV)
        compiled = torch.compile(naive_logprobs)
        impls = {"torch eager (full logits)": naive_logprobs, "torch.compile (full logits)": naive_logprobs if SMOKE["on"] else compiled,
                 "core chunked reference": logprobs_torch, "miles_nvidia triton": logprobs_triton}
        ref = None
        for name, fn in impls.items():
            row = {"impl": name, "hidden": hdim, "tokens": m, "vocab": v}
            try:
                fwd = lambda: fn(h.detach(), w.detach(), t)  # noqa: E731

                def fwd_bwd():
                    lp, ent = fn(h, w, t)
                    (lp.sum() + ent.sum()).backward()
                    h.grad = w.grad = None

                with torch.no_grad():
                    lp, _ = fwd()
                if ref is None:
                    ref = lp.float()
                row["max_abs_err_vs_eager"] = float((lp.float() - ref).abs().max())
                row["fwd_ms"] = timeit(lambda: torch.no_grad()(fwd)())
                row["fwd_peak_mb"] = peak_mb(lambda: torch.no_grad()(fwd)())
                row["fwd_bwd_ms"] = timeit(fwd_bwd, 1, 3)
                row["fwd_bwd_peak_mb"] = peak_mb(fwd_bwd)
            except Exception as exc:  # an OOM or a compile failure is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.empty_cache()
            out.append(row)
        del h, w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    RESULTS["logprobs"] = out
    table("fused logprob + entropy (bf16, vocab 151936)", ["impl", "H", "tokens", "fwd ms", "fwd peak MiB", "fwd+bwd ms", "fwd+bwd peak MiB", "max|err|"],
          [[r["impl"], r["hidden"], r["tokens"], f"{r.get('fwd_ms', float('nan')):.2f}", f"{r.get('fwd_peak_mb', float('nan')):.0f}",
            f"{r.get('fwd_bwd_ms', float('nan')):.2f}", f"{r.get('fwd_bwd_peak_mb', float('nan')):.0f}",
            r.get("error", f"{r.get('max_abs_err_vs_eager', float('nan')):.2e}")] for r in out])


# ---------------------------------------------------------------------------------- 2. fp8
SHAPES = {  # name: (N, K) of x[M, K] @ W[N, K].T
    "0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288),
}


ROUNDS = 5
# forward+backward variants, by the environment each runs under (the module reads it per call)
FWD_BWD_VARIANTS = {
    "blocks (default)": {},
    "tiles": {"MILES_FP8_WGRAD": "tiles"},
    "dy_blocks": {"MILES_FP8_WGRAD": "dy_blocks"},
}


def _fwd_bwd(layer, x, dy, params):
    """One micro-batch: forward, backward(dy) into x.grad and the weight's grad, grads reset."""
    def step():
        layer(x).backward(dy)
        x.grad = None
        for p in params:
            p.grad = None
    return step


def _operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k], W [n, k] (scaled as an initialised weight) and dy [m, n], random bf16 on the device."""
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    return x, w, torch.randn(m, n, device=DEV, dtype=torch.bfloat16)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def bench_fp8(quick: bool):
    from miles_nvidia.fp8.gemm import fp8_gemm
    from miles_nvidia.fp8.linear import Fp8Linear, Fp8Weight, fp8_linear
    from miles_nvidia.fp8.quant import quantize_act, quantize_act_both, quantize_act_t, quantize_weight

    m = 4096 if quick else 16384
    shapes = SHAPES
    if SMOKE["on"]:
        m, shapes = 16, {"smoke": (256, 128)}
    out = []
    lin = (lambda x, w: x @ w.t()) if SMOKE["on"] else torch.compile(lambda x, w: x @ w.t())
    for name, (n, k) in shapes.items():
        x, w, dy = _operands(m, n, k)
        qx, sx = quantize_act(x)
        qw, sw = quantize_weight(w)
        row = {"shape": name, "M": m, "N": n, "K": k}
        row["bf16_eager_ms"] = timeit(lambda: x @ w.t())
        try:
            row["bf16_compile_ms"] = timeit(lambda: lin(x, w))
        except Exception as exc:
            row["bf16_compile_error"] = str(exc)[:200]
        for backend in ("scaled_mm", "triton"):
            try:
                row[f"fp8_{backend}_gemm_ms"] = timeit(lambda: fp8_gemm(qx, sx, qw, sw, 128, torch.bfloat16, backend))
                err = (fp8_gemm(qx, sx, qw, sw, 128, torch.bfloat16, backend).float() - (x @ w.t()).float()).norm() / (x @ w.t()).float().norm()
                row[f"fp8_{backend}_rel_err"] = float(err)
            except Exception as exc:
                row[f"fp8_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        try:
            row["fp8_linear_incl_quant_ms"] = timeit(lambda: fp8_linear(x, w))
        except Exception as exc:
            row["fp8_linear_error"] = str(exc)[:200]
        # quantisers alone, and the wgrad GEMM forced onto scaled_mm (a layout error would show here)
        row["quant_x_ms"] = timeit(lambda: quantize_act(x))
        row["quant_x_gbs"] = 3 * m * k / (row["quant_x_ms"] * 1e-3) / 1e9  # read 2 B + write 1 B per element
        # dy's two layouts (issue #7): unfused (torch's transposing copy + the row kernel) and as the module makes
        # them (the row kernel, then the fused column kernel); the latter's bytes and scales must equal the former's
        from miles_nvidia.fp8.quant_triton import quantize_act_both_triton
        with _env("MILES_FP8_FUSED_TRANSPOSE", "0"):
            ref_bytes = quantize_act_both_triton(dy, 128)
            row["quant_dy_both_unfused_ms"] = timeit(lambda: quantize_act_both_triton(dy, 128))
        row["quant_dy_both_ms"] = timeit(lambda: quantize_act_both_triton(dy, 128))
        got = quantize_act_both_triton(dy, 128)
        row["quant_dy_both_bad"] = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) + int((sa != sb).sum())
                                       for a, b, sa, sb in ((got[0], ref_bytes[0], got[1], ref_bytes[1]), (got[2], ref_bytes[2], got[3], ref_bytes[3])))
        del ref_bytes, got
        row["quant_w_ms"] = timeit(lambda: quantize_weight(w, transposed=True))
        qdy, sdy, qdyt, sdyt = quantize_act_both(dy)
        qxt, sxt = quantize_act_t(x)
        wq = Fp8Weight.of(w)
        gemms = {"dgrad": lambda: fp8_gemm(qdy, sdy, wq.qt, wq.st, 128, torch.bfloat16, "scaled_mm"),
                 "wgrad": lambda: fp8_gemm(qdyt, sdyt, qxt, sxt, 1, torch.bfloat16, "scaled_mm")}
        for gname, fn in gemms.items():
            try:
                row[f"fp8_{gname}_scaled_mm_ms"] = timeit(fn)
            except Exception as exc:
                row[f"fp8_{gname}_scaled_mm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        # module forward / forward+backward, weight cache warm (steady-state micro-batch)
        ref = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
        mod = Fp8Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
        with torch.no_grad():
            ref.weight.copy_(w)
            mod.weight.copy_(w)
        xg = x.clone().requires_grad_()
        try:
            row["bf16_fwd_bwd_ms"] = timeit(_fwd_bwd(ref, xg, dy, [ref.weight]), 3, 20)
            with torch.no_grad():
                mod(x)  # fills the cache
            with torch.no_grad():  # a training forward also quantises x.T (kept for the wgrad): in fwd+bwd below
                row["fp8_module_fwd_ms"] = timeit(lambda: mod(x))
            row["fp8_module_fwd_bwd_ms"] = timeit(_fwd_bwd(mod, xg, dy, [mod.weight]), 3, 20)
            row["fp8_module_weight_quantisations"] = mod.fp8_cache.quantisations  # 1: every timed call hit the cache
            # every recipe variant against bf16 in interleaved rounds (the H200's speed drifts by 5% within a run:
            # one FP8 mode timed 9.80 and 10.36 ms minutes apart in session 10): the median of ROUNDS
            row["rounds"] = {name: [] for name in ("bf16", *FWD_BWD_VARIANTS)}
            for _ in range(1 if SMOKE["on"] else ROUNDS):
                row["rounds"]["bf16"].append(timeit(_fwd_bwd(ref, xg, dy, [ref.weight]), 2, 20))
                for vname, env in FWD_BWD_VARIANTS.items():
                    with contextlib.ExitStack() as st:
                        for kv in env.items():
                            st.enter_context(_env(*kv))
                        row["rounds"][vname].append(timeit(_fwd_bwd(mod, xg, dy, [mod.weight]), 2, 20))
        except Exception as exc:
            row["fp8_module_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        best = min(row.get("fp8_scaled_mm_gemm_ms", float("inf")), row.get("fp8_triton_gemm_ms", float("inf")))
        row["speedup_gemm"] = row["bf16_eager_ms"] / best
        row["speedup_linear_incl_quant"] = row["bf16_eager_ms"] / row.get("fp8_linear_incl_quant_ms", float("inf"))
        row["speedup_module_fwd"] = row["bf16_eager_ms"] / row.get("fp8_module_fwd_ms", float("inf"))
        row["speedup_fwd_bwd"] = row.get("bf16_fwd_bwd_ms", float("nan")) / row.get("fp8_module_fwd_bwd_ms", float("inf"))
        out.append(row)
        del x, w, dy, qx, qw, qdyt, qdy, qxt, wq, ref, mod, xg
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    RESULTS["fp8"] = out
    f = lambda r, k: f"{r[k]:.3f}" if k in r else "err"  # noqa: E731
    table(f"FP8 blockwise (1x128 act, 128x128 weight) vs bf16, forward, M={m}", ["shape", "N", "K", "bf16 ms", "bf16 compile ms", "fp8 scaled_mm ms", "fp8 triton ms", "fp8 linear+quant ms", "fp8 module fwd ms", "GEMM speedup", "linear speedup", "module fwd speedup"],
          [[r["shape"], r["N"], r["K"], f(r, "bf16_eager_ms"), f(r, "bf16_compile_ms"), f(r, "fp8_scaled_mm_gemm_ms"), f(r, "fp8_triton_gemm_ms"),
            f(r, "fp8_linear_incl_quant_ms"), f(r, "fp8_module_fwd_ms"), f"{r['speedup_gemm']:.2f}x", f"{r['speedup_linear_incl_quant']:.2f}x", f"{r['speedup_module_fwd']:.2f}x"] for r in out])
    table(f"FP8 linear forward+backward vs bf16 (dx and dW), M={m}", ["shape", "bf16 fwd+bwd ms", "fp8 module fwd+bwd ms", "fwd+bwd speedup", "quant x ms", "quant x GB/s", "quant dy (both) ms", "TB/s", "unfused ms", "bytes+scales != unfused", "quant W (+W.T) ms", "dgrad scaled_mm ms", "wgrad scaled_mm ms", "W quantisations"],
          [[r["shape"], f(r, "bf16_fwd_bwd_ms"), f(r, "fp8_module_fwd_bwd_ms"), f"{r['speedup_fwd_bwd']:.2f}x", f(r, "quant_x_ms"), f"{r['quant_x_gbs']:.0f}",
            f(r, "quant_dy_both_ms"), f"{6 * r['M'] * r['N'] / (r['quant_dy_both_ms'] * 1e-3) / 1e12:.2f}", f(r, "quant_dy_both_unfused_ms"), r["quant_dy_both_bad"], f(r, "quant_w_ms"), f(r, "fp8_dgrad_scaled_mm_ms"),
            f(r, "fp8_wgrad_scaled_mm_ms"), r.get("fp8_module_weight_quantisations", "err")] for r in out])
    print(FP8_LEGEND)
    med = lambda r, v: statistics.median(r["rounds"][v])  # noqa: E731
    table(f"FP8 linear forward+backward against bf16, {ROUNDS} interleaved rounds of 20 calls each, M={m}: median ms "
          "(speedup over bf16's median) [slowest/fastest round]", ["shape", "bf16", *FWD_BWD_VARIANTS],
          [[r["shape"], f"{med(r, 'bf16'):.3f} [{max(r['rounds']['bf16']) / min(r['rounds']['bf16']):.2f}]",
            *(f"{med(r, v):.3f} ({med(r, 'bf16') / med(r, v):.2f}x) [{max(r['rounds'][v]) / min(r['rounds'][v]):.2f}]" for v in FWD_BWD_VARIANTS)]
           for r in out if "rounds" in r])
    print("  variants: " + "; ".join(f"{v}: {' '.join(f'{k}={x}' for k, x in env.items()) or 'defaults'}" for v, env in FWD_BWD_VARIANTS.items()))

FP8_LEGEND = """Columns (times are means over CUDA-synchronised loops; bf16 inputs, fp32 accumulation everywhere):
  bf16 ms / bf16 compile ms: x @ W.T, eager / torch.compile.
  fp8 scaled_mm ms / fp8 triton ms: the blockwise FP8 GEMM alone, x and W already quantised.
  fp8 linear+quant ms: the free function fp8_linear(x, W) forward, no grad: quantise W (128x128) and x (1x128), GEMM.
  fp8 module fwd ms: Fp8Linear forward, no grad, weight cache warm: quantise x, GEMM (W quantised once per optimizer step).
  bf16 fwd+bwd ms: nn.Linear forward + backward (dx = dy @ W and dW = dy.T @ x), grads reset each call.
  fp8 module fwd+bwd ms: Fp8Linear the same, weight cache warm: quant x and x.T (one pass; q(x.T) is what backward
    keeps), GEMM; quant dy (rows and dy.T in one pass), dgrad GEMM with the cached q(W).T, wgrad GEMM (bf16 out).
    Speedups are bf16 time / fp8 time.
  quant x ms / GB/s: quantize_act(x) alone (3 bytes per element moved). quant dy (both) ms / TB/s: dy's row tiles and
    dy.T's tiles as the module makes them (row kernel, then the fused column kernel; 6 bytes per element moved over
    both); unfused: through torch's transposing copy of pad(dy).T and the row kernel; their bytes must not differ.
  quant W (+W.T): quantize_weight(W, transposed=True), paid once per optimizer step by the module.
  dgrad / wgrad scaled_mm ms: the backward GEMMs alone forced onto torch._scaled_mm (dgrad dy @ W: 1x128 x 128x128,
    wgrad dy.T @ x: 1x128 x 1x128 scales); 'err' means the module's auto backend falls back to Triton there.
  W quantisations: times the module quantised W during the timed loops (1 = every call hit the cache)."""


def bench_parts(quick: bool):
    """The backward's parts alone, 8B shapes (issue #7: the wgrad GEMM and dy's quantisation are what keep
    forward+backward under 1.4x): bf16 GEMMs; the three FP8 GEMMs; the wgrad GEMM with its operands swapped
    (dW.T = x.T-tiles x dy.T-tiles, then a transposing copy) and on the Triton kernel at several launch
    shapes; the row and column quantisers at several launch shapes, in TB/s of 3 bytes per element."""
    from miles_nvidia.fp8.gemm import fp8_gemm, fp8_gemm_triton
    from miles_nvidia.fp8.linear import Fp8Weight
    from miles_nvidia.fp8.quant import quantize_act, quantize_act_both, quantize_act_t, quantize_act_t_blocks
    from miles_nvidia.fp8.quant_triton import quantize_act_t_triton, quantize_act_triton

    m = 4096 if quick else 16384
    shapes = {k: v for k, v in SHAPES.items() if k.startswith("8B")}
    if SMOKE["on"]:
        m, shapes = 256, {"smoke": (256, 128)}
    rows, qrows = [], []
    for name, (n, k) in shapes.items():
        x, w, dy = _operands(m, n, k)
        qx, sx = quantize_act(x)
        qxt, sxt = quantize_act_t(x)
        qdy, sdy, qdyt, sdyt = quantize_act_both(dy)
        wq = Fp8Weight.of(w)
        ref = dy.t().float() @ x.float()  # the exact product: every wgrad variant's error against it
        # x in 128x128 blocks for the wgrad (q(x).T with the blocks' scales transposed): the weight-style
        # B operand of the fast 1x128 x 128x128 GEMM (fwd, dgrad) instead of x.T's 1x128 tiles along tokens
        from miles_nvidia.fp8.quant import quantize_weight
        _, sxb, qxbt = quantize_weight(x, transposed=True)
        sxbt = sxb.t().contiguous()
        _, sdyb0, qdyb = quantize_weight(dy, transposed=True)  # dy.T in 128x128 blocks (M = 16384: no padding)
        sdyb = sdyb0.t().contiguous()
        cand = {
            "bf16 fwd x @ W.T": lambda: x @ w.t(),
            "bf16 dgrad dy @ W": lambda: dy @ w,
            "bf16 wgrad dy.T @ x": lambda: dy.t() @ x,
        }
        if not SMOKE["on"]:
            cand |= {
                "fp8 fwd (scaled_mm)": lambda: fp8_gemm(qx, sx, wq.q, wq.s, 128, torch.bfloat16, "scaled_mm"),
                "fp8 dgrad (scaled_mm)": lambda: fp8_gemm(qdy, sdy, wq.qt, wq.st, 128, torch.bfloat16, "scaled_mm"),
                "fp8 wgrad (scaled_mm, module)": lambda: fp8_gemm(qdyt, sdyt, qxt, sxt, 1, torch.bfloat16, "scaled_mm"),
                "fp8 wgrad swapped, GEMM only": lambda: fp8_gemm(qxt, sxt, qdyt, sdyt, 1, torch.bfloat16, "scaled_mm"),
                "fp8 wgrad swapped + .t().contiguous()": lambda: fp8_gemm(qxt, sxt, qdyt, sdyt, 1, torch.bfloat16, "scaled_mm").t().contiguous(),
                "fp8 wgrad, x in 128x128 blocks": lambda: fp8_gemm(qdyt, sdyt, qxbt, sxbt, 128, torch.bfloat16, "scaled_mm"),
                "fp8 wgrad, dy in 128x128 blocks": lambda: fp8_gemm(qdyb, sdyb, qxt, sxt, 1, torch.bfloat16, "scaled_mm", a_rows=128),
                "quantise x in 128x128 blocks (+ q.T copy)": lambda: quantize_weight(x, transposed=True),
                "quantise x.T 1x128 tiles (module)": lambda: quantize_act_t(x),
                "quantise x rows, then x.T blocks (module, blocks mode)": lambda: quantize_act_t_blocks(x, quantize_act(x)[1]),
            }
        from miles_nvidia.fp8.gemm import TRITON_SWEEP

        configs = [(32, 64, 4, 2)] if SMOKE["on"] else list(TRITON_SWEEP)
        for c in configs:
            cand[f"fp8 wgrad triton {c}"] = lambda c=c: fp8_gemm_triton(qdyt, sdyt, qxt, sxt, 1, torch.bfloat16, c)
        flops = 2 * m * n * k
        for cname, fn in cand.items():
            try:
                ms = timeit(fn)
                out = fn()
                err = ""
                if "wgrad" in cname:
                    got = out.float() if out.shape == ref.shape else out.float().t()
                    err = f"{float((got - ref).norm() / ref.norm()):.1e}"
                rows.append([name, cname, f"{ms:.3f}", f"{flops / (ms * 1e-3) / 1e12:.0f}", err])
            except Exception as exc:
                rows.append([name, cname, f"{type(exc).__name__}: {str(exc)[:80]}", "", ""])
        elems = m * n
        qcand = {f"rows block_m={bm} warps={wp}": (lambda bm=bm, wp=wp: quantize_act_triton(dy, bm, wp)) for bm in (16, 32, 64) for wp in (2, 4, 8)}
        qcand |= {f"cols block_k={bk} warps={wp}": (lambda bk=bk, wp=wp: quantize_act_t_triton(dy, fused=True, block_k=bk, warps=wp))
                  for bk in (16, 32, 64) for wp in (2, 4, 8)}
        base_rows, base_cols = quantize_act_triton(dy), quantize_act_t_triton(dy, fused=True)
        for qname, fn in qcand.items():
            try:
                ms = timeit(fn)
                got, want = fn(), (base_rows if qname.startswith("rows") else base_cols)
                same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
                qrows.append([name, qname, f"{ms:.3f}", f"{3 * elems / (ms * 1e-3) / 1e12:.2f}", "yes" if same else "NO"])
            except Exception as exc:
                qrows.append([name, qname, f"{type(exc).__name__}: {str(exc)[:80]}", "", ""])
        del x, w, dy, qx, qxt, qdyt, qdy, wq, ref, base_rows, base_cols, qxbt, qdyb
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    RESULTS["parts"] = {"gemms": rows, "quant": qrows, "M": m}
    table(f"backward parts alone, M={m}: GEMMs (wgrad: rel. Frobenius error against the fp32 product dy.T @ x)", ["shape", "GEMM", "ms", "TFLOP/s", "wgrad rel err"], rows)
    table(f"dy quantisers alone, M={m} (3 B per element moved)", ["shape", "kernel launch", "ms", "TB/s", "same bytes as default"], qrows)


# ---------------------------------------------------------------------------------- 3. loss
def train_loss(recipe_name: str, steps: int, seed: int = 0, wgrad: str | None = None, device: str | None = None) -> list[float]:
    """SFT losses of the quickstart-size model on the addition task, one per step; ``seed`` sets the
    initial weights and the data; ``wgrad`` the FP8 recipe's ``MILES_FP8_WGRAD`` for this process."""
    import random

    from miles_core.data.tokenizer import CharTokenizer
    from miles_core.kernels.logprobs import logprobs_torch
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.plugins.manager import MilesPlugins
    import miles_nvidia.plugin

    if wgrad is not None:
        os.environ["MILES_FP8_WGRAD"] = wgrad
    pm = MilesPlugins(autoload=False, extra_plugins=[("miles_nvidia", miles_nvidia.plugin)])
    recipe = pm.registries.precision_recipes.get(recipe_name)
    tok = CharTokenizer()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384))
    dev = torch.device(device or DEV)
    model = recipe.prepare_model(model).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99))
    losses = []
    for _ in range(steps):
        pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(64)]
        seqs = [tok.encode(f"{a}+{b}={a + b}") + [tok.eos_token_id] for a, b in pairs]
        ln = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (ln - len(s)) for s in seqs], device=dev)
        mask = (ids[:, 1:] != tok.pad_token_id).float()
        with recipe.autocast(dev):
            h = model(ids)[:, :-1]
        w = model.lm_head.weight
        lp, _ = logprobs_torch(h.reshape(-1, h.shape[-1]).to(w.dtype), w, ids[:, 1:].reshape(-1))
        loss = -(lp.view_as(mask) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# (label, precision recipe, MILES_FP8_WGRAD): bf16 is the reference; fp32 shows how far a run moves
# when only the rounding changes (the noise floor of this comparison)
LOSS_RUNS = (("bf16", "bf16", None), ("fp32", "fp32", None), ("fp8 tiles", "fp8", "tiles"), ("fp8 blocks", "fp8", "blocks"),
             ("fp8 dy_blocks", "fp8", "dy_blocks"))


def bench_loss(quick: bool, seeds: int = 8, workers: int = 8):
    """Every run of :data:`LOSS_RUNS` for seeds 0..seeds-1, in ``workers`` processes at once (the runs are
    small and host-bound). One seed's 200-step loss moves by a few percent with the rounding alone, so
    the figure is the mean over seeds, each recipe paired with bf16 on the same seed."""
    import concurrent.futures
    import multiprocessing
    import statistics

    steps = 10 if SMOKE["on"] else 50 if quick else 200
    seeds = 2 if SMOKE["on"] else seeds
    jobs = [(label, recipe, wgrad, seed) for label, recipe, wgrad in LOSS_RUNS for seed in range(seeds)]
    final = {}
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futs = {pool.submit(train_loss, recipe, steps, seed, wgrad, DEV): (label, seed) for label, recipe, wgrad, seed in jobs}
        for fut in concurrent.futures.as_completed(futs):
            label, seed = futs[fut]
            losses = fut.result()
            final[label, seed] = sum(losses[-10:]) / 10
    res = {"steps": steps, "seeds": seeds, "seconds": time.perf_counter() - t0, "runs": {}}
    ref = [final["bf16", s] for s in range(seeds)]
    rows = []
    for label, _, _ in LOSS_RUNS:
        vals = [final[label, s] for s in range(seeds)]
        paired = [(v - r) / r for v, r in zip(vals, ref)]
        mean = statistics.fmean(vals)
        rel = (mean - statistics.fmean(ref)) / statistics.fmean(ref)
        se = statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
        res["runs"][label] = {"final_losses": vals, "mean": mean, "rel_diff_of_means": rel, "paired_se": se}
        verdict = "" if label == "bf16" else " (< 1%)" if abs(rel) < 0.01 else " (NOT < 1%)"
        rows.append([label, f"{mean:.4f}", f"{statistics.stdev(vals) if seeds > 1 else 0:.4f}", f"{100 * rel:+.2f}%{verdict}",
                     f"{100 * se:.2f}%", f"{100 * min(paired):+.2f} .. {100 * max(paired):+.2f}%"])
    RESULTS["loss"] = res
    table(f"quickstart-size SFT loss after {steps} steps (addition, batch 64; mean of the last 10 steps), {seeds} seeds",
          ["recipe", "mean over seeds", "std over seeds", "vs bf16 (means)", "paired s.e.", "per-seed range vs bf16"], rows)


# ---------------------------------------------------------------------------------- 4. batch-invariant
def bench_bi(quick: bool):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from nvidia_helpers import tiny_pair

    from miles_core.rollout.base import SamplingParams
    from miles_core.train.batch import make_train_batch
    from miles_core.types import Prompt

    shape = dict(hidden_size=1024, num_layers=4 if quick else 28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072)
    texts = [f"{a}+{b}=" for a in range(10, 42) for b in (3, 17)]  # 64 prompts
    new_tokens = 64
    if SMOKE["on"]:
        shape = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
        texts, new_tokens = texts[:2], 3
    out = []
    for recipe in ("bf16_batch_invariant", "bf16", "fp32"):
        trainer, engine, tok = tiny_pair(recipe, DEV, DEV, **shape)
        prompts = [Prompt(t, prompt_ids=tok.encode(t)) for t in texts]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=1)
        engine.generate(prompts[:4], SamplingParams(max_new_tokens=4, temperature=1.0))  # warm-up / compile
        sync()
        t0 = time.perf_counter()
        samples = engine.generate(prompts, params, n=1)
        sync()
        t_gen = time.perf_counter() - t0
        batch = make_train_batch(samples, tok.pad_token_id)
        trainer.compute_logprobs(batch)
        sync()
        t0 = time.perf_counter()
        lp = trainer.compute_logprobs(batch)
        sync()
        t_lp = time.perf_counter() - t0
        mask = batch.response_mask
        diff = (lp - batch.rollout_logprobs) * mask
        n_tok = float(mask.sum())
        out.append({"recipe": recipe, "layers": shape["num_layers"], "tokens": n_tok, "generate_s": t_gen, "gen_tok_s": n_tok / t_gen,
                    "trainer_logprobs_s": t_lp, "bitwise_equal": bool(torch.equal(lp * mask, batch.rollout_logprobs * mask)),
                    "max_abs_diff": float(diff.abs().max()), "kl_k1": float(diff.sum() / n_tok)})
        del trainer, engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    RESULTS["batch_invariant"] = out
    table(f"rollout vs trainer logprobs, Qwen3-0.6B-shaped, {shape['num_layers']} layers, {len(texts)} prompts x {new_tokens} new tokens (temperature 1)",
          ["recipe", "bitwise equal", "max |diff|", "KL (k1)", "engine tok/s", "engine s", "trainer logprobs s"],
          [[r["recipe"], r["bitwise_equal"], f"{r['max_abs_diff']:.3e}", f"{r['kl_k1']:.3e}", f"{r['gen_tok_s']:.0f}", f"{r['generate_s']:.2f}",
            f"{r['trainer_logprobs_s']:.3f}"] for r in out])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="logprobs,fp8,loss,bi")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under the Triton interpreter (checks the script)")
    ap.add_argument("--seeds", type=int, default=8, help="loss: seeds per recipe")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        SMOKE["on"], DEV = True, "cpu"
    RESULTS["device"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loss = lambda quick: bench_loss(quick, args.seeds)  # noqa: E731
    for name, fn in (("logprobs", bench_logprobs), ("fp8", bench_fp8), ("parts", bench_parts), ("loss", loss), ("bi", bench_bi)):
        if name in args.only.split(","):
            t0 = time.perf_counter()
            try:
                fn(args.quick)
            except Exception:
                traceback.print_exc()
                RESULTS[f"{name}_error"] = traceback.format_exc()[-2000:]
            print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_nvidia.json").write_text(json.dumps(RESULTS, indent=2))


if __name__ == "__main__":
    main()
