"""The OSCAR quantizer kernels (fused token quantizer, quantile / percentile clip) compile for sm_90
(H100) without a GPU, with ``tl.sort`` (the GPU path) and no FMA contraction: type / layout errors and
register spills show before a GPU run.

Runs in a subprocess without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` returns an
interpreted function that cannot be compiled).

    pytest tests/fast/test_triton_compile_oscar.py
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
    from kvq.fast.triton import oscar_quant, quant
    v = json.loads(sys.argv[1])
    fn = {"tokens": oscar_quant._quantize_tokens_kernel, "rows": quant._quantile_rows_kernel}[v["kernel"]]
    sig = {}
    for a in fn.arg_names:
        if a in v["cx"]:
            sig[a] = "constexpr"
        elif a == "x_ptr":
            sig[a] = v["xt"]
        elif a == "q_ptr":
            sig[a] = "*u8"
        elif a in ("s_ptr", "m_ptr"):
            sig[a] = v["mt"]
        elif a in ("t_ptr", "o_ptr"):
            sig[a] = "*fp32"
        elif a == "FRAC":
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=v["cx"]), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": v["warps"], "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    print(json.dumps({"local": ptx.count("ld.local") + ptx.count("st.local"), "fma": ptx.count("fma.rn.f32")}))
''')

TOKENS = dict(QMAX=3.0, BITS=2, PER=4, IN_BF16=False, FASTDIV=True, RANK=False, BLOCK_J=8)
# name -> (kernel, x type, meta type, warps, constexprs); BLOCK_R = 1 as the launchers pick on the GPU
# (quant.sort_rows)
VARIANTS = {
    "tokens-D128-G128-fp16": ("tokens", "*fp16", "*fp16", 4, dict(TOKENS, D=128, G=128, BLOCK_R=1, BLOCK_NG=1,
                                                                   BLOCK_J=32)),
    "tokens-D128-G64-fp16": ("tokens", "*fp16", "*fp16", 4, dict(TOKENS, D=128, G=64, BLOCK_R=1, BLOCK_NG=2,
                                                                  BLOCK_J=16)),
    "tokens-D128-G32-bf16": ("tokens", "*i16", "*fp16", 4, dict(TOKENS, D=128, G=32, BLOCK_R=1, BLOCK_NG=4,
                                                                 IN_BF16=True)),
    "tokens-D256-G128-fp32-meta32": ("tokens", "*fp32", "*fp32", 4, dict(TOKENS, D=256, G=128, BLOCK_R=1,
                                                                          BLOCK_NG=2, BLOCK_J=32)),
    "tokens-D96-G32-4bit": ("tokens", "*fp16", "*fp16", 4, dict(TOKENS, D=96, G=32, BLOCK_R=1, BLOCK_NG=4,
                                                                 QMAX=15.0, BITS=4, PER=2, BLOCK_J=16)),
    "quantile-128": ("rows", "*fp16", None, 4, dict(ABS=False, CLIP=False, IN_BF16=False, BLOCK_R=1,
                                                    BLOCK_S=128, RANK=False)),
    "percentile-clip-128": ("rows", "*fp32", None, 4, dict(ABS=True, CLIP=True, IN_BF16=False, BLOCK_R=1,
                                                           BLOCK_S=128, RANK=False)),
    "percentile-clip-4096": ("rows", "*fp32", None, 4, dict(ABS=True, CLIP=True, IN_BF16=False, BLOCK_R=1,
                                                            BLOCK_S=4096, RANK=False)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_oscar_kernels_compile_for_sm90(name):
    pytest.importorskip("triton")
    kernel, xt, mt, warps, cx = VARIANTS[name]
    arg = json.dumps({"kernel": kernel, "xt": xt, "mt": mt, "warps": warps, "cx": cx})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["local"] == 0, f"{name}: register spills to local memory ({out})"
    if kernel == "rows":
        assert out["fma"] == 0, f"{name}: FMA contraction in the quantile interpolation ({out})"
