"""The OSCAR kernels compile for sm_90 (H100) without a GPU: the quantizer kernels (fused token
quantizer, quantile / percentile clip) with ``tl.sort`` (the GPU path) and no FMA contraction, and the
fused decode's page kernel (``oscar_decode._pages_kernel``) with tensor-core mma on its fp16 path:
type / layout errors and register spills show before a GPU run.

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
    import importlib, json, sys
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    v = json.loads(sys.argv[1])
    mod, name = v["kernel"].rsplit(".", 1)
    fn = getattr(importlib.import_module(mod), name)
    sig = {a: "constexpr" if a in v["cx"] else v["types"].get(a, "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=v["cx"]), target=GPUTarget("cuda", 90, 32),
                       options=v["options"])
    ptx = k.asm["ptx"]
    print(json.dumps({"local": ptx.count("ld.local") + ptx.count("st.local"), "fma": ptx.count("fma.rn.f32"),
                      "mma": ptx.count("mma.sync")}))
''')


def _compile(kernel: str, types: dict, cx: dict, options: dict) -> dict:
    """Compile ``kernel`` (module.name) for sm_90 in a subprocess without TRITON_INTERPRET: arguments of
    ``types`` (others i32, constexprs ``cx``); returns the PTX counts (local memory, fp32 FMA, mma)."""
    pytest.importorskip("triton")
    arg = json.dumps({"kernel": kernel, "types": types, "cx": cx, "options": options})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


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
    kernel, xt, mt, warps, cx = VARIANTS[name]
    types = {"x_ptr": xt, "q_ptr": "*u8", "s_ptr": mt, "m_ptr": mt, "t_ptr": "*fp32", "o_ptr": "*fp32",
             "FRAC": "fp32"}
    fn = {"tokens": "kvq.fast.triton.oscar_quant._quantize_tokens_kernel",
          "rows": "kvq.fast.triton.quant._quantile_rows_kernel"}[kernel]
    out = _compile(fn, types, cx, {"num_warps": warps, "enable_fp_fusion": False})
    assert out["local"] == 0, f"{name}: register spills to local memory ({out})"
    if kernel == "rows":
        assert out["fma"] == 0, f"{name}: FMA contraction in the quantile interpolation ({out})"


DECODE = dict(G_Q=4, D=128, G=128, PG=128, BITS=2, BT=64, BLOCK_M=16, PRECISE=False, TIGHT=True, NBLK=0,
              K_TERMS=3, V_TERMS=1, SHIFT=2048.0)
# name -> (meta type, warps, constexprs over DECODE): the tensor-core path (fp16 / bf16 q) for the paper's
# G = 128 and the G = 64 / 32 ablations, 4-bit codes, D = 256, fp32 metadata, the other k / v terms; the
# precise path (fp32 q, or G < 16) with IEEE fp32 dots
DECODE_VARIANTS = {
    "G128-2bit": ("*fp16", 4, {}),
    "G64-2bit-gqa8": ("*fp16", 4, dict(G=64, G_Q=8)),
    "G32-2bit-page16": ("*fp16", 4, dict(G=32, PG=16)),
    "G128-4bit-meta32": ("*fp32", 4, dict(BITS=4)),
    "D256-G64-8bit": ("*fp16", 8, dict(D=256, G=64, BITS=8, BT=32)),
    "G128-2bit-k2-v2": ("*fp16", 4, dict(K_TERMS=2, V_TERMS=2)),
    "G64-precise": ("*fp16", 4, dict(G=64, PRECISE=True, BT=32)),
    "G16-precise-D64": ("*fp32", 4, dict(D=64, G=16, PRECISE=True, BT=32)),
    "D256-G8-precise-gqa8": ("*fp16", 4, dict(D=256, G=8, G_Q=8, PRECISE=True, BT=32)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DECODE_VARIANTS))
def test_oscar_decode_kernel_compiles_for_sm90(name):
    """The fused OSCAR page kernel: compiles, no register spills, and the tensor-core path really issues
    mma instructions."""
    mt, warps, cx = DECODE_VARIANTS[name]
    types = {"q_ptr": "*fp32", "kc_ptr": "*u8", "vc_ptr": "*u8", "tab_ptr": "*i32", "o_ptr": "*fp32",
             "m_ptr": "*fp32", "l_ptr": "*fp32", "ks_ptr": mt, "km_ptr": mt, "vs_ptr": mt, "vm_ptr": mt,
             "qk_scale": "fp32"}
    out = _compile("kvq.fast.triton.oscar_decode._pages_kernel", types, {**DECODE, **cx},
                   {"num_warps": warps, "num_stages": 2})
    assert out["local"] == 0, f"{name}: register spills to local memory ({out})"
    if not cx.get("PRECISE"):
        assert out["mma"] > 0, f"{name}: no tensor-core mma in the PTX ({out})"
