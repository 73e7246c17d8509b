"""Builds the CUDA sources beside this file with CuPy (NVRTC), once per source, and launches kernels
on torch's current stream with torch tensors passed zero-copy (device pointers, or DLPack views).

CuPy is imported lazily (inside the functions), so this module and the backend modules import on a
machine without CuPy; only a launch needs it.

    from kvq.fast.cupy import _loader as L
    fn = L.kernel("quant.cu", "quant_rows<0, 2, true>")      # compiled on first use, then cached
    L.run(fn, grid, block, (x, out, np.int64(n)), x.device)   # torch tensors in, zero-copy

Kernel arguments: torch tensors are passed as device pointers (:data:`ARG_MODE`; :func:`arg` gives the
DLPack view instead); scalars must be NumPy scalars of the kernel's C type (``np.int64`` for
``long long``, ``np.int32`` for ``int``, ``np.float32`` for ``float``): a Python int goes as 8 bytes
and a Python float as a double, as CuPy passes them. :func:`run` packs them into one parameter buffer
and calls ``cuLaunchKernel`` (:data:`LAUNCH_MODE`), on torch's current stream or a raw stream handle
it is given; :func:`stream_wait` orders two raw streams.
"""

from __future__ import annotations

import contextlib
import functools
import re
import struct
import threading
import types
import warnings
from pathlib import Path

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent

#: compile options: C++17 for `if constexpr`; no FMA contraction (numerics contract rule 5). CuPy
#: appends -ftz=true after these (NVRTC honours the last), so quant.cu does its bit-exact arithmetic
#: in PTX without .ftz (common.cuh, ieee_*) and keeps subnormals whatever the flags.
OPTIONS = ("--std=c++17", "--fmad=false")

# dtype codes used by the kernel templates (common.cuh): 0 fp16, 1 bf16, 2 fp32
DT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

#: head dims the attention kernels are built for; fp32 stops at 128 (shared memory)
ATTN_DIMS = (16, 32, 64, 128, 256)
ATTN_QT = (4, 8)


def _quant_names():
    names = []
    for dt in (0, 1, 2):
        for pb in (2, 4, 8):
            for vec in ("true", "false"):
                names.append(f"quant_rows<{dt}, {pb}, {vec}>")
                names.append(f"dequant_rows<{dt}, {pb}, {vec}>")
            for vc in ((1, 2) if dt < 2 else (1,)):
                names.append(f"quant_cols<{dt}, {pb}, {vc}>")
            names.append(f"dequant_cols<{dt}, {pb}>")
    for pb in (2, 4, 8):
        names.append(f"pack_codes<{pb}>")
        names.append(f"unpack_codes<{pb}>")
    return tuple(names)


def attn_supported(dt: int, D: int) -> bool:
    return D in ATTN_DIMS and not (dt == 2 and D > 128)


def attn_warp_bytes(dt: int, D: int) -> int:
    """attn_split.cuh AttnCfg<dt, D>::WARP_BYTES: one warp's 32-key K tile (rows padded by 16 bytes)
    and V tile in shared memory."""
    esz = 4 if dt == 2 else 2
    return 32 * (2 * D + 16 // esz) * esz


def attn_warps(dt: int, D: int) -> int:
    """Warps per attn_split block: each warp stages its tiles (attn_warp_bytes) in shared memory; the
    block stays under 48 KiB of static shared memory (attention.cu checks it with a static_assert at
    compile time)."""
    return max(1, min(4, 36864 // attn_warp_bytes(dt, D)))


#: attention.cu attn_merge: dims per lane it is built for (one warp per row; D > 256 takes more blocks)
MERGE_DIMS_PER_LANE = (1, 2, 4, 8)


def merge_dims_per_lane(D: int) -> int:
    """attn_merge's dims per lane for head dim D: the fewest of MERGE_DIMS_PER_LANE whose 32 lanes cover D
    (8 beyond 256: the grid's second dimension then takes the rest)."""
    return next((n for n in MERGE_DIMS_PER_LANE if 32 * n >= D), MERGE_DIMS_PER_LANE[-1])


def _attention_names():
    names = [f"attn_split<{dt}, {D}, {qt}, {attn_warps(dt, D)}>" for dt in (0, 1, 2) for D in ATTN_DIMS
             for qt in ATTN_QT if attn_supported(dt, D)]
    names += [f"attn_split<2, {D}, {qt}, {attn_warps(2, D)}, 0, {qdt}, {sd}>" for D in ATTN_DIMS for qt in ATTN_QT
              for qdt in (0, 1) for sd in TAIL_SUMS if attn_supported(2, D)]   # fp32 data, fp16 / bf16 q (paged tail)
    names += [f"attn_split<0, {D}, {qt}, {attn_warps(0, D)}, 1, 2>" for D in ATTN_DIMS for qt in ATTN_QT
              if attn_supported(0, D)]                    # fp16 data, fp32 q, double sums (OSCAR's FP16 segments)
    names += [f"attn_merge<{dt}, {ndl}>" for dt in (0, 1, 2) for ndl in MERGE_DIMS_PER_LANE]
    return tuple(names)


#: the fused paged decode (paged.cu): head dims, key codecs (KIVI bits 2 / 4 / 8; Kitty = its 2-bit
#: planes), value bits and query rows per block it is built for
PAGED_DIMS = (64, 128)
PAGED_KEYS = ((2, 0), (4, 0), (8, 0), (2, 1))       # (key bits, Kitty)
PAGED_VBITS = (2, 4, 8)
PAGED_QT = (4, 8)


def paged_decode_name(D: int, k_bits: int, v_bits: int, kitty: bool, QT: int) -> str:
    return f"paged_decode<{D}, {k_bits}, {v_bits}, {int(kitty)}, {QT}>"


def mma2_name(kitty: bool, nr: int, k_bits: int, v_bits: int) -> str:
    return f"paged_decode_mma2<{int(kitty)}, {nr}, {k_bits}, {v_bits}>"


def gather_tail_name(k_bits: int, v_bits: int, kitty: bool) -> str:
    return f"paged_gather_tail<{int(kitty)}, {k_bits}, {v_bits}>"


#: warps per block paged_tail_attn and paged_tail16_attn are built for (their tiles in dynamic shared memory)
PAGED_TAIL_WARPS = (1, 2, 4)
#: how the paged decode's FP16 tail sums each score (attn_split.cuh SD): 1 in double, 2 as four fp32 chains
TAIL_SUMS = (1, 2)


def paged_tail_name(D: int, QT: int, q_dt: int, fp16_rows: bool, nw: int, sums: int) -> str:
    """paged_tail_attn with nw warps (fp32 tiles: any tail row) or, with fp16_rows, paged_tail16_attn
    (fp16 tiles: rows whose key and value are both fp16); nw in PAGED_TAIL_WARPS; ``sums`` in TAIL_SUMS
    (attn_split.cuh SD: 1 double, 2 four fp32 fma chains)."""
    return f"paged_tail{'16' if fp16_rows else ''}_attn<{D}, {QT}, {nw}, {q_dt}, {sums}>"


#: fp16 elements per row of paged_tail_mma's K / V tiles (mma.cuh KVQ_TMMA_ROW: D = 128 padded by 16 bytes)
TAIL_MMA_ROW = 136


def paged_tail_mma_name(nw: int) -> str:
    """paged_tail_mma with nw warps (nw in PAGED_TAIL_WARPS): the fp16 tail rows on the tensor cores (fp16
    q, D = 128)."""
    return f"paged_tail_mma<{nw}>"


def tail_mma_warp_bytes() -> int:
    """One warp's K and V tiles of paged_tail_mma in dynamic shared memory (32 rows of TAIL_MMA_ROW fp16 each)."""
    return 2 * 32 * TAIL_MMA_ROW * 2


def paged_mixed_mma_name(nw: int) -> str:
    """paged_mixed_mma with nw warps (nw in PAGED_TAIL_WARPS): the mixed tail rows whose key is in a page
    and whose value is fp16, on the tensor cores (fp16 q, D = 128)."""
    return f"paged_mixed_mma<{nw}>"


def mixed_mma_warp_bytes() -> int:
    """One warp's tiles of paged_mixed_mma in dynamic shared memory: the keys' hi, the values, the keys' lo
    (32 rows of TAIL_MMA_ROW fp16 each)."""
    return 3 * 32 * TAIL_MMA_ROW * 2


def _paged_names():
    names = [paged_decode_name(D, kb, vb, kitty, qt) for D in PAGED_DIMS for kb, kitty in PAGED_KEYS
             for vb in PAGED_VBITS for qt in PAGED_QT]
    names += [mma2_name(k, nr, kb, vb) for k in (0, 1) for nr in (4, 8) for kb in (2, 4) for vb in (2, 4)
              if not (k and kb == 4)]
    names += [gather_tail_name(kb, vb, kitty) for kb, kitty in PAGED_KEYS for vb in PAGED_VBITS]
    names += [paged_tail_name(D, qt, qdt, f16, nw, sd) for D in PAGED_DIMS for qt in PAGED_QT for qdt in (0, 1)
              for f16 in (True, False) for nw in PAGED_TAIL_WARPS for sd in TAIL_SUMS]
    names += [paged_tail_mma_name(nw) for nw in PAGED_TAIL_WARPS]
    names += [paged_mixed_mma_name(nw) for nw in PAGED_TAIL_WARPS]
    return tuple(names)


def _higgs_names():
    """higgs.cu: fwht over fp16 / bf16 / fp32 rows, the HIGGS quantizer per input dtype and index bits,
    the decoder per output dtype and index bits, and the helper kernels."""
    names = [f"fwht_rows<{dt}>" for dt in (0, 1, 2)] + ["fwht_stage", "higgs_nearest"]
    names += [f"higgs_ss<{dt}>" for dt in (0, 1, 2)]
    names += [f"higgs_quant<{dt}, {ib}>" for dt in (0, 1, 2) for ib in (8, 16, 32)]
    names += [f"higgs_dequant<{dt}, {ib}>" for dt in (0, 1, 2) for ib in (8, 16, 32)]
    return tuple(names)


def _oscar_names():
    """oscar.cu: quantile / percentile clip, the fixed-order rotation and the fused OSCAR token quantizer,
    each per input dtype."""
    return tuple(f"{k}<{dt}>" for k in ("quantile_rows", "rotate_rows", "oscar_quant_rows") for dt in (0, 1, 2))


def _aqua_names():
    """aqua.cu: the fused AQUA-KV decode per HIGGS index bits and per uniform code bits."""
    return tuple(f"aqua_higgs<{ib}>" for ib in (8, 16, 32)) + tuple(f"aqua_uniform<{b}>" for b in (2, 4, 8))


#: the tensor-core OSCAR decode (oscar_decode.cu): query rows per block (4 or 8); its FP16 sink + window
#: kernel (attn_split's body, fp16 K / V, fp32 q; double sums or four fp32 chains) per query tile; the
#: query-side float64 rotation per input / output dtype; the merge with the output rotation per output dtype
OSCAR_DECODE_NAMES = (tuple(f"oscar_decode_mma<{nr}>" for nr in (4, 8))
                      + tuple(f"oscar_tail_attn<{qt}, {attn_warps(0, 128)}, {p}>" for qt in ATTN_QT for p in (1, 2))
                      + tuple(f"rotate_heads_f64<{i}, {o}, {r}>" for i in (0, 1, 2) for o in (0, 1, 2)
                              for r in ("float", "double"))
                      + tuple(f"oscar_merge_rotate<{o}, {r}>" for o in (0, 1, 2) for r in ("float", "double")))


def key_flush_name(bits: int, kitty: bool, meta_half: bool) -> str:
    """flush.cu key_flush: KIVI's (2 / 4 / 8-bit) or Kitty's key pages straight into the pool, fp16 or
    fp32 metadata."""
    return f"key_flush<{bits}, {int(kitty)}, {int(meta_half)}>"


def value_evict_name(bits: int, meta_half: bool, pow2: bool) -> str:
    """flush.cu value_evict: evicted values quantized per token into their page slots (pow2: the value
    group is a power of two, its min / max by shuffles)."""
    return f"value_evict<{bits}, {int(meta_half)}, {int(pow2)}>"


def append_token_name(bits: int, meta_half: bool, pow2: bool) -> str:
    """flush.cu append_token: one decode token's key and value into the paged cache's buffers, and the value it
    evicts into the value Q-buffer or quantized into its page slot (pow2 as value_evict's)."""
    return f"append_token<{bits}, {int(meta_half)}, {int(pow2)}>"


#: flush.cu's threads per block are one per channel, rounded up to a warp, at most this many
FLUSH_MAX_D = 1024


def _flush_names():
    return (tuple(key_flush_name(b, k, mh) for b, k in PAGED_KEYS for mh in (False, True))
            + tuple(name(b, mh, p2) for name in (value_evict_name, append_token_name) for b in PAGED_VBITS
                    for mh in (False, True) for p2 in (False, True)))


#: BitDecoding's warps along N (W_n of eq. 1) that bitdecoding.cu is built for
BITDECODING_WARPS = (1, 2, 4, 8)


def _bitdecoding_names():
    """bitdecoding.cu: the Residual Kernel's key / value packing per input dtype (fp16, fp32), bits and
    W_n, and the page dequantization per bits and W_n."""
    return (tuple(f"bd_pack_{kv}<{dt}, {b}, {nw}>" for kv in ("keys", "values") for dt in (0, 2) for b in (2, 4)
                  for nw in BITDECODING_WARPS)
            + tuple(f"bd_dequantize<{b}, {nw}>" for b in (2, 4) for nw in BITDECODING_WARPS))


def bd_decode_name(bits: int, chan: bool, nw: int, m16: bool) -> str:
    """bitdecoding_decode.cu's fused decode: key / value bits, channel-wise (KC) or tensor-wise (KT) keys,
    W_n warps, 16 query rows per tile (m16) or at most 8."""
    return f"bd_decode<{bits}, {'true' if chan else 'false'}, {nw}, {'true' if m16 else 'false'}>"


def _bitdecoding_decode_names():
    return tuple(bd_decode_name(b, c, nw, m) for b in (2, 4) for c in (True, False) for nw in BITDECODING_WARPS
                 for m in (False, True))


#: source file -> every kernel name expression the Python side may request (tests compile them all)
KERNELS = {
    "quant.cu": _quant_names(),
    "attention.cu": _attention_names(),
    "paged.cu": _paged_names(),
    "flush.cu": _flush_names(),
    "higgs.cu": _higgs_names(),
    "oscar.cu": _oscar_names(),
    "oscar_decode.cu": OSCAR_DECODE_NAMES,
    "aqua.cu": _aqua_names(),
    "bitdecoding.cu": _bitdecoding_names(),
    "bitdecoding_decode.cu": _bitdecoding_decode_names(),
}

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


def source(name: str) -> str:
    """The text of a CUDA source with its local ``#include "x.cuh"`` lines pasted in (once each).

    NVRTC then needs no include path, and CuPy's on-disk kernel cache (keyed on the source text)
    sees every change to a header.
    """
    seen = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (_HERE / fname).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


@functools.lru_cache(maxsize=None)
def module(name: str):
    """The compiled ``cupy.RawModule`` of one source (built once per process; CuPy caches on disk)."""
    import cupy

    if name not in KERNELS:
        raise ValueError(f"unknown CUDA source {name!r}; sources: {tuple(KERNELS)}")
    return cupy.RawModule(code=source(name), options=OPTIONS, name_expressions=KERNELS[name])


@functools.lru_cache(maxsize=None)
def kernel(src: str, expr: str):
    """A kernel of ``src`` by its name expression (exactly as listed in :data:`KERNELS`)."""
    if expr not in KERNELS.get(src, ()):
        raise ValueError(f"kernel {expr!r} is not built from {src}")
    return module(src).get_function(expr)


@functools.lru_cache(maxsize=None)
def _external_stream(ptr: int, device: int):
    import cupy

    with warnings.catch_warnings():                     # CuPy 14 deprecates ExternalStream (still works)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return cupy.cuda.ExternalStream(ptr, device)
        except TypeError:                               # CuPy < 13: no device argument
            return cupy.cuda.ExternalStream(ptr)


def device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device's where ``device`` names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def raw_stream(dev: int) -> int:
    """torch's current CUDA stream of device ``dev`` as a raw handle."""
    try:
        return int(torch._C._cuda_getCurrentRawStream(dev))     # what Triton uses: no Python overhead
    except AttributeError:
        return int(torch.cuda.current_stream(dev).cuda_stream)


def stream(device: torch.device | None = None):
    """torch's current CUDA stream (of ``device``) as a CuPy stream object."""
    dev = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _external_stream(raw_stream(dev), int(dev))


def arg(t: torch.Tensor):
    """A zero-copy CuPy view of a CUDA tensor (through DLPack), to pass as a kernel pointer.

    bfloat16 tensors are viewed as int16 first (the kernels take raw 16-bit patterns).
    """
    import cupy

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


#: how :func:`run` hands tensors to kernels: "pointer" (default) passes the device address of the
#: torch storage as a 64-bit value (zero-copy, ~1 us a tensor); "dlpack" passes a CuPy view made by
#: ``cupy.from_dlpack`` (zero-copy too, but ~16-22 us a tensor, measured on an H100 with torch 2.11 and
#: CuPy 14.2: 4 to 9 tensors a call cost more than a small decode step). Both give the same bits.
ARG_MODE = "pointer"

#: "packed" (default): :func:`run` packs the arguments into one buffer with ``struct`` and calls
#: ``cuLaunchKernel`` itself; "cupy": the RawKernel call, which converts every argument to a CuPy
#: object one by one. Both launch the same kernel with the same bytes. Host time of a whole decode call,
#: medians on the H100 machine's host (``benchmarks/profile_host.py --ab-launch``, results in
#: lab/2026-11-23-host-overhead/results/h100-host-overhead): KIVI-K2V2 1 x 32K 206 -> 188 us, 8 x 32K 242 -> 196 us,
#: Kitty 1 x 32K 520 -> 403 us, OSCAR 300 -> 239 us (cupy -> packed).
LAUNCH_MODE = "packed"


def _pointer(t: torch.Tensor):
    return np.uint64(t.data_ptr())


# struct codes of the argument types :func:`run` packs itself (little-endian, standard sizes): NumPy
# scalars as their C type, Python ints / floats / bools as CuPy passes them (8-byte int, double, bool)
_CODE = {np.int8: "b", np.uint8: "B", np.int16: "h", np.uint16: "H", np.int32: "i", np.uint32: "I",
         np.int64: "q", np.uint64: "Q", np.float16: "e", np.float32: "f", np.float64: "d", np.bool_: "?",
         int: "q", float: "d", bool: "?"}


@functools.lru_cache(maxsize=None)
def _layout(types: tuple):
    """(struct of the arguments at their C offsets followed by the array of their addresses, the
    offsets, the byte offset of that array) for arguments of Python types ``types`` (torch tensors:
    their 8-byte device address), or None if one of them is not packable: each value at its natural
    alignment, as CUDA lays out a kernel's parameters; the address array (``kernelParams`` of
    cuLaunchKernel) after them, 8-byte aligned."""
    fmt, offsets, off = "<", [], 0
    for t in types:
        c = "Q" if issubclass(t, torch.Tensor) else _CODE.get(t)
        if c is None:
            return None
        size = struct.calcsize("<" + c)
        pad = -off % size
        fmt += "x" * pad + c
        offsets.append(off + pad)
        off += pad + size
    pad = -off % 8
    fmt += "x" * pad + "Q" * len(types)
    return struct.Struct(fmt), tuple(offsets), off + pad


def pack_args(args) -> tuple | None:
    """(ctypes buffer, address of its kernelParams array) holding ``args`` as :func:`run` launches them
    (torch tensors as their device addresses), or None when an argument is of a type only CuPy's
    launcher takes."""
    import ctypes

    lay = _layout(tuple(map(type, args)))
    if lay is None:
        return None
    st, offsets, ptr_off = lay
    buf = ctypes.create_string_buffer(st.size)
    base = ctypes.addressof(buf)
    st.pack_into(buf, 0, *[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args],
                 *[base + o for o in offsets])
    return buf, base + ptr_off


@functools.lru_cache(maxsize=None)
def static_smem(fn) -> int:
    """Bytes of static shared memory of kernel ``fn`` (a driver query, asked once per kernel)."""
    return int(fn.shared_size_bytes)


@functools.lru_cache(maxsize=None)
def _function_ptr(fn, dev: int) -> int:
    """The CUfunction of RawKernel ``fn`` on device ``dev`` (which must be current)."""
    return int(fn.kernel.ptr)


@functools.lru_cache(maxsize=None)
def _driver_launch():
    """CuPy's binding of cuLaunchKernel, or None where this CuPy has none (then CuPy's launcher runs)."""
    from cupy.cuda import driver

    return getattr(driver, "launchKernel", None)


def _launch_packed(fn, grid, block, args, dev: int, shared_mem: int, stream_ptr: int) -> bool:
    """cuLaunchKernel of ``fn`` with ``args`` packed by :func:`pack_args` on device ``dev`` (current);
    False (nothing launched) when an argument needs CuPy's launcher."""
    launch = _driver_launch()
    packed = pack_args(args) if launch is not None else None
    if packed is None:
        return False
    buf, params = packed
    g = (tuple(int(x) for x in grid) + (1, 1))[:3]
    b = (tuple(int(x) for x in block) + (1, 1))[:3]
    launch(_function_ptr(fn, dev), max(1, g[0]), max(1, g[1]), max(1, g[2]), max(1, b[0]),
                        max(1, b[1]), max(1, b[2]), int(shared_mem), stream_ptr, params, 0)
    del buf                                             # the driver copied the parameters at the call
    return True


def run(fn, grid, block, args, device: torch.device, shared_mem: int = 0, stream: int | None = None) -> None:
    """Launch ``fn`` with ``shared_mem`` bytes of dynamic shared memory on ``stream`` (a raw CUDA stream
    handle; None: torch's current stream of ``device``): torch tensors in ``args`` become device pointers
    (see :data:`ARG_MODE`; the tensors stay alive until the call returns, and torch's caching allocator
    orders any reuse of their memory after this launch on the same stream); other values are passed as
    they are (NumPy scalars of the kernel's C types). :data:`LAUNCH_MODE` says who packs them."""
    import cupy

    dev = device_index(device)
    sp = raw_stream(dev) if stream is None else int(stream)
    if LAUNCH_MODE == "packed" and ARG_MODE == "pointer":
        with contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == dev else cupy.cuda.Device(dev):
            if _launch_packed(fn, grid, block, args, dev, shared_mem, sp):
                return
    conv = _pointer if ARG_MODE == "pointer" else arg
    with cupy.cuda.Device(dev), _external_stream(sp, dev):
        cargs = tuple(conv(a) if isinstance(a, torch.Tensor) else a for a in args)
        fn(tuple(int(g) for g in grid), tuple(int(b) for b in block), cargs, shared_mem=int(shared_mem))


@functools.lru_cache(maxsize=1024)
def _packer_code(pattern: tuple):
    """The code of a :class:`Prepared` packer for an argument ``pattern`` (per argument: the index of the
    value a Slot reads, or None for a constant, which the function finds as global ``c<position>``). A plan
    is made per cache length, so a model's step makes new ``Prepared`` launches often; the pattern of each
    kernel's arguments stays the same, and compiling its source once saves about 0.1 ms per launch made."""
    parts = [f"c{i}" if k is None else f"v[{k}]" for i, k in enumerate(pattern)]
    src = f"def _pack(v, buf, addrs):\n    _p(buf, 0, {', '.join(parts)}, *addrs)\n"
    module = compile(src, "<kvq Prepared packer>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


class Slot:
    """A placeholder in a :class:`Prepared` launch's arguments: value ``index`` of the list given to each
    launch (a torch tensor: its device address; a scalar: packed as the template's type says)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = int(index)

    def __repr__(self) -> str:
        return f"Slot({self.index})"


class Prepared:
    """One kernel launch whose kernel, grid, block, shared memory and argument layout are fixed once (a
    launch plan's entry), and whose per-call values (tensor addresses, strides, a scale) fill
    :class:`Slot` placeholders of ``args``: :meth:`launch` packs them with a packer made for this layout
    (no per-call type or layout work, as :func:`run` does) into a parameter buffer kept per thread, and
    calls ``cuLaunchKernel``.

    ``types``: for each Slot of ``args``, the type its values take (``torch.Tensor`` for a device address,
    ``np.int32`` / ``np.int64`` / ``np.float32`` for a scalar); constants are typed by themselves and must
    not be tensors (a plan outlives the tensors of the call that made it).
    """

    __slots__ = ("fn", "grid", "block", "shared_mem", "args", "_lay", "_fill", "_cast", "_packer", "_tls")

    def __init__(self, fn, grid, block, args, shared_mem: int = 0, types: dict | None = None):
        types = types or {}
        self.fn = fn
        self.grid = (tuple(max(1, int(x)) for x in grid) + (1, 1))[:3]
        self.block = (tuple(max(1, int(x)) for x in (block if isinstance(block, tuple) else (block,))) + (1, 1))[:3]
        self.shared_mem = int(shared_mem)
        self.args = tuple(args)
        if any(isinstance(a, torch.Tensor) for a in self.args):
            raise TypeError("a Prepared launch outlives the call that plans it: pass tensors as Slots, "
                            "their addresses are taken at each launch")
        kinds = tuple(types[a.index] if isinstance(a, Slot) else type(a) for a in self.args)
        self._lay = _layout(kinds)
        self._fill = tuple((i, a.index) for i, a in enumerate(self.args) if isinstance(a, Slot))
        # scalar slots as their declared NumPy type for CuPy's launcher (a Python float would go as a double)
        self._cast = {i: kinds[i] for i, _ in self._fill if kinds[i] is not torch.Tensor}
        self._packer = None if self._lay is None else self._make_packer()
        self._tls = threading.local()

    def _make_packer(self):
        """A function (values, buffer, addresses) -> None packing this launch's arguments, Slots read from
        ``values`` by index, constants bound in, then the kernelParams ``addresses`` (one struct call). The
        function's code is compiled once per argument pattern (:func:`_packer_code`); each launch binds its
        own constants and struct to it."""
        names = {"_p": self._lay[0].pack_into}
        pattern = []
        for i, a in enumerate(self.args):
            if isinstance(a, Slot):
                pattern.append(a.index)
            else:
                names[f"c{i}"] = a
                pattern.append(None)
        return types.FunctionType(_packer_code(tuple(pattern)), names, "_pack")

    def bind(self, values) -> tuple:
        """The launch's arguments with every Slot replaced by its value (scalars as their declared type; a
        tensor slot may hold a tensor or a device address)."""
        out = list(self.args)
        for i, k in self._fill:
            v = values[k]
            out[i] = self._cast[i](v) if i in self._cast else v
        return tuple(out)

    def _buffer(self):
        """This thread's parameter buffer: (buffer, kernelParams addresses, address of that array). The
        driver copies the parameters at the launch call, so the buffer is reused by the next launch."""
        got = getattr(self._tls, "buf", None)
        if got is None:
            import ctypes

            st, offsets, ptr_off = self._lay
            buf = ctypes.create_string_buffer(st.size)
            base = ctypes.addressof(buf)
            got = self._tls.buf = (buf, tuple(base + o for o in offsets), base + ptr_off)
        return got

    def pack(self, values) -> tuple:
        """(ctypes buffer, address of its kernelParams array) of this launch with the Slot ``values`` (tensor
        slots: tensors or addresses): the bytes :func:`pack_args` makes of ``bind(values)``."""
        vals = list(values)
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                vals[i] = v.data_ptr()
        buf, addrs, params = self._buffer()
        self._packer(vals, buf, addrs)
        return buf, params

    def launch(self, values, dev: int, stream_ptr: int) -> None:
        """Launch on raw stream ``stream_ptr`` of device ``dev``, which must be the current device
        (:func:`on_device`), with the Slot ``values``: device addresses (ints) in the tensor slots, Python
        numbers in the scalar ones."""
        launch = _driver_launch() if LAUNCH_MODE == "packed" and ARG_MODE == "pointer" else None
        if launch is None or self._packer is None:
            run(self.fn, self.grid, self.block, self.bind(values), torch.device("cuda", dev),
                shared_mem=self.shared_mem, stream=stream_ptr)
            return
        buf, addrs, params = self._buffer()
        self._packer(values, buf, addrs)
        g, b = self.grid, self.block
        launch(_function_ptr(self.fn, dev), g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem, stream_ptr, params, 0)


#: Prepared launches kept by ``run_planned`` (least recently used dropped): one per kernel and launch shape
PLANNED_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=PLANNED_CACHE_SIZE)
def planned(fn, grid: tuple, block: tuple, shared_mem: int, kinds: tuple) -> Prepared:
    """The :class:`Prepared` launch of ``fn`` over ``grid`` / ``block`` whose every argument is a per-call
    value, argument i of type ``kinds[i]`` (``torch.Tensor``: a device address; ``np.int32`` / ``np.int64`` /
    ``np.float32``: a scalar), kept per these: a call packs its values with the launch's own packer."""
    return Prepared(fn, grid, block, tuple(Slot(i) for i in range(len(kinds))), shared_mem, dict(enumerate(kinds)))


def run_planned(fn, grid: tuple, block: tuple, kinds: tuple, values: tuple, dev: int, shared_mem: int = 0,
                stream: int | None = None) -> None:
    """``run`` for a launch whose argument types are fixed (``kinds``, as :func:`planned` takes them):
    ``values`` hold device addresses (ints) for the tensors and Python numbers for the scalars; on raw
    ``stream`` of device ``dev`` (None: torch's current stream of that device)."""
    launch = planned(fn, grid, block, shared_mem, kinds)
    with on_device(dev):
        launch.launch(values, dev, raw_stream(dev) if stream is None else stream)


def on_device(dev: int):
    """A context in which CUDA device ``dev`` is current (nothing to do where it is already)."""
    import cupy

    return contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == dev else cupy.cuda.Device(dev)


_EVENTS = threading.local()


def _event(dev: int, k: int) -> int:
    """Event ``k`` of device ``dev`` (no timing) for :func:`stream_wait`, created once per thread (a
    thread's record and wait then never interleave with another thread's; the events live as long as
    the process)."""
    import cupy

    d = _EVENTS.__dict__.setdefault("by_key", {})
    ev = d.get((dev, k))
    if ev is None:
        with cupy.cuda.Device(dev):
            ev = d[(dev, k)] = int(cupy.cuda.runtime.eventCreateWithFlags(2))       # cudaEventDisableTiming
    return ev


def stream_wait(waiter: int, waited: int, dev: int, k: int = 0) -> None:
    """Make raw stream ``waiter`` wait for the work enqueued on raw stream ``waited`` so far (an event
    recorded on ``waited``, waited for on ``waiter``: torch's ``Stream.wait_stream`` without a new event
    per call; CUDA-graph capture records it as a dependency). ``k`` picks one of the thread's reusable
    events of the device: a wait takes the event's state when it is enqueued, so the event may be
    recorded again right after."""
    import cupy

    rt = cupy.cuda.runtime
    ev = _event(dev, k)
    rt.eventRecord(ev, waited)
    rt.streamWaitEvent(waiter, ev, 0)


def grid_1d(work: int, per_block: int, cap: int = 1 << 20) -> int:
    """Blocks for ``work`` items at ``per_block`` per block, capped (the kernels loop grid-stride)."""
    return max(1, min(cap, -(-work // per_block)))


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
