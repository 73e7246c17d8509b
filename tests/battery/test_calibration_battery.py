"""Bad input to the calibration loaders and savers (``kvq.calibration``) and to the HF caches that take a
calibration file by path.

Every loader (``load_oscar``, ``load_aqua``, ``inspect``, ``make_cache(calibration=path)``) gets paths that
are not calibration files (missing, a directory, a FIFO, a character device, empty, truncated, a pickle,
an ``.npz``, random bytes, the other kind) and files whose checksums were recomputed after their contents
were made invalid (NaN or 1e30 predictors, ``sink=1e9``, malformed metadata, another ``rope_theta`` than
the model's). Each must end in a clear error (a ``CalibrationFileError``, ValueError or TypeError naming
the file or the field), within seconds (a FIFO must not block: issue 36 item 6). A rejected save leaves
the directory as it was; a good save respects the umask (item 7).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import stat

import numpy as np
import pytest

from kvq import calibration as cf
from kvq.integrations import methods as M
from kvq.reference import aqua, oscar

from ._core import ERROR, OK_OR_ERROR, Recorder
from .strategies import orthogonal
from .test_hf_battery import config as llama_config

safetensors_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402

L, H, D = 2, 2, 64
SHAPE = {"n_layers": L, "kv_heads": H, "head_dim": D, "rope_theta": 10000.0}
TIMEOUT_S = 10
FIFO_S = 3  # opening a FIFO blocks at once: 3 s without an answer is a hang


def oscar_calibs(lead=()):
    return [oscar.OSCARCalibration(orthogonal(l, D, lead), orthogonal(l + 9, D, lead), 0.95, 0.9) for l in range(L)]


def aqua_parts(fill=None):
    cfg = M.configure("AQUA-KV", head_dim=D, max_tokens=256, kv_heads=H, sink=4, buffer=16)
    F = H * D
    rng = np.random.default_rng(0)

    def pred(n_in):
        m = (rng.standard_normal((n_in, F)) * 0.05).astype(np.float32)
        if fill is not None:
            m[:] = fill
        return aqua.Predictor((m,), np.zeros(F, np.float32))

    P = aqua.AquaPredictors(
        (None,) + tuple(pred(F) for _ in range(L - 1)), (None,) + tuple(pred(2 * F) for _ in range(L - 1))
    )
    return P, cfg


NEST = "@@nested@@"


def _dumps(x) -> str:
    """The canonical JSON of kvq.calibration (sorted keys, no spaces), with ``NEST`` placeholders replaced
    by a list nested 50000 deep (which no JSON library of Python can build or parse recursively)."""
    s = json.dumps(x, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return s.replace(json.dumps(NEST), "[" * 50000 + "]" * 50000)


def rewrite(path, out, *, tensors=None, meta=None):
    """Copy a calibration file with tensors / metadata edited and both checksums recomputed."""
    import hashlib

    with safe_open(str(path), framework="np") as f:
        arrays = {k: f.get_tensor(k) for k in f.keys()}
        md = {k: json.loads(v) for k, v in f.metadata().items()}
    if tensors:
        tensors(arrays)
    if meta:
        meta(md)
    md["checksum"] = cf.checksum(arrays)
    body = {k: v for k, v in md.items() if k != "meta_checksum"}
    md["meta_checksum"] = "sha256:" + hashlib.sha256(_dumps(body).encode()).hexdigest()
    safetensors_numpy.save_file(arrays, str(out), metadata={k: _dumps(v) for k, v in md.items()})
    return str(out)


def _nested(depth):
    return NEST


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> path of every file the loaders get, and which loaders must accept it (the controls)."""
    d = tmp_path_factory.mktemp("calib")
    o, a = d / "good.oscar.safetensors", d / "good.aqua.safetensors"
    cf.save_oscar(o, oscar_calibs(), model_shape=SHAPE, config=oscar.OSCARConfig(group_size=D))
    P, cfg = aqua_parts()
    cf.save_aqua(a, P, cfg, model_shape=SHAPE)
    out = {"good_oscar": str(o), "good_aqua": str(a)}
    # the controls: rewritten without a change, they must still load (else the rewriting is out of date)
    out["control_oscar"] = rewrite(o, d / "control.oscar.safetensors")
    out["control_aqua"] = rewrite(a, d / "control.aqua.safetensors")
    out["missing"] = str(d / "missing.safetensors")
    out["directory"] = str(d)
    fifo = d / "fifo.safetensors"
    os.mkfifo(fifo)
    out["fifo"] = str(fifo)
    out["dev_null"] = "/dev/null"
    if os.path.exists("/dev/urandom"):
        out["dev_urandom"] = "/dev/urandom"
    (d / "empty.safetensors").write_bytes(b"")
    out["empty"] = str(d / "empty.safetensors")
    raw = o.read_bytes()
    (d / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    out["truncated"] = str(d / "truncated.safetensors")
    (d / "pickle.safetensors").write_bytes(pickle.dumps({"R_K": np.eye(4)}))
    out["pickle"] = str(d / "pickle.safetensors")
    np.savez(d / "arrays.npz", R_K=np.eye(4))
    out["npz"] = str(d / "arrays.npz")
    (d / "random.safetensors").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    out["random_bytes"] = str(d / "random.safetensors")
    # valid checksums, invalid contents
    out["aqua_nan_predictors"] = rewrite(
        a,
        d / "nan.aqua.safetensors",
        tensors=lambda t: t.update({"f_key.1.mats.0": np.full_like(t["f_key.1.mats.0"], np.nan)}),
    )
    out["aqua_1e30_predictors"] = rewrite(
        a,
        d / "big.aqua.safetensors",
        tensors=lambda t: t.update({"f_value.1.mats.0": np.full_like(t["f_value.1.mats.0"], 1e30)}),
    )
    out["aqua_inf_bias"] = rewrite(
        a,
        d / "infb.aqua.safetensors",
        tensors=lambda t: t.update({"f_key.1.bias": np.full_like(t["f_key.1.bias"], np.inf)}),
    )
    out["aqua_sink_1e9"] = rewrite(
        a, d / "sink.aqua.safetensors", meta=lambda m: m["config"]["fields"].update(sink=10**9)
    )
    out["aqua_buffer_0"] = rewrite(
        a, d / "buffer.aqua.safetensors", meta=lambda m: m["config"]["fields"].update(buffer=0)
    )
    out["aqua_max_tokens_neg"] = rewrite(
        a, d / "maxt.aqua.safetensors", meta=lambda m: m["config"]["fields"].update(max_tokens=-5)
    )
    out["aqua_rope_theta_str"] = rewrite(
        a, d / "theta.aqua.safetensors", meta=lambda m: m["config"]["fields"].update(rope_theta="x")
    )
    out["aqua_layout_nested"] = rewrite(
        a, d / "nest.aqua.safetensors", meta=lambda m: m["layout"].update(f_key=_nested(3000))
    )
    out["aqua_layout_inner_str"] = rewrite(
        a, d / "inner.aqua.safetensors", meta=lambda m: m["layout"]["f_key"].__setitem__(1, ["a"])
    )
    out["aqua_backbone_list"] = rewrite(
        a, d / "bb.aqua.safetensors", meta=lambda m: m["config"]["fields"].update(backbone=[])
    )
    out["oscar_nan_rotation"] = rewrite(
        o,
        d / "nan.oscar.safetensors",
        tensors=lambda t: t.update({"layers.0.R_K": np.full_like(t["layers.0.R_K"], np.nan)}),
    )
    out["oscar_layout_nested"] = rewrite(
        o, d / "nest.oscar.safetensors", meta=lambda m: m["layout"].update(layers=_nested(3000))
    )
    out["oscar_clip_str"] = rewrite(
        o, d / "clip.oscar.safetensors", meta=lambda m: m["layout"]["layers"][0].update(clip_k="0.9")
    )
    out["oscar_n_layers_list"] = rewrite(
        o, d / "nl.oscar.safetensors", meta=lambda m: m["model_shape"].update(n_layers=[2])
    )
    out["oscar_model_shape_str"] = rewrite(o, d / "ms.oscar.safetensors", meta=lambda m: m.update(model_shape="x"))
    out["oscar_rope_theta_nan"] = rewrite(
        o, d / "rt.oscar.safetensors", meta=lambda m: m["model_shape"].update(rope_theta=1e400 * 0)
    )
    # a valid AQUA-KV file of a model with another RoPE base than the tiny Llama's (10000)
    P, cfg = aqua_parts()
    t = d / "theta5e5.aqua.safetensors"
    cf.save_aqua(t, P, dataclasses.replace(cfg, rope_theta=500000.0), model_shape={**SHAPE, "rope_theta": 500000.0})
    out["aqua_other_rope_theta"] = str(t)
    yield out
    os.unlink(fifo)


def unblock_fifo(path):
    """Open the write end of a FIFO (non-blocking) and close it: a reader blocked in open() gets EOF."""

    def f():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    return f


WORDS = ("path", "file", "calibration", "safetensors")
BAD = [
    "missing",
    "directory",
    "fifo",
    "dev_null",
    "dev_urandom",
    "empty",
    "truncated",
    "pickle",
    "npz",
    "random_bytes",
    "aqua_nan_predictors",
    "aqua_1e30_predictors",
    "aqua_inf_bias",
    "aqua_sink_1e9",
    "aqua_buffer_0",
    "aqua_max_tokens_neg",
    "aqua_rope_theta_str",
    "aqua_layout_nested",
    "aqua_layout_inner_str",
    "aqua_backbone_list",
    "oscar_nan_rotation",
    "oscar_layout_nested",
    "oscar_clip_str",
    "oscar_n_layers_list",
    "oscar_model_shape_str",
    "oscar_rope_theta_nan",
]


#: files whose structure is sound but whose values are not (what ``inspect`` may still show)
CONTENT_ONLY = {
    "aqua_nan_predictors",
    "aqua_1e30_predictors",
    "aqua_inf_bias",
    "aqua_sink_1e9",
    "aqua_buffer_0",
    "aqua_max_tokens_neg",
    "aqua_rope_theta_str",
    "aqua_layout_inner_str",
    "aqua_backbone_list",
    "oscar_nan_rotation",
    "oscar_clip_str",
}


def _loaders():
    return {
        "load_oscar": lambda p: cf.load_oscar(p),
        "load_aqua": lambda p: cf.load_aqua(p),
        "inspect": lambda p: cf.inspect(p),
        "make_cache(OSCAR)": lambda p: _make("OSCAR", p),
        "make_cache(AQUA-KV)": lambda p: _make("AQUA-KV", p),
    }


def _make(method, path):
    from kvq.integrations.transformers import make_cache

    return make_cache(method, llama_config(), backend="reference", calibration=path, max_tokens=256)


@pytest.mark.parametrize("loader", list(_loaders()))
def test_loaders_refuse_bad_files(files, loader):
    rec = Recorder("calibration", loader)
    fn = _loaders()[loader]
    kind = "aqua" if "aqua" in loader.lower() else "oscar" if "oscar" in loader.lower() else None
    for ctl in ("control_oscar", "control_aqua", "good_oscar", "good_aqua"):
        if kind is None or kind in ctl:  # the controls and the good files load
            rec.call(ctl, lambda p=files[ctl]: fn(p), expect=OK_OR_ERROR, timeout=TIMEOUT_S)
            if rec.failures or (rec.counts["clear_errors"] and ctl.startswith("control")):
                rec.fail(ctl, "wrong_result", "a valid file (or its rewritten copy) did not load")
    for name in BAD:
        if name not in files:
            continue
        p = files[name]
        words = WORDS + (
            p,
            os.path.basename(p),
            "sink",
            "buffer",
            "max_tokens",
            "rope_theta",
            "clip_k",
            "n_layers",
            "model_shape",
            "layout",
            "backbone",
            "f_key",
            "f_value",
            "R_K",
        )
        # inspect reads metadata only: a file whose tensors or config values are out of range may be shown
        # (but never with an unclear error, and a path that is no calibration file is always refused)
        expect = OK_OR_ERROR if loader == "inspect" and name in CONTENT_ONLY else ERROR
        rec.call(
            name,
            lambda p=p: fn(p),
            names=words,
            expect=expect,
            timeout=FIFO_S if name == "fifo" else TIMEOUT_S,
            unblock=unblock_fifo(p) if name == "fifo" else None,
        )
    if kind is None or kind == "oscar" and "make_cache" not in loader:
        other = files["good_aqua"] if kind == "oscar" else None
        if other:
            rec.call(
                "other_kind", lambda: fn(other), names=WORDS + (other, "aqua", "kind"), expect=ERROR, timeout=TIMEOUT_S
            )
    if kind == "aqua" and "make_cache" not in loader:
        rec.call(
            "other_kind",
            lambda: fn(files["good_oscar"]),
            names=WORDS + ("oscar", "kind"),
            expect=ERROR,
            timeout=TIMEOUT_S,
        )
    if loader == "make_cache(AQUA-KV)":
        p = files["aqua_other_rope_theta"]
        rec.call(
            "rope_theta of another model", lambda: fn(p), names=("rope_theta", "theta"), expect=ERROR, timeout=TIMEOUT_S
        )
    for case, bad in (("path=None", None), ("path=3.5", 3.5), ("path=987654 (an int)", 987654), ("path=['a']", ["a"])):
        rec.call(case, lambda bad=bad: fn(bad), names=WORDS + (str(bad),), expect=ERROR, timeout=TIMEOUT_S)
    rec.assert_clean()


def test_expect_argument(files):
    rec = Recorder("calibration", "load_oscar(expect=...)")
    p = files["good_oscar"]
    for case, expect in (
        ("expect=5", 5),
        ("expect=['head_dim']", ["head_dim"]),
        ("expect={'head_dim': 32}", {"head_dim": 32}),
        ("expect={'bogus': 1}", {"bogus": 1}),
        ("expect={'n_layers': '2'}", {"n_layers": "2"}),
    ):
        rec.call(
            case,
            lambda expect=expect: cf.load_oscar(p, expect=expect),
            names=("expect", "head_dim", "bogus", "n_layers", p),
            expect=ERROR,
            timeout=TIMEOUT_S,
        )
    rec.assert_clean()


@dataclasses.dataclass
class Folder:
    """A directory as a state: every file's bytes and mode (snapshotted by ``_core.snapshot``)."""

    path: str

    def arrays(self) -> dict:
        out = {}
        for n in sorted(os.listdir(self.path)):
            q = os.path.join(self.path, n)
            if os.path.isfile(q):
                out[n] = np.frombuffer(open(q, "rb").read(), np.uint8)
                out[n + "#mode"] = np.array([os.stat(q).st_mode], np.int64)
        return out


def test_savers_refuse_and_leave_the_folder(tmp_path):
    rec = Recorder("calibration", "save_oscar / save_aqua")
    folder = Folder(str(tmp_path))
    existing = tmp_path / "existing.safetensors"
    cf.save_oscar(existing, oscar_calibs(), model_shape=SHAPE)
    target = str(existing)
    P, cfg = aqua_parts()
    cases = [
        (
            "oscar: one calibration short",
            lambda: cf.save_oscar(target, oscar_calibs()[:1], model_shape=SHAPE),
            ("calibrations", "n_layers"),
        ),
        (
            "oscar: model_shape n_layers=True",
            lambda: cf.save_oscar(target, oscar_calibs(), model_shape={**SHAPE, "n_layers": True}),
            ("n_layers", "model_shape"),
        ),
        ("oscar: model_shape=None", lambda: cf.save_oscar(target, oscar_calibs(), model_shape=None), ("model_shape",)),
        (
            "oscar: rope_theta='x'",
            lambda: cf.save_oscar(target, oscar_calibs(), model_shape={**SHAPE, "rope_theta": "x"}),
            ("rope_theta", "model_shape"),
        ),
        (
            "oscar: rope_theta=nan",
            lambda: cf.save_oscar(target, oscar_calibs(), model_shape={**SHAPE, "rope_theta": float("nan")}),
            ("rope_theta", "model_shape"),
        ),
        (
            "oscar: config with NaN",
            lambda: cf.save_oscar(target, oscar_calibs(), model_shape=SHAPE, config={"clip": float("nan")}),
            ("config", "clip"),
        ),
        ("oscar: not calibrations", lambda: cf.save_oscar(target, ["x", "y"], model_shape=SHAPE), ("calibrations",)),
        (
            "oscar: into a missing folder",
            lambda: cf.save_oscar(str(tmp_path / "no" / "x.safetensors"), oscar_calibs(), model_shape=SHAPE),
            ("path", "folder", "directory"),
        ),
        (
            "oscar: onto a folder",
            lambda: cf.save_oscar(str(tmp_path), oscar_calibs(), model_shape=SHAPE),
            ("path", "directory", str(tmp_path)),
        ),
        (
            "aqua: NaN predictors",
            lambda: cf.save_aqua(target, aqua_parts(np.nan)[0], cfg, model_shape=SHAPE),
            ("predictors", "f_key", "f_value", "predictor"),
        ),
        (
            "aqua: 1e30 predictors",
            lambda: cf.save_aqua(target, aqua_parts(1e30)[0], cfg, model_shape=SHAPE),
            ("predictors", "f_key", "f_value", "predictor"),
        ),
        (
            "aqua: sink=1e9",
            lambda: cf.save_aqua(target, P, dataclasses.replace(cfg, sink=10**9), model_shape=SHAPE),
            ("sink", "max_tokens"),
        ),
        (
            "aqua: rope_theta differs from the model's",
            lambda: cf.save_aqua(target, P, dataclasses.replace(cfg, rope_theta=5e5), model_shape=SHAPE),
            ("rope_theta",),
        ),
        ("aqua: cfg not an AquaConfig", lambda: cf.save_aqua(target, P, "cfg", model_shape=SHAPE), ("cfg",)),
        (
            "aqua: predictors for 3 layers",
            lambda: cf.save_aqua(
                target, aqua.AquaPredictors(P.f_key + (None,), P.f_value + (None,)), cfg, model_shape=SHAPE
            ),
            ("f_key", "n_layers", "predictors"),
        ),
    ]
    for case, call, words in cases:
        rec.call(case, call, names=words, expect=ERROR, states=[folder], timeout=TIMEOUT_S)
    rec.assert_clean()


def test_save_respects_the_umask(tmp_path):
    """Item 7: files are written with the mode the umask gives (0666 & ~umask), not always 0600."""
    rec = Recorder("calibration", "save_oscar / save_aqua file mode")
    old = os.umask(0o022)
    try:
        for case, save in (
            ("save_oscar", lambda p: cf.save_oscar(p, oscar_calibs(), model_shape=SHAPE)),
            ("save_aqua", lambda p: cf.save_aqua(p, *aqua_parts(), model_shape=SHAPE)),
        ):
            p = tmp_path / f"{case}.safetensors"

            def check(result, p=p):
                mode = stat.S_IMODE(os.stat(p).st_mode)
                return None if mode == 0o644 else f"written with mode {oct(mode)} under umask 022 (expected 0o644)"

            rec.call(case, lambda save=save, p=p: save(p), expect=OK_OR_ERROR, oracle=check)
    finally:
        os.umask(old)
    rec.assert_clean()
