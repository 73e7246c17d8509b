"""The short ways a decode step's host code takes for the common case (a model's float scale, tensors already
in the dtype and on the device wanted, an int layer index), against the general rule they skip: the same
result, the same errors (CPU, no kernels)."""

import math

import numpy as np
import pytest
import torch

from kvq.fast import common as C
from kvq.fast.caches import paged as CP
from kvq.integrations import methods as M
from kvq.reference import kivi as RK
from kvq.reference import state as RS


@pytest.mark.parametrize("scale, want", [(None, 1 / math.sqrt(128)), (0.088, 0.088), (np.float64(0.5), 0.5),
                                         (np.float32(0.25), 0.25), (2, 2.0)])
def test_softmax_scale_values(scale, want):
    """A Python float comes back as it is; None, NumPy reals and ints as the float of their value."""
    got = C.softmax_scale(scale, 128)
    assert type(got) is float and got == want


@pytest.mark.parametrize("scale, err", [(float("inf"), ValueError), (float("nan"), ValueError),
                                        (-float("inf"), ValueError), (True, TypeError), ("0.1", TypeError),
                                        (1j, TypeError)])
def test_softmax_scale_refuses(scale, err):
    """Non-finite floats (the short way for floats takes finite ones only), bools and non-reals are refused."""
    with pytest.raises(err, match="scale must be"):
        C.softmax_scale(scale, 64)


def test_to_out_same_dtype_is_the_tensor():
    """``to_out`` to the tensor's own dtype returns the tensor itself (no copy); fp32 to fp16 still saturates
    finite values beyond the fp16 range, and a dtype named by a string still works."""
    x16 = torch.tensor([1.0, -2.0], dtype=torch.float16)
    assert C.to_out(x16, torch.float16) is x16
    x32 = torch.tensor([1e6, -1e6, float("inf"), float("nan"), 1.5])
    y = C.to_out(x32, torch.float16)
    assert y.dtype == torch.float16
    assert y[:2].tolist() == [65504.0, -65504.0] and math.isinf(y[2].item()) and math.isnan(y[3].item())
    assert C.to_out(x32, "float32") is x32


def test_to_fp16_keeps_fp16_tokens():
    """fp16 tokens reach the append as they are; fp32 tokens are rounded (a new tensor)."""
    k = torch.randn(1, 2, 1, 16).half()
    v = torch.randn(1, 2, 1, 16)
    k16, v16 = CP._to_fp16(k, v)
    assert k16 is k and v16 is not v and v16.dtype == torch.float16 and torch.equal(v16, v.half())


def _store(**kw):
    return M.KVStore("KIVI-K2V2", n_layers=3, batch=1, kv_heads=2, head_dim=32, max_tokens=64, backend="reference",
                     **kw)


@pytest.mark.parametrize("layer, want", [(0, 0), (2, 2), (np.int64(1), 1)])
def test_check_layer_accepts(layer, want):
    got = _store().check_layer(layer)
    assert got == want and type(got) is int


@pytest.mark.parametrize("layer", [3, -1, True, False, 1.0, "0", None, np.int64(3)])
def test_check_layer_refuses(layer):
    """Out of range, bools (even True == 1), floats, strings: IndexError, as before the short way for ints."""
    with pytest.raises(IndexError, match="out of range"):
        _store().check_layer(layer)


def test_convert_takes_a_tensor_as_it_is():
    """A float16 / float32 tensor already on the layer's device is used as it is (no copy, no new view); one
    that requires grad is detached; bf16 is widened to fp32; a CPU tensor for a CUDA layer is copied over
    (Triton backend: the CUDA device where there is one, else the CPU under the interpreter, which the test
    suite's conftest turns on)."""
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    s = M.KVStore("KIVI-K2V2", n_layers=1, batch=1, kv_heads=2, head_dim=32, max_tokens=64, backend="triton",
                  device=dev)
    x = torch.randn(1, 2, 3, 32).half().to(dev)
    assert s._convert(x, "k", 0) is x
    g = torch.randn(1, 2, 3, 32, requires_grad=True, device=dev)
    y = s._convert(g, "k", 0)
    assert not y.requires_grad and torch.equal(y, g.detach())
    b = torch.randn(1, 2, 3, 32).bfloat16().to(dev)
    z = s._convert(b, "k", 0)
    assert z.dtype == torch.float32 and torch.equal(z, b.float())
    if dev.type == "cuda":
        h = torch.randn(1, 2, 3, 32).half()
        w = s._convert(h, "k", 0)
        assert w.device == dev and torch.equal(w.cpu(), h)


def test_reference_convert_detaches_grad_tensors():
    """The reference store takes a tensor that requires grad (as NumPy, detached)."""
    g = torch.randn(1, 2, 3, 32, requires_grad=True)
    a = _store()._convert(g, "k", 0)
    assert isinstance(a, np.ndarray) and np.array_equal(a, g.detach().numpy())


@pytest.mark.parametrize("n, ok", [(0, True), (5, True), (np.int64(5), True), (64, True), (65, False), (-1, False),
                                   (True, False), (5.0, False), (None, False)])
def test_state_length_check(n, ok):
    """``check_state``'s token counter: an int (Python or NumPy, not a bool) in [0, max_tokens]."""
    cfg = RK.CONFIGS["KIVI-K2V2"]
    import dataclasses
    cfg = dataclasses.replace(cfg, max_tokens=64)
    st = RK.init(cfg, 1, 2, 32)
    st.length = n
    if ok:
        RS.check_state(st, cfg, type(cfg), type(st))
    else:
        with pytest.raises(ValueError, match="state.length="):
            RS.check_state(st, cfg, type(cfg), type(st))


def test_atomic_puts_the_store_back_on_error():
    """``KVStore._atomic``: the states, config and counters taken on entry come back if the block raises (and
    the error propagates); a block that completes keeps what it did."""
    s = _store()
    held = list(s.layer_states)
    with pytest.raises(KeyError):
        with s._atomic(1):
            s.layer_states[1] = "changed"
            s.dequantize_calls += 5
            raise KeyError("x")
    assert s.layer_states == held and s.dequantize_calls == 0
    with s._atomic(1):
        s.layer_states[1] = "kept"
    assert s.layer_states[1] == "kept"


def test_device_ctx_switches_and_restores(monkeypatch):
    """``KVStore.device_ctx`` on CUDA layers: the layer's device current inside the block and the one before
    after it, also when the block raises; no switch where the device is current already (the CUDA calls
    recorded through stand-ins, so this runs without a GPU)."""
    current, calls = [1], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(i):
        calls.append(i)
        current[0] = i

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    ctx = M._OnDevice(3)
    with ctx:
        assert current[0] == 3
    assert current == [1] and calls == [3, 1]
    with pytest.raises(KeyError):
        with M._OnDevice(2):
            assert current[0] == 2
            raise KeyError("x")
    assert current == [1] and calls == [3, 1, 2, 1]
    calls.clear()
    with M._OnDevice(1):
        with M._OnDevice(0):
            assert current[0] == 0
        assert current[0] == 1
    assert calls == [0, 1]


@pytest.mark.gpu
def test_device_ctx_on_the_gpu():
    """On a CUDA store the context holds the layer's device current (the store's devices carry their index)."""
    s = M.KVStore("KIVI-K2V2", n_layers=2, batch=1, kv_heads=2, head_dim=32, max_tokens=64, backend="triton",
                  device="cuda")
    before = torch.cuda.current_device()
    assert all(d.index is not None for d in s.devices)
    with s.device_ctx(1):
        assert torch.cuda.current_device() == s.devices[1].index
    assert torch.cuda.current_device() == before
