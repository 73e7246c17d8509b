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
file, anything but a regular file (a named pipe, a directory, a device, a socket: refused before it is
opened, so a pipe never blocks), bytes that are not safetensors (a pickle / ``.npz`` is refused, never
unpickled), a truncated or corrupted file, a wrong schema or kind, a newer schema version, a model shape
other than the expected one, missing or extra tensors. The contents are validated too, on load and on
save (a file whose checksums were recomputed gets no further than a corrupted one): every tensor finite,
AQUA-KV predictors within ``MAX_PREDICTOR_ABS``, integer fields within the documented limits
(``MAX_MODEL_DIM``, ``MAX_TOKENS``, ``MAX_FP16_TOKENS``), metadata of the JSON types the writer writes and
at most ``MAX_META_DEPTH`` levels deep, an AQUA-KV ``rope_theta`` equal to the model's. Arrays come back
with the dtype and shape they were saved with. Files are written atomically (a temporary file in the
same directory, then ``os.replace``) with the permissions the process umask gives a new file.

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
import secrets
import stat

import numpy as np

from kvq.reference import aqua as RA

__all__ = ["SCHEMA", "SCHEMA_VERSION", "CalibrationFileError", "checksum", "save_oscar", "load_oscar",
           "save_aqua", "load_aqua", "inspect"]

SCHEMA = "kvq-calibration"
SCHEMA_VERSION = 1
KINDS = ("oscar", "aqua")
_META_KEYS = ("schema", "schema_version", "kind", "kvq_version", "model_shape", "config", "data", "layout",
              "checksum", "meta_checksum")
_SHAPE_INTS = ("n_layers", "kv_heads", "head_dim")

#: largest ``n_layers``, ``kv_heads`` or ``head_dim`` a file may describe (65,536: far beyond any model;
#: a larger value is corruption, and products of them size the arrays a loader checks)
MAX_MODEL_DIM = 1 << 16
#: largest AQUA-KV ``max_tokens`` (tokens per sequence) a file may describe: 2**24 = 16,777,216, beyond
#: any released model's positions
MAX_TOKENS = 1 << 24
#: most tokens an AQUA-KV file may keep in FP16 (``sink``, ``buffer``): 65,536, 500x the paper's 4 + 128.
#: Caches allocate these buffers up front (B x H_kv x tokens x D per layer), so a corrupted ``sink=1e9``
#: must fail here rather than ask for hundreds of GiB at the first update.
MAX_FP16_TOKENS = 1 << 16
#: largest |weight| or |bias| of an AQUA-KV predictor (1e6): defined beside the predictors' check,
#: ``kvq.reference.aqua.MAX_PREDICTOR_ABS``, and enforced by the loader here too
MAX_PREDICTOR_ABS = RA.MAX_PREDICTOR_ABS
#: deepest nesting of a metadata JSON value (the writer's deepest is 4: config.fields.backbone.type);
#: deeper documents are refused instead of recursing (no RecursionError)
MAX_META_DEPTH = 32


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used: missing, not safetensors, corrupted, or not the one expected."""


# ---------------------------------------------------------------------------------------------------
# helpers: JSON, checksums, model shapes


def _jsonable(x, where: str, depth: int = 0):
    """``x`` with NumPy scalars turned into Python ones; raises unless it is plain JSON data at most
    ``MAX_META_DEPTH`` levels deep (a self-containing list is refused, not recursed into)."""
    if depth > MAX_META_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_META_DEPTH} levels deep")
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
        return [_jsonable(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string")
            out[k] = _jsonable(v, f"{where}.{k}", depth + 1)
        return out
    raise ValueError(f"{where}: {type(x).__name__} {x!r} is not JSON data (str, number, bool, None, list, dict)")


def _short(x, n: int = 200) -> str:
    """``repr(x)`` cut to ``n`` characters (a corrupted value can be huge)."""
    r = repr(x)
    return r if len(r) <= n else r[:n] + "..."


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


def _positive_number(x) -> bool:
    """True for a finite int / float > 0 (never a bool)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_finite_tensors(tensors: dict, where: str) -> None:
    """ValueError naming the first floating-point tensor that holds NaN or inf."""
    for n in sorted(tensors):
        a = np.asarray(tensors[n])
        if a.dtype.kind in "fc" and not np.all(np.isfinite(a)):
            bad = int(np.size(a) - np.count_nonzero(np.isfinite(a)))
            raise ValueError(f"{where}tensor {n!r} holds {bad} NaN or inf value{'s' if bad > 1 else ''}; "
                             f"calibration arrays must be finite")


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
        if v > MAX_MODEL_DIM:
            raise ValueError(f"model_shape[{k!r}]={v} exceeds kvq.calibration.MAX_MODEL_DIM={MAX_MODEL_DIM}")
    ms.setdefault("rope_theta", None)
    if ms["rope_theta"] is not None and not _positive_number(ms["rope_theta"]):
        raise ValueError(f"model_shape['rope_theta'] must be a finite positive number or None, got "
                         f"{ms['rope_theta']!r}")
    if "model" in ms and ms["model"] is not None and not isinstance(ms["model"], str):
        raise ValueError(f"model_shape['model'] must be a name or path (str), got {ms['model']!r}")
    return ms


# ---------------------------------------------------------------------------------------------------
# writing and reading the container


def _check_destination(path: str) -> None:
    """Refuse a destination that cannot become a calibration file, before anything is written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CalibrationFileError(f"{path}: the directory {folder} does not exist")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CalibrationFileError(f"{path}: cannot be written ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CalibrationFileError(f"{path}: is {_file_kind(st.st_mode)}, not a regular file; it cannot be "
                                   f"replaced by a calibration file")


def _umask() -> int:
    """The process umask, read without changing it where the kernel reports it (Linux >= 4.7); else by the
    classic set-and-restore."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _new_temp(folder: str) -> str:
    """The name of a new empty file in ``folder`` (created exclusively, so never another's)."""
    for _ in range(100):
        tmp = os.path.join(folder, f".kvq-calib-{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"no free temporary file name in {folder}")


def _write(path, kind: str, tensors: dict, *, model_shape: dict, config, data, layout) -> dict:
    from safetensors.numpy import save_file

    from kvq import __version__

    tensors = {n: np.ascontiguousarray(a) for n, a in tensors.items()}
    for n, a in tensors.items():
        if a.dtype.byteorder == ">":
            tensors[n] = a.astype(a.dtype.newbyteorder("<"))
    _check_finite_tensors(tensors, "")
    meta = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": kind, "kvq_version": __version__,
            "model_shape": model_shape, "config": _jsonable(config, "config"),
            "data": _jsonable({} if data is None else data, "data"), "layout": _jsonable(layout, "layout"),
            "checksum": checksum(tensors)}
    meta["meta_checksum"] = _meta_checksum(meta)
    path = _fspath(path)
    _check_destination(path)
    tmp = _new_temp(os.path.dirname(os.path.abspath(path)))
    try:
        save_file(tensors, tmp, metadata={k: _dumps(v) for k, v in meta.items()})
        os.chmod(tmp, 0o666 & ~_umask())                        # a new file's mode (safetensors writes 0o600)
        os.replace(tmp, path)                                   # atomic: never a half-written file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return meta


def _fspath(path) -> str:
    """``path`` as a str (TypeError naming what it is otherwise)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fsdecode(os.fspath(path))


def _file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _regular_file(path: str) -> os.stat_result:
    """``os.stat(path)`` of a regular file; CalibrationFileError for a missing path or anything else (a
    named pipe would block the first read forever, a device never ends), decided before any open."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CalibrationFileError(f"{path}: no such calibration file") from None
    except (OSError, ValueError) as e:                       # permission, ENOTDIR, ELOOP, embedded NUL, ...
        raise CalibrationFileError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CalibrationFileError(f"{path}: is {_file_kind(st.st_mode)}, not a regular file; a calibration file "
                                   f"must be a regular file")
    return st


def _read_head(path: str, n: int) -> bytes:
    """The first ``n`` bytes of the regular file ``path``. Opened non-blocking and checked again on the
    open descriptor, so a path swapped for a pipe after the stat still cannot block."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise CalibrationFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CalibrationFileError(f"{path}: is {_file_kind(mode)}, not a regular file; a calibration file "
                                       f"must be a regular file")
        return os.read(fd, n)
    finally:
        os.close(fd)


def _sniff(path: str) -> None:
    """Refuse files that are plainly something else, before any parser sees them (pickle is never loaded):
    anything but a regular file first, by ``os.stat``, before any open."""
    size = _regular_file(path).st_size
    head = _read_head(path, 9)
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


def _depth(x) -> int:
    """Nesting depth of a JSON value (a scalar: 0), computed without recursion."""
    deepest, todo = 0, [(x, 0)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if d > MAX_META_DEPTH:
            break
        if isinstance(v, dict):
            todo.extend((w, d + 1) for w in v.values())
        elif isinstance(v, list):
            todo.extend((w, d + 1) for w in v)
    return deepest


def _loads(path: str, key: str, text) -> object:
    """One metadata value: JSON of finite numbers at most ``MAX_META_DEPTH`` deep, else CalibrationFileError."""
    def constant(name):
        raise CalibrationFileError(f"{path}: metadata {key!r} holds {name}, not a finite number")

    def finite(s):
        v = float(s)
        if not math.isfinite(v):
            raise CalibrationFileError(f"{path}: metadata {key!r} holds {s}, which overflows a float")
        return v

    if not isinstance(text, str):
        raise CalibrationFileError(f"{path}: metadata {key!r} is not a string")
    try:
        v = json.loads(text, parse_constant=constant, parse_float=finite)
    except CalibrationFileError:
        raise
    except RecursionError:
        raise CalibrationFileError(f"{path}: metadata {key!r} is nested more than {MAX_META_DEPTH} levels deep: "
                                   f"corrupted file") from None
    except ValueError as e:                                     # JSONDecodeError, an int of 5000 digits, ...
        raise CalibrationFileError(f"{path}: metadata {key!r} is not valid JSON ({e}): corrupted file") from None
    if _depth(v) > MAX_META_DEPTH:
        raise CalibrationFileError(f"{path}: metadata {key!r} is nested more than {MAX_META_DEPTH} levels deep: "
                                   f"corrupted file")
    return v


def _read_meta(path: str, f) -> dict:
    raw = f.metadata() or {}
    if "schema" not in raw:
        raise CalibrationFileError(f"{path}: a safetensors file without kvq calibration metadata "
                                   f"(no 'schema' key; metadata keys: {sorted(raw)})")
    meta = {k: _loads(path, k, v) for k, v in raw.items()}
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

    path = _fspath(path)
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
        try:
            _check_finite_tensors(arrays, "")
        except ValueError as e:
            raise CalibrationFileError(f"{path}: {e}") from None
    return meta, arrays


def _expect_arg(expect) -> dict | None:
    """``expect`` as a dict of model_shape fields (TypeError for anything else), checked before any read."""
    if expect is None:
        return None
    if not isinstance(expect, dict) or not all(isinstance(k, str) for k in expect):
        raise TypeError(f"expect must be a dict of model_shape fields (n_layers, kv_heads, head_dim, "
                        f"rope_theta, ...), got {expect!r}")
    return dict(expect)


def _check_expect(path, meta: dict, expect) -> None:
    if expect is None:
        return
    ms = meta["model_shape"]
    for k, want in expect.items():
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


_LAYER_KEYS = {"clip_k": "a number", "clip_v": "a number", "rotation": "a str", "lam_K": "true or false",
               "lam_V": "true or false"}


def _check_layer_entry(e) -> None:
    """ValueError unless ``e`` is an OSCAR layout entry of the writer's keys and JSON types (the values'
    ranges are ``OSCARCalibration``'s to check)."""
    if not isinstance(e, dict):
        raise ValueError(f"{_short(e)} is not a dict")
    if set(e) != set(_LAYER_KEYS):
        raise ValueError(f"has keys {sorted(e)}, expected {sorted(_LAYER_KEYS)}")
    for k, what in _LAYER_KEYS.items():
        v = e[k]
        ok = (isinstance(v, bool) if what == "true or false" else isinstance(v, str) if what == "a str"
              else not isinstance(v, bool) and isinstance(v, (int, float)))
        if not ok:
            raise ValueError(f"{k} must be {what}, got {v!r}")


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

    expect = _expect_arg(expect)
    meta, arrays = _open(path, "oscar")
    _check_expect(path, meta, expect)
    layers = meta["layout"].get("layers") if isinstance(meta["layout"], dict) else None
    ms = meta["model_shape"]
    if not isinstance(layers, list) or len(layers) != ms["n_layers"]:
        raise CalibrationFileError(f"{path}: layout describes {None if layers is None else len(layers)} layers; "
                                   f"model_shape n_layers is {ms['n_layers']}")
    names = set()
    for l, e in enumerate(layers):
        try:
            _check_layer_entry(e)
        except ValueError as err:
            raise CalibrationFileError(f"{path}: layout entry of layer {l}: {err}") from None
        names |= {f"layers.{l}.R_K", f"layers.{l}.R_V"} | {f"layers.{l}.{n}" for n in ("lam_K", "lam_V") if e[n]}
    _check_names(path, arrays, names)
    out = []
    for l, e in enumerate(layers):
        R_K, R_V = arrays[f"layers.{l}.R_K"], arrays[f"layers.{l}.R_V"]
        D, H = ms["head_dim"], ms["kv_heads"]
        if R_K.shape not in ((D, D), (H, D, D)):
            raise CalibrationFileError(f"{path}: layers.{l}.R_K has shape {R_K.shape}; model_shape needs "
                                       f"({D}, {D}) or ({H}, {D}, {D})")
        lam = {n: arrays[f"layers.{l}.{n}"] if e[n] else None for n in ("lam_K", "lam_V")}
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


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int)


def _check_backbone_json(d: dict, F: int) -> None:
    """ValueError unless the backbone description ``d`` has the writer's keys and JSON types, and groups
    that serve F = kv_heads * head_dim values per token: a uniform group divides F (quantization groups
    tile the vector); a HIGGS group is at most max(1024, F) (the paper's 1024, or the whole vector: a
    larger group only zero-pads every token)."""
    from kvq.reference.numerics import META_DTYPES

    if not isinstance(d, dict):
        raise ValueError(f"is a {type(d).__name__}, not a dict")
    kind = d.get("type")
    layouts = {"uniform": {"type", "bits", "group_size", "meta_dtype"}, "fp16": {"type"},
               "higgs": {"type", "d", "n", "group_size", "meta_dtype", "grid"}}
    keys = layouts.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise ValueError(f"has unknown type {kind!r} (uniform, higgs, fp16)")
    if set(d) != keys:
        raise ValueError(f"has keys {sorted(d)}; a {kind} backbone has {sorted(keys)}")
    if kind == "fp16":
        return
    if d["meta_dtype"] not in META_DTYPES:
        raise ValueError(f"meta_dtype {d['meta_dtype']!r} is not one of {META_DTYPES}")
    g = d["group_size"]
    if kind == "uniform":
        if not _is_int(d["bits"]):
            raise ValueError(f"bits must be an int, got {d['bits']!r}")
        if not _is_int(g) or not 1 <= g <= F or F % g:
            raise ValueError(f"group_size {g!r} must be an int dividing F = kv_heads * head_dim = {F}")
        return
    for k in ("d", "n"):
        if not _is_int(d[k]) or not 1 <= d[k] <= MAX_MODEL_DIM:
            raise ValueError(f"{k} must be an int in [1, {MAX_MODEL_DIM}], got {d[k]!r}")
    if not _is_int(g) or not 1 <= g <= max(1024, F):
        raise ValueError(f"group_size {g!r} must be an int in [1, max(1024, F = {F})]")
    if d["grid"] is not None and not isinstance(d["grid"], str):
        raise ValueError(f"grid must be a tensor name or null, got {d['grid']!r}")


def _backbone_from_json(path, d: dict, name: str, arrays: dict, F: int):
    from kvq.reference import higgs
    from kvq.reference.aqua import Higgs, KeepFP16, Uniform

    try:
        _check_backbone_json(d, F)
        kind = d["type"]
        if kind == "uniform":
            return Uniform(bits=d["bits"], group_size=d["group_size"], meta_dtype=d["meta_dtype"])
        if kind == "fp16":
            return KeepFP16()
        grid = None if d["grid"] is None else arrays[d["grid"]]
        return Higgs(higgs.HiggsConfig(d=d["d"], n=d["n"], group_size=d["group_size"],
                                       meta_dtype=d["meta_dtype"], grid=grid))
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationFileError(f"{path}: config.{name} {_short(d)} cannot be rebuilt: "
                                   f"{type(e).__name__}: {e}") from None


_AQUA_BOOLS = ("pre_rope", "predict_keys", "predict_values")
_AQUA_INTS = (("sink", 0, MAX_FP16_TOKENS, "MAX_FP16_TOKENS"), ("buffer", 1, MAX_FP16_TOKENS, "MAX_FP16_TOKENS"),
              ("max_tokens", 1, MAX_TOKENS, "MAX_TOKENS"))


def _check_aqua_fields(fields: dict, rope_theta) -> None:
    """ValueError unless the JSON ``AquaConfig`` fields (backbones aside) have the writer's types and lie
    within the documented limits: flags true / false, ``sink`` / ``buffer`` / ``max_tokens`` ints up to
    ``MAX_FP16_TOKENS`` / ``MAX_TOKENS``, ``rope_theta`` a finite positive number or null, equal to the
    model's ``rope_theta`` (when known) for keys predicted before RoPE."""
    for k in _AQUA_BOOLS:
        if k in fields and not isinstance(fields[k], bool):
            raise ValueError(f"AquaConfig.{k} must be true or false, got {fields[k]!r}")
    for k, lo, hi, limit in _AQUA_INTS:
        if k in fields and (not _is_int(fields[k]) or not lo <= fields[k] <= hi):
            raise ValueError(f"AquaConfig.{k}={fields[k]!r} must be an int in [{lo}, {hi}] "
                             f"(kvq.calibration.{limit})")
    theta = fields.get("rope_theta")
    if theta is not None and not _positive_number(theta):
        raise ValueError(f"AquaConfig.rope_theta must be a finite positive number or null, got {theta!r}")
    pre_rope = fields.get("pre_rope", True)
    if pre_rope and theta is not None and rope_theta is not None and float(theta) != float(rope_theta):
        raise ValueError(f"cfg.rope_theta={theta} differs from the model's rope_theta={rope_theta} (keys are "
                         f"predicted before RoPE, so the base must be the model's)")


def _check_predictor_array(name: str, a: np.ndarray) -> None:
    """ValueError unless every value of a predictor matrix / bias is finite with |w| <= MAX_PREDICTOR_ABS."""
    if a.size and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds NaN or inf; predictors must be finite")
    top = float(np.max(np.abs(a))) if a.size else 0.0
    if top > MAX_PREDICTOR_ABS:
        raise ValueError(f"{name} holds |w| = {top:.3g} > kvq.calibration.MAX_PREDICTOR_ABS = {MAX_PREDICTOR_ABS:g}: "
                         f"no ridge fit gives such weights (its predictions would overflow fp16)")


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
            _check_predictor_array(f"{name}[{l}].mats[{i}]", m)
            tensors[f"{name}.{l}.mats.{i}"] = m
        b = np.asarray(p.bias)
        if dims[-1] != F or b.dtype != np.float32 or b.shape != (F,):
            raise ValueError(f"{name}[{l}] maps to {dims[-1]} values with bias {b.dtype} {b.shape}; "
                             f"expected F = {F} and a float32 ({F},) bias")
        _check_predictor_array(f"{name}[{l}].bias", b)
        tensors[f"{name}.{l}.bias"] = b
        layout.append([int(d) for d in dims[1:-1]])           # inner (rank) dims; [] for one matrix
    return layout


def save_aqua(path, predictors, cfg, *, model_shape: dict, data=None) -> dict:
    """Write AQUA-KV predictors and the ``AquaConfig`` they were fit for to ``path``; returns the metadata.

    Predictors map F = kv_heads * head_dim values (keys) or 2F (values: ``[V_prev_hat; K_hat]``) to F,
    in float32, finite, with |w| <= ``MAX_PREDICTOR_ABS``. ``cfg`` must lie within the limits the loader
    checks (``MAX_FP16_TOKENS``, ``MAX_TOKENS``; backbone groups that serve F); with ``cfg.pre_rope`` the
    model's ``rope_theta`` must equal ``cfg.rope_theta``. Nothing is written unless all of it holds.
    """
    from kvq.reference.aqua import AquaConfig, AquaPredictors

    ms = _check_model_shape(model_shape)
    if not isinstance(cfg, AquaConfig):
        raise TypeError(f"cfg must be an AquaConfig, got {type(cfg).__name__}")
    if not isinstance(predictors, AquaPredictors):
        raise TypeError(f"predictors must be AquaPredictors, got {type(predictors).__name__}")
    F = ms["kv_heads"] * ms["head_dim"]
    tensors = {}
    conf = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("backbone", "first_layer")}
    conf = _jsonable(conf, "AquaConfig")
    _check_aqua_fields(conf, ms["rope_theta"])
    for name in ("backbone", "first_layer"):
        conf[name] = _backbone_json(getattr(cfg, name), name, tensors)
        try:
            _check_backbone_json(conf[name], F)
        except ValueError as e:
            raise ValueError(f"cfg.{name}: {e}") from None
    layout = {"f_key": _predictor_layout(predictors.f_key, "f_key", ms["n_layers"], F, F, tensors),
              "f_value": _predictor_layout(predictors.f_value, "f_value", ms["n_layers"], F, 2 * F, tensors)}
    return _write(path, "aqua", tensors, model_shape=ms, config={"class": "AquaConfig", "fields": conf},
                  data=data, layout=layout)


def load_aqua(path, *, expect=None):
    """``(predictors, cfg, meta)`` from a file written by :func:`save_aqua`, verified (see the module doc).

    ``expect``: model-shape fields the file must match, as for :func:`load_oscar`; with ``rope_theta``
    (the model's RoPE base, or None for a model without RoPE) a configuration that predicts keys before
    RoPE must also use that base. Predictors must be finite with |w| <= ``MAX_PREDICTOR_ABS``; the
    configuration within ``MAX_FP16_TOKENS`` / ``MAX_TOKENS``.
    """
    from kvq.reference.aqua import AquaConfig, AquaPredictors, Predictor

    expect = _expect_arg(expect)
    meta, arrays = _open(path, "aqua")
    _check_expect(path, meta, expect)
    ms = meta["model_shape"]
    F = ms["kv_heads"] * ms["head_dim"]
    conf = meta["config"]
    if not isinstance(conf, dict) or conf.get("class") != "AquaConfig" or not isinstance(conf.get("fields"), dict):
        raise CalibrationFileError(f"{path}: config is not an AquaConfig description: {_short(conf)}")
    fields = dict(conf["fields"])
    try:
        _check_aqua_fields(fields, ms["rope_theta"])
    except ValueError as e:
        raise CalibrationFileError(f"{path}: {e}") from None
    if expect is not None and "rope_theta" in expect and fields.get("pre_rope", True):
        theta, want = fields.get("rope_theta"), expect["rope_theta"]
        if (theta is None) != (want is None) or (theta is not None and float(theta) != float(want)):
            raise CalibrationFileError(f"{path}: the predictors were fit before RoPE with rope_theta={theta!r}; "
                                       f"the model's is {want!r}")
    lay = meta["layout"]
    if not isinstance(lay, dict) or sorted(lay) != ["f_key", "f_value"]:
        raise CalibrationFileError(f"{path}: layout must hold f_key and f_value, got {_short(lay)}")
    names = {d["grid"] for d in (fields.get("backbone"), fields.get("first_layer"))
             if isinstance(d, dict) and d.get("type") == "higgs" and isinstance(d.get("grid"), str)}
    for which, F_in in (("f_key", F), ("f_value", 2 * F)):
        if not isinstance(lay[which], list) or len(lay[which]) != ms["n_layers"]:
            raise CalibrationFileError(f"{path}: layout {which} does not list n_layers={ms['n_layers']} entries")
        for l, inner in enumerate(lay[which]):
            if inner is None:
                continue
            if not isinstance(inner, list) or not all(_is_int(r) and 1 <= r <= F_in for r in inner):
                raise CalibrationFileError(f"{path}: layout {which}[{l}] must be null or a list of inner "
                                           f"(rank) dims in [1, {F_in}], got {_short(inner)}")
            names |= {f"{which}.{l}.bias"} | {f"{which}.{l}.mats.{i}" for i in range(len(inner) + 1)}
    _check_names(path, arrays, names)
    fields["backbone"] = _backbone_from_json(path, fields.get("backbone", {}), "backbone", arrays, F)
    fields["first_layer"] = _backbone_from_json(path, fields.get("first_layer", {}), "first_layer", arrays, F)
    try:
        cfg = AquaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CalibrationFileError(f"{path}: the AquaConfig cannot be rebuilt: {type(e).__name__}: {e}") from None
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
            for n, a in [(f"{which}.{l}.mats.{i}", m) for i, m in enumerate(mats)] + [(f"{which}.{l}.bias",
                                                                                        arrays[f"{which}.{l}.bias"])]:
                try:
                    _check_predictor_array(f"tensor {n!r}", a)
                except ValueError as e:
                    raise CalibrationFileError(f"{path}: {e}") from None
            preds.append(Predictor(tuple(mats), arrays[f"{which}.{l}.bias"]))
        out[which] = tuple(preds)
    return AquaPredictors(out["f_key"], out["f_value"]), cfg, meta
