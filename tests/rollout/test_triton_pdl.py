"""The PDL chain's kernels compiled for sm90 ahead of time (no GPU needed): with ``PDL`` the GEMM
issues its L2 weight prefetches, then ``griddepcontrol.wait``, then ``launch_dependents``, and only
then its first global load or store; without it none of these instructions appear. Runs in a
subprocess without TRITON_INTERPRET (the interpreter is chosen when triton is imported)."""

import json
import os
import subprocess
import sys

import pytest

CODE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from miles_core.rollout.engine_core import triton_gemm as tg, triton_fused as tf
out = {}
for pdl in (False, True):
    consts = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, K_ITERS=8, EVEN_K=True, IEEE=False, PDL=pdl, PREFETCH=pdl, LINE=64, LINES=8)
    sig = dict(X="*bf16", W="*bf16", P="*fp32", M="i32", N="i32", K="i32", s_xm="i32", s_wn="i32", s_ps="i32", s_pm="i32")
    sig.update({c: "constexpr" for c in consts})
    k = triton.compile(ASTSource(fn=tg._splitk_kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 4, "launch_pdl": pdl})
    lines = k.asm["ptx"].splitlines()
    first = lambda pat: next((i for i, l in enumerate(lines) if re.search(pat, l)), -1)
    out[f"splitk {pdl}"] = {"prefetch": first(r"prefetch\.global\.L2"), "wait": first(r"griddepcontrol\.wait"),
                            "launch": first(r"griddepcontrol\.launch_dependents"), "load": first(r"ld\.global|cp\.async"),
                            "store": first(r"st\.global"), "launch_pdl": bool(k.metadata.launch_pdl)}
    consts = dict(SPLITS=2, BLOCK=1024, PDL=pdl)
    sig = dict(X="*bf16", R="*fp32", W="*bf16", XO="*bf16", HO="*bf16", n="i32", s_rs="i32", eps="fp32")
    sig.update({c: "constexpr" for c in consts})
    k = triton.compile(ASTSource(fn=tf._add_rmsnorm_kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "launch_pdl": pdl})
    lines = k.asm["ptx"].splitlines()
    out[f"add_rmsnorm {pdl}"] = {"wait": first(r"griddepcontrol\.wait"), "load": first(r"ld\.global")}
print(json.dumps(out))
"""


def test_pdl_kernels_order_their_prefetch_wait_and_loads_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and ("No module named 'triton'" in res.stderr or "GPUTarget" in res.stderr):
        pytest.skip("triton with the NVIDIA backend is not installed")
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    off, on = r["splitk False"], r["splitk True"]
    assert off["prefetch"] == off["wait"] == off["launch"] == -1 and not off["launch_pdl"]
    assert on["launch_pdl"] and 0 <= on["prefetch"] < on["wait"] < on["launch"] < on["load"] and on["wait"] < on["store"]
    assert r["add_rmsnorm False"]["wait"] == -1 and 0 <= r["add_rmsnorm True"]["wait"] < r["add_rmsnorm True"]["load"]
