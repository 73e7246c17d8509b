"""Launch-planning helpers shared by the CuPy decode kernels (``paged``, ``oscar_decode``,
``bitdecoding_decode``): device limits, occupancy, the split-KV makespan model, side streams, and the checks
of the modules' launch knobs (each module's frozen ``Knobs``).

Everything here but the driver queries (``device_props``, ``allow_smem``, ``side_stream``) is plain
arithmetic on numbers and runs on the CPU. The measurements behind the rules are lab notes:
``lab/2026-11-22-kivi-kitty-decode/KNOBS.md`` (the KIVI / Kitty page kernel and its tail) and
``lab/2026-11-22-oscar-decode/KNOBS.md`` (OSCAR's page kernel).
"""

from __future__ import annotations

import functools

import torch

from . import _loader as L

#: fused_splits: a plan that gives each warp at most this many pages at full occupancy is re-planned at
#: 2 blocks per SM (lab/2026-11-22-kivi-kitty-decode/KNOBS.md, "few pages per warp")
FEW_PAGES_PER_WARP = 8


# ---------------------------------------------------------------------------------------------------
# knob checks (the modules' Knobs.__post_init__)


def check_optional_bool(owner: str, name: str, value) -> None:
    """ValueError unless ``value`` is None (auto), True or False (1 and 0 are refused: they are not bools)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} = {value!r}: None (auto), True or False")


def check_bool(owner: str, name: str, value) -> None:
    """ValueError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} = {value!r}: True or False")


def check_choice(owner: str, name: str, value, choices: tuple, optional: bool = False, what: str = "") -> None:
    """ValueError unless ``value`` is one of ``choices`` (ints, never bools) or, ``optional``, None."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value not in choices:
        allowed = ("None or " if optional else "") + " / ".join(map(str, choices))
        raise ValueError(f"{owner}.{name} = {value!r}: {allowed}{what}")


def check_positive(owner: str, name: str, value, optional: bool = False, number: bool = False) -> None:
    """ValueError unless ``value`` is a positive int (``number``: int or float) or, ``optional``, None."""
    if optional and value is None:
        return
    kinds = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ValueError(f"{owner}.{name} = {value!r}: a positive {'number' if number else 'int'}"
                         f"{' or None' if optional else ''}")


# ---------------------------------------------------------------------------------------------------
# the driver: device properties, kernel attributes, streams


def allow_smem(fn, smem: int, device_index: int):
    """Raise ``fn``'s dynamic shared-memory limit to ``smem`` bytes on that device (and prefer shared memory
    over L1); returns ``fn``. The attributes are per device: set with that device current."""
    import cupy

    with cupy.cuda.Device(device_index):
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        try:
            fn.preferred_shared_memory_carveout = 100
        except (AttributeError, RuntimeError):          # older CuPy: the driver's choice stays
            pass
    return fn


@functools.lru_cache(maxsize=None)
def side_stream(device_index: int, k: int = 0) -> torch.cuda.Stream:
    """Side stream number k of a device, on which a decode runs (a part of) its FP16 tail beside the page
    kernel (forked from and joined back into the caller's stream in every call, so CUDA-graph capture
    works)."""
    return torch.cuda.Stream(device=device_index)


@functools.lru_cache(maxsize=None)
def device_props(device_index: int) -> dict:
    """CUDA's device properties of that device (one driver query per device)."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_index)


@functools.lru_cache(maxsize=None)
def device_limits(device_index: int) -> tuple:
    """(registers, shared memory bytes, threads) per SM and the shared memory the driver keeps per block."""
    p = device_props(device_index)
    return (int(p["regsPerMultiprocessor"]), int(p["sharedMemPerMultiprocessor"]),
            int(p["maxThreadsPerMultiProcessor"]), int(p.get("reservedSharedMemPerBlock", 1024)))


def smem_optin(device_index: int) -> int:
    """The most shared memory one block may opt into on that device (bytes; 48 KiB if not reported)."""
    return int(device_props(device_index).get("sharedMemPerBlockOptin", 48 * 1024))


# ---------------------------------------------------------------------------------------------------
# occupancy and split-KV plans (numbers only)


def blocks_per_sm(fn, threads: int, smem: int, device_index: int) -> int:
    """Blocks of ``fn`` resident per SM at ``threads`` threads and ``smem`` bytes of dynamic shared
    memory: the least of the register, shared-memory and thread limits (registers are allocated per
    warp in units of 256)."""
    regs, shm, thr, reserved = device_limits(device_index)
    per_warp = -(-max(int(fn.num_regs), 1) * 32 // 256) * 256
    by_regs = regs // (per_warp * (threads // 32))
    by_smem = shm // (smem + int(fn.shared_size_bytes) + reserved)
    return max(1, min(by_regs, by_smem, thr // threads, 32))


@functools.lru_cache(maxsize=None)
def resident_slots(fn, threads: int, smem: int, device_index: int) -> int:
    """Blocks of ``fn`` resident on the whole device at once (``blocks_per_sm`` x SMs), once per launch
    configuration: the kernel attributes are driver queries, kept off the per-step path."""
    return blocks_per_sm(fn, threads, smem, device_index) * L.sm_count(device_index)


@functools.lru_cache(maxsize=4096)
def n_splits(NP: int, n_base: int, nw: int, slots: int) -> tuple:
    """(splits, pages per split) of NP pages for n_base blocks per split on ``slots`` resident blocks:
    the split count minimizing the makespan model waves(n_base * s) x (pages per warp + 1) (every page
    costs the same; a block's prologue, combine and partial write about one page more), among the
    counts that fill whole waves and never leave a warp without a page; ties go to fewer splits."""
    cap = max(1, -(-NP // nw))
    cands = {1, cap} | {max(1, min(cap, k * slots // n_base)) for k in range(1, 9)}
    best = None
    for sp in sorted(cands):
        pps = -(-(-(-NP // sp)) // nw) * nw                # whole pages for every warp of a block
        sp_real = -(-NP // pps)
        cost = (-(-(n_base * sp_real) // slots), pps // nw + 1)
        key = (cost[0] * cost[1], sp_real)
        if best is None or key < best[0]:
            best = (key, sp_real, pps)
    return best[1], best[2]


def fused_splits(NP: int, n_base: int, nw: int, slots: int, sms: int, few_bases: bool = False,
                 max_blocks_per_sm: int | None = None) -> tuple:
    """(splits, pages per split) of a fused decode kernel: ``n_splits`` on the kernel's ``slots`` resident
    blocks, or on at most ``max_blocks_per_sm`` blocks per SM. None (auto): where the plan at full
    occupancy leaves each warp at most ``FEW_PAGES_PER_WARP`` pages (a small grid: batch 1, or 8K
    context), at most 2 blocks per SM, each warp then twice the pages: fewer partials to merge and fewer
    block prologues, while 2 blocks of 4 warps already reach most of the SM's issue rate (the KIVI /
    Kitty and the OSCAR page kernels alike). ``few_bases``: also at most 2 blocks per SM whenever the
    n_base (batch x KV head) blocks of one split are fewer than the SMs, however many pages (the OSCAR
    kernel: lab/2026-11-22-oscar-decode/KNOBS.md)."""
    cap = max_blocks_per_sm
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"max_blocks_per_sm = {cap!r}: a positive int or None")
    if cap is None:
        sp, pps = n_splits(NP, n_base, nw, slots)
        if slots <= 2 * sms or (pps // nw > FEW_PAGES_PER_WARP and not (few_bases and n_base < sms)):
            return sp, pps
        cap = 2
    return n_splits(NP, n_base, nw, min(slots, cap * sms))
