"""The HIGGS / FWHT kernels (``kvq.fast.triton.higgs``, ``kvq.fast.triton.hadamard``) compile for sm_90
(H100) without a GPU: no register spills, and no FMA contraction (bit-exactness with
``kvq.reference.higgs`` needs every multiply and add rounded separately: ``enable_fp_fusion=False``;
the nearest-point distances ``dist + t * t`` would otherwise contract).

Runs in a subprocess without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` returns an
interpreted function that cannot be compiled).

    pytest tests/fast/test_triton_compile_higgs.py
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
    from kvq.fast.triton import hadamard, higgs
    v = json.loads(sys.argv[1])
    fn = getattr({"hadamard": hadamard, "higgs": higgs}[v["mod"]], v["kernel"])
    sig = {}
    for a in fn.arg_names:
        if a in v["cx"]:
            sig[a] = "constexpr"
        elif a in v["types"]:
            sig[a] = v["types"][a]
        elif a.endswith("_ptr"):
            sig[a] = "*fp32"
        elif a == "FS":
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=v["cx"]), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": v["warps"], "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    print(json.dumps({"local": ptx.count("ld.local") + ptx.count("st.local"), "fma": ptx.count("fma.rn.f32"),
                      "mul": ptx.count("mul.rn.f32"), "add": ptx.count("add.rn.f32")
                      + ptx.count("sub.rn.f32")}))
''')


def _q(G, D, N, bits=8, xt="*fp16", meta="*fp16"):
    return ("higgs", "_quantize_kernel", {"x_ptr": xt, "s_ptr": meta, "i_ptr": {8: "*u8", 16: "*i16"}[bits]},
            dict(N=N, G=G, LOG2G=G.bit_length() - 1, D=D, BLOCK_D=D, IDX_BITS=bits, IN_BF16=False,
                 BLOCK_R=max(1, 1024 // G)), min(8, max(1, 1024 // 256)))


def _dq(G, D, bits=8, out=0):
    return ("higgs", "_dequantize_kernel", {"i_ptr": {8: "*u8", 16: "*i16"}[bits], "s_ptr": "*fp16",
                                            "o_ptr": {0: "*fp16", 2: "*fp32"}[out]},
            dict(G=G, LOG2G=G.bit_length() - 1, D=D, IDX_BITS=bits, OUT_KIND=out, BLOCK_R=max(1, 1024 // G)), 4)


# name -> (module, kernel, arg types, constexprs, warps), as the launchers pick them on the GPU
VARIANTS = {
    "fwht-1024-fp16": ("hadamard", "_fwht_rows_kernel", {"x_ptr": "*fp16"},
                       dict(N=1024, LOG2N=10, SCALE=True, IN_BF16=False, BLOCK_R=2), 4),
    "fwht-4096-fp32": ("hadamard", "_fwht_rows_kernel", {},
                       dict(N=4096, LOG2N=12, SCALE=False, IN_BF16=False, BLOCK_R=1), 8),
    "fwht-128-fp32": ("hadamard", "_fwht_rows_kernel", {},
                      dict(N=128, LOG2N=7, SCALE=True, IN_BF16=False, BLOCK_R=16), 4),
    "fwht-stage": ("hadamard", "_fwht_stage_kernel", {}, dict(SCALE=True, BLOCK=1024), 4),
    "quant-g1024-d2-n16": _q(1024, 2, 16),
    "quant-g1024-d2-n256": _q(1024, 2, 256),
    "quant-g1024-d4-n256": _q(1024, 4, 256, xt="*fp32", meta="*fp32"),
    "quant-g128-d2-n64": _q(128, 2, 64),
    "quant-g1024-d2-n300": _q(1024, 2, 300, bits=16),
    "dequant-g1024-d2": _dq(1024, 2),
    "dequant-g1024-d4-fp32": _dq(1024, 4, out=2),
    "dequant-g128-d2-u16": _dq(128, 2, bits=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_higgs_kernel_compiles_for_sm90(name):
    pytest.importorskip("triton")
    mod, kernel, types, cx, warps = VARIANTS[name]
    arg = json.dumps({"mod": mod, "kernel": kernel, "types": types, "cx": cx, "warps": warps})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["local"] == 0, f"{name}: register spills to local memory ({out})"
    assert out["fma"] == 0, f"{name}: FMA contraction (must be mul then add) ({out})"
    assert out["add"] > 0, f"{name}: expected rounded fp32 add / sub in the PTX ({out})"
