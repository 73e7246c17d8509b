"""Evaluation of cache methods on real models: perplexity with the compressed cache maintained while the
text is consumed, and the attention-level errors of the OSCAR paper from real activations.

    from kvq import evaluation as E
    ppl = E.perplexity(model, windows, ["FP16", "KIVI-K2V2"], chunk=128)           # windows: (N, S) ids
    att = E.attention_errors(layers, ["KIVI-K2V2", "OSCAR"], calibrations={"OSCAR": calib})

Both take method names of ``kvq.integrations.methods.METHODS`` and write the protocol they followed
into their result (``result["protocol"]``), so a number is never separated from how it was obtained.
``kvq eval ppl`` and ``kvq eval attention`` (``kvq.commands.eval``) are the command-line front ends.

Methods at equal memory, and the amortized cost of a periodic flush (issue 40):

    row = E.equal_memory_config("KIVI-K2V2", 2.5, context=16384, head_dim=128, kv_heads=2, n_layers=6)
    row["overrides"], row["bits_per_element"]        # the configuration closest to 2.5 b/e, and its bits
    E.amortized_overhead(quantize_ms=0.02, rank_ms=0.005, layers=32, period=128, step_ms=20.0)["percent"]

``paper_config`` gives a paper's own configuration as a labelled row; ``attention_errors_at_budgets`` and
``perplexity_at_budgets`` run the evaluations at each budget.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from kvq.reference import metrics

#: the one comparison of issue 7, in the order of its table
COMPARISON = ("FP16", "KIVI-K2V2", "KIVI-K2V2*", "KIVI-K4V4", "Kitty", "Kitty-Pro", "OSCAR", "AQUA-KV-uniform",
              "AQUA-KV", "BitDecoding-2", "BitDecoding-4")

PPL_PROTOCOL = (
    "Perplexity with the compressed KV cache maintained while the text is consumed (AQUA-KV, section 4: "
    "sequences encoded auto-regressively instead of in parallel, so that sink tokens, residual windows and "
    "buffers act as they do in generation). Each evaluation window of S tokens starts from an empty cache "
    "of the method; it is fed in chunks of C tokens, one model forward per chunk with the method's "
    "transformers Cache as past_key_values: the cache appends the chunk's keys and values and returns its "
    "dequantized contents, over which the chunk's queries attend (causally). C = 1 is token-by-token "
    "decoding; a larger C differs only in that a chunk's tokens are appended together (for AQUA-KV they "
    "attend to each other before they are compressed, Algorithm 4). Every token after the first of a "
    "window is scored (next-token negative log-likelihood of the model's float32 logits); perplexity = "
    "exp(mean NLL). The row 'no cache' runs each window in one parallel forward without a cache: the "
    "protocol's check that FP16 (keys and values rounded to fp16) changes nothing but rounding.")

ATTENTION_PROTOCOL = (
    "Attention-level errors (OSCAR, section 5) of each method's cache from real activations: for every "
    "layer, the model's post-RoPE queries, keys and values on held-out text (captured from its attention "
    "interface) fill the method's cache (all tokens appended at once, the method's own sink / window / "
    "residual rules deciding which are quantized), which is dequantized back; then, in float64 "
    "(kvq.reference.metrics): K and V relative MSE ||x - x_hat||^2 / ||x||^2, logit MSE of q k^T * scale, "
    "attention KL(p || p_hat) per query row (mean, nats) and the attention output's MSE, with the model's "
    "own softmax scale and masking (causal for decoders, none for an encoder such as MiniLM). Values are "
    "per layer and their mean over layers.")


def _bar(iterable, progress: bool, **kw):
    if not progress:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, **kw)


def _torch():
    import torch
    return torch


def windows_from_ids(ids, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows (N, seq_len) int64 of a 1-D id stream (the tail that does not fill one is
    dropped). Raises when the stream is shorter than one window."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    n = ids.size // seq_len
    if max_windows is not None:
        n = min(n, int(max_windows))
    if n < 1:
        raise ValueError(f"{ids.size} tokens are fewer than one window of seq_len={seq_len}")
    return ids[: n * seq_len].reshape(n, seq_len)


def _nll(logits, targets):
    """Sum of next-token NLL (float64) and count, logits (B, T, V) float32, targets (B, T) (-1 = none)."""
    torch = _torch()
    lp = torch.log_softmax(logits.float(), dim=-1)
    mask = targets >= 0
    picked = lp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return float(-(picked[mask]).double().sum()), int(mask.sum())


def _window_nll(model, ids, *, method, chunk, backend, calibration, max_tokens, overrides):
    """NLL sum, count and the cache's bits per element, for one batch of windows (B, S) ids on the model's
    device. ``method`` None: one parallel forward without a cache."""
    torch = _torch()
    B, S = ids.shape
    targets = torch.full_like(ids, -1)
    targets[:, :-1] = ids[:, 1:]
    with torch.no_grad():
        if method is None:
            out = model(input_ids=ids, use_cache=False)
            nll, n = _nll(out.logits, targets)
            return nll, n, None
        from kvq.integrations.transformers import cache_argument, make_cache
        cache = make_cache(method, model, backend=backend, calibration=calibration, max_tokens=max_tokens,
                           **overrides)
        nll, n = 0.0, 0
        for c0 in range(0, S, chunk):
            out = model(input_ids=ids[:, c0:c0 + chunk], use_cache=True, **{cache_argument(model): cache})
            a, b = _nll(out.logits, targets[:, c0:c0 + chunk])
            nll += a
            n += b
        return nll, n, {"state": float(cache.bits_per_element("state")), "paper": float(cache.bits_per_element("paper"))}


def perplexity(model, windows, methods, *, chunk: int = 128, batch_size: int = 8, backend: str = "auto",
               calibrations: dict | None = None, overrides: dict | None = None, no_cache_row: bool = True,
               progress: bool = True) -> dict:
    """Perplexity of ``model`` on ``windows`` (N, S) token ids with each method's cache (``PPL_PROTOCOL``).

    ``calibrations``: method name -> what ``make_cache`` takes as ``calibration`` (OSCAR: a list of
    ``OSCARCalibration``; AQUA-KV: ``AquaPredictors``); required for those methods. ``overrides``: method
    name -> config fields for its cache (e.g. the AquaConfig its predictors were calibrated for). Returns
    ``{"protocol", "windows", "seq_len", "chunk", "tokens_scored", "rows": [{method, ppl, nll, bits_per_element,
    bits_per_element_paper, seconds}]}`` (bits at the window's length: "state" counts the tokens where the
    cache holds them, FP16 windows included; "paper" is the papers' accounting); the row "no cache"
    (parallel forward, model dtype) comes first when ``no_cache_row``.
    """
    torch = _torch()
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (N, S) token ids with S >= 2, got shape {windows.shape}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    calibrations = dict(calibrations or {})
    overrides = dict(overrides or {})
    from kvq.integrations.methods import configure, get_method
    from kvq.integrations.transformers import model_dims
    N, S = windows.shape
    geo = model_dims(model)
    for m in methods:
        spec = get_method(m)                                     # unknown names fail here, before any work
        if spec.calibration and m not in calibrations:
            try:
                configure(m, head_dim=geo["head_dim"], max_tokens=S, kv_heads=geo["kv_heads"], **overrides.get(m, {}))
            except ValueError:
                continue                                         # cannot serve this model: skipped below
            raise ValueError(f"{m} needs a calibration (kvq calibrate {spec.calibration}); none was given")
    dev = next(model.parameters()).device
    rows = []
    todo = ([None] if no_cache_row else []) + list(methods)
    for m in _bar(todo, progress, desc="methods"):
        if m is not None:                                        # a layout this model cannot take: say so
            try:
                configure(m, head_dim=geo["head_dim"], max_tokens=S, kv_heads=geo["kv_heads"], **overrides.get(m, {}))
            except ValueError as e:
                rows.append({"method": m, "skipped": str(e)})
                continue
        t0 = time.perf_counter()
        nll, n, bits = 0.0, 0, None
        for i in range(0, N, batch_size):
            ids = torch.as_tensor(windows[i:i + batch_size], dtype=torch.long, device=dev)
            a, b, bits = _window_nll(model, ids, method=m, chunk=chunk, backend=backend,
                                     calibration=calibrations.get(m), max_tokens=S,
                                     overrides=overrides.get(m, {}))
            nll += a
            n += b
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if m is None:                                            # the model's own dtype, no cache
            b = float(torch.finfo(next(model.parameters()).dtype).bits)
            bits = {"state": b, "paper": b}
        rows.append({"method": "no cache" if m is None else m, "ppl": math.exp(nll / n), "nll": nll / n,
                     "bits_per_element": bits["state"], "bits_per_element_paper": bits["paper"],
                     "seconds": time.perf_counter() - t0})
    return {"protocol": PPL_PROTOCOL, "windows": int(N), "seq_len": int(S), "chunk": int(chunk),
            "tokens_scored": int(N * (S - 1)), "backend": backend, "rows": rows}


def attention_errors(layers, methods, *, calibrations: dict | None = None, causal: bool = False,
                     backend: str = "reference", progress: bool = True, overrides: dict | None = None) -> dict:
    """The OSCAR paper's attention-level errors (``ATTENTION_PROTOCOL``) of each method on captured
    activations ``layers``: a list (one per layer) of dicts with "q" (B, H_q, T, D), "k", "v"
    (B, H_kv, T, D) float arrays and optionally "scaling" (the layer's softmax scale; default 1/sqrt(D)).

    Returns ``{"protocol", "shape", "rows": [{method, bits_per_element, bits_per_element_state, mean: {...},
    layers: [{...}]}]}`` (bits per element at the captured length: the papers' accounting, and where the
    tokens are in the state) with the metrics k_rel_mse, v_rel_mse, logit_mse, attention_kl, output_mse.
    ``overrides``: method name -> config fields for that method's store (e.g. AQUA-KV's ``pre_rope=False``
    for a model without RoPE, or the configuration its predictors were calibrated for).
    """
    overrides = dict(overrides or {})
    from kvq.integrations.methods import KVStore, get_method
    if not layers:
        raise ValueError("layers is empty: capture some activations first")
    calibrations = dict(calibrations or {})
    L = len(layers)
    B, H_kv, T, D = np.shape(layers[0]["k"])
    for l, d in enumerate(layers):
        if np.shape(d["k"]) != (B, H_kv, T, D) or np.shape(d["v"]) != (B, H_kv, T, D):
            raise ValueError(f"layer {l}: k / v shapes {np.shape(d['k'])} / {np.shape(d['v'])} differ from "
                             f"layer 0's {(B, H_kv, T, D)}")
    rows = []
    for m in _bar(list(methods), progress, desc="methods"):
        spec = get_method(m)
        if spec.calibration and m not in calibrations:
            try:                                             # a method that cannot serve is skipped below
                KVStore(m, n_layers=L, batch=B, kv_heads=H_kv, head_dim=D, max_tokens=T, backend=backend,
                        calibration="identity", **overrides.get(m, {}))
            except ValueError as e:
                rows.append({"method": m, "skipped": str(e)})
                continue
            raise ValueError(f"{m} needs a calibration (kvq calibrate {spec.calibration}); none was given")
        try:
            store = KVStore(m, n_layers=L, batch=B, kv_heads=H_kv, head_dim=D, max_tokens=T, backend=backend,
                            calibration=calibrations.get(m), **overrides.get(m, {}))
        except ValueError as e:                             # e.g. a layout this head_dim cannot take
            rows.append({"method": m, "skipped": str(e)})
            continue
        for l, d in enumerate(layers):
            store.append(l, np.asarray(d["k"], np.float32), np.asarray(d["v"], np.float32))
        per = []
        for l, d in enumerate(layers):
            K_hat, V_hat = (t.detach().cpu().double().numpy() for t in store.keys_values(l))
            q, k, v = (np.asarray(d[n], np.float64) for n in ("q", "k", "v"))
            sc = d.get("scaling")
            sc = None if sc is None else float(sc)
            per.append({"layer": l,
                        "k_rel_mse": metrics.relative_mse(k, K_hat), "v_rel_mse": metrics.relative_mse(v, V_hat),
                        "logit_mse": metrics.logit_mse(q, k, K_hat, scale=sc),
                        "attention_kl": metrics.attention_kl(q, k, K_hat, causal=causal, scale=sc),
                        "output_mse": metrics.output_mse(q, k, v, K_hat, V_hat, causal=causal, scale=sc)})
        keys = ("k_rel_mse", "v_rel_mse", "logit_mse", "attention_kl", "output_mse")
        rows.append({"method": m, "bits_per_element": float(store.bits_per_element(accounting="paper")),
                     "bits_per_element_state": float(store.bits_per_element(accounting="state")),
                     "mean": {k: float(np.mean([p[k] for p in per])) for k in keys}, "layers": per})
    return {"protocol": ATTENTION_PROTOCOL, "shape": {"layers": L, "batch": int(B), "kv_heads": int(H_kv),
                                                      "tokens": int(T), "head_dim": int(D)},
            "causal": bool(causal), "backend": backend, "rows": rows}


# ---------------------------------------------------------------------------------------------------
# equal-memory configurations


#: the accounting of every equal-memory comparison: ``kvq.integrations.methods.bits_per_element`` with
#: ``accounting="state"``, i.e. the tokens where the cache holds them at the evaluated context: FP16 sink,
#: recent window, Q-buffers and residual blocks at 16 bits, quantized tokens at payload + metadata
#: (scale and minimum per group) + index bits. It is ``kvq.reference.memory``'s "full" accounting for this
#: exact configuration and context, without the rounding of the last page up to a whole page.
EQUAL_MEMORY_ACCOUNTING = "state"

#: the budgets of ``kvq eval attention --budget`` (bits per element). A strict 2.0 or 4.0 is infeasible for
#: every method: 2-bit codes with an fp16 scale and minimum per group of 128 already cost 2.25 (KIVI's
#: 2 + 32 / 128). The classes are "2-bit" (at most 2.5 bits per element) and "4-bit" (at most 4.5).
DEFAULT_BUDGETS = (2.5, 4.5)

_SINKS = (0, 4, 8, 16, 32, 64)
_WINDOWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_GROUPS = (32, 64, 128)

#: what :func:`equal_memory_config` may change, per method family (each method keeps its quantizer:
#: payload bits, boost rate, key mode). ``"sink"`` ranges over ``_SINKS`` from 4 up to the paper's own
#: sink (a method whose paper keeps no sink keeps none, one that keeps a sink keeps at least 4 tokens);
#: windows (KIVI / Kitty ``residual``, OSCAR ``window``, AQUA-KV ``buffer``) range from 16 tokens to the
#: first size that holds the whole context; groups: KIVI / Kitty key groups (tokens per page), KIVI value
#: groups (channels; None = the whole head), OSCAR channel groups, BitDecoding key and value groups.
SEARCH_SPACE = {
    "kivi": {"sink": _SINKS, "residual": _WINDOWS, "group_size": _GROUPS, "v_group_size": (32, 64, None)},
    "kitty": {"sink": _SINKS, "residual": _WINDOWS, "group_size": _GROUPS},
    "oscar": {"sink": _SINKS, "window": _WINDOWS, "group_size": _GROUPS},
    "bitdecoding": {"k_group": _GROUPS, "v_group": _GROUPS},
    "aqua": {"sink": _SINKS, "buffer": _WINDOWS},
    "fp16": {},
}

EQUAL_MEMORY_RULE = (
    "Equal memory: for each method and budget B (bits per element), every configuration of the method's "
    "search space (kvq.evaluation.SEARCH_SPACE: FP16 sink tokens from 4 to the paper's own, none if it "
    "keeps none; recent / residual window 16 .. context tokens; group sizes 32 / 64 / 128; the quantizer "
    "itself, its bits and boost rate, kept) is accounted at the evaluated context, head dim, KV heads and layers by "
    "kvq.integrations.methods.bits_per_element(accounting='state') (sinks, windows, Q-buffers, residual "
    "blocks, metadata and index bits counted); the configuration with the most bits per element not above "
    "B is chosen, ties broken by the smallest distance to the paper's configuration. A method none of whose "
    "configurations fits B is reported as such, with the smallest bits it reaches. The paper's own "
    "configuration is a separate, labelled row.")


def _search_values(fam: str, base, context: int) -> dict:
    """Knob -> candidate values for one method at ``context`` (windows above the context are pointless:
    they all hold every token)."""
    space = {}
    for knob, values in SEARCH_SPACE[fam].items():
        paper = getattr(base, knob)
        if knob == "sink":
            vals = [s for s in values if 0 < s <= paper] or [paper]     # a sink method keeps a sink
        elif knob in ("residual", "window", "buffer"):
            vals = [w for w in values if w < context] + [min(w for w in values if w >= context)] \
                if any(w >= context for w in values) else list(values)
        else:
            vals = list(values)
        space[knob] = sorted(set(vals), key=lambda x: (x is None, x or 0))
    return space


def _distance(cfg, base, knobs, head_dim: int) -> float:
    """Sum over ``knobs`` of |log2((x + 1) / (paper + 1))| (None, a whole-head group, is head_dim)."""
    d = 0.0
    for n in knobs:
        a, b = getattr(cfg, n), getattr(base, n)
        a, b = (head_dim if a is None else a), (head_dim if b is None else b)
        d += abs(math.log2((a + 1) / (b + 1)))
    return d


def _config_row(method, cfg, overrides, *, context, head_dim, kv_heads, n_layers, budget, label) -> dict:
    from kvq.integrations.methods import bits_per_element
    dims = dict(context=context, head_dim=head_dim, kv_heads=kv_heads, n_layers=n_layers)
    return {"method": method, "label": label, "budget": budget, "feasible": True, "overrides": overrides,
            "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "max_tokens"}
            if dataclasses.is_dataclass(cfg) else {},
            "bits_per_element": bits_per_element(method, cfg, accounting=EQUAL_MEMORY_ACCOUNTING, **dims),
            "bits_per_element_paper": bits_per_element(method, cfg, accounting="paper", **dims)}


def _check_dims(context, head_dim, kv_heads, n_layers):
    for n, v in (("context", context), ("head_dim", head_dim), ("kv_heads", kv_heads), ("n_layers", n_layers)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{n} must be a positive int, got {v!r}")


def paper_config(method: str, *, context: int, head_dim: int, kv_heads: int, n_layers: int,
                 fixed: dict | None = None) -> dict:
    """The paper's own configuration of ``method`` (``methods.configure`` with only ``fixed`` overrides,
    e.g. a calibration's AQUA-KV config) as a labelled row like :func:`equal_memory_config`'s, with its bits
    per element at ``context`` (``EQUAL_MEMORY_ACCOUNTING`` and the papers' accounting)."""
    from kvq.integrations.methods import configure
    _check_dims(context, head_dim, kv_heads, n_layers)
    fixed = dict(fixed or {})
    cfg = configure(method, head_dim=head_dim, max_tokens=context, kv_heads=kv_heads, **fixed)
    return _config_row(method, cfg, fixed, context=context, head_dim=head_dim, kv_heads=kv_heads,
                       n_layers=n_layers, budget=None, label=f"{method} (paper)")


def equal_memory_config(method: str, budget: float, *, context: int, head_dim: int, kv_heads: int,
                        n_layers: int, fixed: dict | None = None) -> dict:
    """The configuration of ``method`` whose bits per element at ``context`` are the closest to ``budget``
    without exceeding it (``EQUAL_MEMORY_RULE``; search space ``SEARCH_SPACE``; accounting
    ``EQUAL_MEMORY_ACCOUNTING``).

    ``budget``: bits per element (> 0), e.g. 2.5 or 4.5 (``DEFAULT_BUDGETS``). ``context``: tokens per
    sequence (the cache's length when it is measured); ``head_dim``, ``kv_heads``, ``n_layers``: the
    model's. ``fixed``: config fields held as given and not searched (``--set`` values, a calibration's
    AQUA-KV config). Returns ``{"method", "label", "budget", "feasible", "overrides" (what
    ``configure`` / ``make_cache`` / ``KVStore`` take), "config", "bits_per_element" (state accounting),
    "bits_per_element_paper", "candidates"}``; when nothing fits, ``feasible`` is False, ``overrides`` None
    and ``min_bits_per_element`` says the least the method reaches.

        row = equal_memory_config("KIVI-K2V2", 2.5, context=16384, head_dim=128, kv_heads=2, n_layers=6)
        store = KVStore("KIVI-K2V2", ..., max_tokens=16384, **row["overrides"])
    """
    import itertools

    from kvq.integrations.methods import bits_per_element, configure, get_method
    _check_dims(context, head_dim, kv_heads, n_layers)
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)) \
            or not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget must be a positive number of bits per element, got {budget!r}")
    budget = float(budget)
    spec = get_method(method)
    fixed = dict(fixed or {})
    label = f"{method} @ <={budget:g} b/e"
    try:
        base = configure(method, head_dim=head_dim, max_tokens=context, kv_heads=kv_heads, **fixed)
    except (ValueError, TypeError) as e:                 # the method cannot serve this model at all
        return {"method": method, "label": label, "budget": budget, "feasible": False, "overrides": None,
                "candidates": 0, "min_bits_per_element": None, "reason": str(e)}
    space = {k: v for k, v in _search_values(spec.family, base, context).items() if k not in fixed}
    dims = dict(context=context, head_dim=head_dim, kv_heads=kv_heads, n_layers=n_layers)
    best, best_key, lowest, n = None, None, math.inf, 0
    knobs = list(space)
    for values in itertools.product(*(space[k] for k in knobs)):
        ovr = {**fixed, **dict(zip(knobs, values))}
        try:
            cfg = configure(method, head_dim=head_dim, max_tokens=context, kv_heads=kv_heads, **ovr)
        except (ValueError, TypeError):
            continue                                     # a combination the method cannot take
        n += 1
        bits = bits_per_element(method, cfg, accounting=EQUAL_MEMORY_ACCOUNTING, **dims)
        lowest = min(lowest, bits)
        if bits > budget:
            continue
        key = (bits, -_distance(cfg, base, knobs, head_dim), repr(values))
        if best_key is None or key > best_key:
            best, best_key = (cfg, ovr), key
    if best is None:
        return {"method": method, "label": label, "budget": budget, "feasible": False, "overrides": None,
                "candidates": n, "min_bits_per_element": lowest if n else None,
                "reason": (f"no configuration of {method} fits {budget:g} bits per element at context "
                           f"{context} (the least it reaches is {lowest:.3f})" if n else
                           f"{method} has no valid configuration for head_dim={head_dim}")}
    row = _config_row(method, best[0], best[1], budget=budget, label=label, **dims)
    row["candidates"] = n
    return row


# ---------------------------------------------------------------------------------------------------
# amortized costs


def amortized_overhead(*, quantize_ms: float, step_ms: float, rank_ms: float = 0.0, layers: int = 1,
                       period: int = 128) -> dict:
    """The amortized overhead of a periodic flush (Kitty's slides: quantization and channel ranking once
    every G = 128 decode steps, "0.17%" of a step) from measured times.

    ``quantize_ms``: time of one layer's flush, quantizing the full key Q-buffer and the values leaving
    the window into a page (milliseconds, for the batch of the step); ``rank_ms``: one layer's ranking
    of the key channels to boost (ms, 0 when it is inside ``quantize_ms``); ``layers``: layers that
    flush (each flushes once per period); ``period``: decode steps between flushes (the page size G);
    ``step_ms``: one decode step of the whole model at the same batch and context, without a flush (ms).
    Any one time unit may be used throughout; the ``_ms`` outputs are then in that unit.

    Returns ``{"flush_ms" (all layers, one flush), "per_step_ms" (= flush_ms / period), "fraction"
    (= per_step_ms / step_ms), "percent"}``; e.g. 32 layers x 0.02 ms every 128 steps of a 20 ms step:
    0.005 ms a step, 0.025 %.
    """
    vals = {}
    for n, v, lo_open in (("quantize_ms", quantize_ms, False), ("rank_ms", rank_ms, False),
                          ("step_ms", step_ms, True)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
                or v < 0 or (lo_open and v == 0):
            raise ValueError(f"{n} must be a finite time {'> 0' if lo_open else '>= 0'} (milliseconds), got {v!r}")
        vals[n] = float(v)
    for n, v in (("layers", layers), ("period", period)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{n} must be a positive int, got {v!r}")
    flush = int(layers) * (vals["quantize_ms"] + vals["rank_ms"])
    per_step = flush / int(period)
    frac = per_step / vals["step_ms"]
    return {"flush_ms": flush, "per_step_ms": per_step, "fraction": frac, "percent": 100.0 * frac,
            "layers": int(layers), "period": int(period), "step_ms": vals["step_ms"]}


def attention_errors_at_budgets(layers, methods, budgets=DEFAULT_BUDGETS, *, calibrations: dict | None = None,
                                causal: bool = False, backend: str = "reference", progress: bool = True,
                                overrides: dict | None = None) -> list[dict]:
    """:func:`attention_errors` of each method at equal memory: for every budget (bits per element),
    the method's :func:`equal_memory_config` at the captured length, head dim, KV heads and layers
    (``overrides[method]`` held fixed, e.g. a calibration's AQUA-KV config or ``--set`` values).

    Returns ``[{"budget", "rows": [...]}]``, one entry per budget in order; each row is an
    :func:`attention_errors` row plus ``budget``, ``label``, ``overrides`` (the chosen configuration) and
    ``bits_per_element_state`` equal to the chosen configuration's bits; a method none of whose
    configurations fits is a row with ``skipped`` (why, and the least it reaches). FP16 has no budget
    row (it is the reference, at 16 bits).
    """
    if not layers:
        raise ValueError("layers is empty: capture some activations first")
    overrides = dict(overrides or {})
    B, H_kv, T, D = np.shape(layers[0]["k"])
    dims = dict(context=int(T), head_dim=int(D), kv_heads=int(H_kv), n_layers=len(layers))
    return _at_budgets(methods, budgets, overrides, dims, lambda fit, over: attention_errors(
        layers, fit, calibrations=calibrations, causal=causal, backend=backend, progress=progress, overrides=over))


def _at_budgets(methods, budgets, overrides: dict, dims: dict, run) -> list[dict]:
    """For every budget: each method's :func:`equal_memory_config` at ``dims`` (``overrides[method]`` held
    fixed), ``run(fitting methods, {method: chosen overrides})`` -> ``{"rows": [...]}`` over those that fit,
    and one row per method (the run's, or ``skipped`` with the reason) with ``budget``, ``label`` and
    ``overrides`` added; FP16 has no budget row."""
    out = []
    for b in budgets:
        chosen = {m: equal_memory_config(m, b, fixed=overrides.get(m), **dims) for m in methods if m != "FP16"}
        fit = [m for m, c in chosen.items() if c["feasible"]]
        res = run(fit, {m: chosen[m]["overrides"] for m in fit}) if fit else {"rows": []}
        by_name = {r["method"]: r for r in res["rows"]}
        rows = []
        for m, c in chosen.items():
            r = dict(by_name.get(m) or {"method": m, "skipped": c.get("reason", "")})
            r.update(budget=float(b), label=c["label"], overrides=c["overrides"])
            rows.append(r)
        out.append({"budget": float(b), "rows": rows})
    return out


def perplexity_at_budgets(model, windows, methods, budgets=DEFAULT_BUDGETS, *, calibrations: dict | None = None,
                          overrides: dict | None = None, **kwargs) -> list[dict]:
    """:func:`perplexity` of each method at equal memory: for every budget, the method's
    :func:`equal_memory_config` at the windows' length and the model's head dim, KV heads and layers
    (``overrides[method]`` held fixed). ``kwargs``: :func:`perplexity`'s (chunk, batch_size, backend,
    progress). Returns ``[{"budget", "rows": [...]}]`` like :func:`attention_errors_at_budgets`: each row a
    :func:`perplexity` row plus ``budget``, ``label`` and ``overrides``, or ``skipped`` with the reason; no
    FP16 or "no cache" rows (they are the reference)."""
    from kvq.integrations.transformers import model_dims
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (N, S) token ids with S >= 2, got shape {windows.shape}")
    overrides = dict(overrides or {})
    geo = model_dims(model)
    dims = dict(context=int(windows.shape[1]), head_dim=int(geo["head_dim"]), kv_heads=int(geo["kv_heads"]),
                n_layers=int(geo["n_layers"]))
    return _at_budgets(methods, budgets, overrides, dims, lambda fit, over: perplexity(
        model, windows, fit, calibrations=calibrations, no_cache_row=False, overrides=over, **kwargs))
