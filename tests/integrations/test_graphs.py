"""Decode steps replayed from CUDA graphs (kvq.integrations.graphs): the checks and the capture's hooks on the
CPU (no CUDA graph exists there: a recorder that runs each layer's kvq work at once stands in for the
replay), and on the device machine (``-m gpu``) generation through the graphs against ``model.generate``."""

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from kvq.integrations import graphs as G  # noqa: E402
from kvq.integrations import methods as M  # noqa: E402
from kvq.integrations.transformers import cache_argument, make_cache  # noqa: E402

from .small import SMALL  # noqa: E402
from .test_transformers_caches import calibration_for, prompt, tiny  # noqa: E402

METHODS = list(M.METHODS)


def _arrays(cache) -> list:
    """Every array of every layer's state (NumPy copies), in a fixed order."""
    out = []
    store = cache.store
    seen = set()
    for layer in range(store.n_layers):
        st = store.state(layer)
        if id(st) in seen:
            continue
        seen.add(id(st))
        out.extend(_flatten(st))
    return out


def _flatten(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x.detach().cpu().numpy().copy()]
    if isinstance(x, np.ndarray):
        return [x.copy()]
    if isinstance(x, (list, tuple)):
        return [a for y in x for a in _flatten(y)]
    if isinstance(x, dict):
        return [a for k in sorted(x) for a in _flatten(x[k])]
    if hasattr(x, "__dataclass_fields__"):
        return [a for k in x.__dataclass_fields__ for a in _flatten(getattr(x, k))]
    return [np.asarray(x).copy()] if isinstance(x, (int, float)) else []


def _same_arrays(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and
                                    np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def _cache(model, name, **kw):
    calib = calibration_for(model, name) if M.METHODS[name].calibration else None
    return make_cache(name, model, calibration=calib, **SMALL[name], **kw)


def _prefilled(model, name, ids, **kw):
    cache = _cache(model, name, **kw)
    with torch.no_grad():
        model(ids, **{cache_argument(model): cache})
    return cache


class _Graph:
    """What the recorder needs of a CUDA graph on the CPU: it counts the ends of its capture."""

    def __init__(self):
        self.ended = 0

    def capture_end(self):
        self.ended += 1


class _Recorder(G.DecodeGraphs):
    """The capture's hooks on the CPU, where ops run at once: ``run_now`` runs each layer's recorded kvq work
    as soon as it is recorded (a replay runs it between the same two graphs), so the forward continues on
    real values."""

    def __init__(self, cache, run_now: bool):
        self.cache, self.run_now = cache, run_now
        self._graphs, self._pieces = [_Graph()], []

    def _begin(self):
        self._graphs.append(_Graph())

    def capture_attention(self, module, layer, query, key, value, kwargs):
        out, none = super().capture_attention(module, layer, query, key, value, kwargs)
        if self.run_now:                                     # as a replay runs it: the cache not recording
            self.cache.graph_capture = None
            try:
                self._pieces[-1]()
            finally:
                self.cache.graph_capture = self
        return out, none


def _step(model, cache, tok, recorder=None):
    pos = torch.full((tok.shape[0], 1), cache.get_seq_length(), dtype=torch.long)
    cache.graph_capture = recorder
    try:
        with torch.no_grad():
            return model(input_ids=tok, position_ids=pos, **{cache_argument(model): cache}).logits[:, -1]
    finally:
        cache.graph_capture = None


@pytest.mark.parametrize("name", ["KIVI-K2V2", "AQUA-KV", "FP16"])
def test_capture_writes_nothing_and_cuts_the_step_at_each_attention_layer(name):
    """While a step is recorded, the cache's update appends nothing (every array bit-identical, the length
    unchanged) and each attention layer ends a graph and begins the next: layers + 1 graphs, each ended once."""
    model = tiny(head_dim=64)
    cache = _prefilled(model, name, prompt(24, batch=2))
    before, T = _arrays(cache), cache.get_seq_length()
    rec = _Recorder(cache, run_now=False)
    _step(model, cache, torch.tensor([[3], [5]]), rec)
    assert cache.get_seq_length() == T and _same_arrays(_arrays(cache), before)
    assert [p.layer for p in rec._pieces] == [0, 1]
    assert len(rec._graphs) == 3 and all(g.ended == 1 for g in rec._graphs[:-1]) and rec._graphs[-1].ended == 0
    assert all(p.out.shape == (2, 1, 4, 64) for p in rec._pieces)


@pytest.mark.parametrize("name", METHODS)
def test_recorded_layer_work_is_the_eager_step(name):
    """Each recorded piece is the eager step's kvq work of its layer: run in the replay's order, the pieces
    give the eager step's logits and leave every layer's state as the eager step leaves it, bit for bit."""
    model = tiny(head_dim=64)
    ids = prompt(28, batch=2, seed=4)
    cache = _prefilled(model, name, ids[:, :24])
    twin = copy.deepcopy(cache, memo={id(cache.store._mod): cache.store._mod})
    for t in range(24, 28):                                  # several steps: a page and a window boundary pass
        tok = ids[:, t:t + 1]
        want = _step(model, twin, tok)
        got = _step(model, cache, tok, _Recorder(cache, run_now=True))
        assert torch.equal(got, want)
        assert cache.get_seq_length() == twin.get_seq_length() == t + 1
        assert _same_arrays(_arrays(cache), _arrays(twin))


def test_generate_checks_everything_before_the_prefill():
    """Each bad argument is refused with a clear error and the cache stays empty; on the CPU the last check
    refuses the model (CUDA graphs need a CUDA device)."""
    model = tiny(head_dim=64)
    ids = prompt(12)
    cache = _cache(model, "KIVI-K2V2")
    with pytest.raises(TypeError, match="kvq cache"):
        G.generate(model, ids, DynamicCache(config=model.config), 4)
    plain = make_cache("KIVI-K2V2", model, attention="dequantize", **SMALL["KIVI-K2V2"])
    with pytest.raises(ValueError, match="attention='auto'"):
        G.generate(model, ids, plain, 4)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="'kvq' attention"):
        G.generate(model, ids, cache, 4)
    model.set_attn_implementation("kvq")
    with pytest.raises(TypeError, match="input_ids"):
        G.generate(model, ids.float(), cache, 4)
    with pytest.raises(TypeError, match="input_ids"):
        G.generate(model, ids[0], cache, 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            G.generate(model, ids, cache, bad)
    for bad in ("2", [], [1, -2], 1.5):
        with pytest.raises(TypeError, match="eos_token_id"):
            G.generate(model, ids, cache, 4, eos_token_id=bad)
    with pytest.raises(TypeError, match="pad_token_id"):
        G.generate(model, ids, cache, 4, eos_token_id=2, pad_token_id="0")
    with pytest.raises(ValueError, match="capacity"):
        G.generate(model, ids, _cache(model, "KIVI-K2V2", max_tokens=16), 8)
    with pytest.raises(ValueError, match="CUDA device"):
        G.generate(model, ids, cache, 4)
    assert cache.store is None and cache.get_seq_length() == 0
    full = _prefilled(model, "KIVI-K2V2", ids)
    with pytest.raises(ValueError, match="empty cache"):
        G.generate(model, ids, full, 4)
    assert full.get_seq_length() == 12


def test_decode_graphs_refuses_an_empty_cache_and_a_cpu_model():
    model = tiny(head_dim=64)
    with pytest.raises(ValueError, match="CUDA device"):
        G.DecodeGraphs(model, _prefilled(model, "KIVI-K2V2", prompt(12)))
    with pytest.raises(TypeError, match="kvq cache"):
        G.DecodeGraphs(model, DynamicCache(config=model.config))


# ---------------------------------------------------------------------------------------------------
# the device machine


def _gpu_model(dtype):
    return tiny(dtype=dtype, head_dim=64).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cupy"])
@pytest.mark.parametrize("name", METHODS)
def test_graph_generate_equals_model_generate_gpu(name, backend):
    """Greedy generation through the graphs gives model.generate's tokens, token for token, and leaves the
    cache as an eager generation does (every array bit-identical); the step was replayed from layers + 1
    graphs."""
    model = _gpu_model(torch.float16)
    calib = calibration_for(tiny(head_dim=64), name) if M.METHODS[name].calibration else None
    ids = prompt(40, batch=2, seed=7).cuda()
    mk = lambda: make_cache(name, model, calibration=calib, backend=backend, **SMALL[name])    # noqa: E731
    want_cache = mk()
    want = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          **{cache_argument(model): want_cache})
    made = []
    orig = G.DecodeGraphs.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        made.append(self)

    G.DecodeGraphs.__init__ = spy
    try:
        cache = mk()
        got = G.generate(model, ids, cache, 24)
    finally:
        G.DecodeGraphs.__init__ = orig
    assert torch.equal(got, want)
    assert made and made[0].captured and made[0].n_graphs == model.config.num_hidden_layers + 1
    eager_cache = mk()
    eager = G.generate(model, ids, eager_cache, 24, graphs=False)
    assert torch.equal(eager, want)
    assert cache.get_seq_length() == eager_cache.get_seq_length()
    assert _same_arrays(_arrays(cache), _arrays(eager_cache))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_graph_steps_give_the_eager_logits_gpu(dtype):
    """Step by step: the replayed step's logits equal the eager step's on a twin cache, bit for bit."""
    model = _gpu_model(dtype)
    ids = prompt(60, batch=2, seed=8).cuda()
    cache = _prefilled(model, "KIVI-K2V2", ids[:, :36], backend="cupy")
    twin = copy.deepcopy(cache, memo={id(cache.store._mod): cache.store._mod})
    dg = G.DecodeGraphs(model, cache)
    for t in range(36, 60):
        tok = ids[:, t]
        got = dg.step(tok).clone()
        pos = torch.full((2, 1), twin.get_seq_length(), dtype=torch.long, device="cuda")
        with torch.no_grad():
            want = model(input_ids=tok.view(2, 1), position_ids=pos, **{cache_argument(model): twin}).logits[:, -1]
        assert torch.equal(got, want), t
    assert dg.captured and _same_arrays(_arrays(cache), _arrays(twin))
    with pytest.raises(ValueError, match="shape"):
        dg.step(ids[:, :2])
    with pytest.raises(TypeError, match="integer"):
        dg.step(ids[:, 0].float())


@pytest.mark.gpu
def test_graph_generate_stops_at_eos_as_model_generate_gpu():
    """With an end-of-sequence id, the output (finished sequences padded, generation stopped once all have
    finished) equals model.generate's."""
    model = _gpu_model(torch.float16)
    ids = prompt(30, batch=2, seed=9).cuda()
    free = G.generate(model, ids, _cache(model, "Kitty", backend="cupy"), 20)
    eos = int(free[0, 30 + 5])                               # a token the first sequence emits at step 5
    want = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                          **{cache_argument(model): _cache(model, "Kitty", backend="cupy")})
    got = G.generate(model, ids, _cache(model, "Kitty", backend="cupy"), 20, eos_token_id=eos)
    assert torch.equal(got, want)
