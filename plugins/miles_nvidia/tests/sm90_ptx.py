"""Compile the FP8 quantisers for sm90 ahead of time and report PTX facts as JSON (run by
test_nv_fp8.py in a subprocess without TRITON_INTERPRET; exit code 3 = no NVIDIA toolchain)."""

import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from miles_nvidia.fp8 import quant_triton as qt

TYPES = {"x": "*bf16", "w": "*bf16", "q": "*fp8e4nv", "qt": "*i8", "s": "*fp32", "st": "*fp32"}
CASES = {  # the launch configurations of quant_triton.py
    "rows": (qt._act_rows_kernel, "x_ptr q_ptr s_ptr M K s_xm s_qm s_sk", dict(BLOCK_M=32, TILE=128, QMAX=448.0, EMULATE_RNE=False), 4),
    "cols": (qt._act_cols_kernel, "x_ptr qt_ptr st_ptr M K s_xm s_qtk s_stm s_stk",
             dict(BLOCK_K=32, TILE=128, QMAX=448.0, EMULATE_RNE=False, GIVEN_SCALES=False), 4),
    "cols_blocks": (qt._act_cols_kernel, "x_ptr qt_ptr st_ptr M K s_xm s_qtk s_stm s_stk",
                    dict(BLOCK_K=32, TILE=128, QMAX=448.0, EMULATE_RNE=False, GIVEN_SCALES=True), 4),
    "weight": (qt._weight_kernel, "w_ptr q_ptr qt_ptr s_ptr N K s_wn s_qn s_qtk s_sn", dict(TILE=128, QMAX=448.0, TRANSPOSED=False, EMULATE_RNE=False), 8),
    "weight_t": (qt._weight_kernel, "w_ptr q_ptr qt_ptr s_ptr N K s_wn s_qn s_qtk s_sn", dict(TILE=128, QMAX=448.0, TRANSPOSED=True, EMULATE_RNE=False), 8),
}
DEFAULT_PATH = ("rows", "cols", "cols_blocks", "weight")  # what quant_triton runs by default (not the fused q(W).T)
# an f8 tensor moved between layouts (tl.trans, or a convert_layout through shared memory): the
# lowering that corrupted the e4m3 tiles on the H200 (issue #7)
F8_MOVE = re.compile(r"(tt\.trans|ttg\.convert_layout|ttg\.local_alloc)\b[^\n]*: tensor<[0-9x]+xf8E")
# the same moves of int8 tiles: how the fused kernels transpose e4m3 bytes instead
I8_MOVE = re.compile(r"(tt\.trans|ttg\.convert_layout|ttg\.local_alloc)\b[^\n]*: tensor<[0-9x]+xi8")


def main() -> int:
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
    if not ptxas:
        print("no ptxas in this Triton build")
        return 3
    report = {}
    for name, (fn, names, consts, warps) in CASES.items():
        sig = {n: (TYPES[n[:-4]] if n.endswith("_ptr") else "i32") for n in names.split()}
        sig.update({c: "constexpr" for c in consts})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = k.asm["ptx"]
        ttgir = "\n".join(line.split(" loc(")[0] for line in k.asm["ttgir"].splitlines())
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            info = subprocess.run([ptxas[0], "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", info)]
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", info)]
        report[name] = {"div_rn": "div.rn.f32" in ptx, "div_approx": "div.full" in ptx or "div.approx" in ptx,
                        "cvt_rne_e4m3": "cvt.rn.satfinite.e4m3x2.f32" in ptx, "spill_bytes": sum(spills), "registers": max(regs, default=-1),
                        "f8_layout_moves": len(F8_MOVE.findall(ttgir)), "i8_layout_moves": len(I8_MOVE.findall(ttgir)),
                        "default_path": name in DEFAULT_PATH}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
