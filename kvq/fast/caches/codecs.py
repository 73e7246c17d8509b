"""Key-page codecs of the paged cache (KIVI, Kitty) on torch tensors, for either fast backend.

A codec knows how a key page is stored in the pool (``empty_pool``), how full pages of FP16 keys become
pool arrays (``encode_pages``; ``write_pages``: straight into the pool, one kernel), how pool
arrays become fp32 keys (``decode``) and which tensors the backend's fused decode kernel reads
(``kernel_arrays``). The arithmetic runs in the backend's bit-exact
kernels (``Ops``: its ``quant`` and ``packing`` modules); selection, gathers and layout are torch.

    from kvq.fast.caches.codecs import Ops, KittyCodec
    codec = KittyCodec(Ops("triton", TQ, TP, TQ.interpreting))     # TQ / TP: kvq.fast.triton.quant / packing
    arrays = codec.encode_pages(cfg, pages, first_index=0)       # pages: (B, H, n, G, D) fp16

Kitty (paper section 4.1, Fig. 3a): per page and head, the ``d_boost`` channels of largest mean |x|
(eq. 2) at 4 bits, the rest at 2: a dense ``low`` plane (D, G/4) of every channel's low two bits, a
compact ``high`` plane (D_boost, G/4) of the boosted channels' high two bits, and ``idx`` (D,) uint8:
the channel's 0-based row in ``high``, ``d_boost`` (the sentinel) for an unboosted channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np
import torch

from kvq.fast import common as C
from kvq.reference import kitty as RK
from kvq.reference import numerics as nx
from kvq.reference.kitty import SELECTIONS, KittyConfig
from kvq.reference.kivi import KIVIConfig


@dataclass(frozen=True)
class Ops:
    """A backend's bit-exact kernels: ``quant`` (quantize / dequantize) and ``packing`` (pack / unpack /
    quantize_pack / unpack_dequantize) modules, whether CPU tensors are allowed (the interpreter) and,
    where the backend has them, single-kernel writers of key pages and evicted values into the pool."""

    name: str
    quant: ModuleType
    packing: ModuleType
    allow_cpu: Callable[[], bool]
    #: (pages, pool, first slot, bits, d_boost, kitty) -> None: full key pages into the pool, one kernel
    key_flush: Callable | None = None
    #: (toks, v_codes, v_scale, v_mn, v_table, q0, bits, Gv) -> bool: evicted values into their page slots,
    #: one kernel (True), or False where the backend declines this eviction (the caller then quantizes
    #: and scatters: the same bits)
    value_evict: Callable | None = None
    #: (k, v, k_buf, v_win, v_buf, v_codes, v_scale, v_mn, v_table, nb, slot, nvb, mode, q0, new_page, first_id,
    #: bits, Gv) -> bool: one decode token's append in one kernel (``kvq.fast.caches.paged._append_token``'s
    #: writes: key into Q-buffer slot nb, value into window slot ``slot``, the evicted value (mode 1) into value
    #: Q-buffer slot nvb or (mode 2) quantized into history slot q0, its page ``first_id + b`` entered in
    #: the table where ``new_page``; mode 0 evicts nothing), or False where the backend declines it
    token_append: Callable | None = None


#: the paged cache writes pages and evicted values with the backend's single-kernel writers where it has
#: them (False: every write takes the quantize kernels and torch copies into the pool, as a backend
#: without them does)
FUSED_FLUSH = True


def writer(ops: Ops, name: str):
    """The backend's single-kernel pool writer ``name`` ("key_flush" / "value_evict" / "token_append"), or None
    has none or ``FUSED_FLUSH`` is off."""
    return getattr(ops, name) if FUSED_FLUSH else None


def check_key_flush(pages, pool: dict, first: int, bits: int, d_boost: int, kitty: bool) -> None:
    """The arguments of a backend's ``key_flush`` (see ``Ops``): ValueError on what its kernel relies on,
    before any launch (the caller, ``kvq.fast.caches.paged.append``, has validated the keys and allocated the
    slots)."""
    if pages.ndim != 5 or pages.dtype != torch.float16:
        raise ValueError(f"pages must be (B, H, n, G, D) float16, got {tuple(pages.shape)} {pages.dtype}")
    B, H, n, G, D = pages.shape
    if bits not in (2, 4, 8) or (kitty and bits != 2) or G % (8 // bits):
        raise ValueError(f"bits={bits} (Kitty: 2) must be 2, 4 or 8 and divide the group size {G} into bytes")
    if not 0 <= d_boost <= (min(D, 255) if kitty else 0):
        raise ValueError(f"d_boost={d_boost} must lie in [0, min(D, 255)] (KIVI: 0)")
    names = ("low", "high", "idx", "scale", "mn") if kitty else ("codes", "scale", "mn")
    if set(pool) != set(names):
        raise ValueError(f"the pool holds {sorted(pool)}, not {sorted(names)}")
    codes, scale, mn = pool[names[0]], pool["scale"], pool["mn"]
    shapes_ok = (codes.shape[1:] == (H, D, G * bits // 8) and scale.shape[1:] == (H, D) and mn.shape == scale.shape
                 and codes.dtype == torch.uint8 and first + n * B <= codes.shape[0])
    if kitty:
        shapes_ok = shapes_ok and pool["high"].shape[1:] == (H, d_boost, G // 4) and pool["idx"].shape == scale.shape
    if not shapes_ok:
        raise ValueError("the pool arrays do not match the pages (or too few slots are left)")
    _check_meta(scale, mn)
    if not all(t.is_contiguous() for t in pool.values()):
        raise ValueError("the pool arrays must be contiguous")


def _check_meta(scale, mn) -> None:
    """The writers' metadata: float16 or float32 (the configurations' ``meta_dtype``), both alike."""
    if scale.dtype not in (torch.float16, torch.float32) or mn.dtype != scale.dtype:
        raise ValueError(f"the metadata must be float16 or float32 (scale and mn alike), got {scale.dtype} / "
                         f"{mn.dtype}")


def key_flush_operands(pages, pool: dict, d_boost: int, kitty: bool) -> tuple:
    """What a backend's key-flush kernel takes, after ``check_key_flush``: (keys with (n, G, D) contiguous,
    codes (KIVI ``codes`` / Kitty ``low``), high, idx, scale, mn); a KIVI pool (or Kitty without boosted
    channels) passes the codes again for the arrays it lacks (never written)."""
    G, D = pages.shape[-2:]
    x = pages if pages.stride()[2:] == (G * D, D, 1) else pages.contiguous()
    codes = pool["low" if kitty else "codes"]
    return (x, codes, pool["high"] if kitty and d_boost else codes, pool["idx"] if kitty else codes, pool["scale"],
            pool["mn"])


def check_value_evict(toks, v_codes, v_scale, v_mn, v_table, q0: int, bits: int, Gv: int) -> None:
    """The arguments of a backend's ``value_evict`` (see ``Ops``): ValueError on what its kernel relies
    on, before any launch (the caller has set the page-table entries of these tokens)."""
    if toks.ndim != 4 or toks.dtype != torch.float16:
        raise ValueError(f"toks must be (B, H, e, D) float16, got {tuple(toks.shape)} {toks.dtype}")
    B, H, e, D = toks.shape
    if bits not in (2, 4, 8) or D % (8 // bits) or Gv < 1 or D % Gv:
        raise ValueError(f"bits={bits} must be 2, 4 or 8 with D={D} a multiple of {8 // max(bits, 1)} and of Gv={Gv}")
    G = v_codes.shape[2] if v_codes.ndim == 4 else 0
    if (v_codes.ndim != 4 or v_codes.shape[1] != H or v_codes.shape[3] != D * bits // 8
            or v_scale.shape != (v_codes.shape[0], H, G, D // Gv) or v_mn.shape != v_scale.shape
            or v_table.ndim != 2 or v_table.shape[0] != B or v_table.dtype != torch.int32
            or (e and (q0 + e - 1) // G >= v_table.shape[1])):
        raise ValueError("the value pool, its page table and the tokens do not match")
    _check_meta(v_scale, v_mn)
    if not all(t.is_contiguous() for t in (v_codes, v_scale, v_mn, v_table)):
        raise ValueError("the value pool and page table must be contiguous")


def _meta(cfg) -> torch.dtype:
    return C.torch_dtype(nx.dtype_name(cfg.meta_dtype))


class KIVICodec:
    """KIVI key pages: per-channel b-bit codes over the page's G tokens, packed along tokens:
    ``codes`` (D, G * bits / 8) uint8, ``scale`` / ``mn`` (D,) in the metadata dtype."""

    config = KIVIConfig          # the configuration class of the caches that store these pages

    def __init__(self, ops: Ops):
        self.ops = ops

    def empty_pool(self, cfg, Pn: int, H: int, D: int, device) -> dict:
        meta = _meta(cfg)
        return {"codes": torch.zeros((Pn, H, D, cfg.group_size * cfg.k_bits // 8), dtype=torch.uint8, device=device),
                "scale": torch.zeros((Pn, H, D), dtype=meta, device=device),
                "mn": torch.zeros((Pn, H, D), dtype=meta, device=device)}

    def encode_pages(self, cfg, pages: torch.Tensor, first_index: int) -> dict:
        """(B, H, n, G, D) fp16 keys -> page arrays (B, n, H, ...), one quantize+pack kernel for all."""
        B, H, n, G, D = pages.shape
        packed, scale, mn = self.ops.packing.quantize_pack(pages.reshape(B, H, n * G, D), cfg.k_bits, G, axis=2,
                                                           meta_dtype=nx.dtype_name(cfg.meta_dtype))
        codes = packed.view(B, H, n, G * cfg.k_bits // 8, D).permute(0, 2, 1, 4, 3)   # (B, n, H, D, GB)
        return {"codes": codes, "scale": scale.transpose(1, 2), "mn": mn.transpose(1, 2)}

    def write_pages(self, cfg, pool: dict, pages: torch.Tensor, first_slot: int) -> bool:
        """Full pages (B, H, n, G, D) fp16 encoded straight into the pool arrays at slots ``first_slot + j *
        B + b`` by the backend's key-page writer (one launch): True. False where the backend has none or
        ``FUSED_FLUSH`` is off: the caller then encodes (``encode_pages``) and copies."""
        flush = writer(self.ops, "key_flush")
        if flush is None:
            return False
        flush(pages, pool, first_slot, cfg.k_bits, 0, False)
        return True

    def decode(self, cfg, page: dict) -> torch.Tensor:
        """Pages (..., H, ...) -> fp32 keys (..., H, G, D)."""
        x = self.ops.packing.unpack_dequantize(page["codes"], page["scale"][..., None], page["mn"][..., None],
                                               cfg.k_bits, cfg.group_size, axis=-1, out_dtype="float32")
        return x.transpose(-1, -2)

    def kernel_arrays(self, cfg, st) -> dict:
        """The key-pool tensors and constants the fused decode kernel takes."""
        p = st.k_pool
        return {"codes": p["codes"], "high": p["codes"], "idx": p["codes"], "scale": p["scale"], "mn": p["mn"],
                "bits": cfg.k_bits, "kitty": False, "d_boost": 0}


# ---------------------------------------------------------------------------------------------------
# Kitty


def check_kpage(kpage, name="kpage", *, allow_cpu: bool = False):
    C.check_tensor(kpage, name, allow_cpu=allow_cpu)
    if kpage.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"{name} has dtype {kpage.dtype}; kvq quantizes float16 / bfloat16 / float32 data "
                        f"(bfloat16 as float32 values in NumPy). Convert explicitly, e.g. {name}.float().")
    RK.check_kpage_shape(kpage.shape, name)                      # (..., G, D) with G >= 1, as the reference


def check_select_boost(scores, d_boost, selection, rng, *, allow_cpu: bool = False) -> int:
    """The arguments of the public ``select_boost`` (the reference's rules and messages): ``scores`` a
    float tensor (..., D) on an allowed device, finite while validation is on (NaN would sort as the
    largest score; one device read), then ``kvq.reference.kitty.check_boost_args``. Returns d_boost."""
    C.check_tensor(scores, "scores", allow_cpu=allow_cpu)
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a real floating tensor (float16 / bfloat16 / float32 / float64), "
                        f"got dtype {scores.dtype}")
    if scores.dim() == 0:
        raise ValueError(f"scores must have at least 1 dimension(s) (..., D), got shape {tuple(scores.shape)}")
    d_boost = RK.check_boost_args(d_boost, selection, rng, scores.shape[-1])
    C.check_finite(scores, "scores")
    return d_boost


def check_page(page) -> None:
    """A Kitty page dict (``kvq.reference.kitty.check_page``: its keys, the reference's messages)."""
    RK.check_page(page)


def channel_scores(kpage) -> torch.Tensor:
    """Eq. 2: ``(1/G) sum_t |x_{t,i}|`` fp32, (..., G, D) -> (..., D) (torch's sum order: rule 7)."""
    G = kpage.shape[-2]
    # a 0-d device tensor, not a Python scalar: torch divides by a CPU scalar as a multiply by its reciprocal on CUDA
    return kpage.float().abs().sum(dim=-2) / torch.full((), float(G), dtype=torch.float32, device=kpage.device)


def select_boost(scores, d_boost: int, selection: str = "magnitude", rng=None) -> torch.Tensor:
    """Bool mask (..., D) of the ``d_boost`` boosted channels: largest scores first, ties to the lower
    channel (a stable sort on -score); ``"random"`` draws ``rng.random(scores.shape)`` on the host."""
    D = scores.shape[-1]
    if not 0 <= d_boost <= D:
        raise ValueError(f"d_boost={d_boost} must lie in [0, D={D}]")
    if selection == "magnitude":
        order = torch.sort(-scores.float(), dim=-1, stable=True).indices
    elif selection == "random":
        rng = np.random.default_rng(0) if rng is None else rng
        r = torch.from_numpy(rng.random(tuple(scores.shape))).to(scores.device)
        order = torch.sort(r, dim=-1, stable=True).indices
    else:
        raise ValueError(f"selection={selection!r} is unknown; choose one of {SELECTIONS}")
    mask = torch.zeros(tuple(scores.shape), dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, order[..., :d_boost], True)
    return mask


def check_boost(kpage, boost) -> int:
    """``d_boost`` of a boost mask (..., D) that holds the same number of channels in every page."""
    D = kpage.shape[-1]
    cnt = boost.sum(dim=-1)
    d_boost = int(cnt.max()) if boost.numel() else 0
    if tuple(boost.shape) != tuple(kpage.shape[:-2]) + (D,) or bool((cnt != d_boost).any()):
        raise ValueError(f"boost must be (..., D={D}) with the same number of channels in every page")
    return d_boost


def encode(ops: Ops, kpage, boost, d_boost: int, meta_dtype) -> dict:
    """Kitty page arrays of ``kpage`` (..., G, D); ``boost`` holds ``d_boost`` channels per page (no checks:
    they synchronize). The page is quantized at both widths with the backend's bit-exact quantizer (codes
    along tokens), the planes are selected with torch and packed with the backend's packer."""
    G = kpage.shape[-2]
    meta = nx.dtype_name(meta_dtype)
    c2, s2, m2 = ops.quant.quantize(kpage, 2, G, axis=-2, meta_dtype=meta)          # (..., G, D), (..., 1, D)
    c4, s4, m4 = ops.quant.quantize(kpage, 4, G, axis=-2, meta_dtype=meta)
    boost = boost.to(torch.bool)
    bt = boost.unsqueeze(-2)
    low = torch.where(bt, c4 & 3, c2)                                               # (..., G, D)
    rows = torch.cumsum(boost.to(torch.int32), dim=-1) - 1
    idx = torch.where(boost, rows, torch.full_like(rows, d_boost)).to(torch.uint8)
    hi_all = (c4 >> 2).transpose(-1, -2)                                            # (..., D, G)
    order = torch.sort((~boost).to(torch.int32), dim=-1, stable=True).indices[..., :d_boost]
    high = torch.gather(hi_all, -2, order.unsqueeze(-1).expand(*order.shape, G))
    return {"low": ops.packing.pack(low.transpose(-1, -2).contiguous(), 2, axis=-1),
            "high": ops.packing.pack(high.contiguous(), 2, axis=-1),
            "idx": idx,
            "scale": torch.where(boost, s4[..., 0, :], s2[..., 0, :]),
            "mn": torch.where(boost, m4[..., 0, :], m2[..., 0, :])}


def dequantize_page(ops: Ops, page: dict, group_size: int) -> torch.Tensor:
    """Algorithm 1: a key page back to fp32 keys (..., G, D): low | high[idx] << 2, then code * scale + mn."""
    low = ops.packing.unpack(page["low"], 2, axis=-1)                               # (..., D, G)
    high = ops.packing.unpack(page["high"], 2, axis=-1)                             # (..., D_boost, G)
    idx = page["idx"].long()
    d_boost = high.shape[-2]
    boost = idx < d_boost
    if d_boost:
        rows = torch.clamp(idx, max=d_boost - 1).unsqueeze(-1).expand(*idx.shape, low.shape[-1])
        x_high = torch.where(boost.unsqueeze(-1), torch.gather(high, -2, rows), 0).to(torch.uint8)
    else:
        x_high = torch.zeros_like(low)
    codes = low | (x_high << 2)
    x = ops.quant.dequantize(codes, page["scale"][..., None], page["mn"][..., None], group_size, axis=-1,
                             out_dtype="float32")
    return x.transpose(-1, -2)


class KittyCodec:
    """Kitty key pages: ``low``, ``high``, ``idx``, ``scale``, ``mn`` per (page, head)."""

    config = KittyConfig         # the configuration class of the caches that store these pages

    def __init__(self, ops: Ops):
        self.ops = ops

    def empty_pool(self, cfg, Pn: int, H: int, D: int, device) -> dict:
        meta = _meta(cfg)
        G, Db = cfg.group_size, cfg.d_boost(D)
        u8 = dict(dtype=torch.uint8, device=device)
        return {"low": torch.zeros((Pn, H, D, G // 4), **u8), "high": torch.zeros((Pn, H, Db, G // 4), **u8),
                "idx": torch.zeros((Pn, H, D), **u8), "scale": torch.zeros((Pn, H, D), dtype=meta, device=device),
                "mn": torch.zeros((Pn, H, D), dtype=meta, device=device)}

    def encode_pages(self, cfg, pages: torch.Tensor, first_index: int) -> dict:
        """(B, H, n, G, D) fp16 keys -> page arrays (B, n, H, ...)."""
        B, H, n, G, D = pages.shape
        scores = channel_scores(pages)                                              # (B, H, n, D)
        if cfg.selection == "random":
            boost = torch.stack([select_boost(scores[:, :, j], cfg.d_boost(D), "random",
                                              np.random.default_rng([cfg.seed, first_index + j]))
                                 for j in range(n)], dim=2)
        else:
            boost = select_boost(scores, cfg.d_boost(D), cfg.selection)
        arrays = encode(self.ops, pages, boost, cfg.d_boost(D), cfg.meta_dtype)      # d_boost per page
        return {name: a.transpose(1, 2) for name, a in arrays.items()}

    def write_pages(self, cfg, pool: dict, pages: torch.Tensor, first_slot: int) -> bool:
        """Full pages (B, H, n, G, D) fp16 encoded straight into the pool arrays at slots ``first_slot + j *
        B + b`` by the backend's fused flush kernel (one launch): True. False where the backend has none,
        the selection is random (drawn on the host) or ``FUSED_FLUSH`` is off: the caller then encodes
        (``encode_pages``) and copies."""
        flush = writer(self.ops, "key_flush")
        if flush is None or cfg.selection != "magnitude":
            return False
        flush(pages, pool, first_slot, 2, cfg.d_boost(pages.shape[-1]), True)
        return True

    def decode(self, cfg, page: dict) -> torch.Tensor:
        return dequantize_page(self.ops, page, cfg.group_size)

    def kernel_arrays(self, cfg, st) -> dict:
        p = st.k_pool
        Db = p["high"].shape[2]
        return {"codes": p["low"], "high": p["high"] if Db else p["low"], "idx": p["idx"], "scale": p["scale"],
                "mn": p["mn"], "bits": 2, "kitty": True, "d_boost": Db}
