"""Does the planned CuPy paged decode launch exactly what the unplanned one (564c384) launched? (CPU only)

    git show 564c384:kvq/fast/cupy/paged.py > kvq/fast/cupy/_paged_old.py
    .venv/bin/python -W ignore lab/2026-11-28-decode-host/plan_equivalence.py
    rm kvq/fast/cupy/_paged_old.py

Both decodes run with stand-ins for CuPy (kernels, device properties of an H100-like card, streams) on
CPU caches built by the Triton interpreter; every launch (kernel, grid, block, shared memory, stream,
arguments with tensors named by role, packed layout) and every stream wait is recorded and compared, for
KIVI / Kitty configurations, head dims 64 / 128, batch 1 / 3, eight lengths, q fp16 / bf16 / fp32, GQA,
two query tokens, and 13 knob settings (the old module's ``TUNE`` dict; the new one's ``Knobs``).
"""
import contextlib, os, sys, itertools
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
import kvq.fast.cupy._loader as L
import kvq.fast.cupy.paged as NEW
import kvq.fast.cupy.plans as PL
import kvq.fast.cupy._paged_old as OLD
import kvq.fast.cupy.attention as A
from kvq.fast.caches import paged as _paged
from kvq.fast.triton import kivi as TK, kitty as TT
from kvq.fast.cupy import kivi as CK, kitty as CT

class FakeFn:
    def __init__(self, name): self.name = name; self.num_regs = 96; self.shared_size_bytes = 0
    def __repr__(self): return self.name
_fns = {}
L.kernel = lambda src, expr: _fns.setdefault((src, expr), FakeFn(expr))
props = {"regsPerMultiprocessor": 65536, "sharedMemPerMultiprocessor": 233472, "maxThreadsPerMultiProcessor": 2048,
         "reservedSharedMemPerBlock": 1024, "sharedMemPerBlockOptin": 232448}
class FS:
    def __init__(self, k): self.cuda_stream = 100 + k
for M in (PL, OLD):       # the new module's device helpers live in kvq.fast.cupy.plans
    M.allow_smem = M._allow_smem = lambda fn, smem, dev: fn
    M.device_props = M._device_props = lambda i: props
    M.side_stream = M._side_stream = lambda dev, k=0: FS(k)
PL.device_limits.cache_clear()
OLD._device_limits.cache_clear()
for M in (NEW, OLD):
    M._paged.check_q = lambda *a, **k: None
L.sm_count = lambda i: 132
L.raw_stream = lambda dev: 7
L.on_device = lambda dev: contextlib.nullcontext()
torch.cuda.current_device = lambda: 0
import contextlib
torch.cuda.stream = lambda s: contextlib.nullcontext()
torch.cuda.current_stream = lambda d=None: None
LOG = []
L.stream_wait = lambda a, b, dev, k=0: LOG.append(("wait", a, b, k))
def run(fn, grid, block, args, device, shared_mem=0, stream=None):
    LOG.append(("run", fn.name, tuple(int(g) for g in grid), tuple(int(b) for b in block), int(shared_mem),
                stream if stream is not None else 7, norm(args), L._layout(tuple(map(type, args)))[0].format.replace('q','Q')))
L.run = run
def plaunch(self, values, dev, stream):
    args = self.bind(values)
    LOG.append(("run", self.fn.name, self.grid[:3], self.block[:1] if self.block[1:] == (1, 1) else self.block,
                self.shared_mem, stream, norm(args), self._lay[0].format.replace('q','Q')))
L.Prepared.launch = plaunch
NAMES = {}
def norm(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.data_ptr() == 0:   # an empty tensor: address 0 either way
            out.append(0)
        elif isinstance(a, torch.Tensor):
            nm = NAMES.get(a.data_ptr(), "?")
            out.append(("T", nm) if nm != "?" else "PTR")
        elif isinstance(a, (float, np.floating)):
            out.append(float(np.float32(a)))
        elif int(a) > 2**40:                              # a device address (the planned launches pass them)
            nm = NAMES.get(int(a), "?")
            out.append(("T", nm) if nm != "?" else "PTR")
        else:
            out.append(int(a))
    return tuple(out)

def fix_grid(entry):
    # old L.run passes grid as given (2 or 3 dims): pad to 3
    if entry[0] == "run":
        g = (entry[2] + (1, 1))[:3]
        return (entry[0], entry[1], g, entry[3][:1], *entry[4:])
    return entry

torch.manual_seed(0)
n = fails = 0
cases = []
for fam, cfgs, tmod, cmod in (("kivi", TK.CONFIGS, TK, CK), ("kitty", TT.CONFIGS, TT, CT)):
    for name, cfg in cfgs.items():
        cases.append((fam, name, cfg, tmod, cmod))
TUNES = [{}, {"tail16": False}, {"fused_tail": False}, {"side_stream": False}, {"tail_first": True},
         {"tail_mma": True}, {"tail_mma": False}, {"mixed_mma": True}, {"mixed_mma": False}, {"tail16": True},
         {"waves": 2}, {"max_blocks_per_sm": 1}, {"mma": False}]
for fam, name, cfg, tmod, cmod in cases:
    for D in (64, 128):
        try:
            cfg.check_head_dim(D)
        except Exception:
            continue
        for B in (1, 3):
            st = tmod.init(cfg, B, 2, D)
            T_total = 0
            for step, T_new in enumerate((300, 1, 1, 127, 1, 200, 64, 1)):
                k = torch.randn(B, 2, T_new, D, dtype=torch.float16)
                v = torch.randn(B, 2, T_new, D, dtype=torch.float16)
                tmod.append(cfg, st, k, v)
                kp = cmod.KeyCodec.kernel_arrays(cfg, st)
                NAMES.clear()
                for nm, t in list(st.arrays().items()) + [("kp." + k2, v2) for k2, v2 in kp.items() if isinstance(v2, torch.Tensor)]:
                    NAMES.setdefault(t.data_ptr(), nm)
                for qdt, Hq, Tq in ((torch.float16, 8, 1), (torch.bfloat16, 8, 1), (torch.float32, 4, 1), (torch.float16, 16, 2)):
                    q = torch.randn(B, Hq, Tq, D, dtype=qdt)
                    for kq in [kk for kk, vv in NAMES.items() if vv == "q"]:
                        del NAMES[kq]
                    NAMES[q.data_ptr()] = "q"
                    for tune in (TUNES if (qdt == torch.float16 and Tq == 1 and step in (0, 3, 5)) else [{}]):
                        OLD.TUNE.update(tune)
                        LOG.clear(); OLD.decode_attention(cfg, cmod.KeyCodec, st, q); old = [fix_grid(e) for e in LOG]
                        LOG.clear(); NEW.decode_attention(cfg, cmod.KeyCodec, st, q, knobs=NEW.Knobs(**tune))
                        new = [fix_grid(e) for e in LOG]
                        for M in (OLD,):
                            for kk in tune:
                                M.TUNE[kk] = {"num_warps": None, "waves": None, "mma": True, "side_stream": True, "fused_tail": True, "tail_tiles": 1,
        "tail_first": False, "tail16": None, "tail_warps": None, "tail16_warps": None, "max_blocks_per_sm": None,
        "tail_sums": 2, "tail_mma": None, "tail_mma_warps": None, "mixed_mma": None}[kk]
                        n += 1
                        if old != new:
                            fails += 1
                            if fails <= 3:
                                print("DIFF", name, D, B, st.length, qdt, Hq, Tq, tune)
                                for a, b in itertools.zip_longest(old, new):
                                    if a != b:
                                        print("  old", a); print("  new", b)
print("cases", n, "diffs", fails, "kernels seen", len(_fns))
