"""Evaluation of cache methods on real models: perplexity with the compressed cache maintained while the
text is consumed, and the attention-level errors of the OSCAR paper from real activations.

    from kvq import evaluation as E
    ppl = E.perplexity(model, windows, ["FP16", "KIVI-K2V2"], chunk=128)           # windows: (N, S) ids
    att = E.attention_errors(layers, ["KIVI-K2V2", "OSCAR"], calibrations={"OSCAR": calib})

Both take method names of ``kvq.integrations.methods.METHODS`` and write the protocol they followed
into their result (``result["protocol"]``), so a number is never separated from how it was obtained.
``kvq eval ppl`` and ``kvq eval attention`` (``kvq.commands.eval``) are the command-line front ends.
"""

from __future__ import annotations

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

    Returns ``{"protocol", "shape", "rows": [{method, bits_per_element, mean: {...}, layers: [{...}]}]}``
    with the metrics k_rel_mse, v_rel_mse, logit_mse, attention_kl, output_mse. ``overrides``: method
    name -> config fields for that method's store (e.g. AQUA-KV's ``pre_rope=False`` for a model
    without RoPE, or the configuration its predictors were calibrated for).
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
                     "mean": {k: float(np.mean([p[k] for p in per])) for k in keys}, "layers": per})
    return {"protocol": ATTENTION_PROTOCOL, "shape": {"layers": L, "batch": int(B), "kv_heads": int(H_kv),
                                                      "tokens": int(T), "head_dim": int(D)},
            "causal": bool(causal), "backend": backend, "rows": rows}
