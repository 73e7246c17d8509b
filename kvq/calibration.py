"""Calibration files: OSCAR rotations and AQUA-KV predictors as checked safetensors files (never pickle).

A calibration is fit once per model (``kvq calibrate oscar|aqua``) and loaded by every run that uses it.
The file is a plain safetensors file (``safetensors.numpy``): the arrays are its tensors, everything
else is JSON in its string metadata, one JSON document per key:

    schema          "kvq-calibration"            schema_version  1
    kind            "oscar" | "aqua"             kvq_version     the writer's kvq.__version__
    model_shape     {"n_layers", "kv_heads", "head_dim", "rope_theta", optional "model", ...}
    config          the method configuration (OSCAR: a dict or a dataclass's fields; AQUA: every
                    ``AquaConfig`` field, the backbone / first-layer quantizers described exactly)
    data            what the calibration was fit on (free-form)
    layout          per-layer scalars (OSCAR clip ratios, rotation kind) / predictor structure (AQUA)
    checksum        "sha256:..." over the tensors' names, dtypes, shapes and bytes in sorted name order
    meta_checksum   "sha256:..." over the other metadata (canonical JSON)

Loading verifies all of it and fails with a :class:`CalibrationFileError` naming the problem: a missing
file, bytes that are not safetensors (a pickle / ``.npz`` is refused, never unpickled), a truncated or
corrupted file, a wrong schema or kind, a newer schema version, a model shape other than the expected
one, missing or extra tensors. Arrays come back with the dtype and shape they were saved with.

    save_oscar("llama.oscar.safetensors", calibs, model_shape=dict(n_layers=32, kv_heads=8, head_dim=128))
    calibs, meta = load_oscar("llama.oscar.safetensors", expect={"head_dim": 128, "n_layers": 32})
    P, cfg, meta = load_aqua("llama.aqua.safetensors")
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile

import numpy as np

__all__ = ["SCHEMA", "SCHEMA_VERSION", "CalibrationFileError", "checksum", "save_oscar", "load_oscar",
           "save_aqua", "load_aqua", "inspect"]

SCHEMA = "kvq-calibration"
SCHEMA_VERSION = 1
KINDS = ("oscar", "aqua")
_META_KEYS = ("schema", "schema_version", "kind", "kvq_version", "model_shape", "config", "data", "layout",
              "checksum", "meta_checksum")
_SHAPE_INTS = ("n_layers", "kv_heads", "head_dim")


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used: missing, not safetensors, corrupted, or not the one expected."""


# ---------------------------------------------------------------------------------------------------
# helpers: JSON, checksums, model shapes


def _jsonable(x, where: str):
    """``x`` with NumPy scalars turned into Python ones; raises unless it is plain JSON data."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(float(x)):
            raise ValueError(f"{where}: {x!r} is not a finite number (JSON cannot hold it exactly)")
        return float(x)
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string")
            out[k] = _jsonable(v, f"{where}.{k}")
        return out
    raise ValueError(f"{where}: {type(x).__name__} {x!r} is not JSON data (str, number, bool, None, list, dict)")


def _dumps(x) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"), allow_nan=False)


def checksum(tensors: dict) -> str:
    """``"sha256:<hex>"`` over each tensor's name, dtype, shape and bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        head = _dumps([name, a.dtype.name, list(a.shape), len(data)]).encode()
        h.update(len(head).to_bytes(8, "little") + head + data)
    return "sha256:" + h.hexdigest()


def _meta_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return "sha256:" + hashlib.sha256(_dumps(body).encode()).hexdigest()


def _check_model_shape(model_shape) -> dict:
    if not isinstance(model_shape, dict):
        raise TypeError(f"model_shape must be a dict with n_layers, kv_heads, head_dim; got {model_shape!r}")
    ms = _jsonable(dict(model_shape), "model_shape")
    for k in _SHAPE_INTS:
        v = ms.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"model_shape[{k!r}] must be a positive int, got {v!r}")
    ms.setdefault("rope_theta", None)
    if ms["rope_theta"] is not None and not isinstance(ms["rope_theta"], (int, float)):
        raise ValueError(f"model_shape['rope_theta'] must be a number or None, got {ms['rope_theta']!r}")
    if "model" in ms and ms["model"] is not None and not isinstance(ms["model"], str):
        raise ValueError(f"model_shape['model'] must be a name or path (str), got {ms['model']!r}")
    return ms


# ---------------------------------------------------------------------------------------------------
# writing and reading the container


def _write(path, kind: str, tensors: dict, *, model_shape: dict, config, data, layout) -> dict:
    from safetensors.numpy import save_file

    from kvq import __version__

    tensors = {n: np.ascontiguousarray(a) for n, a in tensors.items()}
    for n, a in tensors.items():
        if a.dtype.byteorder == ">":
            tensors[n] = a.astype(a.dtype.newbyteorder("<"))
    meta = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": kind, "kvq_version": __version__,
            "model_shape": model_shape, "config": _jsonable(config, "config"),
            "data": _jsonable({} if data is None else data, "data"), "layout": _jsonable(layout, "layout"),
            "checksum": checksum(tensors)}
    meta["meta_checksum"] = _meta_checksum(meta)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kvq-calib-", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={k: _dumps(v) for k, v in meta.items()})
        os.replace(tmp, path)                                   # atomic: never a half-written file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return meta


def _sniff(path: str) -> None:
    """Refuse files that are plainly something else, before any parser sees them (pickle is never loaded)."""
    if not os.path.exists(path):
        raise CalibrationFileError(f"{path}: no such calibration file")
    if os.path.isdir(path):
        raise CalibrationFileError(f"{path}: is a directory, not a calibration file")
    with open(path, "rb") as f:
        head = f.read(9)
    size = os.path.getsize(path)
    if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= size - 8:
        return                    # safetensors: an 8-byte little-endian header length, then JSON "{...}"
    head = head[:8]
    what = None
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        what = "a zip archive (a NumPy .npz or a torch .pt file?)"
    elif head.startswith(b"\x93NUMPY"):
        what = "a NumPy .npy file"
    elif head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        what = "a Python pickle"
    if what is not None:
        raise CalibrationFileError(f"{path}: is {what}, not a safetensors file; kvq calibration files are "
                                   f"safetensors and pickled or .npz data is never loaded")
    if len(head) < 8:
        raise CalibrationFileError(f"{path}: is {len(head)} bytes long: truncated, not a safetensors file")


def _read_meta(path: str, f) -> dict:
    raw = f.metadata() or {}
    if "schema" not in raw:
        raise CalibrationFileError(f"{path}: a safetensors file without kvq calibration metadata "
                                   f"(no 'schema' key; metadata keys: {sorted(raw)})")
    meta = {}
    for k, v in raw.items():
        try:
            meta[k] = json.loads(v)
        except json.JSONDecodeError as e:
            raise CalibrationFileError(f"{path}: metadata {k!r} is not valid JSON ({e}): corrupted file") from None
    if meta["schema"] != SCHEMA:
        raise CalibrationFileError(f"{path}: schema is {meta['schema']!r}, expected {SCHEMA!r}")
    ver = meta.get("schema_version")
    if isinstance(ver, bool) or not isinstance(ver, int) or ver < 1:
        raise CalibrationFileError(f"{path}: schema_version {ver!r} is not a positive int")
    if ver > SCHEMA_VERSION:
        raise CalibrationFileError(f"{path}: schema_version {ver} is newer than this kvq reads "
                                   f"({SCHEMA_VERSION}); upgrade kvq to load it")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise CalibrationFileError(f"{path}: metadata lacks {missing}")
    extra = sorted(set(meta) - set(_META_KEYS))
    if extra:
        raise CalibrationFileError(f"{path}: unexpected metadata keys {extra}")
    if meta["meta_checksum"] != _meta_checksum(meta):
        raise CalibrationFileError(f"{path}: metadata checksum mismatch: the metadata was altered or corrupted")
    if meta["kind"] not in KINDS:
        raise CalibrationFileError(f"{path}: kind {meta['kind']!r} is not one of {KINDS}")
    try:
        meta["model_shape"] = _check_model_shape(meta["model_shape"])
    except (TypeError, ValueError) as e:
        raise CalibrationFileError(f"{path}: {e}") from None
    return meta


def _open(path, kind: str | None, *, tensors: bool = True):
    """``(meta, {name: array})`` of a calibration file, verified; ``tensors=False`` skips the arrays."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    _sniff(path)
    try:
        with safe_open(path, framework="np") as f:
            meta = _read_meta(path, f)
            arrays = {n: np.array(f.get_tensor(n)) for n in f.keys()} if tensors else None
    except SafetensorError as e:
        raise CalibrationFileError(f"{path}: not a valid safetensors file (truncated or corrupted?): {e}") from None
    if kind is not None and meta["kind"] != kind:
        raise CalibrationFileError(f"{path}: holds a {meta['kind']!r} calibration, not {kind!r} "
                                   f"(load it with load_{meta['kind']})")
    if arrays is not None:
        got = checksum(arrays)
        if got != meta["checksum"]:
            raise CalibrationFileError(f"{path}: tensor checksum mismatch (file says {meta['checksum']}, "
                                       f"bytes give {got}): the file is corrupted")
    return meta, arrays


def _check_expect(path, meta: dict, expect) -> None:
    if expect is None:
        return
    ms = meta["model_shape"]
    for k, want in dict(expect).items():
        if k not in ms:
            raise CalibrationFileError(f"{path}: expect names {k!r}, which the file's model_shape lacks "
                                       f"(it has {sorted(ms)})")
        if ms[k] != want:
            raise CalibrationFileError(f"{path}: model shape mismatch: {k} is {ms[k]!r} in the file, "
                                       f"expected {want!r}")


def _check_names(path, arrays: dict, expected: set) -> None:
    missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if missing:
        raise CalibrationFileError(f"{path}: missing tensors {missing}")
    if extra:
        raise CalibrationFileError(f"{path}: unexpected tensors {extra}")


def _check_array(path, name: str, a: np.ndarray, shape: tuple, dtype=np.float32) -> None:
    if a.dtype != np.dtype(dtype) or a.shape != tuple(shape):
        raise CalibrationFileError(f"{path}: tensor {name!r} is {a.dtype} {a.shape}, expected "
                                   f"{np.dtype(dtype)} {tuple(shape)}")


def inspect(path, *, verify: bool = True) -> dict:
    """The metadata of a calibration file (JSON values decoded); ``verify`` also checks the tensor checksum."""
    return _open(path, None, tensors=verify)[0]


# ---------------------------------------------------------------------------------------------------
# OSCAR


def _config_json(config):
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return {"class": type(config).__name__, "fields": _jsonable(fields, f"config ({type(config).__name__})")}
    return _jsonable(config, "config")


def save_oscar(path, calibrations, *, model_shape: dict, config=None, data=None) -> dict:
    """Write one ``OSCARCalibration`` per layer to ``path``; returns the metadata written.

    ``config``: the method configuration (an ``OSCARConfig`` or any dataclass, stored as its fields, or a
    JSON dict such as the ``calibrate`` arguments); ``data``: what it was fit on (free-form JSON dict).
    """
    from kvq.reference.oscar import OSCARCalibration

    ms = _check_model_shape(model_shape)
    calibrations = list(calibrations)
    if len(calibrations) != ms["n_layers"]:
        raise ValueError(f"{len(calibrations)} calibrations for model_shape n_layers={ms['n_layers']}")
    D, H = ms["head_dim"], ms["kv_heads"]
    tensors, layers = {}, []
    for l, c in enumerate(calibrations):
        if not isinstance(c, OSCARCalibration):
            raise TypeError(f"calibrations[{l}] is a {type(c).__name__}, not an OSCARCalibration")
        try:
            c.check(H, D)
        except ValueError as e:
            raise ValueError(f"calibrations[{l}]: {e}") from None
        entry = {"clip_k": float(c.clip_k), "clip_v": float(c.clip_v), "rotation": str(c.rotation),
                 "lam_K": c.lam_K is not None, "lam_V": c.lam_V is not None}
        layers.append(entry)
        tensors[f"layers.{l}.R_K"], tensors[f"layers.{l}.R_V"] = np.asarray(c.R_K), np.asarray(c.R_V)
        for n in ("lam_K", "lam_V"):
            if entry[n]:
                tensors[f"layers.{l}.{n}"] = np.asarray(getattr(c, n))
    return _write(path, "oscar", tensors, model_shape=ms, config=_config_json(config), data=data,
                  layout={"layers": layers})


def load_oscar(path, *, expect=None):
    """``(calibrations, meta)`` from a file written by :func:`save_oscar`, verified (see the module doc).

    ``expect``: model-shape fields (``n_layers``, ``kv_heads``, ``head_dim``, ...) the file must match.
    Every rotation passes ``OSCARCalibration``'s own checks (fp32, orthogonal, clip ratios in (0, 1]).
    """
    from kvq.reference.oscar import OSCARCalibration

    meta, arrays = _open(path, "oscar")
    _check_expect(path, meta, expect)
    layers = meta["layout"].get("layers") if isinstance(meta["layout"], dict) else None
    ms = meta["model_shape"]
    if not isinstance(layers, list) or len(layers) != ms["n_layers"]:
        raise CalibrationFileError(f"{path}: layout describes {None if layers is None else len(layers)} layers; "
                                   f"model_shape n_layers is {ms['n_layers']}")
    names = set()
    for l, e in enumerate(layers):
        if not isinstance(e, dict):
            raise CalibrationFileError(f"{path}: layout entry of layer {l} is {e!r}, not a dict")
        names |= {f"layers.{l}.R_K", f"layers.{l}.R_V"} | {f"layers.{l}.{n}" for n in ("lam_K", "lam_V") if e.get(n)}
    _check_names(path, arrays, names)
    out = []
    for l, e in enumerate(layers):
        R_K, R_V = arrays[f"layers.{l}.R_K"], arrays[f"layers.{l}.R_V"]
        D, H = ms["head_dim"], ms["kv_heads"]
        if R_K.shape not in ((D, D), (H, D, D)):
            raise CalibrationFileError(f"{path}: layers.{l}.R_K has shape {R_K.shape}; model_shape needs "
                                       f"({D}, {D}) or ({H}, {D}, {D})")
        lam = {n: arrays[f"layers.{l}.{n}"] if e.get(n) else None for n in ("lam_K", "lam_V")}
        try:
            out.append(OSCARCalibration(R_K, R_V, e["clip_k"], e["clip_v"], lam["lam_K"], lam["lam_V"],
                                        e["rotation"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CalibrationFileError(f"{path}: layer {l}: {type(err).__name__}: {err}") from None
    return out, meta


# ---------------------------------------------------------------------------------------------------
# AQUA-KV


def _backbone_json(b, name: str, tensors: dict) -> dict:
    from kvq.reference.aqua import Higgs, KeepFP16, Uniform

    if type(b) is Uniform:
        return {"type": "uniform", "bits": int(b.bits), "group_size": int(b.group_size), "meta_dtype": str(b.meta_dtype)}
    if type(b) is KeepFP16:
        return {"type": "fp16"}
    if type(b) is Higgs:
        c = b.cfg
        grid = None
        if c.grid is not None:
            grid = f"config.{name}.grid"
            tensors[grid] = np.asarray(c.grid)
        return {"type": "higgs", "d": int(c.d), "n": int(c.n), "group_size": int(c.group_size),
                "meta_dtype": str(c.meta_dtype), "grid": grid}
    raise TypeError(f"cfg.{name} is a {type(b).__name__}; a calibration file can describe Uniform, Higgs "
                    f"and KeepFP16 backbones")


def _backbone_from_json(path, d: dict, name: str, arrays: dict):
    from kvq.reference import higgs
    from kvq.reference.aqua import Higgs, KeepFP16, Uniform

    try:
        kind = d["type"]
        if kind == "uniform":
            return Uniform(bits=d["bits"], group_size=d["group_size"], meta_dtype=d["meta_dtype"])
        if kind == "fp16":
            return KeepFP16()
        if kind == "higgs":
            grid = None if d["grid"] is None else arrays[d["grid"]]
            return Higgs(higgs.HiggsConfig(d=d["d"], n=d["n"], group_size=d["group_size"],
                                           meta_dtype=d["meta_dtype"], grid=grid))
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationFileError(f"{path}: config.{name} {d!r} cannot be rebuilt: {type(e).__name__}: {e}") from None
    raise CalibrationFileError(f"{path}: config.{name} has unknown type {kind!r} (uniform, higgs, fp16)")


def _predictor_layout(preds, name: str, n_layers: int, F: int, F_in: int, tensors: dict) -> list:
    from kvq.reference.aqua import Predictor

    if len(preds) != n_layers:
        raise ValueError(f"{name} has {len(preds)} entries for n_layers={n_layers}")
    layout = []
    for l, p in enumerate(preds):
        if p is None:
            layout.append(None)
            continue
        if not isinstance(p, Predictor):
            raise TypeError(f"{name}[{l}] is a {type(p).__name__}, not a Predictor")
        dims = [F_in] + [int(np.shape(m)[1]) for m in p.mats]
        for i, m in enumerate(p.mats):
            m = np.asarray(m)
            if m.dtype != np.float32 or m.shape != (dims[i], dims[i + 1]):
                raise ValueError(f"{name}[{l}].mats[{i}] is {m.dtype} {m.shape}; expected float32 "
                                 f"({dims[i]}, {dims[i + 1]}) (F = kv_heads * head_dim = {F})")
            tensors[f"{name}.{l}.mats.{i}"] = m
        b = np.asarray(p.bias)
        if dims[-1] != F or b.dtype != np.float32 or b.shape != (F,):
            raise ValueError(f"{name}[{l}] maps to {dims[-1]} values with bias {b.dtype} {b.shape}; "
                             f"expected F = {F} and a float32 ({F},) bias")
        tensors[f"{name}.{l}.bias"] = b
        layout.append([int(d) for d in dims[1:-1]])           # inner (rank) dims; [] for one matrix
    return layout


def save_aqua(path, predictors, cfg, *, model_shape: dict, data=None) -> dict:
    """Write AQUA-KV predictors and the ``AquaConfig`` they were fit for to ``path``; returns the metadata.

    Predictors map F = kv_heads * head_dim values (keys) or 2F (values: ``[V_prev_hat; K_hat]``) to F,
    in float32. With ``cfg.pre_rope`` the model's ``rope_theta`` must equal ``cfg.rope_theta``.
    """
    from kvq.reference.aqua import AquaConfig, AquaPredictors

    ms = _check_model_shape(model_shape)
    if not isinstance(cfg, AquaConfig):
        raise TypeError(f"cfg must be an AquaConfig, got {type(cfg).__name__}")
    if not isinstance(predictors, AquaPredictors):
        raise TypeError(f"predictors must be AquaPredictors, got {type(predictors).__name__}")
    if cfg.pre_rope and ms["rope_theta"] is not None and float(ms["rope_theta"]) != float(cfg.rope_theta):
        raise ValueError(f"cfg.rope_theta={cfg.rope_theta} differs from the model's rope_theta={ms['rope_theta']}")
    F = ms["kv_heads"] * ms["head_dim"]
    tensors = {}
    conf = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("backbone", "first_layer")}
    conf = _jsonable(conf, "AquaConfig")
    conf["backbone"] = _backbone_json(cfg.backbone, "backbone", tensors)
    conf["first_layer"] = _backbone_json(cfg.first_layer, "first_layer", tensors)
    layout = {"f_key": _predictor_layout(predictors.f_key, "f_key", ms["n_layers"], F, F, tensors),
              "f_value": _predictor_layout(predictors.f_value, "f_value", ms["n_layers"], F, 2 * F, tensors)}
    return _write(path, "aqua", tensors, model_shape=ms, config={"class": "AquaConfig", "fields": conf},
                  data=data, layout=layout)


def load_aqua(path, *, expect=None):
    """``(predictors, cfg, meta)`` from a file written by :func:`save_aqua`, verified (see the module doc)."""
    from kvq.reference.aqua import AquaConfig, AquaPredictors, Predictor

    meta, arrays = _open(path, "aqua")
    _check_expect(path, meta, expect)
    ms = meta["model_shape"]
    conf = meta["config"]
    if not isinstance(conf, dict) or conf.get("class") != "AquaConfig" or not isinstance(conf.get("fields"), dict):
        raise CalibrationFileError(f"{path}: config is not an AquaConfig description: {conf!r}")
    fields = dict(conf["fields"])
    lay = meta["layout"]
    if not isinstance(lay, dict) or sorted(lay) != ["f_key", "f_value"]:
        raise CalibrationFileError(f"{path}: layout must hold f_key and f_value, got {lay!r}")
    names = {d["grid"] for d in (fields.get("backbone"), fields.get("first_layer"))
             if isinstance(d, dict) and d.get("type") == "higgs" and d.get("grid")}
    for which in ("f_key", "f_value"):
        if not isinstance(lay[which], list) or len(lay[which]) != ms["n_layers"]:
            raise CalibrationFileError(f"{path}: layout {which} does not list n_layers={ms['n_layers']} entries")
        for l, inner in enumerate(lay[which]):
            if inner is not None:
                names |= {f"{which}.{l}.bias"} | {f"{which}.{l}.mats.{i}" for i in range(len(inner) + 1)}
    _check_names(path, arrays, names)
    try:
        fields["backbone"] = _backbone_from_json(path, fields.get("backbone", {}), "backbone", arrays)
        fields["first_layer"] = _backbone_from_json(path, fields.get("first_layer", {}), "first_layer", arrays)
        cfg = AquaConfig(**fields)
    except (TypeError, ValueError) as e:
        if isinstance(e, CalibrationFileError):
            raise
        raise CalibrationFileError(f"{path}: the AquaConfig cannot be rebuilt: {type(e).__name__}: {e}") from None
    F = ms["kv_heads"] * ms["head_dim"]
    out = {}
    for which, F_in in (("f_key", F), ("f_value", 2 * F)):
        preds = []
        for l, inner in enumerate(lay[which]):
            if inner is None:
                preds.append(None)
                continue
            dims = [F_in] + list(inner) + [F]
            mats = []
            for i in range(len(dims) - 1):
                n = f"{which}.{l}.mats.{i}"
                _check_array(path, n, arrays[n], (dims[i], dims[i + 1]))
                mats.append(arrays[n])
            _check_array(path, f"{which}.{l}.bias", arrays[f"{which}.{l}.bias"], (F,))
            preds.append(Predictor(tuple(mats), arrays[f"{which}.{l}.bias"]))
        out[which] = tuple(preds)
    return AquaPredictors(out["f_key"], out["f_value"]), cfg, meta
