"""Calibration files (``kvq.calibration``) and ``kvq calibrate`` (``kvq.commands.calibrate``).

Round trips are exact; every way a file can be wrong (missing, not safetensors, pickle / npz, truncated,
one flipped byte, wrong schema / version / kind, another model's shape, missing or extra tensors,
tampered contents) fails with a ``CalibrationFileError`` that names the problem. The calibrate
functions run on a tiny Llama (head_dim 32, GQA 4:2) built from a config, and the command end to end
on a tiny model directory.
"""

import dataclasses
import json
import pickle

import numpy as np
import pytest

from kvq import calibration as cf
from kvq.calibration import CalibrationFileError
from kvq.reference import aqua, higgs, oscar

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from .calibration_rewrite import rewrite as _rewrite  # noqa: E402

SHAPE = {"n_layers": 3, "kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "model": "unit-test"}


def _orth(rng, *lead, D=16):
    A = rng.standard_normal((*lead, D, D))
    return np.linalg.qr(A)[0].astype(np.float32)


def _oscar_calibs(per_head=False, seed=0):
    rng = np.random.default_rng(seed)
    lead = (2,) if per_head else ()
    out = []
    for l in range(3):
        lam = None if l == 1 else np.sort(rng.random((*lead, 16)))[..., ::-1].copy()
        out.append(oscar.OSCARCalibration(_orth(rng, *lead), _orth(rng, *lead), 0.9 + 0.01 * l, 0.87 - 0.01 * l,
                                          lam, None if lam is None else lam * 2, "oscar" if l else "hadamard"))
    return out


def _aqua(rank=None, seed=0):
    rng = np.random.default_rng(seed)
    F = 32

    def pred(F_in):
        dims = [F_in, F] if rank is None else [F_in, rank, F]
        mats = tuple(rng.standard_normal((a, b)).astype(np.float32) for a, b in zip(dims, dims[1:]))
        return aqua.Predictor(mats, rng.standard_normal(F).astype(np.float32))

    return aqua.AquaPredictors((None, pred(F), pred(F)), (None, pred(2 * F), pred(2 * F)))


def _same_oscar(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for n in ("R_K", "R_V", "lam_K", "lam_V"):
            u, v = getattr(x, n), getattr(y, n)
            assert (u is None) == (v is None)
            if u is not None:
                assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v), n
        assert (x.clip_k, x.clip_v, x.rotation) == (y.clip_k, y.clip_v, y.rotation)


def _same_aqua(P, Q):
    for a, b in zip(P.f_key + P.f_value, Q.f_key + Q.f_value):
        assert (a is None) == (b is None)
        if a is not None:
            assert len(a.mats) == len(b.mats)
            for m, n in zip(a.mats + (a.bias,), b.mats + (b.bias,)):
                assert m.dtype == n.dtype and m.shape == n.shape and np.array_equal(m, n)


@pytest.fixture
def oscar_file(tmp_path):
    p = tmp_path / "o.safetensors"
    cf.save_oscar(p, _oscar_calibs(), model_shape=SHAPE, config=oscar.OSCARConfig(group_size=16),
                  data={"source": "synthetic", "tokens": 123})
    return p


@pytest.fixture
def aqua_file(tmp_path):
    p = tmp_path / "a.safetensors"
    cf.save_aqua(p, _aqua(), aqua.AquaConfig(), model_shape=SHAPE)
    return p


# ---------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("per_head", [False, True])
def test_oscar_round_trip_is_exact(tmp_path, per_head):
    calibs = _oscar_calibs(per_head)
    p = tmp_path / "o.safetensors"
    written = cf.save_oscar(p, calibs, model_shape=SHAPE, config=oscar.OSCARConfig(group_size=16),
                            data={"source": "synthetic"})
    back, meta = cf.load_oscar(p, expect={"n_layers": 3, "kv_heads": 2, "head_dim": 16})
    _same_oscar(calibs, back)
    assert meta == written == cf.inspect(p)
    assert (meta["schema"], meta["schema_version"], meta["kind"]) == ("kvq-calibration", 1, "oscar")
    assert meta["model_shape"] == SHAPE and meta["data"] == {"source": "synthetic"}
    assert meta["config"] == {"class": "OSCARConfig",
                              "fields": dataclasses.asdict(oscar.OSCARConfig(group_size=16))}
    assert meta["checksum"].startswith("sha256:") and meta["kvq_version"]


def test_oscar_round_trip_of_a_real_calibration(tmp_path):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 4, 40, 16)), rng.standard_normal((1, 2, 40, 16)), rng.standard_normal((1, 2, 40, 16))
    calibs = [oscar.calibrate(q, k, v, clip="fit", group_size=16), oscar.identity_calibration(16)]
    p = tmp_path / "o.safetensors"
    cf.save_oscar(p, calibs, model_shape={**SHAPE, "n_layers": 2}, config={"rotation": "oscar", "clip": "fit"})
    back, meta = cf.load_oscar(p)
    _same_oscar(calibs, back)
    assert back[0].lam_K.dtype == np.float64 and meta["config"] == {"rotation": "oscar", "clip": "fit"}


@pytest.mark.parametrize("rank", [None, 4])
def test_aqua_round_trip_is_exact(tmp_path, rank):
    P, cfg = _aqua(rank), aqua.AquaConfig(sink=2, buffer=16, rope_theta=5e5, predict_values=False)
    p = tmp_path / "a.safetensors"
    cf.save_aqua(p, P, cfg, model_shape={**SHAPE, "rope_theta": 5e5}, data={"n": 1})
    Q, cfg2, meta = cf.load_aqua(p, expect={"head_dim": 16})
    _same_aqua(P, Q)
    assert cfg2 == cfg and meta["kind"] == "aqua" and meta["data"] == {"n": 1}
    assert meta["config"]["fields"]["backbone"] == {"type": "higgs", "d": 2, "n": 16, "group_size": 1024,
                                                    "meta_dtype": "float16", "grid": None}


def test_aqua_backbones_are_rebuilt_exactly(tmp_path):
    grid = (higgs.load_grid(2, 16) * np.float32(1.25)).astype(np.float32)
    for backbone, first in [(aqua.Uniform(bits=4, group_size=32, meta_dtype="float32"), aqua.KeepFP16()),
                            (aqua.Higgs(higgs.HiggsConfig(d=2, n=16, group_size=64, grid=grid)),
                             aqua.Higgs(higgs.HiggsConfig(d=4, n=256)))]:
        cfg = aqua.AquaConfig(backbone=backbone, first_layer=first, pre_rope=False, rope_theta=None)
        p = tmp_path / "a.safetensors"
        cf.save_aqua(p, _aqua(), cfg, model_shape=SHAPE)
        _, cfg2, _ = cf.load_aqua(p)
        assert type(cfg2.backbone) is type(backbone) and type(cfg2.first_layer) is type(first)
        for got, want in ((cfg2.backbone, backbone), (cfg2.first_layer, first)):
            if isinstance(want, aqua.Higgs):
                for f in ("d", "n", "group_size", "meta_dtype"):
                    assert getattr(got.cfg, f) == getattr(want.cfg, f)
                assert np.array_equal(got.cfg.codebook(), want.cfg.codebook())
                assert (got.cfg.grid is None) == (want.cfg.grid is None)
            else:
                assert got == want
        x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        assert np.array_equal(cfg2.backbone.decode(cfg2.backbone.encode(x), 64),
                              backbone.decode(backbone.encode(x), 64))


# ---------------------------------------------------------------------------------------------------
# refusing bad files


def test_missing_file(tmp_path):
    with pytest.raises(CalibrationFileError, match="no such calibration file"):
        cf.load_oscar(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("kind", ["npz", "npy", "pickle", "text", "empty"])
def test_non_safetensors_files_are_refused_and_never_unpickled(tmp_path, kind):
    p = tmp_path / f"calib.{kind}"
    calibs = _oscar_calibs()
    if kind == "npz":
        np.savez(p, R_K=calibs[0].R_K)
        p = p.with_suffix(".npz")
    elif kind == "npy":
        np.save(p, calibs[0].R_K)
        p = p.with_suffix(".npy")
    elif kind == "pickle":
        p.write_bytes(pickle.dumps(calibs))
    elif kind == "text":
        p.write_text("R_K = [[1, 0], [0, 1]]\n" * 4)
    else:
        p.write_bytes(b"")
    want = {"npz": "zip archive", "npy": "NumPy .npy", "pickle": "pickle", "text": "not a valid safetensors",
            "empty": "truncated"}[kind]
    with pytest.raises(CalibrationFileError, match=want):
        cf.load_oscar(p)


def test_truncated_file(oscar_file, tmp_path):
    data = oscar_file.read_bytes()
    for cut in (len(data) - 7, len(data) // 2, 20):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(data[:cut])
        with pytest.raises(CalibrationFileError, match="truncated or corrupted|truncated"):
            cf.load_oscar(p)


def test_one_flipped_tensor_byte_fails_the_checksum(oscar_file, tmp_path):
    data = bytearray(oscar_file.read_bytes())
    header = int.from_bytes(data[:8], "little") + 8
    for pos in (header, header + 1000, len(data) - 1):          # first, middle and last tensor bytes
        bad = bytearray(data)
        bad[pos] ^= 0x01
        p = tmp_path / "flip.safetensors"
        p.write_bytes(bytes(bad))
        with pytest.raises(CalibrationFileError, match="tensor checksum mismatch"):
            cf.load_oscar(p)
        with pytest.raises(CalibrationFileError, match="checksum"):
            cf.inspect(p)
        assert cf.inspect(p, verify=False)["kind"] == "oscar"


def test_altered_metadata_fails(oscar_file, tmp_path):
    p = _rewrite(oscar_file, tmp_path / "m.safetensors",
                 meta=lambda m: m["layout"]["layers"][0].update(clip_k=0.5), fix=False)
    with pytest.raises(CalibrationFileError, match="metadata checksum mismatch"):
        cf.load_oscar(p)
    data = oscar_file.read_bytes()
    i = data.index(b'"clip_k')
    bad = data[:i + 1] + b"C" + data[i + 2:]                    # a byte of the JSON header
    (tmp_path / "h.safetensors").write_bytes(bad)
    with pytest.raises(CalibrationFileError):
        cf.load_oscar(tmp_path / "h.safetensors")


def test_plain_safetensors_file_without_kvq_metadata(tmp_path):
    p = tmp_path / "weights.safetensors"
    safetensors_numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(p))
    with pytest.raises(CalibrationFileError, match="without kvq calibration metadata"):
        cf.load_oscar(p)


def test_wrong_schema_and_newer_version(oscar_file, tmp_path):
    p = _rewrite(oscar_file, tmp_path / "s.safetensors", meta=lambda m: m.update(schema="other-schema"))
    with pytest.raises(CalibrationFileError, match="schema is 'other-schema', expected 'kvq-calibration'"):
        cf.load_oscar(p)
    p = _rewrite(oscar_file, tmp_path / "v.safetensors", meta=lambda m: m.update(schema_version=2))
    with pytest.raises(CalibrationFileError, match="schema_version 2 is newer than this kvq reads"):
        cf.load_oscar(p)


def test_wrong_kind(oscar_file, aqua_file):
    with pytest.raises(CalibrationFileError, match="holds a 'aqua' calibration, not 'oscar'"):
        cf.load_oscar(aqua_file)
    with pytest.raises(CalibrationFileError, match="holds a 'oscar' calibration, not 'aqua'"):
        cf.load_aqua(oscar_file)


@pytest.mark.parametrize("field, want", [("head_dim", 128), ("n_layers", 32), ("kv_heads", 8)])
def test_expect_mismatch_names_field_and_values(oscar_file, aqua_file, field, want):
    msg = f"{field} is {SHAPE[field]!r} in the file, expected {want!r}"
    with pytest.raises(CalibrationFileError, match=msg):
        cf.load_oscar(oscar_file, expect={field: want})
    with pytest.raises(CalibrationFileError, match=msg):
        cf.load_aqua(aqua_file, expect={field: want})


def test_expect_unknown_field(oscar_file):
    with pytest.raises(CalibrationFileError, match="expect names 'n_experts'"):
        cf.load_oscar(oscar_file, expect={"n_experts": 8})
    cf.load_oscar(oscar_file, expect={"model": "unit-test", "rope_theta": 10000.0})


def test_missing_and_extra_tensors(oscar_file, aqua_file, tmp_path):
    p = _rewrite(oscar_file, tmp_path / "x1.safetensors", tensors=lambda t: t.pop("layers.2.R_V"))
    with pytest.raises(CalibrationFileError, match=r"missing tensors \['layers.2.R_V'\]"):
        cf.load_oscar(p)
    p = _rewrite(oscar_file, tmp_path / "x2.safetensors", tensors=lambda t: t.update(extra=np.zeros(3, np.float32)))
    with pytest.raises(CalibrationFileError, match=r"unexpected tensors \['extra'\]"):
        cf.load_oscar(p)
    p = _rewrite(aqua_file, tmp_path / "x3.safetensors", tensors=lambda t: t.pop("f_value.1.bias"))
    with pytest.raises(CalibrationFileError, match=r"missing tensors \['f_value.1.bias'\]"):
        cf.load_aqua(p)


def test_tampered_contents_with_valid_checksums_are_still_checked(oscar_file, aqua_file, tmp_path):
    def skew(t):
        t["layers.0.R_K"] = t["layers.0.R_K"] * np.float32(1.1)

    p = _rewrite(oscar_file, tmp_path / "t1.safetensors", tensors=skew)
    with pytest.raises(CalibrationFileError, match="layer 0: ValueError: R_K is not orthogonal"):
        cf.load_oscar(p)
    p = _rewrite(oscar_file, tmp_path / "b.safetensors",
                 tensors=lambda t: t.update({"layers.1.R_V": t["layers.1.R_V"].astype(np.float64)}))
    with pytest.raises(CalibrationFileError, match="R_V has dtype float64"):
        cf.load_oscar(p)
    p = _rewrite(oscar_file, tmp_path / "c.safetensors", meta=lambda m: m["model_shape"].update(head_dim=32))
    with pytest.raises(CalibrationFileError, match=r"layers.0.R_K has shape \(16, 16\)"):
        cf.load_oscar(p)
    p = _rewrite(aqua_file, tmp_path / "d.safetensors",
                 tensors=lambda t: t.update({"f_key.1.mats.0": t["f_key.1.mats.0"].astype(np.float16)}))
    with pytest.raises(CalibrationFileError, match="'f_key.1.mats.0' is float16 .*expected float32"):
        cf.load_aqua(p)
    p = _rewrite(aqua_file, tmp_path / "e.safetensors",
                 meta=lambda m: m["config"]["fields"]["backbone"].update(n=17))
    with pytest.raises(CalibrationFileError, match="config.backbone .* cannot be rebuilt"):
        cf.load_aqua(p)
    p = _rewrite(oscar_file, tmp_path / "f.safetensors", meta=lambda m: m["layout"]["layers"][2].update(clip_v=1.5))
    with pytest.raises(CalibrationFileError, match=r"clip_v=1.5 must be a ratio"):
        cf.load_oscar(p)


def test_save_validates_its_inputs(tmp_path):
    p = tmp_path / "x.safetensors"
    calibs = _oscar_calibs()
    with pytest.raises(ValueError, match="2 calibrations for model_shape n_layers=3"):
        cf.save_oscar(p, calibs[:2], model_shape=SHAPE)
    with pytest.raises(ValueError, match=r"calibrations\[0\]: calibration rotations have shape"):
        cf.save_oscar(p, calibs, model_shape={**SHAPE, "head_dim": 32})
    with pytest.raises(ValueError, match="model_shape\\['kv_heads'\\] must be a positive int"):
        cf.save_oscar(p, calibs, model_shape={"n_layers": 3, "head_dim": 16})
    with pytest.raises(ValueError, match="data.when: .* is not JSON data"):
        cf.save_oscar(p, calibs, model_shape=SHAPE, data={"when": object()})
    with pytest.raises(ValueError, match=r"expected float32 \(64, 32\) \(F = kv_heads \* head_dim = 64\)"):
        cf.save_aqua(p, _aqua(), aqua.AquaConfig(), model_shape={**SHAPE, "head_dim": 32})
    with pytest.raises(ValueError, match="differs from the model's rope_theta"):
        cf.save_aqua(p, _aqua(), aqua.AquaConfig(rope_theta=1e6), model_shape=SHAPE)
    assert not p.exists()
    assert not list(tmp_path.iterdir())                          # no temporary file left behind


# ---------------------------------------------------------------------------------------------------
# calibrating a tiny model


@pytest.fixture(scope="module")
def tiny():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvq.integrations.models import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny_llama_config(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, intermediate_size=256, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (2, 48)) for _ in range(2)]
    return model, batches


def test_calibrate_oscar_model_save_load_use(tiny, tmp_path):
    from kvq.commands.calibrate import calibrate_oscar_model, model_shape
    from kvq.integrations.capture import collect_calibration

    model, batches = tiny
    calibs = calibrate_oscar_model(model, batches, progress=False)
    assert len(calibs) == 2
    for c in calibs:
        assert c.R_K.shape == c.R_V.shape == (32, 32) and c.R_K.dtype == np.float32
        for R in (c.R_K, c.R_V):
            assert np.abs(R.T.astype(np.float64) @ R - np.eye(32)).max() < 1e-5
    # streaming the target covariances batch by batch == calibrating on all batches at once
    layers = collect_calibration(model, batches, progress=False)
    for c, r in zip(calibs, layers):
        direct = oscar.calibrate(r["q"], r["k"], r["v"], scale=r["scaling"])
        np.testing.assert_allclose(c.lam_K, direct.lam_K, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(c.lam_V, direct.lam_V, rtol=1e-9, atol=1e-12)
    shape = model_shape(model, "tiny")
    assert shape["n_layers"] == 2 and shape["kv_heads"] == 2 and shape["head_dim"] == 32
    p = tmp_path / "tiny.oscar.safetensors"
    cf.save_oscar(p, calibs, model_shape=shape, data={"source": "random ids"})
    back, meta = cf.load_oscar(p, expect={"n_layers": 2, "kv_heads": 2, "head_dim": 32})
    _same_oscar(calibs, back)
    # use it: the loaded calibration drives an OSCAR cache exactly as the in-memory one
    ocfg = oscar.OSCARConfig(sink=4, window=8, group_size=32, page_size=8, max_tokens=64)
    k, v, q = layers[1]["k"][:1], layers[1]["v"][:1], layers[1]["q"][:1, :, -1:]
    outs = []
    for c in (calibs[1], back[1]):
        st = oscar.init(ocfg, 1, 2, 32)
        oscar.append(ocfg, c, st, k, v)
        outs.append(oscar.decode_attention(ocfg, c, st, q)[0])
    assert np.array_equal(outs[0], outs[1])

    per_head = calibrate_oscar_model(model, batches[:1], per_head=True, rotation="eigen", clip="fit",
                                     group_size=32, progress=False)
    assert per_head[0].R_K.shape == (2, 32, 32) and per_head[0].rotation == "eigen"
    cf.save_oscar(p, per_head, model_shape=shape)
    _same_oscar(per_head, cf.load_oscar(p)[0])


def test_calibrate_aqua_model_save_load_use(tiny, tmp_path):
    from kvq.commands.calibrate import calibrate_aqua_model, model_shape
    from kvq.integrations.capture import collect_calibration

    model, batches = tiny
    cfg = aqua.AquaConfig(backbone=aqua.Uniform(), sink=4, rope_theta=10000.0)
    P, cfg2 = calibrate_aqua_model(model, batches, cfg=cfg, progress=False)
    assert cfg2 is cfg and P.n_layers == 2 and P.f_key[0] is None
    assert P.f_key[1].mats[0].shape == (64, 64) and P.f_value[1].mats[0].shape == (128, 64)
    layers = collect_calibration(model, batches, progress=False, keep=("k", "v"))
    direct = aqua.calibrate(cfg, [(r["k"], r["v"]) for r in layers])
    _same_aqua(P, direct)                                        # same captured K, V -> same predictors
    p = tmp_path / "tiny.aqua.safetensors"
    cf.save_aqua(p, P, cfg, model_shape=model_shape(model, "tiny"))
    Q, cfg3, _ = cf.load_aqua(p, expect={"n_layers": 2, "head_dim": 32})
    _same_aqua(P, Q)
    assert cfg3 == cfg
    toks = aqua.calibration_tokens(cfg, [(r["k"][:1], r["v"][:1]) for r in layers])
    hats = []
    for PP in (P, Q):
        _, _, K0, V0 = aqua.encode(cfg, PP, 0, *toks[0])
        hats.append(aqua.encode(cfg, PP, 1, *toks[1], K0, V0)[2:])
    assert all(np.array_equal(a, b) for a, b in zip(*hats))
    with pytest.raises(ValueError, match="cfg.rope_theta=500000.0 but the model's is 10000.0"):
        calibrate_aqua_model(model, batches, cfg=aqua.AquaConfig(rope_theta=5e5), progress=False)


def test_calibration_batches(tmp_path):
    pytest.importorskip("transformers")
    from kvq.commands.calibrate import calibration_batches
    from kvq.integrations.models import ByteTokenizer

    batches, desc = calibration_batches(ByteTokenizer(), source="stdlib", tokens=1000, seq_len=128, batch_size=3)
    assert [b.shape for b in batches] == [(3, 128), (3, 128), (1, 128)] and desc["tokens"] == 896
    assert desc["source"] == "stdlib" and all(b.dtype == np.int64 and b.max() <= 256 for b in batches)
    f = tmp_path / "text.txt"
    f.write_text("hello world, " * 40)
    batches, desc = calibration_batches(ByteTokenizer(), source=str(f), tokens=10_000, seq_len=100)
    assert desc["tokens"] == 500 and desc["source"] == "file" and batches[0][0, :5].tolist() == list(b"hello")
    with pytest.raises(ValueError, match="less than one sequence"):
        calibration_batches(ByteTokenizer(), source=str(f), tokens=10_000, seq_len=1000)
    with pytest.raises(FileNotFoundError, match="not 'stdlib', 'english' or an existing text file"):
        calibration_batches(ByteTokenizer(), source=str(tmp_path / "none.txt"))


# ---------------------------------------------------------------------------------------------------
# the command


@pytest.mark.parametrize("method", ["oscar", "aqua"])
def test_main_help(method, capsys):
    from kvq.commands.calibrate import main

    with pytest.raises(SystemExit) as e:
        main([method, "--help"])
    assert e.value.code == 0 and "--model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_main_end_to_end_on_a_model_directory(tiny, tmp_path, capsys):
    from kvq.commands.calibrate import main

    model, _ = tiny
    model_dir = tmp_path / "tiny-lm"
    model.save_pretrained(model_dir)
    out = tmp_path / "t.oscar.safetensors"
    common = ["--model", str(model_dir), "--tokens", "256", "--seq-len", "64", "--device", "cpu", "--quiet"]
    assert main(["oscar", *common, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    calibs, meta = cf.load_oscar(out, expect={"n_layers": 2, "head_dim": 32})
    assert len(calibs) == 2 and summary["checksum"] == meta["checksum"]
    assert meta["data"]["tokens"] == 256 and meta["data"]["source"] == "stdlib"
    assert meta["model_shape"]["model"] == str(model_dir)
    out = tmp_path / "t.aqua.safetensors"
    assert main(["aqua", *common, "--out", str(out), "--backbone", "uniform", "--rank", "8"]) == 0
    assert "wrote" in capsys.readouterr().out
    P, cfg, _ = cf.load_aqua(out, expect={"kv_heads": 2})
    assert isinstance(cfg.backbone, aqua.Uniform) and cfg.pre_rope and P.f_key[1].mats[0].shape == (64, 8)
    # a missing model directory is a bad invocation, refused before any work (exit status 2, one line)
    assert main(["oscar", "--model", str(tmp_path / "missing"), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no such model directory" in err and len(err.strip().splitlines()) == 1


def test_sniff_accepts_a_safetensors_header_that_starts_like_a_pickle(tmp_path):
    """A safetensors header of 640-1535 bytes starts with 0x80 0x02..0x05, a pickle's first two bytes;
    the safetensors layout (length, then '{') is recognised first, so such a file is not refused."""
    from kvq.calibration import _sniff
    p = tmp_path / "h.safetensors"
    p.write_bytes((640).to_bytes(8, "little") + b"{" + b" " * 639)
    assert p.read_bytes()[:2] == b"\x80\x02"
    _sniff(str(p))                                   # no error: the parser decides from here on
    q = tmp_path / "p.safetensors"
    import pickle
    q.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(CalibrationFileError, match="pickle"):
        _sniff(str(q))
