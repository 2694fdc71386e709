"""The split-K GEMM (triton_gemm.py) on CPU under the Triton interpreter: the partials sum to x @ w.T
over ragged M, N and K (a K tail, an empty split, an M grid axis), the same bits on every call, and
the split chooser. The kernel case runs in a subprocess because the interpreter is chosen when
triton is imported."""

import os
import subprocess
import sys

import pytest

from miles_core.rollout.engine_core import triton_gemm as tg


def test_splitk_partials_sum_to_the_product_in_interpreter():
    code = r"""
import torch
from miles_core.rollout.engine_core import triton_gemm as tg
if not tg.available():
    print("SKIP"); raise SystemExit
torch.manual_seed(0)
#        M    N    K  split block_n block_k
cases = [(5,   64, 256, 1, 32, 64),    # M below the 16-row tile
         (5,   96, 300, 3, 32, 64),    # N not a multiple of block_n, K tail
         (64,  96, 300, 4, 32, 64),    # 5 K blocks in 4 splits of 2: the last split is empty
         (64,  64, 256, 4, 32, 128),   # 2 K blocks in 4 splits: two empty splits
         (100, 40, 200, 3, 32, 64),    # two M tiles (M axis), N and K tails
         (64,  64, 384, 3, 64, 128)]   # even splits: the unmasked path
for m, n, k, split, bn, bk in cases:
    x, w = torch.randn(m, k), torch.randn(n, k)
    p = tg.splitk_gemm(x, w, split, block_n=bn, block_k=bk)
    assert p.shape == (split, m, n) and p.dtype == torch.float32, (p.shape, p.dtype)
    err = (p.sum(0) - x @ w.T).abs().max().item()
    assert err < 1e-4, (m, n, k, split, err)
    assert (tg.reduce_splits(p) - x @ w.T).abs().max() < 1e-4
    kb = -(-k // bk)
    per = -(-kb // split)
    for s in range(split):  # splits that start past K are written, as zeros
        if s * per >= kb:
            assert p[s].abs().max() == 0, (m, n, k, split, s)
    assert torch.equal(p, tg.splitk_gemm(x, w, split, block_n=bn, block_k=bk)), (m, n, k, split)  # deterministic
# x with a row stride past K (a slice of a wider activation)
big, w = torch.randn(7, 320), torch.randn(96, 300)
x = big[:, :300]
p = tg.splitk_gemm(x, w, 3, block_n=32, block_k=64)
assert (p.sum(0) - x @ w.T).abs().max() < 1e-4
# 16-bit inputs: products are exact in fp32, so only the fp32 sums' rounding differs. fp16, not the
# GPU's bf16: the interpreter's tl.dot multiplies bf16's raw bits (stored as uint16) as integers
xh, wh = torch.randn(64, 300).half(), torch.randn(96, 300).half()
p = tg.splitk_gemm(xh, wh, 4, block_n=32, block_k=64)
assert p.dtype == torch.float32 and (p.sum(0) - xh.float() @ wh.float().T).abs().max() < 1e-4
# the gate/up GEMM with its SwiGLU epilogue: w [2I, K], gate rows first
import torch.nn.functional as F
for m, inter, k, bn, bk in [(5, 48, 300, 32, 64), (64, 64, 256, 32, 64), (100, 40, 128, 16, 128)]:
    x, w = torch.randn(m, k), torch.randn(2 * inter, k)
    gate, up = (x @ w.T).chunk(2, -1)
    out = tg.gated_gemm(x, w, block_n=bn, block_k=bk)
    assert out.shape == (m, inter) and out.dtype == torch.float32
    assert (out - F.silu(gate) * up).abs().max() < 1e-3 * (F.silu(gate) * up).abs().max(), (m, inter, k)
# fp16: rounded as torch rounds F.linear, then F.silu(gate) * up
xh, wh = torch.randn(64, 256).half(), (torch.randn(96, 256) * 0.1).half()
gate, up = (xh.float() @ wh.float().T).half().chunk(2, -1)
ref = F.silu(gate) * up
got = tg.gated_gemm(xh, wh, block_n=16, block_k=64)
assert got.dtype == torch.float16
bad = (got != ref).float().mean().item()
assert bad < 0.02 and (got.float() - ref.float()).abs().max() < 1e-2, bad  # the GEMM sums round differently, rarely
# gemm(): one split, the output in x's dtype (the q/k/v GEMM of the PDL chain)
out = tg.gemm(xh, wh, block_n=32, block_k=64)
ref = (xh.float() @ wh.float().T).half()
assert out.shape == (64, 96) and out.dtype == torch.float16
assert (out != ref).float().mean().item() < 0.02 and (out.float() - ref.float()).abs().max() < 1e-2
x, w = torch.randn(5, 300), torch.randn(40, 300)
assert (tg.gemm(x, w) - x @ w.T).abs().max() < 1e-4
print("OK")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    if "SKIP" in res.stdout:
        pytest.skip("triton is not installed")
    assert "OK" in res.stdout, res.stdout[-2000:]


def test_choose_split():
    # o_proj on an H200: 32 N tiles, 5 splits needed, 16 K blocks -> 8 (the least divisor in [5, 10])
    assert tg.choose_split(1024, 2048, 132) == 8
    # down_proj: 24 K blocks -> 6
    assert tg.choose_split(1024, 3072, 132) == 6
    # 128 N tiles, 4 short of 132 SMs -> 2; 256 tiles fill the GPU -> 1
    assert tg.choose_split(4096, 1024, 132) == 2
    assert tg.choose_split(8192, 1024, 132) == 1
    # no divisor of 17 K blocks in [5, 10]: 5 splits of 4, 4, 4, 4, 1 blocks (none empty)
    assert tg.choose_split(1024, 17 * 128, 132) == 5
    # 16 K blocks in [9, 18] -> 16; too few K blocks to fill the GPU -> one block a split
    assert tg.choose_split(512, 2048, 132) == 16
    assert tg.choose_split(1024, 256, 132) == 2
    # wider blocks: 16 N tiles of 64 need 9 splits; 32 K blocks of 64 -> 16
    assert tg.choose_split(1024, 2048, 132, block_n=64, block_k=64) == 16
    for n, k, sms, bn, bk in [(1024, 2048, 132, 32, 128), (1024, 3000, 132, 64, 64), (96, 300, 8, 32, 64)]:
        s = tg.choose_split(n, k, sms, bn, bk)
        kb = -(-k // bk)
        assert 1 <= s <= kb and -(-n // bn) * s >= min(sms, -(-n // bn) * kb)
        assert -(-kb // -(-kb // s)) == s  # no empty split
