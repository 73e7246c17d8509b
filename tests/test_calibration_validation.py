"""Calibration files that must be refused even when their checksums are right (issue 36, items 6 and 7).

Item 6: ``kvq.calibration`` opens regular files only: a named pipe, a directory, a device, a socket
fail at once with a ``CalibrationFileError`` (a pipe never blocks the loader). Item 7: the contents are
validated on load and on save: finite tensors, AQUA-KV predictors within ``MAX_PREDICTOR_ABS``, config
integers within the documented limits, ``rope_theta`` matching the model's, metadata of the writer's JSON
types and depth; files are written with the process umask. Every tampered file here has both checksums
recomputed (``_tamper``), so only the content checks can catch it.
"""

from __future__ import annotations

import json
import os
import socket
import threading

import numpy as np
import pytest

from kvq import calibration as cf
from kvq.calibration import CalibrationFileError
from kvq.reference import aqua, oscar

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from .calibration_rewrite import rewrite as _tamper  # noqa: E402

SHAPE = {"n_layers": 2, "kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "model": "unit-test"}
F = SHAPE["kv_heads"] * SHAPE["head_dim"]
TIMEOUT_S = 10.0


def _oscar_calibs(n_layers=2, D=16):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n_layers):
        R = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
        out.append(oscar.OSCARCalibration(R, R.T.copy(), 0.9, 0.9, np.arange(D, 0, -1.0), None, "oscar"))
    return out


def _predictors(scale=1.0, n_layers=2):
    rng = np.random.default_rng(1)

    def pred(F_in):
        return aqua.Predictor((rng.standard_normal((F_in, F)).astype(np.float32) * np.float32(scale),),
                              rng.standard_normal(F).astype(np.float32))

    return aqua.AquaPredictors((None,) + tuple(pred(F) for _ in range(n_layers - 1)),
                               (None,) + tuple(pred(2 * F) for _ in range(n_layers - 1)))


@pytest.fixture
def oscar_file(tmp_path):
    p = tmp_path / "o.safetensors"
    cf.save_oscar(p, _oscar_calibs(), model_shape=SHAPE)
    return p


@pytest.fixture
def aqua_file(tmp_path):
    p = tmp_path / "a.safetensors"
    cf.save_aqua(p, _predictors(), aqua.AquaConfig(), model_shape=SHAPE)
    return p


def _refused(load, path, match):
    """``load(path)`` raises exactly a CalibrationFileError whose message names the path and matches."""
    with pytest.raises(CalibrationFileError, match=match) as e:
        load(path)
    assert str(path) in str(e.value)


# ---------------------------------------------------------------------------------------------------
# item 6: only regular files are opened


def _no_hang(fn):
    """Run ``fn()`` in a thread; fail (after unblocking it) if it has not returned within TIMEOUT_S.
    Returns the exception ``fn`` raised (or None)."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(TIMEOUT_S)
    return t, box.get("error")


def _unblock(fifo) -> None:
    """Open the FIFO for writing and close it, so a reader blocked in open() returns (then sees EOF)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


LOADERS = {
    "load_oscar": lambda p: cf.load_oscar(p),
    "load_aqua": lambda p: cf.load_aqua(p),
    "inspect": lambda p: cf.inspect(p),
    "inspect_no_verify": lambda p: cf.inspect(p, verify=False),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_named_pipe_is_refused_without_blocking(tmp_path, loader):
    fifo = tmp_path / "calib.safetensors"
    os.mkfifo(fifo)
    t, err = _no_hang(lambda: LOADERS[loader](fifo))
    if t.is_alive():
        _unblock(fifo)
        t.join(TIMEOUT_S)
        pytest.fail(f"{loader} blocked on a named pipe for {TIMEOUT_S} s")
    assert isinstance(err, CalibrationFileError), err
    assert str(fifo) in str(err) and "named pipe (FIFO), not a regular file" in str(err)


def test_a_symlink_to_a_named_pipe_is_refused_and_to_a_file_is_followed(tmp_path, oscar_file):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "link.safetensors"
    link.symlink_to(fifo)
    t, err = _no_hang(lambda: cf.load_oscar(link))
    if t.is_alive():
        _unblock(fifo)
        pytest.fail("load_oscar blocked on a symlink to a named pipe")
    assert isinstance(err, CalibrationFileError) and "named pipe" in str(err)
    good = tmp_path / "good.safetensors"
    good.symlink_to(oscar_file)
    assert len(cf.load_oscar(good)[0]) == 2


def test_make_cache_with_a_named_pipe_is_refused_without_blocking(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvq.integrations.models import tiny_llama_config
    from kvq.integrations.transformers import make_cache

    config = tiny_llama_config(num_hidden_layers=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                               hidden_size=64)
    fifo = tmp_path / "calib.safetensors"
    os.mkfifo(fifo)
    for method in ("OSCAR", "AQUA-KV"):
        t, err = _no_hang(lambda: make_cache(method, config, calibration=str(fifo)))
        if t.is_alive():
            _unblock(fifo)
            pytest.fail(f"make_cache({method!r}, calibration=<FIFO>) blocked")
        assert isinstance(err, CalibrationFileError) and "not a regular file" in str(err), err


@pytest.mark.parametrize("what", ["directory", "char_device", "socket"])
def test_other_non_regular_files_are_refused(tmp_path, what):
    if what == "directory":
        path, words = tmp_path, "a directory"
    elif what == "char_device":
        path, words = "/dev/urandom", "a character device"
        if not os.path.exists(path):
            pytest.skip("no /dev/urandom here")
    else:
        path, words = tmp_path / "s.sock", "a socket"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
    for load in LOADERS.values():
        _refused(load, path, f"is {words}, not a regular file")


def test_unreadable_paths_give_a_calibration_file_error(tmp_path, oscar_file):
    _refused(cf.load_oscar, f"{oscar_file}/inside", "cannot be read")          # a path through a file
    with pytest.raises(CalibrationFileError, match="cannot be read"):
        cf.load_oscar(str(tmp_path / "a\0b"))                                   # an embedded NUL byte
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        cf.load_oscar(3)
    assert len(cf.load_oscar(os.fsencode(str(oscar_file)))[0]) == 2            # bytes paths work


# ---------------------------------------------------------------------------------------------------
# item 7: contents, on load


def test_non_finite_tensors_are_refused(oscar_file, aqua_file, tmp_path):
    def nan_lam(t):
        t["layers.0.lam_K"] = t["layers.0.lam_K"].copy()
        t["layers.0.lam_K"][3] = np.nan

    p = _tamper(oscar_file, tmp_path / "o1.safetensors", tensors=nan_lam)
    _refused(cf.load_oscar, p, r"tensor 'layers.0.lam_K' holds 1 NaN or inf value; .* must be finite")

    def inf_rotation(t):
        t["layers.1.R_K"] = t["layers.1.R_K"].copy()
        t["layers.1.R_K"][0, 0] = np.inf

    p = _tamper(oscar_file, tmp_path / "o2.safetensors", tensors=inf_rotation)
    _refused(cf.load_oscar, p, r"'layers.1.R_K' holds 1 NaN or inf")

    def nan_predictor(t):
        t["f_key.1.mats.0"] = np.full_like(t["f_key.1.mats.0"], np.nan)

    p = _tamper(aqua_file, tmp_path / "a1.safetensors", tensors=nan_predictor)
    _refused(cf.load_aqua, p, r"'f_key.1.mats.0' holds 1024 NaN or inf values")


@pytest.mark.parametrize("name, value", [("f_key.1.mats.0", 1e30), ("f_value.1.mats.0", -2e6),
                                         ("f_value.1.bias", 1e7)])
def test_absurd_predictor_magnitudes_are_refused(aqua_file, tmp_path, name, value):
    def big(t):
        t[name] = t[name].copy()
        t[name].flat[5] = np.float32(value)

    p = _tamper(aqua_file, tmp_path / "big.safetensors", tensors=big)
    _refused(cf.load_aqua, p, rf"tensor '{name}' holds \|w\| = .* > kvq.calibration.MAX_PREDICTOR_ABS")


def test_predictors_at_the_bound_load(tmp_path):
    P = _predictors()
    P.f_key[1].mats[0][0, 0] = np.float32(cf.MAX_PREDICTOR_ABS)
    p = tmp_path / "edge.safetensors"
    cf.save_aqua(p, P, aqua.AquaConfig(), model_shape=SHAPE)
    assert cf.load_aqua(p)[0].f_key[1].mats[0][0, 0] == np.float32(cf.MAX_PREDICTOR_ABS)


@pytest.mark.parametrize("field, value, match", [
    ("sink", 10**9, r"AquaConfig.sink=1000000000 must be an int in \[0, 65536\] \(kvq.calibration.MAX_FP16_TOKENS\)"),
    ("buffer", 0, r"AquaConfig.buffer=0 must be an int in \[1, 65536\]"),
    ("buffer", 2.5, r"AquaConfig.buffer=2.5 must be an int"),
    ("max_tokens", 2**40, r"AquaConfig.max_tokens=1099511627776 must be an int in \[1, 16777216\]"),
    ("sink", "4", r"AquaConfig.sink='4' must be an int"),
    ("sink", True, r"AquaConfig.sink=True must be an int"),
    ("pre_rope", "yes", r"AquaConfig.pre_rope must be true or false, got 'yes'"),
    ("predict_keys", 1, r"AquaConfig.predict_keys must be true or false"),
    ("rope_theta", -1.0, r"AquaConfig.rope_theta must be a finite positive number or null"),
    ("rope_theta", "1e4", r"AquaConfig.rope_theta must be a finite positive number or null"),
    ("rope_theta", 5e5, r"cfg.rope_theta=500000.0 differs from the model's rope_theta=10000.0"),
    ("no_such_field", 1, r"the AquaConfig cannot be rebuilt: TypeError"),
])
def test_aqua_config_fields_out_of_range_are_refused(aqua_file, tmp_path, field, value, match):
    p = _tamper(aqua_file, tmp_path / "c.safetensors", meta=lambda m: m["config"]["fields"].update({field: value}))
    _refused(cf.load_aqua, p, match)


def test_sink_of_a_billion_fails_before_any_cache_is_built(aqua_file, tmp_path):
    """The issue's reproducer: sink=1e9 in a checksummed file must be refused by make_cache (which loads
    the file), not at the first update's 238 GiB allocation."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvq.integrations.models import tiny_llama_config
    from kvq.integrations.transformers import make_cache

    config = tiny_llama_config(num_hidden_layers=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                               hidden_size=64)
    p = _tamper(aqua_file, tmp_path / "sink.safetensors", meta=lambda m: m["config"]["fields"].update(sink=10**9))
    with pytest.raises(CalibrationFileError, match="AquaConfig.sink=1000000000"):
        make_cache("AQUA-KV", config, calibration=str(p))


def test_backbones_are_checked(aqua_file, tmp_path):
    def edit(**kw):
        return lambda m: m["config"]["fields"]["backbone"].update(kw)

    cases = [
        (edit(group_size=2**30), r"config.backbone .* cannot be rebuilt: ValueError: group_size 1073741824 must be "
                                 r"an int in \[1, max\(1024, F = 32\)\]"),
        (edit(meta_dtype="float64"), "meta_dtype 'float64' is not one of"),
        (edit(grid=[1, 2]), "grid must be a tensor name or null"),
        (edit(extra=1), r"has keys .*; a higgs backbone has"),
        (lambda m: m["config"]["fields"].update(backbone=[1, 2]), "is a list, not a dict"),
        (lambda m: m["config"]["fields"].update(backbone={"type": "uniform", "bits": 2, "group_size": 7,
                                                          "meta_dtype": "float16"}),
         r"group_size 7 must be an int dividing F = kv_heads \* head_dim = 32"),
        (lambda m: m["config"]["fields"].update(first_layer={"type": 3}), "has unknown type 3"),
    ]
    for i, (meta, match) in enumerate(cases):
        p = _tamper(aqua_file, tmp_path / f"b{i}.safetensors", meta=meta)
        _refused(cf.load_aqua, p, match)


def test_rope_theta_must_be_the_models(aqua_file, tmp_path):
    assert cf.load_aqua(aqua_file, expect={"rope_theta": 10000})[1].rope_theta == 10000.0
    _refused(lambda p: cf.load_aqua(p, expect={"rope_theta": 5e5}), aqua_file,
             "rope_theta is 10000.0 in the file, expected 500000.0")
    # a model without RoPE: the file's pre-RoPE predictors cannot serve it
    _refused(lambda p: cf.load_aqua(p, expect={"rope_theta": None}), aqua_file, "rope_theta is 10000.0 in the file")
    # the model shape says nothing, but the configuration's base differs from the model's
    p = _tamper(aqua_file, tmp_path / "r.safetensors",
                meta=lambda m: (m["model_shape"].update(rope_theta=None), m["config"]["fields"].update(rope_theta=5e5)))
    assert cf.load_aqua(p)[1].rope_theta == 5e5
    with pytest.raises(CalibrationFileError, match=r"model shape mismatch: rope_theta is None in the file"):
        cf.load_aqua(p, expect={"rope_theta": 10000.0})
    # the file does not know the model's base; the caller does: a model without RoPE
    p = _tamper(aqua_file, tmp_path / "n.safetensors", meta=lambda m: m["model_shape"].update(rope_theta=None))
    _refused(lambda q: cf.load_aqua(q, expect={"rope_theta": None}), p,
             r"the predictors were fit before RoPE with rope_theta=10000.0; the model's is None")
    # post-RoPE predictors never apply the base: only the model shape is compared
    cfg = aqua.AquaConfig(pre_rope=False, rope_theta=None)
    q = tmp_path / "post.safetensors"
    cf.save_aqua(q, _predictors(), cfg, model_shape=SHAPE)
    assert cf.load_aqua(q, expect={"rope_theta": 10000.0})[1].pre_rope is False


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["model_shape"].update(head_dim=10**9), r"model_shape\['head_dim'\]=1000000000 exceeds "
                                                        r"kvq.calibration.MAX_MODEL_DIM"),
    (lambda m: m["model_shape"].update(rope_theta="10000"), r"model_shape\['rope_theta'\] must be a finite positive"),
    (lambda m: m["model_shape"].update(rope_theta=0), r"model_shape\['rope_theta'\] must be a finite positive"),
    (lambda m: m.update(model_shape=[2, 2, 16]), "model_shape must be a dict"),
    (lambda m: m["layout"]["layers"][0].update(clip_k="0.9"), r"layout entry of layer 0: clip_k must be a number"),
    (lambda m: m["layout"]["layers"][1].update(lam_K="yes"), r"layout entry of layer 1: lam_K must be true or false"),
    (lambda m: m["layout"]["layers"][1].update(rotation=["oscar"]), r"rotation must be a str"),
    (lambda m: m["layout"]["layers"][1].pop("clip_v"), r"layer 1: has keys"),
    (lambda m: m["layout"].update(layers={"0": {}}), "layout describes"),
    (lambda m: m["layout"]["layers"].__setitem__(0, 7), r"layout entry of layer 0: 7 is not a dict"),
    (lambda m: m.update(layout=5), "layout describes None layers"),
    (lambda m: m.update(kind=["oscar"]), "kind \\['oscar'\\] is not one of"),
    (lambda m: m.update(schema_version="1"), "schema_version '1' is not a positive int"),
])
def test_malformed_oscar_metadata_gives_a_calibration_file_error(oscar_file, tmp_path, edit, match):
    p = _tamper(oscar_file, tmp_path / "m.safetensors", meta=edit)
    _refused(cf.load_oscar, p, match)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["layout"]["f_key"].__setitem__(1, 5), r"layout f_key\[1\] must be null or a list"),
    (lambda m: m["layout"]["f_key"].__setitem__(1, ["a"]), r"layout f_key\[1\] must be null or a list"),
    (lambda m: m["layout"]["f_value"].__setitem__(1, [10**9]), r"layout f_value\[1\] must be null or a list"),
    (lambda m: m["layout"].update(f_key="all"), "layout f_key does not list n_layers=2 entries"),
    (lambda m: m["config"].update(fields=[1]), "config is not an AquaConfig description"),
    (lambda m: m.update(config="AquaConfig"), "config is not an AquaConfig description"),
])
def test_malformed_aqua_metadata_gives_a_calibration_file_error(aqua_file, tmp_path, edit, match):
    p = _tamper(aqua_file, tmp_path / "m.safetensors", meta=edit)
    _refused(cf.load_aqua, p, match)


def _nest(depth):
    x = 0
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize("key, text, match", [
    ("data", "[" * 100_000 + "]" * 100_000, "nested more than 32 levels deep"),
    ("layout", "{\"a\":" * 50_000 + "0" + "}" * 50_000, "nested more than 32 levels deep"),
    ("data", json.dumps(_nest(40)), "nested more than 32 levels deep"),
    ("data", '{"x": NaN}', "holds NaN, not a finite number"),
    ("model_shape", '{"n_layers": 2, "kv_heads": 2, "head_dim": 16, "rope_theta": Infinity}',
     "holds Infinity, not a finite number"),
    ("data", '{"x": 1e400}', "holds 1e400, which overflows a float"),
    ("data", "1" * 5000, "is not valid JSON"),
    ("config", "{not json", "is not valid JSON"),
])
def test_malformed_metadata_json_never_escapes_as_another_exception(oscar_file, tmp_path, key, text, match):
    p = _tamper(oscar_file, tmp_path / "j.safetensors", raw={key: text})
    for load in (cf.load_oscar, cf.inspect, lambda q: cf.inspect(q, verify=False)):
        _refused(load, p, match)


def test_metadata_at_the_depth_limit_loads(tmp_path):
    p = tmp_path / "deep.safetensors"
    cf.save_oscar(p, _oscar_calibs(), model_shape=SHAPE, data={"x": _nest(cf.MAX_META_DEPTH - 1)})
    assert cf.load_oscar(p)[1]["data"]["x"] == _nest(cf.MAX_META_DEPTH - 1)


def test_expect_must_be_a_dict(oscar_file):
    with pytest.raises(TypeError, match="expect must be a dict of model_shape fields"):
        cf.load_oscar(oscar_file, expect=[("head_dim", 16)])


# ---------------------------------------------------------------------------------------------------
# item 7: contents, on save; permissions


def _nothing_written(tmp_path):
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_save_refuses_what_load_would_refuse(tmp_path):
    p = tmp_path / "x.safetensors"
    cases = [
        (lambda: cf.save_aqua(p, _predictors(), aqua.AquaConfig(sink=10**9), model_shape=SHAPE),
         r"AquaConfig.sink=1000000000 must be an int in \[0, 65536\]"),
        (lambda: cf.save_aqua(p, _predictors(), aqua.AquaConfig(max_tokens=2**30), model_shape=SHAPE),
         r"AquaConfig.max_tokens=1073741824"),
        (lambda: cf.save_aqua(p, _predictors(scale=1e30), aqua.AquaConfig(), model_shape=SHAPE),
         r"f_key\[1\].mats\[0\] holds \|w\| = .* > kvq.calibration.MAX_PREDICTOR_ABS"),
        (lambda: cf.save_aqua(p, _predictors(scale=np.nan), aqua.AquaConfig(), model_shape=SHAPE),
         r"f_key\[1\].mats\[0\] holds NaN or inf"),
        (lambda: cf.save_aqua(p, _predictors(), aqua.AquaConfig(backbone=aqua.Uniform(group_size=7)),
                              model_shape=SHAPE), r"cfg.backbone: group_size 7 must be an int dividing F"),
        (lambda: cf.save_aqua(p, _predictors(), aqua.AquaConfig(), model_shape={**SHAPE, "head_dim": 2**20}),
         r"model_shape\['head_dim'\]=1048576 exceeds"),
        (lambda: cf.save_aqua(p, _predictors(), aqua.AquaConfig(), model_shape={**SHAPE, "rope_theta": float("inf")}),
         r"model_shape.rope_theta: inf is not a finite number"),
        (lambda: cf.save_aqua(p, _predictors(), aqua.AquaConfig(), model_shape={**SHAPE, "rope_theta": -5}),
         r"model_shape\['rope_theta'\] must be a finite positive number"),
        (lambda: cf.save_oscar(p, _oscar_calibs(), model_shape=SHAPE, data={"x": _nest(40)}),
         "nested more than 32 levels deep"),
    ]
    bad_lam = _oscar_calibs()
    bad_lam[1].lam_K[0] = np.nan
    cases.append((lambda: cf.save_oscar(p, bad_lam, model_shape=SHAPE),
                  r"tensor 'layers.1.lam_K' holds 1 NaN or inf value"))
    loop: dict = {}
    loop["self"] = loop
    cases.append((lambda: cf.save_oscar(p, _oscar_calibs(), model_shape=SHAPE, data=loop),
                  "nested more than 32 levels deep"))
    for save, match in cases:
        with pytest.raises(ValueError, match=match):
            save()
        _nothing_written(tmp_path)                         # refused before anything was written


def test_save_refuses_a_destination_that_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    t, err = _no_hang(lambda: cf.save_oscar(fifo, _oscar_calibs(), model_shape=SHAPE))
    if t.is_alive():
        _unblock(fifo)
        pytest.fail("save_oscar blocked on a named pipe")
    assert isinstance(err, CalibrationFileError) and "named pipe (FIFO), not a regular file" in str(err)
    with pytest.raises(CalibrationFileError, match="is a directory"):
        cf.save_oscar(tmp_path, _oscar_calibs(), model_shape=SHAPE)
    with pytest.raises(CalibrationFileError, match="does not exist"):
        cf.save_oscar(tmp_path / "no" / "dir.safetensors", _oscar_calibs(), model_shape=SHAPE)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["pipe.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002])
def test_files_are_written_with_the_process_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        for i, save in enumerate((lambda p: cf.save_oscar(p, _oscar_calibs(), model_shape=SHAPE),
                                  lambda p: cf.save_aqua(p, _predictors(), aqua.AquaConfig(), model_shape=SHAPE))):
            p = tmp_path / f"f{i}.safetensors"
            save(p)
            assert (p.stat().st_mode & 0o777) == 0o666 & ~umask
            save(p)                                          # replacing a file: the new file's mode again
            assert (p.stat().st_mode & 0o777) == 0o666 & ~umask
    finally:
        os.umask(old)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f0.safetensors", "f1.safetensors"]
