"""Decode steps replayed from CUDA graphs: a model generating with a kvq cache, without the model's Python.

At batch 1 an eager decode step is bound by the host: an 8B-shaped model's own Python (norms, projections,
RoPE, MLP, the LM head: about 300 launches) costs about as much as its GPU work, and kvq's append and fused
decode of each layer add their Python to it (``lab/2026-11-28-decode-host/NOTE.md``). :class:`DecodeGraphs`
records one decode step of the model in pieces, each a CUDA graph: the model's work before the first attention
layer, between two attention layers, and after the last one. A step copies the new tokens into the graphs'
input, replays the pieces, and between two pieces runs that layer's kvq work eagerly: the cache's
``update`` (append the new token) and the ``"kvq"`` attention function (the method's fused decode over the
compressed state), exactly the calls an eager step makes. kvq's kernels stay outside the graphs because
their launches are planned from the cache's lengths on the host (``kvq.fast.cupy.paged.decode_plan``);
everything else a step launches is replayed. This is the "piecewise" capture of serving engines (vLLM's
piecewise CUDA graphs keep attention out of the graph in the same way).

    from kvq.integrations.transformers import make_cache
    from kvq.integrations.graphs import generate
    cache = make_cache("KIVI-K2V2", model)
    tokens = generate(model, input_ids, cache, max_new_tokens=256)      # greedy, = model.generate(...)'s tokens

or, step by step (``cache`` already holds the prompt):

    graphs = DecodeGraphs(model, cache)
    logits = graphs.step(next_tokens)           # (B, vocab); the first call runs eagerly and then captures

What it takes: a CUDA model on one device, a kvq cache attending through kvq (``attention="auto"``, the default of
``make_cache``), prompts of one length (kvq refuses left padding anyway). Every method and backend works, as
each layer's kvq work is the eager call. The graphs hold the step's activations (a few MB at batch 1) in
their own memory pool, and they are tied to the cache and the batch they were captured with.
"""

from __future__ import annotations

import torch

from .attention import kvq_attention_forward, tag_states
from .methods import same_device

__all__ = ["DecodeGraphs", "generate"]

#: generate checks whether every sequence has finished (one host synchronization) once every this many steps
EOS_CHECK_EVERY = 8


def _kvq_cache_class():
    from .transformers import KVQCache
    return KVQCache


def _model_device(model) -> torch.device:
    """The one CUDA device of ``model``'s parameters; ValueError otherwise (CPU, or spread over devices)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(f"CUDA-graph decode takes a model on one device; this one spans "
                         f"{sorted(str(d) for d in devices)} (generate with model.generate(...) instead)")
    dev = next(iter(devices))
    if dev.type != "cuda":
        raise ValueError(f"CUDA-graph decode needs a model on a CUDA device; this one is on {dev}")
    return dev


def _check_cache(cache, model) -> None:
    """A kvq cache that attends through kvq (TypeError / ValueError otherwise; nothing changes)."""
    if not isinstance(cache, _kvq_cache_class()):
        raise TypeError(f"cache must be a kvq cache (kvq.integrations.transformers.make_cache), got "
                        f"{type(cache).__name__}; transformers' own caches have their own compiled generation")
    if cache.attention != "auto":
        raise ValueError(f"CUDA-graph decode needs a cache that attends through kvq (attention='auto'); this one "
                         f"has attention={cache.attention!r}, whose update returns a new dequantized copy each step")
    from .attention import ATTN_IMPLEMENTATION
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(f"the model attends with {getattr(model.config, '_attn_implementation', None)!r}; "
                         f"CUDA-graph decode needs the 'kvq' attention function that make_cache sets "
                         f"(model.set_attn_implementation('kvq'))")


class _Piece:
    """One layer's eager kvq work between two graphs: append the new token (``cache.update``) and attend
    (``kvq_attention_forward``), the output copied into the buffer the next graph reads."""

    __slots__ = ("cache", "layer", "module", "query", "key", "value", "kwargs", "out")

    def __init__(self, cache, layer, module, query, key, value, kwargs, out):
        self.cache, self.layer, self.module = cache, layer, module
        self.query, self.key, self.value, self.kwargs, self.out = query, key, value, kwargs, out

    def __call__(self) -> None:
        k, v = self.cache.update(self.key, self.value, self.layer)
        o, _ = kvq_attention_forward(self.module, self.query, k, v, None, **self.kwargs)
        self.out.copy_(o)


class DecodeGraphs:
    """One decode step of ``model`` with ``cache``, captured in pieces and replayed (module docstring).

    ``cache`` must hold the prompt already (a prefill through ``model(...)``), so that the batch and the
    devices are fixed. The first :meth:`step` runs eagerly on the capture stream (a real step: the warm-up
    CUDA asks for before a capture) and then records the pieces; every later step replays them. Nothing is
    captured or changed when a check fails.
    """

    def __init__(self, model, cache):
        _check_cache(cache, model)
        self.device = _model_device(model)
        store = cache.store
        if store is None or store.length(0) == 0:
            raise ValueError("the cache is empty: prefill the prompt through model(...) first (or use "
                             "kvq.integrations.graphs.generate, which does)")
        if store.devices is not None and any(not same_device(d, self.device, unindexed="zero")
                                             for d in store.devices):
            raise ValueError(f"CUDA-graph decode takes a cache on the model's device ({self.device}); this one "
                             f"keeps layers on {sorted({str(d) for d in store.devices})}")
        from .transformers import cache_argument
        self.model, self.cache = model, cache
        self.batch = store.batch
        self._arg = cache_argument(model)
        self._ids = torch.zeros((self.batch, 1), dtype=torch.long, device=self.device)
        self._pos = torch.zeros((self.batch, 1), dtype=torch.long, device=self.device)
        self._graphs: list = []
        self._pieces: list = []
        self._logits = None
        self._stream = None

    @property
    def captured(self) -> bool:
        """True once the step has been recorded (after the first :meth:`step`)."""
        return self._logits is not None

    @property
    def n_graphs(self) -> int:
        """The pieces recorded: one graph per attention layer, plus one."""
        return len(self._graphs)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decode one token per sequence: ``tokens`` (B,) or (B, 1) integer ids on the model's device, at
        position ``cache.get_seq_length()``. Returns the next-token logits (B, vocab) in the model's dtype:
        a buffer the next step overwrites (copy it to keep it). The cache grows by one token per layer."""
        tokens = self._check_tokens(tokens)
        self._pos.fill_(self.cache.get_seq_length())
        self._ids.copy_(tokens.view(self.batch, 1))
        if not self.captured:
            return self._first_step()
        graphs, pieces = self._graphs, self._pieces
        with torch.cuda.device(self.device):
            for i, piece in enumerate(pieces):
                graphs[i].replay()
                piece()
            graphs[-1].replay()
        return self._logits

    def _check_tokens(self, tokens) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be an integer torch.Tensor of shape (B,) or (B, 1), got "
                            f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
        if tokens.numel() != self.batch or tokens.ndim > 2 or (tokens.ndim == 2 and tokens.shape[1] != 1):
            raise ValueError(f"tokens must have shape ({self.batch},) or ({self.batch}, 1) (the cache's batch), "
                             f"got {tuple(tokens.shape)}")
        if tokens.device != self.device:
            raise ValueError(f"tokens are on {tokens.device}; the model is on {self.device}")
        return tokens

    def _forward(self):
        with torch.no_grad():
            return self.model(input_ids=self._ids, position_ids=self._pos, **{self._arg: self.cache},
                              use_cache=True).logits

    def _first_step(self) -> torch.Tensor:
        """The warm-up step, eager on the capture stream, then the capture; returns the warm-up's logits."""
        main = torch.cuda.current_stream(self.device)
        self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            logits = self._forward()[:, -1].clone()
        main.wait_stream(self._stream)
        torch.cuda.synchronize(self.device)
        self._capture()
        return logits

    def _capture(self) -> None:
        """Record the step: the model's forward with the cache in capture mode, where each layer's ``update``
        and attention end the current graph, note the layer's eager work (:class:`_Piece`) and begin the
        next graph. The capture itself runs nothing: the cache is untouched."""
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs, self._pieces = [], []
        cache = self.cache
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._begin()
            cache.graph_capture = self
            try:
                logits = self._forward()[:, -1]
            except BaseException:
                cache.graph_capture = None
                try:
                    self._graphs[-1].capture_end()
                except Exception:                                     # noqa: BLE001 - the first error is the one
                    pass
                self._graphs, self._pieces = [], []
                raise
            cache.graph_capture = None
            self._graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._logits = logits

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self._pool)
        self._graphs.append(g)

    # the cache's and the attention function's hooks while capturing ------------------------------------

    def capture_update(self, layer: int, key_states, value_states):
        """``KVQCache.update`` while capturing: nothing is appended; the keys come back tagged, as the
        fused path's update returns them (the tokens cached before them: the cache's length)."""
        return tag_states(key_states, self.cache, layer, self.cache.store.length(layer)), value_states

    def capture_attention(self, module, layer: int, query, key, value, kwargs):
        """The attention function while capturing: the current graph ends after allocating the attention
        output's buffer, the layer's kvq work is noted, and the next graph begins, reading the buffer."""
        if query.shape[2] != 1:
            raise ValueError("CUDA-graph decode records one token per sequence per step")
        B, H_q, T_q, D = query.shape
        out = torch.empty((B, T_q, H_q, D), dtype=query.dtype, device=query.device)
        self._graphs[-1].capture_end()
        self._pieces.append(_Piece(self.cache, layer, module, query, key, value, dict(kwargs), out))
        self._begin()
        return out, None


def _eos_ids(eos_token_id) -> list[int] | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    try:
        ids = list(ids)
    except TypeError:
        ids = None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TypeError(f"eos_token_id must be a non-negative int, a list of them, or None; got {eos_token_id!r}")
    return ids


def generate(model, input_ids: torch.Tensor, cache, max_new_tokens: int, *, attention_mask=None,
             eos_token_id=None, pad_token_id: int | None = None, graphs: bool = True) -> torch.Tensor:
    """Greedy generation with a kvq cache, each decode step replayed from CUDA graphs (:class:`DecodeGraphs`).

    Args:
        model: a transformers causal LM on one CUDA device, attending through kvq (``make_cache`` sets it).
        input_ids: (B, T) integer prompt ids on the model's device, one length for every sequence.
        cache: an empty kvq cache for ``model`` (``make_cache``); it holds the prompt and the generated
            tokens afterwards.
        max_new_tokens: tokens to generate per sequence (at least 1).
        attention_mask: the prompt's mask, passed to the prefill (kvq refuses left padding there).
        eos_token_id: an id or a list of ids that end a sequence (None: generate ``max_new_tokens``); a
            finished sequence continues with ``pad_token_id`` (default: the first eos id), and generation
            stops once every sequence has finished (checked every EOS_CHECK_EVERY steps).
        graphs: False runs every step eagerly (the same tokens: a comparison).

    Returns (B, T + n) ids, the prompt then the new tokens, as ``model.generate(..., do_sample=False)``
    returns them for the same cache and stopping rule. Everything is checked before the prefill.
    """
    _check_cache(cache, model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32) \
            or input_ids.ndim != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise TypeError(f"input_ids must be a (B, T) integer torch.Tensor with B, T >= 1, got "
                        f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    eos = _eos_ids(eos_token_id)
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
        raise TypeError(f"pad_token_id must be an int or None, got {pad_token_id!r}")
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
    if cache.store is not None and cache.store.length(0) > 0:
        raise ValueError("generate takes an empty cache (it prefills the prompt); make a new one with make_cache")
    limit = getattr(cache, "max_capacity", None) or (None if cache.grow else cache.max_tokens)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) and max_new_tokens={max_new_tokens} exceed the "
                         f"cache's capacity of {limit} tokens per sequence")
    device = _model_device(model)
    if input_ids.device != device:
        raise ValueError(f"input_ids are on {input_ids.device}; the model is on {device}")
    from .transformers import cache_argument
    arg = cache_argument(model)
    B = input_ids.shape[0]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **{arg: cache}, use_cache=True).logits[:, -1]
    new = torch.empty((B, max_new_tokens), dtype=input_ids.dtype, device=device)
    eos_t = torch.tensor(eos, device=device) if eos else None
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    done_at = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)   # step at which each finished
    dg = DecodeGraphs(model, cache) if graphs else None
    n = max_new_tokens
    for i in range(max_new_tokens):
        tok = logits.argmax(-1).to(input_ids.dtype)
        if eos_t is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
            hit = torch.isin(tok, eos_t) & unfinished
            done_at = torch.where(hit, torch.full_like(done_at, i), done_at)
            unfinished &= ~hit
        new[:, i] = tok
        if i + 1 == max_new_tokens:
            break
        if eos_t is not None and (i + 1) % EOS_CHECK_EVERY == 0 and not bool(unfinished.any()):
            break
        if dg is not None:
            logits = dg.step(tok)
        else:
            with torch.no_grad():
                pos = torch.full((B, 1), cache.get_seq_length(), dtype=torch.long, device=device)
                logits = model(input_ids=tok.view(B, 1), position_ids=pos, **{arg: cache},
                               use_cache=True).logits[:, -1]
    if eos_t is not None:
        last = int(done_at.max())                    # every sequence finished at or before this step
        n = min(max_new_tokens, last + 1)
    return torch.cat([input_ids, new[:, :n]], dim=1)
