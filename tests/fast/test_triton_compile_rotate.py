"""The fixed-order rotation kernel (``kvq.fast.triton.rotate``) compiles for sm_90 (H100) without a GPU:
no register spills, and no FMA contraction (bit-exactness with ``kvq.reference.rotations.rotate``
needs every multiply and add rounded separately: ``enable_fp_fusion=False``).

Runs in a subprocess without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` returns an
interpreted function that cannot be compiled).

    pytest tests/fast/test_triton_compile_rotate.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, sys
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from kvq.fast.triton import rotate
    v = json.loads(sys.argv[1])
    fn = rotate._rotate_kernel
    sig = {}
    for a in fn.arg_names:
        if a in v["cx"]:
            sig[a] = "constexpr"
        elif a == "x_ptr":
            sig[a] = v["xt"]
        elif a in ("r_ptr", "o_ptr"):
            sig[a] = "*fp32"
        else:
            sig[a] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=v["cx"]), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    print(json.dumps({"local": ptx.count("ld.local") + ptx.count("st.local"), "fma": ptx.count("fma.rn.f32"),
                      "mul": ptx.count("mul.rn.f32"), "add": ptx.count("add.rn.f32")}))
''')

# name -> (x type, constexprs); BLOCK_T as rotate._block_t picks on the GPU (8192 // D, at most 64)
VARIANTS = {
    "D128-fp16": ("*fp16", dict(D=128, BLOCK_T=64, BLOCK_D=128)),
    "D128-fp32": ("*fp32", dict(D=128, BLOCK_T=64, BLOCK_D=128)),
    "D64-fp16": ("*fp16", dict(D=64, BLOCK_T=64, BLOCK_D=64)),
    "D256-fp32": ("*fp32", dict(D=256, BLOCK_T=32, BLOCK_D=256)),
    "D96-fp16": ("*fp16", dict(D=96, BLOCK_T=64, BLOCK_D=128)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_rotate_kernel_compiles_for_sm90(name):
    pytest.importorskip("triton")
    xt, cx = VARIANTS[name]
    arg = json.dumps({"xt": xt, "cx": cx})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["local"] == 0, f"{name}: register spills to local memory ({out})"
    assert out["fma"] == 0, f"{name}: FMA contraction in the rotation (must be mul then add) ({out})"
    assert out["mul"] > 0 and out["add"] > 0, f"{name}: expected rounded fp32 mul / add in the PTX ({out})"
