"""Each method family's behaviour behind one interface, so that ``KVStore`` and the ``"kvq"`` attention
function read the same for every method.

One class per family of :data:`kvq.integrations.methods.METHODS`: :class:`FP16` (the uncompressed
baseline), :class:`Paged` (KIVI and Kitty: one paged state per layer), :class:`OSCAR` (per-layer states and
per-layer calibrations), :class:`BitDecoding` and :class:`AquaKV` (one cross-layer state, predictors,
tokens waiting for the other layers). :data:`FAMILIES` maps ``MethodSpec.family`` to its class.

Two kinds of members:

* class methods, of a method's config (no store): ``adapt`` / ``check_config`` (what ``configure`` changes
  for a head dim), ``quantized_bits`` / ``token_split`` / ``bits_per_element`` (the memory accounting),
  ``resolve_calibration`` (what the method takes as calibration), ``store_overrides`` /
  ``model_overrides`` (config fields a calibration or a model implies), ``check_devices`` (whether the
  layers may live on several devices);
* instance methods, of one store (``Family(store)``; the store keeps every piece of state in its own
  ``layer_states`` (one entry per layer) and ``shared_state`` (what the layers share), the family object
  only the method's module and derived caches; what else it uses of the store is the store's public
  interface for families, listed in ``KVStore``'s docstring): ``init`` / ``grown`` (the states for a
  capacity), ``length``, ``state``, ``pending``, ``prepare`` (the last checks of an append, before any
  write), ``write``, ``commit`` / ``attended`` (the cross-layer step), ``dequantize`` / ``read``
  (``keys_values``), ``decode_attention`` (a query over the compressed state), ``allocated_bytes``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from kvq.reference import aqua, aqua_cache, bitdecoding, oscar, paged
from kvq.reference.model import apply_rope

from . import tensors as T

__all__ = ["Family", "FP16", "Paged", "Kitty", "OSCAR", "BitDecoding", "AquaKV", "FAMILIES", "family_of"]


def _largest_divisor(n: int, cap: int, step: int = 1) -> int | None:
    """The largest g <= cap, a multiple of ``step``, that divides n (None if there is none)."""
    for g in range(min(cap, n) - min(cap, n) % step, 0, -step):
        if n % g == 0:
            return g
    return None


def _meta_bits(meta_dtype) -> int:
    return 8 * np.dtype(np.float16 if str(meta_dtype) in ("float16", "fp16") else meta_dtype).itemsize


def _aqua_counts(cfg, T: int):
    """(n_sink, n_chunks, n_buf) of T tokens in an AQUA-KV cache (``aqua_cache``'s bookkeeping)."""
    n_sink = min(T, cfg.sink)
    post = T - n_sink
    return n_sink, post // cfg.buffer, post % cfg.buffer


@functools.cache
def _fast_paged():
    """``kvq.fast.caches.paged``, imported on first use (this module loads without torch)."""
    return importlib.import_module("kvq.fast.caches.paged")


def _no_value_scan():
    """The fast decode without its NaN / inf scan of q (``kvq.fast.validation(False)``): a scan is a device
    synchronization per layer and step, and a model's query is its own (NaN there comes from NaN hidden
    states, which reach the logits anyway). Triton's decodes give NaN out for a NaN query row; CuPy's may give
    zeros (their running max skips NaN scores). Shapes, dtypes and devices are still checked."""
    return T.fast_common().validation(False)


# ---------------------------------------------------------------------------------------------------
# the interface, and the methods whose layers each hold one state of the method's module


class Family:
    """A family of methods whose layers each hold one state of ``kvq.<tier>.<module>`` (``init``,
    ``append(cfg, state, k, v)``, ``dequantize(cfg, state)``, ``decode_attention(cfg, state, q)``): the
    interface's defaults, which :class:`Paged` and :class:`BitDecoding` use as they are."""

    #: ``MethodSpec.family`` of the methods it serves
    name = ""
    #: ``MethodSpec.calibration``: None, or the calibration's kind ("oscar", "aqua")
    calibration = None
    #: whether an append past the capacity reallocates the states (``KVStore(grow=True)``)
    grows = True
    #: whether reads are the stored tokens themselves (FP16: no dequantization, no memoised fp32 stage)
    exact = False

    def __init__(self, store):
        self.store = store
        module = store.spec.module
        tier = "kvq.reference" if store.backend == "reference" else f"kvq.fast.{store.backend}"
        self.mod = None if module is None else importlib.import_module(f"{tier}.{module}")

    # ------------------------------------------------------------------ config (class methods)

    @classmethod
    def adapt(cls, name: str, base, overrides: dict, head_dim: int, kv_heads) -> dict:
        """Config fields ``configure`` changes for ``head_dim`` where the caller did not override them."""
        return {}

    @classmethod
    def check_config(cls, name: str, cfg, head_dim: int) -> None:
        """Refuse a configured ``cfg`` that cannot serve ``head_dim`` (ValueError naming the method)."""

    @classmethod
    def quantized_bits(cls, cfg, head_dim: int, kv_heads: int, n_layers: int, accounting: str):
        """(q_k, q_v): bits of one quantized key / value element, metadata (and index) included."""
        raise NotImplementedError(cls.name)

    @classmethod
    def paper_fp_tokens(cls, cfg) -> int:
        """Tokens the paper keeps in FP16 and counts (KIVI / Kitty / AQUA-KV: the sink)."""
        return cfg.sink

    @classmethod
    def state_tokens(cls, cfg, T: int):
        """((fp_k, q_k_tokens), (fp_v, q_v_tokens)) of T tokens where the state actually keeps them."""
        raise NotImplementedError(cls.name)

    @classmethod
    def token_split(cls, cfg, T: int, accounting: str):
        """((fp_k, q_k_tokens), (fp_v, q_v_tokens)): tokens of one K / V stream in FP16 and quantized."""
        if accounting == "paper":
            n_fp = min(cls.paper_fp_tokens(cfg), T)
            return (n_fp, T - n_fp), (n_fp, T - n_fp)
        return cls.state_tokens(cfg, T)

    @classmethod
    def bits_per_element(cls, cfg, T: int, head_dim: int, kv_heads: int, n_layers: int, accounting: str) -> float:
        """``methods.bits_per_element`` of this family (arguments checked there)."""
        q_k, q_v = cls.quantized_bits(cfg, head_dim, kv_heads, n_layers, accounting)
        (fk, nk), (fv, nv) = cls.token_split(cfg, T, accounting)
        total = 16 * fk + nk * q_k + 16 * fv + nv * q_v
        return float(Fraction(total) / (2 * T))

    @classmethod
    def resolve_calibration(cls, name: str, calibration, L: int, H: int, D: int):
        """``methods.resolve_calibration`` of this family: what the method takes, validated."""
        kind = cls.calibration
        if kind is None:
            if calibration is not None:
                raise ValueError(f"{name} takes no calibration (got {type(calibration).__name__})")
            return None
        if calibration is None:
            raise ValueError(f"{name} needs a calibration: {cls.calibration_needed}. Run `kvq calibrate` on the "
                             f"model (or calibrate with kvq.reference.{kind}.calibrate), or pass "
                             f"calibration='identity' for the uncalibrated baseline")
        if isinstance(calibration, str):
            if calibration != "identity":
                raise ValueError(f"calibration={calibration!r} is unknown; pass calibration objects or 'identity'")
            return cls.identity_calibration(L, D)
        return cls.check_calibration(name, calibration, L, H, D)

    @classmethod
    def store_overrides(cls, calibration, overrides: dict) -> dict:
        """The config overrides a store of this family uses with ``calibration`` (default: ``overrides``)."""
        return overrides

    @classmethod
    def model_overrides(cls, dims: dict, calibration, overrides: dict) -> dict:
        """The config overrides an HF cache uses for a model of ``dims`` (``model_dims``)."""
        return overrides

    @classmethod
    def check_devices(cls, name: str, devices) -> None:
        """Refuse per-layer ``devices`` the family cannot spread its layers over (default: any are fine)."""

    # ------------------------------------------------------------------ one store's states

    def init(self, cfg):
        """(states, shared): one empty state per layer for ``cfg``, each on its layer's device; nothing shared."""
        s = self.store
        states = []
        for l in range(s.n_layers):
            with s.device_ctx(l):
                states.append(self.mod.init(cfg, s.batch, s.kv_heads, s.head_dim))
        return states, None

    def grown(self, cfg):
        """(states, shared) for the larger capacity of ``cfg``, holding the current contents."""
        s = self.store
        states = []
        for l, old in enumerate(s.layer_states):
            with s.device_ctx(l):
                states.append(T.copy_state(old, self.mod.init(cfg, s.batch, s.kv_heads, s.head_dim), cfg))
        return states, s.shared_state

    def length(self, layer: int) -> int:
        return int(self.store.layer_states[layer].length)

    def state(self, layer: int):
        """The public state object of ``layer`` (``KVStore.state``)."""
        return self.store.layer_states[layer]

    def pending(self, layer: int) -> int:
        """Tokens of ``layer`` waiting for the other layers (0: every append is written at once)."""
        return 0

    def prepare(self, layer: int, kx, vx, k_in):
        """The tokens as :meth:`write` takes them, after the checks only this family needs (default: as
        converted; the methods' appends validate before they write)."""
        return kx, vx

    def write(self, layer: int, kx, vx) -> None:
        """Append prepared tokens to ``layer`` (inside the store's ``_atomic``)."""
        s = self.store
        s.grow_to(self.length(layer) + int(kx.shape[2]))
        with s.value_checks():
            self.append(layer, kx, vx)

    def append(self, layer: int, k, v) -> None:
        self.mod.append(self.store.cfg, self.store.layer_states[layer], k, v)

    def commit(self) -> None:
        """Write what the layers have all received (cross-layer methods); default nothing."""

    def attended(self, layer: int) -> None:
        """A model's attention of ``layer`` is done for this step; default nothing."""

    def dequantize(self, layer: int):
        """The layer's cache dequantized, fp32 torch (B, H, T, D) on the layer's device."""
        s = self.store
        st = s.layer_states[layer]
        if st.length == 0:
            return s.empty(T.import_torch().float32, layer)
        with s.device_ctx(layer):
            K, V = self.mod_dequantize(layer, st)
        return s.tensor(K, layer), s.tensor(V, layer)

    def mod_dequantize(self, layer: int, st):
        return self.mod.dequantize(self.store.cfg, st)

    def read(self, layer: int, dtype, memo: dict):
        """``keys_values(layer, dtype)`` through the memo: the fp32 dequantization once, then each dtype."""
        torch = T.import_torch()
        if torch.float32 in memo:
            K, V = memo[torch.float32]
        else:
            K, V = self.store.dequantize(layer)
            memo[torch.float32] = (K, V)
        return T.to_out(K, dtype), T.to_out(V, dtype)

    def decode_attention(self, layer: int, q, scale=None):
        """Attention of ``q`` (B, H_q, T_q, D) over ``layer``'s state by the method's decode on the store's
        backend (the reference in NumPy fp32), (B, H_q, T_q, D) in q's dtype on q's device."""
        torch = T.import_torch()
        s = self.store
        st = s.layer_states[layer]
        if s.backend == "reference":
            out, _ = self.mod_decode(layer, st, q.detach().float().cpu().numpy(), scale)
            return T.to_out(torch.from_numpy(np.ascontiguousarray(out)).to(q.device), q.dtype)
        with s.device_ctx(layer), _no_value_scan():
            out, _ = self.mod_decode(layer, st, q, scale)
        return T.to_out(out, q.dtype)

    def mod_decode(self, layer: int, st, q, scale):
        return self.mod.decode_attention(self.store.cfg, st, q, scale=scale)

    def held(self) -> list:
        """The method states the store holds (one per layer)."""
        return self.store.layer_states

    def allocated_bytes(self) -> int:
        """Bytes of every array the states hold, preallocated capacity included."""
        total = 0
        for st in self.held():
            for a in st.arrays().values():
                total += int(a.nbytes) if isinstance(a, np.ndarray) else int(a.numel() * a.element_size())
        return total


# ---------------------------------------------------------------------------------------------------
# FP16


@dataclass(frozen=True)
class FP16Layer:
    """One FP16 layer: its tokens as stored (None before the first append) and their count."""

    k: object = None
    v: object = None
    length: int = 0


class FP16(Family):
    """The uncompressed baseline: every layer's tokens concatenated in the store's dtype, fixed by the first
    accepted append (``shared_state``: that dtype, None before)."""

    name = "fp16"
    grows = False
    exact = True

    @classmethod
    def bits_per_element(cls, cfg, T, head_dim, kv_heads, n_layers, accounting) -> float:
        return 16.0

    def init(self, cfg):
        return [FP16Layer()] * self.store.n_layers, None

    def length(self, layer: int) -> int:
        return self.store.layer_states[layer].length

    def state(self, layer: int):
        st = self.store.layer_states[layer]
        return None if st.k is None else (st.k, st.v)

    @property
    def dtype(self):
        """The store's dtype (None before the first accepted append)."""
        return self.store.shared_state

    def prepare(self, layer: int, kx, vx, k_in):
        dtype = self._dtype_for(k_in)
        return self._tensor(kx, dtype, "k", layer), self._tensor(vx, dtype, "v", layer)

    def _dtype_for(self, k_in):
        """The store's dtype, fixed by its first accepted append (that input's fp16 / bf16, else fp16)."""
        torch = T.import_torch()
        if self.store.shared_state is not None:
            return self.store.shared_state
        src = getattr(k_in, "dtype", None)
        return src if src in (torch.float16, torch.bfloat16) else torch.float16

    def _tensor(self, x, dtype, name: str, layer: int):
        """x as a new tensor of ``dtype`` on ``layer``'s device, NaN / inf and overflow refused whatever the
        input dtype (the quantized methods' rule); never the caller's memory."""
        torch = T.import_torch()
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
        t = t.to(self.store.devices[layer])
        y = T.checked_half(t, dtype, name, scan=self.store.validate)
        return y.clone() if y is t else y

    def write(self, layer: int, kx, vx) -> None:
        torch = T.import_torch()
        s = self.store
        if s.shared_state is None:
            s.shared_state = kx.dtype                             # fixed by the first accepted append
        st = s.layer_states[layer]
        if st.k is None:
            s.layer_states[layer] = FP16Layer(kx, vx, int(kx.shape[2]))
        else:
            s.layer_states[layer] = FP16Layer(torch.cat([st.k, kx], dim=2), torch.cat([st.v, vx], dim=2),
                                              st.length + int(kx.shape[2]))

    def read(self, layer: int, dtype, memo: dict):
        st = self.store.layer_states[layer]
        if st.k is None:
            return self.store.empty(dtype, layer)
        return st.k.to(dtype), st.v.to(dtype)

    def decode_attention(self, layer: int, q, scale=None):
        K, V = self.store.keys_values(layer, q.dtype)
        return T.import_torch().nn.functional.scaled_dot_product_attention(q, K, V, scale=scale,
                                                                           enable_gqa=q.shape[1] != K.shape[1])

    def allocated_bytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for st in self.store.layer_states for t in (st.k, st.v)
                       if t is not None))


# ---------------------------------------------------------------------------------------------------
# KIVI, Kitty, OSCAR, BitDecoding: one state per layer


class Paged(Family):
    """KIVI: 2 / 4-bit paged keys per channel and values per token (``kivi.py``)."""

    name = "kivi"

    def append(self, layer: int, k, v) -> None:
        """The fast backends' append without its checks of the state and of k, v, which the store has made
        (``kvq.fast.caches.paged.append_checked``: the values are still checked while validation is on);
        the reference's as it is."""
        s = self.store
        if s.backend == "reference":
            return super().append(layer, k, v)
        _fast_paged().append_checked(s.cfg, self.mod.KeyCodec, s.layer_states[layer], k, v)

    @classmethod
    def quantized_bits(cls, cfg, head_dim, kv_heads, n_layers, accounting):
        mb = _meta_bits(cfg.meta_dtype)
        return (cfg.k_bits + Fraction(2 * mb, cfg.group_size),
                cfg.v_bits + Fraction(2 * mb, cfg.v_group(head_dim)))

    @classmethod
    def state_tokens(cls, cfg, T):
        c = paged.counts(cfg, T)
        fk = c["n_sink"] + c["n_kbuf"]
        fv = c["n_sink"] + c["n_win"] + c["n_vbuf"]
        return (fk, T - fk), (fv, T - fv)


class Kitty(Paged):
    """Kitty: KIVI's pages with a share of key channels boosted to 4 bits (``kitty.py``)."""

    name = "kitty"

    @classmethod
    def quantized_bits(cls, cfg, head_dim, kv_heads, n_layers, accounting):
        D = head_dim
        mb = _meta_bits(cfg.meta_dtype)
        q_k = 2 + Fraction(2 * cfg.d_boost(D), D) + Fraction(2 * mb, cfg.group_size)
        if accounting == "state":
            q_k += Fraction(8, cfg.group_size)                   # the uint8 boost index per channel per page
        return q_k, cfg.v_bits + Fraction(2 * mb, cfg.v_group(D))


class OSCAR(Family):
    """OSCAR: rotated INT2 keys and values per layer, with one ``OSCARCalibration`` per layer."""

    name = "oscar"
    calibration = "oscar"
    calibration_needed = "a list of one kvq.reference.oscar.OSCARCalibration per layer"

    @classmethod
    def adapt(cls, name, base, overrides, head_dim, kv_heads):
        if "group_size" not in overrides and head_dim % base.group_size:
            return {"group_size": _largest_divisor(head_dim, base.group_size)}
        return {}

    @classmethod
    def quantized_bits(cls, cfg, head_dim, kv_heads, n_layers, accounting):
        q = cfg.bits + Fraction(2 * _meta_bits(cfg.meta_dtype), cfg.group_size)
        return q, q

    @classmethod
    def paper_fp_tokens(cls, cfg) -> int:
        return cfg.sink + cfg.window

    @classmethod
    def state_tokens(cls, cfg, T):
        c = oscar.counts(cfg, T)
        f = c["n_sink"] + c["n_win"]
        return (f, T - f), (f, T - f)

    @classmethod
    def identity_calibration(cls, L, D):
        return [oscar.identity_calibration(D)] * L

    @classmethod
    def check_calibration(cls, name, calibration, L, H, D):
        if isinstance(calibration, oscar.OSCARCalibration) or not hasattr(calibration, "__len__"):
            raise TypeError(f"{name} calibration must be a list of {L} OSCARCalibration (one per "
                            f"layer), got {type(calibration).__name__}")
        cal = list(calibration)
        if len(cal) != L:
            raise ValueError(f"{name} calibration has {len(cal)} layers; the model has {L}")
        for l, c in enumerate(cal):
            if not isinstance(c, oscar.OSCARCalibration):
                raise TypeError(f"calibration[{l}] must be an OSCARCalibration, got {type(c).__name__}")
            try:
                c.check(H, D)
            except ValueError as e:
                raise ValueError(f"{name} calibration of layer {l} does not fit this model "
                                 f"(head_dim={D}, kv_heads={H}): {e}") from None
        return cal

    def append(self, layer, k, v):
        self.mod.append(self.store.cfg, self.store.calibration[layer], self.store.layer_states[layer], k, v)

    def mod_dequantize(self, layer, st):
        return self.mod.dequantize(self.store.cfg, self.store.calibration[layer], st)

    def mod_decode(self, layer, st, q, scale):
        """Queries rotated by the layer's R_K, the output rotated back by R_V^T (the method's decode)."""
        return self.mod.decode_attention(self.store.cfg, self.store.calibration[layer], st, q, scale=scale)


class BitDecoding(Family):
    """BitDecoding: the tensor-core fragment layout, channel-wise (or tensor-wise) keys."""

    name = "bitdecoding"

    @classmethod
    def adapt(cls, name, base, overrides, head_dim, kv_heads):
        adapt = {}
        bits = overrides.get("bits", base.bits)
        step = 8 * (16 // bits) if bits in (2, 4) else 8
        if head_dim % step:
            raise ValueError(f"{name} cannot serve head_dim={head_dim}: BitDecoding's tensor-core fragment "
                             f"layout needs head_dim to be a multiple of {step} at {bits} bits (8-channel "
                             f"tiles x {16 // bits} codes per 16-bit word)")
        k_mode = overrides.get("k_mode", base.k_mode)
        groups = ["v_group"] + (["k_group"] if k_mode == "tensor" else [])
        for gname in groups:
            g0 = getattr(base, gname)
            if gname not in overrides and head_dim % g0:
                adapt[gname] = _largest_divisor(head_dim, g0, 8)
        return adapt

    @classmethod
    def quantized_bits(cls, cfg, head_dim, kv_heads, n_layers, accounting):
        return cfg.bits + Fraction(32, cfg.k_group), cfg.bits + Fraction(32, cfg.v_group)

    @classmethod
    def paper_fp_tokens(cls, cfg) -> int:
        return 0

    @classmethod
    def state_tokens(cls, cfg, T):
        n_p, res = bitdecoding.partition(T, cfg.n_r)
        return (res, n_p), (res, n_p)


# ---------------------------------------------------------------------------------------------------
# AQUA-KV: one cross-layer state


@dataclass(frozen=True)
class Waiting:
    """AQUA-KV: one layer's tokens waiting for the other layers (fp16, None when none wait)."""

    k: object = None
    v: object = None


class AquaKV(Family):
    """AQUA-KV: every layer in one cross-layer state (``shared_state``), with the predictors
    (``AquaPredictors``) reading the layer before; each layer's tokens wait (``layer_states``:
    :class:`Waiting`) until every layer has them, then one ``aqua_cache.append`` compresses them all (the
    commit)."""

    name = "aqua"
    calibration = "aqua"
    calibration_needed = "kvq.reference.aqua.AquaPredictors for every layer"

    #: |k| up to which a key's pre-RoPE form fits fp16 (undoing RoPE rotates channel pairs: at most sqrt(2) |k|)
    _ROPE_SAFE = 46000.0

    def __init__(self, store):
        super().__init__(store)
        self.chunks = []                                         # reference: decoded chunks, all layers
        self.all = None                                          # fast: (length, [(K_l, V_l)])
        self.history = None                                      # fast: (layer, chunks, hat) in a step

    # ------------------------------------------------------------------ config

    @classmethod
    def adapt(cls, name, base, overrides, head_dim, kv_heads):
        adapt = {}
        for bname in ("backbone", "first_layer"):
            bb = overrides.get(bname, getattr(base, bname))
            if bname not in overrides and isinstance(bb, aqua.Uniform) and head_dim % bb.group_size:
                adapt[bname] = dataclasses.replace(bb, group_size=_largest_divisor(head_dim, bb.group_size))
            if bname not in overrides and isinstance(bb, aqua.Higgs) and kv_heads is not None:
                F = T.check_pos_int("kv_heads", kv_heads) * head_dim
                g = F & -F                                          # largest power of two dividing F
                if g < bb.cfg.group_size and g % bb.cfg.d == 0:
                    adapt[bname] = aqua.Higgs(dataclasses.replace(bb.cfg, group_size=g))
        return adapt

    @classmethod
    def check_config(cls, name, cfg, head_dim):
        if cfg.pre_rope and head_dim % 2:
            raise ValueError(f"{name} cannot serve head_dim={head_dim}: pre-RoPE keys need an even head_dim")
        for bname in ("backbone", "first_layer"):
            bb = getattr(cfg, bname)
            if isinstance(bb, aqua.Uniform) and head_dim % bb.group_size:
                raise ValueError(f"{name} cannot serve head_dim={head_dim}: the uniform {bname}'s "
                                 f"group_size={bb.group_size} must divide head_dim")

    @classmethod
    def quantized_bits(cls, cfg, head_dim, kv_heads, n_layers, accounting):
        q = aqua_cache.bits_per_value(cfg, n_layers, kv_heads * head_dim)
        return q, q

    @classmethod
    def state_tokens(cls, cfg, T):
        n_sink, n_chunks, n_buf = _aqua_counts(cfg, T)
        return ((n_sink + n_buf, n_chunks * cfg.buffer),) * 2

    @classmethod
    def identity_calibration(cls, L, D):
        return aqua.AquaPredictors((None,) * L, (None,) * L)

    @classmethod
    def check_calibration(cls, name, calibration, L, H, D):
        if not isinstance(calibration, aqua.AquaPredictors):
            raise TypeError(f"{name} calibration must be kvq.reference.aqua.AquaPredictors, got "
                            f"{type(calibration).__name__}")
        if calibration.n_layers != L:
            raise ValueError(f"{name} calibration has predictors for {calibration.n_layers} layers; the "
                             f"model has {L}")
        F = H * D
        for l in range(1, L):
            for which, p, f_in in (("f_key", calibration.f_key[l], F), ("f_value", calibration.f_value[l], 2 * F)):
                if p is None:
                    continue
                shp = (np.shape(p.mats[0])[0], np.shape(p.mats[-1])[-1])
                if shp != (f_in, F):
                    raise ValueError(f"{name} calibration {which}[{l}] maps {shp[0]} -> {shp[1]} values; this "
                                     f"model needs {f_in} -> {F} (kv_heads={H} x head_dim={D})")
                if not all(np.isfinite(np.asarray(a)).all() for a in (*p.mats, p.bias)):
                    raise ValueError(f"{name} calibration {which}[{l}] has NaN or inf weights; every prediction "
                                     f"would be NaN (recalibrate: `kvq calibrate aqua`)")
        return calibration

    @classmethod
    def store_overrides(cls, calibration, overrides):
        """"identity" calibration: no predictors, so prediction is off (unless overridden)."""
        if isinstance(calibration, str) and calibration == "identity":
            return {"predict_keys": False, "predict_values": False, **overrides}
        return overrides

    @classmethod
    def model_overrides(cls, dims, calibration, overrides):
        """The model's ``rope_theta`` (keys are quantized pre-RoPE) unless given, then :meth:`store_overrides`."""
        if "rope_theta" not in overrides and dims["rope_theta"] is not None:
            overrides = {**overrides, "rope_theta": dims["rope_theta"]}
        return cls.store_overrides(calibration, overrides)

    @classmethod
    def check_devices(cls, name, devices):
        if devices is not None and len(set(devices)) > 1:
            raise ValueError(f"{name} keeps every layer in one cross-layer state (its predictors read the layer "
                             f"before), so it cannot spread its layers over devices; got device="
                             f"{[str(d) for d in devices]}. Load the model on one device, or use a per-layer "
                             f"method")

    # ------------------------------------------------------------------ states

    def init(self, cfg):
        s = self.store
        with s.device_ctx(0):
            shared = self.mod.init(cfg, s.n_layers, s.batch, s.kv_heads, s.head_dim)
        return [Waiting()] * s.n_layers, shared

    def grown(self, cfg):
        s = self.store
        with s.device_ctx(0):
            new = self.mod.init(cfg, s.n_layers, s.batch, s.kv_heads, s.head_dim)
            return s.layer_states, T.copy_state(s.shared_state, new, cfg)

    @property
    def pending_k(self) -> list:
        """Every layer's waiting keys (None where none wait)."""
        return [w.k for w in self.store.layer_states]

    @property
    def pending_v(self) -> list:
        return [w.v for w in self.store.layer_states]

    def length(self, layer):
        p = self.store.layer_states[layer].k
        return int(self.store.shared_state.length) + (0 if p is None else int(p.shape[2]))

    def state(self, layer):
        return self.store.shared_state

    def held(self):
        return [self.store.shared_state]

    def pending(self, layer):
        p = self.store.layer_states[layer].k
        return 0 if p is None else int(p.shape[2])

    def prepare(self, layer, kx, vx, k_in):
        """fp16 tokens (NaN / inf and overflow refused), and keys the layer's commit could not quantize refused."""
        k16, v16 = self.store.round16(kx, "k"), self.store.round16(vx, "v")
        self._check_quantizable(layer, k16)
        return k16, v16

    def _check_quantizable(self, layer: int, k16) -> None:
        """Refuse keys of ``layer`` that its chunk's commit could not quantize, where the layer alone decides
        it: tokens past the sink (sink tokens stay fp16) of a layer whose key residual is the pre-RoPE key
        itself (layer 0, or no key predictor).

        Every shipped quantizer (Uniform, HIGGS, KeepFP16) takes any vector within fp16's range: its scale
        and minimum fit fp16 metadata. Values are fp16 already, and so are pre-RoPE keys while |k| <= 46000;
        larger keys are undone from RoPE and run through the layer's quantizer on the host, the commit's
        own computation for them. A residual after a prediction depends on the layers before: the commit
        finds it, and the store's ``_atomic`` takes the completing append back.

        A store made with ``validate=False`` skips the check: it reads the keys' largest magnitude on the
        host, a GPU synchronization per layer and step."""
        s = self.store
        cfg, P = s.cfg, s.calibration
        if not s.validate or not cfg.pre_rope or (layer and cfg.predict_keys and P.f_key[layer] is not None):
            return
        t0 = s.length(layer)                                  # the position of the first new token
        skip = max(0, cfg.sink - t0)
        k = k16[:, :, skip:]
        if k.shape[2] == 0 or float(abs(k).max()) <= self._ROPE_SAFE:
            return
        pos = np.arange(t0 + skip, t0 + int(k16.shape[2]))
        k_pre = apply_rope(T.to_numpy(k).astype(np.float32), pos, cfg.rope_theta, inverse=True)   # (B, H, T, D)
        quantizer = cfg.first_layer if layer == 0 else cfg.backbone
        try:
            quantizer.encode(aqua.to_tokens(k_pre))
        except ValueError as e:
            raise ValueError(f"k cannot be compressed by {s.name} at layer {layer}: undone from RoPE (keys are "
                             f"quantized pre-RoPE) it leaves the range of the "
                             f"{getattr(quantizer, 'label', type(quantizer).__name__)} quantizer ({e})") from None

    def write(self, layer, kx, vx):
        """The tokens wait; the commit grows the state."""
        torch = T.import_torch()
        cat = (lambda a, b: torch.cat([a, b], dim=2)) if isinstance(kx, torch.Tensor) else \
            (lambda a, b: np.concatenate([a, b], axis=2))
        w = self.store.layer_states[layer]
        self.store.layer_states[layer] = Waiting(kx if w.k is None else cat(w.k, kx),
                                                 vx if w.v is None else cat(w.v, vx))

    def commit(self) -> None:
        """Append the tokens every layer has received (the common prefix) with one call. The method's append
        validates and encodes before it writes, so a failure (a residual beyond fp16 metadata, NaN
        predictions) leaves its state and every layer's waiting tokens as they were; the error names the
        commit, and the store's ``_atomic`` takes back the tokens of the append that completed it."""
        torch = T.import_torch()
        s = self.store
        if any(w.k is None for w in s.layer_states):
            return
        n = min(int(w.k.shape[2]) for w in s.layer_states)
        if n == 0:
            return
        if isinstance(s.layer_states[0].k, torch.Tensor):
            K = torch.stack([w.k[:, :, :n] for w in s.layer_states])
            V = torch.stack([w.v[:, :, :n] for w in s.layer_states])
        else:
            K = np.stack([w.k[:, :, :n] for w in s.layer_states])
            V = np.stack([w.v[:, :, :n] for w in s.layer_states])
        before = (s.cfg, s.max_tokens, s.growths, s.shared_state)
        try:
            s.grow_to(int(s.shared_state.length) + n)
            with s.device_ctx(0), s.value_checks():
                self.mod.append(s.cfg, s.calibration, s.shared_state, K, V)
        except (ValueError, TypeError) as e:
            s.cfg, s.max_tokens, s.growths, s.shared_state = before
            raise type(e)(f"{s.name} could not compress the {n} token(s) of every layer that this append "
                          f"completed, so the append was undone: {e}") from e
        for l, w in enumerate(s.layer_states):
            rest_k, rest_v = w.k[:, :, n:], w.v[:, :, n:]
            s.layer_states[l] = Waiting(rest_k, rest_v) if rest_k.shape[2] > 0 else Waiting()
            s.clear_memo(l)

    def attended(self, layer):
        """Commit, and forget the history reconstructed for the step once the last layer has attended."""
        layer = self.store.check_layer(layer)
        self.commit()
        if layer == self.store.n_layers - 1:
            self.history = None

    def aqua_history(self, layer: int):
        """Fast backends: layer ``layer``'s history reconstructed by the predictors (``decode_layer``:
        ``(K_hat, V_hat)`` token vectors of every encoded chunk), from layer ``layer - 1``'s, which is kept
        only during one model step (one layer at a time, never every layer), else decoded from layer 0."""
        s = self.store
        st = s.shared_state
        chunks = _aqua_counts(s.cfg, st.length)[1]
        prev = None
        if layer and self.history is not None and self.history[:2] == (layer - 1, chunks):
            prev = self.history[2]
        with s.device_ctx(layer):
            hat = self.mod.decode_layer(s.cfg, s.calibration, st, layer, prev)
        self.history = (layer, chunks, hat)
        return hat

    def dequantize(self, layer):
        """Committed, then waiting."""
        torch = T.import_torch()
        s = self.store
        K, V = self.committed(layer)
        w = s.layer_states[layer]
        if w.k is not None:
            K = torch.cat([K, s.tensor(w.k, layer)], dim=2)
            V = torch.cat([V, s.tensor(w.v, layer)], dim=2)
        return K, V

    def committed(self, layer: int):
        """Layer ``layer``'s committed cache, fp32 torch: sink, decoded chunks, buffer."""
        torch = T.import_torch()
        s = self.store
        st, cfg, P = s.shared_state, s.cfg, s.calibration
        if st.length == 0:
            return s.empty(torch.float32, layer)
        if s.backend != "reference":
            if self.all is None or self.all[0] != st.length:
                with s.device_ctx(layer):
                    self.all = (st.length, self.mod.dequantize(cfg, P, st))
            K, V = self.all[1][layer]
            return s.tensor(K, layer), s.tensor(V, layer)
        L, B, H, D = st.shape
        n_sink, n_chunks, n_buf = _aqua_counts(cfg, st.length)
        F, R = H * D, cfg.buffer
        while len(self.chunks) < n_chunks:                   # decode each chunk once, all layers, layer 0 first
            c = len(self.chunks)
            pos = cfg.sink + c * R + np.arange(R)
            K_hat = V_hat = None
            per_layer = []
            for l in range(L):
                codes = (st.first_k, st.first_v) if l == 0 else (st.res_k, st.res_v)
                Kq, Vq = ({n: (a[:, c] if l == 0 else a[l - 1, :, c]) for n, a in g.items()} for g in codes)
                K_hat, V_hat = aqua.decode(cfg, P, l, Kq, Vq, F, K_hat, V_hat)      # (B, R, F)
                k = aqua.from_tokens(K_hat, H)
                if cfg.pre_rope:
                    k = apply_rope(k, pos, cfg.rope_theta)
                per_layer.append((k, aqua.from_tokens(V_hat, H)))
            self.chunks.append(per_layer)
        ks = [st.sink_k[layer][:, :, :n_sink].astype(np.float32)] + [ch[layer][0] for ch in self.chunks[:n_chunks]]
        vs = [st.sink_v[layer][:, :, :n_sink].astype(np.float32)] + [ch[layer][1] for ch in self.chunks[:n_chunks]]
        ks.append(st.buf_k[layer][:, :, :n_buf].astype(np.float32))
        vs.append(st.buf_v[layer][:, :, :n_buf].astype(np.float32))
        return s.tensor(np.concatenate(ks, axis=2), layer), s.tensor(np.concatenate(vs, axis=2), layer)

    def decode_attention(self, layer, q, scale=None):
        """Sink, reconstructed history and buffer of the committed cache, then the waiting tokens, merged by
        log-sum-exp."""
        torch = T.import_torch()
        s = self.store
        w = s.layer_states[layer]
        if s.backend == "reference":                     # the committed chunks, each decoded once, then waiting
            from kvq.reference import attention as RA
            segs = []
            if s.shared_state.length:
                K, V = self.committed(layer)
                segs.append((K.cpu().numpy(), V.cpu().numpy()))
            if w.k is not None:
                segs.append((w.k.astype(np.float32), w.v.astype(np.float32)))
            out, _ = RA.decode_attention(q.detach().float().cpu().numpy(), segs, scale=scale)
            return T.to_out(torch.from_numpy(np.ascontiguousarray(out)).to(q.device), q.dtype)
        st = s.shared_state
        segs = []
        if st.length:
            fast = importlib.import_module("kvq.fast.caches.aqua_cache")
            segs = fast.segments(s.cfg, st, layer, self.aqua_history(layer))
        if w.k is not None:
            segs.append((w.k.float(), w.v.float()))
        segs = [x for x in segs if x[0].shape[2]]
        attn = importlib.import_module(f"kvq.fast.{s.backend}.attention")
        with s.device_ctx(layer), _no_value_scan():
            out, _ = attn.decode_attention(q.float(), segs, scale=scale)
        return T.to_out(out, q.dtype)


#: ``MethodSpec.family`` -> the class of its behaviour
FAMILIES: dict[str, type[Family]] = {c.name: c for c in (FP16, Paged, Kitty, OSCAR, BitDecoding, AquaKV)}


def family_of(spec) -> type[Family]:
    """The family class of a ``MethodSpec``."""
    return FAMILIES[spec.family]
