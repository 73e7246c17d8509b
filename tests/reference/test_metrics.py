"""kvq.reference.metrics: zero for identical inputs, small cases by hand, KL >= 0, GQA."""

import numpy as np
import pytest

from kvq.reference.metrics import attention_kl, logit_mse, output_mse, relative_mse


def data(seed, H_q=4, H_kv=2, T_q=5, T_k=7, D=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, H_q, T_q, D)).astype(dtype)
    k = rng.standard_normal((2, H_kv, T_k, D)).astype(dtype)
    v = rng.standard_normal((2, H_kv, T_k, D)).astype(dtype)
    k_hat = (k + 0.1 * rng.standard_normal(k.shape)).astype(dtype)
    v_hat = (v + 0.1 * rng.standard_normal(v.shape)).astype(dtype)
    return q, k, v, k_hat, v_hat


def test_identical_inputs_give_zero():
    q, k, v, _, _ = data(0)
    assert relative_mse(k, k) == 0.0
    assert logit_mse(q, k, k) == 0.0
    assert attention_kl(q, k, k) == 0.0
    assert attention_kl(q, k, k, causal=True) == 0.0
    assert output_mse(q, k, v, k, v) == 0.0
    assert output_mse(q, k, v, k, v, causal=True) == 0.0


def test_relative_mse_by_hand():
    assert relative_mse(np.array([3.0, 4.0]), np.array([3.0, 0.0])) == pytest.approx(16 / 25, rel=1e-15)
    assert relative_mse(np.float16([1, 1]), np.float16([0, 0])) == 1.0
    with pytest.raises(ValueError, match="all zeros"):
        relative_mse(np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="shape"):
        relative_mse(np.ones(3), np.ones(4))
    with pytest.raises(TypeError, match="int64"):
        relative_mse(np.ones(3, np.int64), np.ones(3))


def test_logit_mse_by_hand():
    q = np.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = np.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 1, 2, 2)
    k_hat = np.array([[0.0, 0.0], [0.0, 1.0]]).reshape(1, 1, 2, 2)
    assert logit_mse(q, k, k_hat, scale=1.0) == pytest.approx(0.5, rel=1e-15)     # logits (1, 0) vs (0, 0)
    assert logit_mse(q, k, k_hat) == pytest.approx(0.25, rel=1e-15)               # scale 1/sqrt(2)


def test_attention_kl_by_hand():
    # p = softmax(0, log 3) = (1/4, 3/4); p_hat = softmax(0, 0) = (1/2, 1/2)
    q = np.ones((1, 1, 1, 1))
    k = np.array([0.0, np.log(3.0)]).reshape(1, 1, 2, 1)
    k_hat = np.zeros((1, 1, 2, 1))
    want = 0.25 * np.log(0.25 / 0.5) + 0.75 * np.log(0.75 / 0.5)
    assert attention_kl(q, k, k_hat, scale=1.0) == pytest.approx(want, rel=1e-14)
    # causal with T_q = T_k = 2: row 0 sees one key (KL 0), row 1 is the case above; mean over rows
    q2 = np.ones((1, 1, 2, 1))
    assert attention_kl(q2, k, k_hat, causal=True, scale=1.0) == pytest.approx(want / 2, rel=1e-14)


def test_output_mse_by_hand():
    # one key: the output is that key's value whatever the scores
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 3, 4))
    k, v = rng.standard_normal((1, 1, 1, 4)), rng.standard_normal((1, 1, 1, 4))
    k_hat, v_hat = k + 1.0, v + 0.5
    assert output_mse(q, k, v, k_hat, v_hat) == pytest.approx(0.25, rel=1e-14)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("causal", [False, True])
def test_kl_nonnegative_and_metrics_positive(seed, causal):
    q, k, v, k_hat, v_hat = data(seed, T_q=7)
    assert attention_kl(q, k, k_hat, causal=causal) > 0
    assert attention_kl(q, k_hat, k, causal=causal) > 0
    assert logit_mse(q, k, k_hat) > 0
    assert output_mse(q, k, v, k_hat, v_hat, causal=causal) > 0
    assert 0 < relative_mse(k, k_hat) < 0.1


def test_gqa_aware():
    q, k, v, k_hat, v_hat = data(3, H_q=6, H_kv=2, dtype=np.float64)
    rep = lambda x: np.repeat(x, 3, axis=1)  # noqa: E731
    assert logit_mse(q, k, k_hat) == pytest.approx(logit_mse(q, rep(k), rep(k_hat)), rel=1e-13)
    assert attention_kl(q, k, k_hat) == pytest.approx(attention_kl(q, rep(k), rep(k_hat)), rel=1e-12)
    assert output_mse(q, k, v, k_hat, v_hat) == \
        pytest.approx(output_mse(q, rep(k), rep(v), rep(k_hat), rep(v_hat)), rel=1e-12)


def test_mixed_input_dtypes_are_computed_in_float64():
    q, k, v, k_hat, v_hat = data(4)
    a = output_mse(q, k, v, k_hat.astype(np.float16), v_hat.astype(np.float16))
    b = output_mse(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                   k_hat.astype(np.float16).astype(np.float64), v_hat.astype(np.float16).astype(np.float64))
    assert a == b


def test_errors():
    q, k, v, k_hat, _ = data(5)
    with pytest.raises(ValueError, match="shape"):
        logit_mse(q, k, k_hat[:, :, :3])
    with pytest.raises(ValueError, match="multiple of H_kv"):
        attention_kl(q[:, :3], k, k_hat)
    with pytest.raises(ValueError, match="sees no key"):
        attention_kl(q, k[:, :, :3], k_hat[:, :, :3], causal=True)


def test_nonfinite_inputs_are_named():
    """Issue 36: NaN / inf in k_hat or v_hat raise naming them (not attention's own k / v)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 8)).astype(np.float32) for _ in range(3))
    bad = k.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="k_hat contains non-finite"):
        logit_mse(q, k, bad)
    with pytest.raises(ValueError, match="k_hat contains non-finite"):
        attention_kl(q, k, bad)
    with pytest.raises(ValueError, match="v_hat contains non-finite"):
        output_mse(q, k, v, k, bad)
