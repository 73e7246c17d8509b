"""Quantize+pack and unpack+dequantize throughput: kvq.fast (triton, cupy) against unfused torch ops.

Input x: (B, H, T, D) = (8, 8, 16384, 128) fp16 (268 MB, over 4x L2, so one copy and no rotation).
Layouts (KIVI): per-token values (axis=-1, groups of 128 or 32 channels, packed along channels) and
per-channel keys (axis=2, groups of 128 tokens, packed along tokens); bits 2 and 4; fp16 metadata.

Bytes moved (the minimum, each tensor once): quantize_pack reads x and writes packed + scale + mn;
unpack_dequantize reads packed + scale + mn and writes the fp16 tensor: the same count both ways.
Every kvq output is compared bit for bit with the torch implementation below (itself checked against
``kvq.reference`` on a slice); a mismatch marks the row invalid. Times are reported, never asserted.

    python3 benchmarks/bench_quant.py --out /tmp/res [--quick] [--dry-run]
    from bench_quant import run; res = run("cuda", copy_gbps=3000.0)
"""

from __future__ import annotations


import torch

import baselines as BL
import common as C

SHAPE = (8, 8, 16384, 128)                # (B, H, T, D)
DRY_SHAPE = (1, 2, 256, 128)
LAYOUTS = (("values_per_token", -1, 128), ("values_per_token", -1, 32), ("keys_per_channel", 2, 128))
IMPLS = ("triton", "cupy", "torch")


# ------------------------------------------------------------------ the torch implementation (unfused)

def _grouped(shape, axis, n):
    return tuple(shape[:axis]) + (shape[axis] // n, n) + tuple(shape[axis + 1:])


def _shifts(bits, ndim_after, device):
    per = 8 // bits
    return (torch.arange(per, device=device, dtype=torch.uint8) * bits).view((per,) + (1,) * ndim_after)


def torch_quantize_pack(x, bits, group_size, axis):
    """The numerics contract in plain torch ops (fp32 math, IEEE division by tensors, round half even)."""
    axis = axis % x.dim()
    red = axis + 1
    xg = x.float().reshape(_grouped(x.shape, axis, group_size))  # (..., n/G, G, ...)
    mn = xg.amin(red, keepdim=True) + 0.0                        # + 0.0 turns -0.0 into +0.0
    mx = xg.amax(red, keepdim=True)
    qmax = torch.full_like(mx, 2 ** bits - 1)    # a tensor: torch turns x / python-scalar into
    scale_s = ((mx - mn) / qmax).half()          # x * (1 / scalar), which is not IEEE division
    mn_s = mn.half()
    s32, m32 = scale_s.float(), mn_s.float()
    y = torch.nan_to_num(((xg - m32) / s32).clamp(0, 2 ** bits - 1))   # NaN only where scale_s == 0
    codes = torch.where(s32 == 0, 0.0, torch.round(y)).to(torch.uint8).reshape(x.shape)
    per = 8 // bits
    c = codes.reshape(_grouped(x.shape, axis, per))              # (..., n/per, per, ...)
    packed = (c << _shifts(bits, x.dim() - axis - 1, x.device)).sum(red, dtype=torch.uint8)
    return packed, scale_s.squeeze(red), mn_s.squeeze(red)


def torch_unpack_dequantize(packed, scale, mn, bits, group_size, axis):
    """Inverse: code * scale then + mn, two separately rounded fp32 ops (separate kernels: no FMA)."""
    axis = axis % packed.dim()
    per = 8 // bits
    shape = list(packed.shape)
    shape[axis] *= per
    p = packed.unsqueeze(axis + 1)                               # (..., bytes, 1, ...)
    codes = ((p >> _shifts(bits, packed.dim() - axis - 1, packed.device)) & (2 ** bits - 1)).reshape(shape)
    cg = codes.float().reshape(_grouped(shape, axis, group_size))
    x = cg * scale.float().unsqueeze(axis + 1)
    x = x + mn.float().unsqueeze(axis + 1)
    return x.reshape(shape).half()


def check_torch_impl(x, bits, group_size, axis) -> dict:
    """The torch implementation against kvq.reference (NumPy) on a (1, 1, 256, D) slice."""
    try:
        from kvq.reference import packing as ref
        xs = x[:1, :1, :256].contiguous()
        p, s, m = torch_quantize_pack(xs, bits, group_size, axis)
        rp, rs, rm = ref.quantize_pack(xs.cpu().numpy(), bits, group_size, axis)
        xh = torch_unpack_dequantize(p, s, m, bits, group_size, axis)
        rxh = ref.unpack_dequantize(rp, rs, rm, bits, group_size, axis)
        same = (torch.equal(p.cpu(), torch.from_numpy(rp))
                and torch.equal(s.cpu().view(torch.int16), torch.from_numpy(rs.view("int16")))
                and torch.equal(m.cpu().view(torch.int16), torch.from_numpy(rm.view("int16")))
                and torch.equal(xh.cpu().view(torch.int16), torch.from_numpy(rxh.view("int16"))))
        return {"matches_numpy_reference": bool(same)}
    except Exception as e:
        return {"matches_numpy_reference": None, "error": C.err_str(e)}


# ------------------------------------------------------------------------------------------- checks

def _bits_equal(a, b):
    """(equal, mismatching elements) on the raw bits; shapes and dtypes must match."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"got {tuple(a.shape)} {a.dtype}, expected {tuple(b.shape)} {b.dtype}")
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    n_bad = int((a != b).sum())
    return n_bad == 0, n_bad


def compare_quant(out, ref) -> dict:
    names = ("packed", "scale", "mn")
    res = {}
    for name, a, b in zip(names, out, ref):
        ok, bad = _bits_equal(a, b)
        res[f"{name}_equal"], res[f"{name}_mismatches"] = ok, bad
    res["ok"] = all(res[f"{n}_equal"] for n in names)
    return res


def compare_dequant(out, ref) -> dict:
    ok, bad = _bits_equal(out, ref)
    return {"ok": ok, "out_mismatches": bad,
            "max_abs_diff": float((out.float() - ref.float()).abs().max())}


# ------------------------------------------------------------------------------------------- run

def _fast():
    import kvq.fast as fast
    fast.set_validation(False)               # no NaN / overflow checks (they synchronize) while timing
    return fast


def _measure(op, impl, fn, inputs, check_fn, ref_out, nbytes, base, device, copy_gbps, quick, deadline):
    row = dict(base, op=op, impl=impl, bytes=nbytes, ms=None, gbps=None, pct_copy=None, valid=False)
    if deadline is not None and deadline.expired():
        row["skipped"] = "time budget exhausted"
        return row
    try:
        row["check"] = check_fn(fn(*inputs[0]), ref_out)
        row["valid"] = bool(row["check"]["ok"])
        t = C.bench(fn, inputs, device=device, quick=quick)
        row.update(ms=t["ms"], timing=t)
        row["gbps"] = C.gbps(nbytes, t["ms"])
        row["pct_copy"] = C.pct(row["gbps"], copy_gbps)
    except Exception as e:
        row["error"] = C.err_str(e)
        row["valid"] = False
        C.free_cuda(device)
    return row


def run(device, *, copy_gbps=None, quick=False, dry_run=False, deadline=None) -> dict:
    shape = DRY_SHAPE if dry_run else SHAPE
    bit_list = (2,) if quick and not dry_run else (2, 4)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float16)      # (B, H, T, D)
    n = x.numel()
    rows, self_checks = [], []
    for layout, axis, G in LAYOUTS:
        for bits in bit_list:
            base = {"layout": layout, "axis": axis, "group_size": G, "bits": bits, "shape": list(shape)}
            nbytes = x.numel() * x.element_size() + n * bits // 8 + 2 * (n // G) * 2    # x + packed + meta
            self_checks.append(dict(base, **check_torch_impl(x, bits, G, axis)))
            try:
                ref_q = torch_quantize_pack(x, bits, G, axis)
                ref_x = torch_unpack_dequantize(*ref_q, bits, G, axis)
            except Exception as e:
                rows.append(dict(base, op="reference", impl="torch", error=C.err_str(e), valid=False))
                C.free_cuda(device)
                continue
            q_inputs, d_inputs = [(x,)], [tuple(ref_q)]
            copies = C.copies_for(nbytes, device)
            if copies > 1:                                   # only small (dry-run) shapes need rotation
                q_inputs = [(x.clone(),) for _ in range(copies)]
                d_inputs = [tuple(t.clone() for t in ref_q) for _ in range(copies)]
            for impl in IMPLS:
                if impl == "torch":
                    qfn = lambda a: torch_quantize_pack(a, bits, G, axis)                     # noqa: E731
                    dfn = lambda p, s, m: torch_unpack_dequantize(p, s, m, bits, G, axis)     # noqa: E731
                else:
                    def qfn(a, impl=impl):
                        return _fast().quantize_pack(a, bits, G, axis, torch.float16, backend=impl)

                    def dfn(p, s, m, impl=impl):
                        return _fast().unpack_dequantize(p, s, m, bits, G, axis, torch.float16, backend=impl)
                rows.append(_measure("quantize_pack", impl, qfn, q_inputs, compare_quant, ref_q, nbytes,
                                     base, device, copy_gbps, quick, deadline))
                rows.append(_measure("unpack_dequantize", impl, dfn, d_inputs,
                                     compare_dequant, ref_x, nbytes, base, device, copy_gbps, quick, deadline))
            del ref_q, ref_x, q_inputs, d_inputs
            C.free_cuda(device)
    del x
    C.free_cuda(device)
    return {"copy_gbps": copy_gbps, "target_pct_copy": 60.0,
            "bytes_rule": "input + packed + 2 * metadata (fp16 scale and mn), each once",
            "torch_impl_self_check": self_checks, "rows": rows}


def summary_lines(res: dict) -> list[str]:
    """One line per (op, layout, group, bits): each implementation's ms and % of copy bandwidth."""
    def cell(r):
        if r is None:
            return f"{'-':>15s}"
        if r.get("skipped") or r.get("error") or not r.get("ms"):
            return f"{'skip' if r.get('skipped') else 'err':>15s}"
        pc = f"{r['pct_copy']:5.1f}%" if r.get("pct_copy") else "     -"
        return f"{r['ms']:7.3f}{'' if r.get('valid') else '!'} {pc:>6s}".rjust(15)

    table, errors = {}, {}
    for r in res.get("rows", []):
        key = (r["op"], r.get("layout", ""), r.get("group_size", 0), r.get("bits", 0))
        table.setdefault(key, {})[r["impl"]] = r
        if r.get("error"):
            errors.setdefault((r["impl"], r["op"]), r["error"])
    lines = [f"{'op':17s} {'layout':16s} {'G':>3s} {'b':>1s} " + " ".join(f"{i + ' ms %copy':>15s}" for i in IMPLS)]
    for (op, layout, G, bits), by_impl in table.items():
        lines.append(f"{op:17s} {layout:16s} {G:3d} {bits:1d} " + " ".join(cell(by_impl.get(i)) for i in IMPLS))
    lines += [f"  {impl} {op}: {e[:110]}" for (impl, op), e in errors.items()]
    if res.get("error"):
        lines.append(f"  error: {res['error']}")
    lines.append("  ('!' = not bit-exact with the torch implementation; target >= 60% of copy bandwidth)")
    return lines


def main():
    BL.standalone_main(__doc__, "quant.json", run, summary_lines)


if __name__ == "__main__":
    main()
