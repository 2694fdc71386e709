"""The fused decode-layer kernels (triton_fused.py) on CPU under the Triton interpreter: each
kernel against the op chain it replaces, and the engine's greedy output with the fused layer path
forced on (on a GPU it is on by default) against the unfused path. Each case runs in a subprocess
because the interpreter is chosen when triton is imported."""

import os
import subprocess
import sys

import pytest

PRELUDE = r"""
import torch
from miles_core.rollout.engine_core import triton_fused as tf
if not tf.available():
    print("SKIP"); raise SystemExit
torch.manual_seed(0)
"""


def interpret(code: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", PRELUDE + code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    if "SKIP" in res.stdout:
        pytest.skip("triton is not installed")
    assert "OK" in res.stdout, res.stdout[-2000:]


def test_qkv_prologue_matches_norm_rope_and_cache_write():
    interpret(r"""
from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_core.kernels.rope import rope_torch
from miles_core.models.decoder import Decoder, DecoderConfig
n, H, HK, D = 5, 4, 2, 16
m = Decoder(DecoderConfig(vocab_size=8, hidden_size=64, num_heads=H, num_kv_heads=HK, head_dim=D))
pos = torch.tensor([0, 3, 7, 100, 1])
def close(got, ref, dtype):
    # the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest) at each of the norm's two and
    # the rotary's one rounding, and the rotary mixes two elements: bf16 is allowed 8 ulps of the
    # head's largest value here, which still catches any layout error (fp32 is the tight check; the
    # GPU tests cover bf16)
    tol = 2e-6 if dtype == torch.float32 else 2 ** -5 * ref.float().abs().amax(-1, keepdim=True)
    return bool(((got.float() - ref.float()).abs() <= tol).all())
for dtype in (torch.float32, torch.bfloat16):
    for norm in (True, False):
        qkv = torch.randn(n, (H + 2 * HK) * D).to(dtype)
        qw, kw = (1 + 0.1 * torch.randn(D)).to(dtype), (1 + 0.1 * torch.randn(D)).to(dtype)
        cos, sin = m._rope(pos, dtype)  # [n, 1, D]
        table_cos, table_sin = (t[:, 0].contiguous() for t in m._rope(torch.arange(128), dtype))  # rows read by position
        kc, vc = torch.zeros(32, HK, D, dtype=dtype), torch.zeros(32, HK, D, dtype=dtype)
        slots = torch.tensor([9, 0, 31, 4, 17])
        args = (qkv, H, HK, D, qw if norm else None, kw if norm else None, 1e-6, pos, table_cos, table_sin)
        q = tf.qkv_prologue(*args, kc, vc, slots=slots)
        # decode: the slots found in the block tables (page 4: position 100 is past the 8-page table -> its last page)
        tables = torch.randperm(n * 8).view(n, 8).to(torch.int32)  # distinct pages: distinct slots
        found = tables[torch.arange(n), (pos // 4).clamp(max=7)].long() * 4 + pos % 4
        kc2, vc2 = torch.zeros(n * 32, HK, D, dtype=dtype), torch.zeros(n * 32, HK, D, dtype=dtype)
        q2 = tf.qkv_prologue(*args, kc2, vc2, block_tables=tables, page=4)
        assert torch.equal(q2, q) and torch.equal(kc2[found], kc[slots]) and torch.equal(vc2[found], vc[slots])
        rq, rk, rv = qkv.view(n, H + 2 * HK, D).split([H, HK, HK], 1)
        if norm:
            rq, rk = rmsnorm_torch(rq, qw), rmsnorm_torch(rk, kw)
        # rotary in fp32, rounded once (as miles_nvidia's rope kernel): [n, heads, 1, D] by [n, 1, 1, D]
        c, s = cos[:, :, None].float(), sin[:, :, None].float()
        rq, rk = (rope_torch(y[:, :, None].float(), c, s)[:, :, 0].to(dtype) for y in (rq, rk))
        assert q.shape == (n, H, D) and q.dtype == dtype
        assert close(q, rq, dtype), (dtype, norm, (q.float() - rq.float()).abs().max())
        assert close(kc[slots], rk, dtype)
        assert torch.equal(vc[slots], rv)
        untouched = torch.ones(32, dtype=torch.bool)
        untouched[slots] = False
        assert kc[untouched].abs().max() == 0 and vc[untouched].abs().max() == 0
print("OK")
""")


def test_decode_attention_with_the_prologue_inside_matches_the_two_kernels():
    """triton_decode.paged_decode_qkv (prologue + paged attention in one kernel) against qkv_prologue
    then paged_decode: same attention output, same cache contents, with and without qk-norm, one and
    three splits (the new token's split writes its K/V), a padding row (ctx 0: writes nothing)."""
    interpret(r"""
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.engine_core import triton_decode as td
B, H, HK, D, PAGE = 4, 4, 2, 16, 4
m = Decoder(DecoderConfig(vocab_size=8, hidden_size=64, num_heads=H, num_kv_heads=HK, head_dim=D))
cos, sin = (t[:, 0].contiguous() for t in m._rope(torch.arange(64), torch.float32))
ctx = torch.tensor([5, 29, 0, 1], dtype=torch.int32)
pos = (ctx.long() - 1).clamp(min=0)
tables = torch.randperm(B * 8).view(B, 8).to(torch.int32) + 1  # distinct pages, page 0 left to padding
tables[2] = 0  # the padding row's table, as the engine sets it
qkv = torch.randn(B, (H + 2 * HK) * D)
qw, kw = 1 + 0.1 * torch.randn(D), 1 + 0.1 * torch.randn(D)
kc0, vc0 = torch.randn(40 * PAGE, HK, D), torch.randn(40 * PAGE, HK, D)
for norm in (True, False):
    for splits in (1, 3):
        w = (qw, kw) if norm else (None, None)
        kc, vc = kc0.clone(), vc0.clone()
        q = tf.qkv_prologue(qkv, H, HK, D, *w, 1e-6, pos, cos, sin, kc, vc, block_tables=tables[:, :], page=PAGE)
        kc[:PAGE], vc[:PAGE] = kc0[:PAGE], vc0[:PAGE]  # the padding row's write into page 0 is not part of the contract
        ref = td.paged_decode(q, kc, vc, tables, ctx, PAGE, splits, block_n=8)
        kc2, vc2 = kc0.clone(), vc0.clone()
        got = td.paged_decode_qkv(qkv, H, *w, 1e-6, pos, cos, sin, kc2, vc2, tables, ctx, PAGE, splits, block_n=8)
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc), (norm, splits)
        assert (got - ref).abs().max() < 1e-5, (norm, splits, (got - ref).abs().max())
        assert got[2].abs().max() == 0
print("OK")
""")


def test_add_rmsnorm_matches_add_then_norm():
    interpret(r"""
from miles_core.kernels.rmsnorm import rmsnorm_torch
for dtype in (torch.float32, torch.bfloat16):
    for hidden in (64, 96):  # 96: a row shorter than the kernel's power-of-two block
        x, r = torch.randn(7, hidden).to(dtype), torch.randn(7, hidden).to(dtype)
        w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
        s, h = tf.add_rmsnorm(x, r, w, 1e-5)
        ref_s, ref = x + r, rmsnorm_torch(x + r, w, 1e-5)
        # the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), three times here: bf16 is
        # allowed 8 ulps of the row's largest value (fp32 is the tight check; the GPU tests cover bf16)
        tol = (lambda t: 2e-6 * (1 + t.abs())) if dtype == torch.float32 else (lambda t: 2 ** -5 * t.abs().amax(-1, keepdim=True))
        assert ((s.float() - ref_s.float()).abs() <= tol(ref_s.float())).all(), dtype
        assert ((h.float() - ref.float()).abs() <= tol(ref.float())).all(), (dtype, hidden, (h.float() - ref.float()).abs().max())
        if dtype == torch.float32:
            assert torch.equal(s, ref_s)  # the residual stream: one fp32 add, as torch's
        # split-K partials [3, rows, hidden] fp32: x + (p0 + p1 + p2), rounded once
        parts = torch.randn(3, 7, hidden)
        s3, h3 = tf.add_rmsnorm(x, parts, w, 1e-5)
        ref_s3 = (x.float() + (parts[0] + parts[1] + parts[2])).to(dtype)
        assert ((s3.float() - ref_s3.float()).abs() <= tol(ref_s3.float())).all(), dtype
        ref3 = rmsnorm_torch(ref_s3, w, 1e-5)
        assert ((h3.float() - ref3.float()).abs() <= tol(ref3.float())).all(), dtype
print("OK")
""")


def test_engine_fused_layer_path_matches_unfused():
    """A Qwen3-shaped (qk-norm) and a Llama-shaped tiny model, fp32: greedy tokens equal, logprobs
    within 1e-4, with and without the split-K GEMM and the gated gate/up GEMM, and the fused kernels
    did run (two add_rmsnorm per layer and step; the gated GEMM once per layer and decode step)."""
    interpret(r"""
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core import runner as runner_mod
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core import triton_gemm as tg
calls = {"prologue": 0, "add_norm": 0, "gated": 0}
prologue, add_norm, gated = tf.qkv_prologue, tf.add_rmsnorm, tg.gated_gemm
def count(name, fn):
    def wrapped(*a, **k):
        calls[name] += 1
        return fn(*a, **k)
    return wrapped
tf.qkv_prologue, tf.add_rmsnorm = count("prologue", prologue), count("add_norm", add_norm)
tg.gated_gemm = count("gated", gated)

from miles_core.rollout.engine_core import triton_decode as td
calls["attn_qkv"] = 0
td.paged_decode_qkv = count("attn_qkv", td.paged_decode_qkv)

def run(m, fused, splitk=False, gated=False, triton_decode=False, fused_attention=True):
    core = EngineCore(m, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, decode_steps=2, cpu_decode_window=False,
                                      fused_attention=fused_attention))
    assert core.runner.fusable() and not core.runner.fused_kernels  # on by default only on a GPU with Triton
    core.runner.fused_kernels, core.runner.splitk, core.runner.gated = fused, splitk, gated
    core.runner.use_triton = triton_decode  # the GPU decode path (paged Triton attention), here in the interpreter
    core.runner.fuse()  # the weights in the layout the Triton kernels read ([out, in]; on CPU they are kept transposed)
    prompts = [[3, 5, 7, 9, 11], [2, 4], [13] * 9]
    reqs = [core.add_request(p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))[0] for p in prompts]
    while core.has_unfinished():
        core.step()
    return reqs

for qk_norm in (True, False):
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, qk_norm=qk_norm))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ref = run(m, False)
    assert calls == {"prologue": 0, "add_norm": 0, "gated": 0, "attn_qkv": 0}
    # o_proj / down_proj as split-K partials summed by add_rmsnorm; gate/up + SwiGLU in one kernel
    for splitk, gated in ((False, False), (True, False), (True, True)):
        got = run(m, True, splitk, gated)
        assert calls["add_norm"] == 2 * calls["prologue"] > 0, calls
        # every layer call of <= 64 rows takes the gated kernel: here all of them, prefills included
        assert calls["gated"] == (calls["prologue"] if gated else 0), calls
        calls.update(prologue=0, add_norm=0, gated=0)
        for a, b in zip(got, ref):
            assert a.output_ids == b.output_ids, (qk_norm, splitk, gated, a.output_ids, b.output_ids)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # the GPU's decode path: Triton paged attention, with the prologue inside it (fused_attention) or not
    for fused_attention in (True, False):
        got = run(m, True, True, True, triton_decode=True, fused_attention=fused_attention)
        decode_layers = calls["add_norm"] // 2 - calls["prologue"]  # layer calls that ran no prologue kernel
        assert calls["attn_qkv"] == (decode_layers if fused_attention else 0) and (decode_layers > 0) == fused_attention, calls
        calls.update(prologue=0, add_norm=0, gated=0, attn_qkv=0)
        for a, b in zip(got, ref):
            assert a.output_ids == b.output_ids, (qk_norm, fused_attention, a.output_ids, b.output_ids)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
print("OK")
""")

