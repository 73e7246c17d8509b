"""Static SASS of a Triton paged-decode kernel's page loop, compiled for sm_90 on the CPU (no GPU).

Compiles ``kvq.fast.triton.paged.<kernel>`` (default ``_fused_kernel``) with the constexprs of
ANALYSIS.md section 1 (KIVI-K2V2, fp16 q, G_q 4, D = G = 128) overridden by ``--cx k=v``, disassembles the
cubin with Triton's bundled ``cuobjdump``, takes the body of the largest backward branch (the page loop)
and counts its instructions by the categories of ANALYSIS.md section 2. Prints one JSON line.

    python lab/2026-11-29-triton-decode/sass_count.py --warps 4 [--kernel _fused_kernel] [--cx BT=64 ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvq.fast.triton import paged

PTR = {"kc_ptr": "*u8", "kh_ptr": "*u8", "ki_ptr": "*u8", "ks_ptr": "*fp16", "km_ptr": "*fp16", "vc_ptr": "*u8",
       "vs_ptr": "*fp16", "vm_ptr": "*fp16", "kt_ptr": "*i32", "vt_ptr": "*i32", "o_ptr": "*fp32", "m_ptr": "*fp32",
       "l_ptr": "*fp32"}
BASE = dict(G_Q=4, D=128, G=128, BT=128, NGV=1, BLOCK_M=16, TIGHT=True, NPPS=0, PRECISE=False, MAGIC=True,
            SPLIT_P=False, K_TERMS=2, SHIFT=2048.0, K_WORDS=True, V_WORDS=True, K_BITS=2, V_BITS=2, KITTY=False,
            DB_HIGH=0)
CATS = [("HMMA", r"^HMMA"), ("smem+bar", r"^(LDS|STS|LDSM|STSM|BAR|MOVM)"),
        ("unpack", r"^(LOP3|PRMT|SHF|HADD2|HFMA2|HMUL2|SHL|SHR)"), ("shfl+max", r"^(SHFL|FMNMX)"),
        ("fp32", r"^(FMUL|FADD|FFMA|FSEL|FSETP|MUFU|F2FP|F2F)"), ("global", r"^(LDG|LDGSTS|DEPBAR|STG)")]


def value(s):
    for f in (int, float):
        try:
            return f(s)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(s, s)


def compile_kernel(name, cx, warps, stages, qt="*fp16", maxnreg=None):
    fn = getattr(paged, name)
    sig = {}
    for a in fn.arg_names:
        sig[a] = (qt if a == "q_ptr" else PTR.get(a) or ("fp32" if a == "qk_scale" else
                  "constexpr" if a in cx else "i32"))
    cx = {k: v for k, v in cx.items() if k in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def loop_counts(cubin: bytes):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = None
    for addr, text in ins:
        b = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?.*?0x([0-9a-f]+)", text)
        if b and "BRA" in text:
            tgt = int(b.group(1), 16)
            if tgt < addr and (best is None or addr - tgt > best[1] - best[0]):
                best = (tgt, addr)
    body = [t for a, t in ins if best and best[0] <= a <= best[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    cats = {c: sum(n for op, n in ops.items() if re.match(rx, op)) for c, rx in CATS}
    cats["other"] = sum(ops.values()) - sum(cats.values())
    cats["spill (LDL+STL)"] = ops.get("LDL", 0) + ops.get("STL", 0)
    cats["total"] = sum(ops.values())
    return cats, ops, regs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="_fused_kernel")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--cx", nargs="*", default=[])
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--maxnreg", type=int, default=None)
    a = ap.parse_args()
    cx = dict(BASE, **{k: value(v) for k, v in (s.split("=", 1) for s in a.cx)})
    k = compile_kernel(a.kernel, cx, a.warps, a.stages, maxnreg=a.maxnreg)
    cats, ops, regs = loop_counts(k.asm["cubin"])
    ptx = k.asm["ptx"]
    out = {"kernel": a.kernel, "warps": a.warps, "cx": {k: v for k, v in cx.items() if BASE.get(k) != v},
           "regs": regs, "local": ptx.count("ld.local") + ptx.count("st.local"),
           "per_warp_loop": cats}
    if a.ops:
        out["ops"] = dict(ops.most_common())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
