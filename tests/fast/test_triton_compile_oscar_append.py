"""The fused OSCAR append kernel (``kvq.fast.triton.oscar_append._append_kernel``) compiles for sm_90 (H100)
without a GPU, in its GPU configuration (a program per (batch, head) token tile, the rotation loop, the
bisection quantile, no FMA contraction): type / layout errors and register spills show before a GPU run.

All variants compile in ONE subprocess without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit``
returns an interpreted function that cannot be compiled).

    pytest tests/fast/test_triton_compile_oscar_append.py
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
    from kvq.fast.triton.oscar_append import _append_kernel as fn
    out = {}
    for name, v in json.loads(sys.argv[1]).items():
        sig = {a: "constexpr" if a in v["cx"] else v["types"].get(a, "i32") for a in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, constexprs=v["cx"]), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        out[name] = {"local": ptx.count("ld.local") + ptx.count("st.local"), "mul": ptx.count("mul.rn.f32"),
                     "add": ptx.count("add.rn.f32"), "bar": ptx.count("bar.sync")}
    print(json.dumps(out))
''')

BASE = dict(QMAX=3.0, BITS=2, PER=4, FASTDIV=True, PER_ROW_R=False, RANK=False, CUMSUM=False)
# name -> (x type, meta type, constexprs over BASE); BLOCK_R as oscar_append._tiling picks on the GPU
# (min(next_pow2(n), 4096 // D)): 1 for a decode step, the cap for a prefill
VARIANTS = {
    "D128-G128-decode": ("*fp16", "*fp16", dict(D=128, G=128, BLOCK_R=1)),
    "D128-G32-prefill-fp32-in-meta32": ("*fp32", "*fp32", dict(D=128, G=32, BLOCK_R=32)),
    "D256-G128-4bit": ("*fp16", "*fp16", dict(D=256, G=128, BLOCK_R=16, QMAX=15.0, BITS=4, PER=2)),
}


@pytest.mark.slow
def test_append_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    arg = {}
    for name, (xt, mt, cx) in VARIANTS.items():
        types = {"x_ptr": xt, "r_ptr": "*fp32", "sink_ptr": "*fp16", "win_ptr": "*fp16", "q_ptr": "*u8",
                 "s_ptr": mt, "m_ptr": mt, "tab_ptr": "*i32", "FRAC": "fp32"}
        types.update({a: "i64" for a in ("N_PAD", "BH", "R_SH", "sx_b", "sx_h", "sx_t", "sx_d", "T0", "first", "e")})
        arg[name] = {"types": types, "cx": {**BASE, **cx}}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(arg)], capture_output=True, text=True, env=env,
                         timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name, (_, _, cx) in VARIANTS.items():
        o = out[name]
        assert o["local"] == 0, f"{name}: register spills to local memory ({o})"
        # the rotation's products and sums stay separate IEEE ops (no FMA contraction): at least one
        # mul.rn / add.rn per (row, column) element of the loop body
        per_thread = max(1, cx["BLOCK_R"] * cx["D"] // 128)
        assert o["mul"] >= per_thread and o["add"] >= per_thread, f"{name}: {o}"
        assert o["bar"] > 0, f"{name}: no barrier before the window writes ({o})"
