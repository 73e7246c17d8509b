"""The fused KIVI / Kitty decode kernel compiles for sm_90 (H100) without a GPU: Triton's compiler and
its bundled ptxas run in CI, so type / layout errors and register spills show before a GPU run.

Runs in a subprocess without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` returns an
interpreted function that cannot be compiled).

    pytest tests/fast/test_triton_compile_kivi_kitty.py
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
    from kvq.fast.triton import paged
    v = json.loads(sys.argv[1])
    fn = getattr(paged, v.get("kernel", "_fused_kernel"))
    ptr = {"kc_ptr": "*u8", "kh_ptr": "*u8", "ki_ptr": "*u8", "ks_ptr": "*fp16", "km_ptr": "*fp16",
           "vc_ptr": "*u8", "vs_ptr": "*fp16", "vm_ptr": "*fp16", "kt_ptr": "*i32", "vt_ptr": "*i32",
           "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sk_ptr": "*fp16", "sv_ptr": "*fp16",
           "kb_ptr": "*fp16", "vb_ptr": "*fp16", "vw_ptr": "*fp16"}
    v["cx"] = {k: x for k, x in v["cx"].items() if k in fn.arg_names}
    sig = {}
    for a in fn.arg_names:
        if a == "q_ptr":
            sig[a] = v["qt"]
        elif a in ptr:
            sig[a] = ptr[a]
        elif a in ("qk_scale", "sc"):
            sig[a] = "fp32"
        elif a in v["cx"]:
            sig[a] = "constexpr"
        else:
            sig[a] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=v["cx"]), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": v["warps"], "num_stages": 2})
    ptx = k.asm["ptx"]
    print(json.dumps({"local": ptx.count("ld.local") + ptx.count("st.local"), "mma": ptx.count("mma.sync")}))
''')

BASE = dict(G_Q=4, D=128, G=128, BT=128, NGV=1, BLOCK_M=16, TIGHT=True, NPPS=0, PRECISE=False, MAGIC=True,
            SPLIT_P=True, K_TERMS=2, SHIFT=2048.0, K_WORDS=True, V_WORDS=True, TBN=32, TNBLK=0)
VARIANTS = {
    "KIVI-K2V2-fp16": ("*fp16", 8, dict(K_BITS=2, V_BITS=2, KITTY=False, DB_HIGH=0)),
    "KIVI-K4V4-fp16": ("*fp16", 8, dict(K_BITS=4, V_BITS=4, KITTY=False, DB_HIGH=0)),
    "KIVI-K2V4-Gv32-fp16": ("*fp16", 8, dict(K_BITS=2, V_BITS=4, KITTY=False, DB_HIGH=0, NGV=4, V_WORDS=False)),
    "Kitty-fp16": ("*fp16", 8, dict(K_BITS=2, V_BITS=2, KITTY=True, DB_HIGH=16)),
    "Kitty-fp16-4warps": ("*fp16", 4, dict(K_BITS=2, V_BITS=2, KITTY=True, DB_HIGH=16)),
    "KIVI-K2V2-fp16-p-once": ("*fp16", 8, dict(K_BITS=2, V_BITS=2, KITTY=False, DB_HIGH=0, SPLIT_P=False)),
    "Kitty-Pro-bf16": ("*bf16", 8, dict(K_BITS=2, V_BITS=2, KITTY=True, DB_HIGH=32, MAGIC=False, SHIFT=256.0,
                                        K_WORDS=False, V_WORDS=False)),
    "KIVI-K2V2-fp16-k3": ("*fp16", 4, dict(K_BITS=2, V_BITS=2, KITTY=False, DB_HIGH=0, SPLIT_P=False, K_TERMS=3)),
    "KIVI-K8V8-fp32": ("*fp32", 4, dict(K_BITS=8, V_BITS=8, KITTY=False, DB_HIGH=0, PRECISE=True, BT=32,
                                        MAGIC=False, K_WORDS=False, V_WORDS=False)),
    "KIVI-K2V2-fp16-bytes": ("*fp16", 4, dict(K_BITS=2, V_BITS=2, KITTY=False, DB_HIGH=0, K_WORDS=False, V_WORDS=False)),
    # _tokens_kernel (cache tokens on the MMA's M side): NR query rows, BT tokens per step
    "tokens-KIVI-K2V2-fp16": ("*fp16", 2, dict(kernel="_tokens_kernel", K_BITS=2, V_BITS=2, KITTY=False, DB_HIGH=0,
                                               NR=4)),
    "tokens-KIVI-K4V4-fp16-8rows": ("*fp16", 2, dict(kernel="_tokens_kernel", K_BITS=4, V_BITS=4, KITTY=False,
                                                     DB_HIGH=0, NR=8)),
    "tokens-Kitty-fp16-1warp": ("*fp16", 1, dict(kernel="_tokens_kernel", K_BITS=2, V_BITS=2, KITTY=True, DB_HIGH=16,
                                                 NR=4, BT=64)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_kernel_compiles_for_sm90(name):
    pytest.importorskip("triton")
    qt, warps, cx = VARIANTS[name]
    cx = dict(cx)
    kernel = cx.pop("kernel", "_fused_kernel")
    arg = json.dumps({"qt": qt, "warps": warps, "kernel": kernel, "cx": {**BASE, **cx}})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["local"] == 0, f"{name}: register spills to local memory ({out})"
    if not cx.get("PRECISE"):
        assert out["mma"] > 0, f"{name}: no tensor-core mma in the PTX ({out})"


TAIL_SCRIPT = textwrap.dedent('''
    import json, sys
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from kvq.fast.triton import paged
    fn = paged._gather_tail_kernel
    cx = json.loads(sys.argv[1])
    half = ("sk_ptr", "sv_ptr", "kb_ptr", "vb_ptr", "vw_ptr", "ks_ptr", "km_ptr", "vs_ptr", "vm_ptr")
    sig = {}
    for a in fn.arg_names:
        if a in cx:
            sig[a] = "constexpr"
        elif a in half:
            sig[a] = "*fp16"
        elif a in ("kc_ptr", "kh_ptr", "ki_ptr", "vc_ptr"):
            sig[a] = "*u8"
        elif a in ("kt_ptr", "vt_ptr"):
            sig[a] = "*i32"
        elif a in ("ok_ptr", "ov_ptr"):
            sig[a] = "*fp32"
        else:
            sig[a] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    print(json.dumps({"local": ptx.count("ld.local") + ptx.count("st.local"), "fma": ptx.count("fma.rn.f32")}))
''')


@pytest.mark.slow
@pytest.mark.parametrize("kitty", [False, True], ids=["kivi", "kitty"])
def test_tail_gather_compiles_for_sm90_without_fma(kitty):
    """The tail gather dequantizes bit-exactly (code * scale + mn, no FMA contraction)."""
    pytest.importorskip("triton")
    cx = dict(D=128, K_BITS=2, V_BITS=2, NGV=1, KITTY=kitty, DB_HIGH=16 if kitty else 0, BT=32)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", TAIL_SCRIPT, json.dumps(cx)], capture_output=True, text=True,
                         env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"local": 0, "fma": 0}, out
