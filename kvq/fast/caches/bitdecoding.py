"""Torch-side pieces of the BitDecoding fast tier shared by the Triton and CuPy backends: argument checks
with the reference's messages, the layout's unpacking as torch ops (shifts, masks and the index map as a
reshape), and the query transformation (a reshape). The kernels live in each backend's ``bitdecoding``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.reference import bitdecoding as _R
from kvq.reference.bitdecoding import P_N
from kvq.reference.state import check_config

from kvq.fast import common as C


def dtype_name(dtype) -> str:
    """A torch dtype named the NumPy way ('float16', 'uint16', ...), as the reference's messages name it."""
    return str(dtype).replace("torch.", "")


def check_cfg(cfg) -> None:
    """cfg must be a BitDecodingConfig (TypeError, the reference's message)."""
    check_config(cfg, _R.BitDecodingConfig)


def check_page_input(cfg, x, name: str, *, allow_cpu: bool) -> torch.Tensor:
    """The reference's page checks (same errors) on a torch tensor of pages (..., N_r, D); returns it contiguous."""
    check_cfg(cfg)
    C.check_tensor(x, name, allow_cpu=allow_cpu)
    if x.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"{name} has dtype {dtype_name(x.dtype)}; expected float16 or float32")
    if x.ndim < 2 or x.shape[-2] != cfg.n_r:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; a page is (..., N_r={cfg.n_r}, D)")
    cfg.check_head_dim(x.shape[-1])
    C.check_finite(x, name)
    return x.contiguous()


def check_words(x, name: str, dim: int, want: int, what: str, *, allow_cpu: bool) -> None:
    """x: uint16 words with ``x.shape[dim] == want`` (or, with ``want == 0``, a last axis of whole 8-word blocks)."""
    C.check_tensor(x, name, allow_cpu=allow_cpu)
    if x.dtype != torch.uint16 or x.ndim < 2 or (want and x.shape[dim] != want) or (not want and x.shape[-1] % P_N):
        raise ValueError(f"{name} has dtype {dtype_name(x.dtype)}, shape {tuple(x.shape)}; expected uint16 {what}")


def check_key_words(cfg, k_words, *, allow_cpu: bool) -> None:
    check_words(k_words, "k_words", -2, P_N * cfg.warps_n, f"(..., {P_N * cfg.warps_n}, D)", allow_cpu=allow_cpu)


def check_value_words(cfg, v_words, *, allow_cpu: bool) -> None:
    check_words(v_words, "v_words", -1, 0, f"(..., N_r, D / {cfg.per_word}) with D / {cfg.per_word} a multiple "
                                           f"of {P_N}", allow_cpu=allow_cpu)


def _slots(words: torch.Tensor, bits: int, R: int) -> torch.Tensor:
    """(...) uint16 words -> (..., R) int32 codes, slot i in bits [bits i, bits i + bits)."""
    shifts = torch.arange(R, device=words.device, dtype=torch.int32) * bits
    return (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)


def unpack_keys(cfg, k_words) -> torch.Tensor:
    """k_words (..., 8 W_n, D) -> codes (..., N_r, D) uint8 (checked first)."""
    lead, D = tuple(k_words.shape[:-2]), k_words.shape[-1]
    c = _slots(k_words.reshape(*lead, cfg.warps_n, P_N, D), cfg.bits, cfg.per_word)     # [w, g, c, i]
    return c.movedim(-1, -3).reshape(*lead, cfg.n_r, D).to(torch.uint8)


def unpack_values(cfg, v_words) -> torch.Tensor:
    """v_words (..., N_r, D / R) -> codes (..., N_r, D) uint8 (checked first)."""
    lead, W = tuple(v_words.shape[:-1]), v_words.shape[-1]
    c = _slots(v_words.reshape(*lead, W // P_N, P_N), cfg.bits, cfg.per_word)           # [t, u, g, i]
    return c.transpose(-1, -2).reshape(*lead, W * cfg.per_word).to(torch.uint8)


def check_page(cfg, k_words, k_params, v_words, v_params, *, allow_cpu: bool):
    """The arrays of pages for dequantize_page: shapes and dtypes; returns (lead, D, n pages)."""
    check_key_words(cfg, k_words, allow_cpu=allow_cpu)
    lead, D = tuple(k_words.shape[:-2]), k_words.shape[-1]
    cfg.check_head_dim(D)
    chan = cfg.k_mode == "channel"
    want = {"k_params": (*lead, *((cfg.n_r // cfg.k_group, D) if chan else (cfg.n_r, D // cfg.k_group)), 2),
            "v_words": (*lead, cfg.n_r, D // cfg.per_word), "v_params": (*lead, cfg.n_r, D // cfg.v_group, 2)}
    for name, x in (("k_params", k_params), ("v_words", v_words), ("v_params", v_params)):
        C.check_tensor(x, name, allow_cpu=allow_cpu)
        dt = torch.uint16 if name == "v_words" else torch.float16
        if tuple(x.shape) != want[name] or x.dtype != dt:
            raise ValueError(f"{name} has dtype {dtype_name(x.dtype)}, shape {tuple(x.shape)}; expected "
                             f"{dtype_name(dt)} {want[name]}")
    return lead, D, int(np.prod(lead, dtype=np.int64))


def query_transform(q, kv_heads: int) -> torch.Tensor:
    C.check_tensor(q, "q", allow_cpu=True)
    return q.reshape(_R.transformed_shape(tuple(q.shape), kv_heads))


def query_untransform(o, q_heads: int) -> torch.Tensor:
    C.check_tensor(o, "o", allow_cpu=True)
    return o.reshape(_R.untransformed_shape(tuple(o.shape), q_heads))
