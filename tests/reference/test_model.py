"""kvq.reference.model: the tiny decoder behind AQUA-KV's layer interface (seeded, float32, causal, GQA)."""

import numpy as np
import pytest

from kvq.reference import model as M

CFG = M.ModelConfig(n_layers=3, seed=0)


@pytest.fixture(scope="module")
def tiny():
    return M.TinyDecoder(CFG)


def test_seeded_and_float32(tiny):
    again = M.TinyDecoder(CFG)
    other = M.TinyDecoder(M.ModelConfig(n_layers=3, seed=1))
    assert tiny.embedding.dtype == np.float32
    np.testing.assert_array_equal(tiny.layers[2]["w_k"], again.layers[2]["w_k"])
    assert not np.array_equal(tiny.layers[2]["w_k"], other.layers[2]["w_k"])
    for p in tiny.layers:
        assert all(w.dtype == np.float32 for w in p.values())


def test_interface_shapes(tiny):
    tok = M.sample_tokens(CFG, 2, 10, seed=1)
    assert tok.shape == (2, 10) and tok.min() >= 0 and tok.max() < CFG.vocab_size
    np.testing.assert_array_equal(tok, M.sample_tokens(CFG, 2, 10, seed=1))
    x = tiny.embed(tok)
    k, v, y = tiny.layer(0, x)
    assert k.shape == v.shape == (2, CFG.n_kv_heads, 10, CFG.head_dim)
    assert y.shape == x.shape and y.dtype == k.dtype == np.float32
    assert tiny.logits(y).shape == (2, 10, CFG.vocab_size)
    kv = M.collect_kv(tiny, tok)
    assert len(kv) == CFG.n_layers
    np.testing.assert_array_equal(kv[0][0], k)


def test_incremental_equals_full_forward(tiny):
    """Causal attention with a past: logits of tokens t.. given the past K / V equal the full pass."""
    tok = M.sample_tokens(CFG, 2, 24, seed=3)
    full, kv = M.forward(tiny, tok)
    head, past = M.forward(tiny, tok[:, :15])
    tail, new = M.forward(tiny, tok[:, 15:], past)
    np.testing.assert_allclose(np.concatenate([head, tail], 1), full, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new[1][0], kv[1][0][:, :, 15:], rtol=1e-4, atol=1e-4)


def test_rope_inverse_norm_and_relative_position():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 7, 32)).astype(np.float32)
    pos = np.arange(5, 12)
    y = M.apply_rope(x, pos, 1e4)
    np.testing.assert_allclose(M.apply_rope(y, pos, 1e4, inverse=True), x, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    q, k = x[0, 0, 0], x[0, 0, 1]                      # q . k after RoPE depends on the offset only
    dots = [float(M.apply_rope(q[None], [p + 3], 1e4)[0] @ M.apply_rope(k[None], [p], 1e4)[0]) for p in (0, 10, 99)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        M.ModelConfig(n_heads=3, n_kv_heads=2)
    with pytest.raises(ValueError, match="even"):
        M.ModelConfig(head_dim=31)
    with pytest.raises(ValueError, match="token ids"):
        tiny.embed(np.array([[0, CFG.vocab_size]]))
    with pytest.raises(ValueError, match="layer index"):
        tiny.layer(3, np.zeros((1, 2, CFG.d_model), np.float32))
    with pytest.raises(TypeError, match="float64"):
        tiny.layer(0, np.zeros((1, 2, CFG.d_model)))


def test_bad_arguments_name_the_argument(tiny):
    """Issue 36: every public function refuses a bad argument with an error naming it, before any work."""
    pos = np.arange(3)
    with pytest.raises(TypeError, match="head_dim"):
        M.rope_tables(pos, True, 1e4)                           # a bool is not a head dim
    with pytest.raises(ValueError, match="head_dim"):
        M.rope_tables(pos, 3, 1e4)                              # odd: RoPE rotates pairs
    for theta, err in ((float("nan"), ValueError), (-1.0, ValueError), (0.0, ValueError), ("1e4", TypeError)):
        with pytest.raises(err, match="theta"):
            M.rope_tables(pos, 4, theta)
    with pytest.raises(TypeError, match="positions"):
        M.rope_tables(pos + 0.5, 4, 1e4)                        # float positions would be truncated
    with pytest.raises(ValueError, match="positions"):
        M.rope_tables(pos[None], 4, 1e4)
    x = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="odd head dim"):
        M.apply_rope(x[..., :3], pos, 1e4)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        M.apply_rope(np.float32(1), pos, 1e4)
    with pytest.raises(TypeError, match="positions"):
        M.apply_rope(x, None, 1e4)
    with pytest.raises(TypeError, match="x must be a real floating array"):
        M.rms_norm(np.ones((2, 8), np.complex64), np.ones(8, np.float32), 1e-5)
    with pytest.raises(ValueError, match="w must have shape"):
        M.rms_norm(np.ones((2, 8), np.float32), np.ones(9, np.float32), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        M.rms_norm(np.ones((2, 8), np.float32), np.ones(8, np.float32), -1.0)
    with pytest.raises(ValueError, match="rope_theta"):
        M.ModelConfig(rope_theta=0.0)
    with pytest.raises(ValueError, match="eps"):
        M.ModelConfig(eps=float("nan"))
    with pytest.raises(TypeError, match="cfg must be a ModelConfig"):
        M.sample_tokens("cfg", 1, 4)
    for name, kw in (("batch", dict(batch=True)), ("T", dict(T=-1)), ("branching", dict(branching=0))):
        args = dict(batch=1, T=4, branching=4)
        args.update(kw)
        with pytest.raises((TypeError, ValueError), match=name):
            M.sample_tokens(CFG, **args)
    tok = M.sample_tokens(CFG, 1, 4)
    with pytest.raises(TypeError, match="model must implement KVModel"):
        M.collect_kv({}, tok)
    with pytest.raises(ValueError, match="past must be None or a list of n_layers=3"):
        M.forward(tiny, tok, past=[(np.zeros((1, 2, 2, 32), np.float32),) * 2])
    with pytest.raises(ValueError, match="past must"):
        M.forward(tiny, tok, past="past")
    with pytest.raises(ValueError, match="past_k must be"):
        tiny.layer(0, tiny.embed(tok), np.zeros((1, 2, 2, 16), np.float32), np.zeros((1, 2, 2, 16), np.float32))


def test_non_finite_inputs_propagate_without_numpy_warnings():
    """inf / NaN handed to rms_norm and aqua_probes.explained_variance propagate as documented, and tokens
    beyond fp16's range are refused by rotations.fake_quantize, all without a NumPy RuntimeWarning (the
    suite ends without a wall of warnings)."""
    import warnings

    from kvq.reference import aqua_probes, model, rotations
    x = np.array([[np.inf, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = model.rms_norm(x, np.ones(4, np.float32), 1e-6)
        assert np.isnan(y[0]).any() and np.isfinite(y[1]).all()
        big = np.full((1, 1, 2, 4), 1e6, np.float32)
        with pytest.raises(ValueError, match="non-finite"):              # beyond fp16: refused, not warned
            rotations.fake_quantize(big, np.eye(4), clip=1.0, group_size=4, bits=2)
        ev = aqua_probes.explained_variance(np.array([[1.0, np.inf], [2.0, 3.0]]), np.zeros((2, 2)))
        assert np.isnan(ev)
