"""Evaluation of cache methods on real models: perplexity with the compressed cache maintained while the
text is consumed, and the attention-level errors of the OSCAR paper from real activations.

    from kvq import evaluation as E
    ppl = E.perplexity(model, windows, ["FP16", "KIVI-K2V2"], chunk=128)           # windows: (N, S) ids
    att = E.attention_errors(layers, ["KIVI-K2V2", "OSCAR"], calibrations={"OSCAR": calib})

Both take method names of ``kvq.integrations.methods.METHODS`` and write the protocol they followed
into their result (``result["protocol"]``), so a number is never separated from how it was obtained.
``kvq eval ppl`` and ``kvq eval attention`` (``kvq.commands.eval``) are the command-line front ends.

The choice of a method's configuration at equal memory and the amortized cost of a periodic flush (issue
40) live in ``kvq.budgets`` (their bits per element come from ``kvq.integrations.methods.bits_per_element``,
i.e. ``kvq.reference.memory``'s accountings); this module runs the evaluations at each budget
(:func:`perplexity_at_budgets`, :func:`attention_errors_at_budgets`) and re-exports the budgets' public
names, so that ``E.equal_memory_config``, ``E.paper_config``, ``E.amortized_overhead``,
``E.DEFAULT_BUDGETS``, ``E.EQUAL_MEMORY_RULE``, ``E.EQUAL_MEMORY_ACCOUNTING`` and ``E.SEARCH_SPACE`` keep
working:

    row = E.equal_memory_config("KIVI-K2V2", 2.5, context=16384, head_dim=128, kv_heads=2, n_layers=6)
    row["overrides"], row["bits_per_element"]        # the configuration closest to 2.5 b/e, and its bits
"""

from __future__ import annotations

import math
import time

import numpy as np

from kvq.budgets import (DEFAULT_BUDGETS, EQUAL_MEMORY_ACCOUNTING, EQUAL_MEMORY_RULE,  # noqa: F401 (re-exported)
                         SEARCH_SPACE, amortized_overhead, equal_memory_config, paper_config, search_values)
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
# the long-context model's results (benchmarks/train_long_lm.py's long_lm.json)

_NONE = "—"


def _md_table(head: list, rows: list) -> str:
    """A Markdown table: ``head`` (column names) and ``rows`` (lists of cell strings)."""
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _num(x, spec: str) -> str:
    return _NONE if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _tokens(n: int) -> str:
    """16384 -> "16K", 2048 -> "2K", 300 -> "300"."""
    n = int(n)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _count(n, word: str) -> str:
    """"1 trial", "8 trials", "? trials" (n unknown)."""
    return f"{n} {word}" if n == 1 else f"{'?' if n is None else n} {word}s"


def attention_errors_at_budgets(layers, methods, budgets=DEFAULT_BUDGETS, *, calibrations: dict | None = None,
                                causal: bool = False, backend: str = "reference", progress: bool = True,
                                overrides: dict | None = None) -> list[dict]:
    """:func:`attention_errors` of each method at equal memory: for every budget (bits per element),
    the method's :func:`kvq.budgets.equal_memory_config` at the captured length, head dim, KV heads and layers
    (``overrides[method]`` held fixed, e.g. a calibration's AQUA-KV config or ``--set`` values).

    Returns ``[{"budget", "rows": [...]}]``, one entry per budget in order; each row is an
    :func:`attention_errors` row plus ``budget``, ``label``, ``overrides`` (the chosen configuration) and
    ``bits_per_element_state`` equal to the chosen configuration's bits; a method none of whose
    configurations fits is a row with ``skipped`` (why, and the least it reaches). FP16 has no budget
    row (it is the reference, at 16 bits). Bits per element: ``kvq.integrations.methods.bits_per_element``
    (``kvq.reference.memory``'s accountings), as in :func:`equal_memory_config`.
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
    (``overrides[method]`` held fixed). ``kwargs``: :func:`perplexity`'s (chunk,
    batch_size, backend, progress). Returns ``[{"budget", "rows": [...]}]`` like
    :func:`attention_errors_at_budgets`: each row a :func:`perplexity` row plus ``budget``,
    ``label`` and ``overrides``, or ``skipped`` with the reason; no FP16 or "no cache" rows (they are the
    reference). Bits per element: ``kvq.integrations.methods.bits_per_element`` (``kvq.reference.memory``'s
    accountings), as in :func:`equal_memory_config`."""
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


def _check_long_lm(doc) -> None:
    if not isinstance(doc, dict) or not {"ppl_by_position", "retrieval"} <= set(doc):
        raise ValueError("doc must be the dict of a long_lm.json (benchmarks/train_long_lm.py), with "
                         f"'ppl_by_position' and 'retrieval'; got {type(doc).__name__}"
                         + (f" with keys {sorted(doc)[:8]}" if isinstance(doc, dict) else ""))


def _why_not(row: dict) -> str | None:
    """'skipped: ...' / 'error: ...' of a row that has no measurement, else None."""
    for k in ("skipped", "error"):
        if row.get(k) is not None:
            return f"{k}: {row[k]}"
    return None


def long_lm_protocol(doc: dict) -> str:
    """The protocol of a ``long_lm.json`` in a few sentences, from the JSON itself: model (shape,
    parameters, context, training), data (source, split, tokens), what each table measures, the budgets
    and the accounting."""
    _check_long_lm(doc)
    cfg, tr = doc.get("config") or {}, doc.get("training") or {}
    data, args = doc.get("data") or {}, doc.get("args") or {}
    pp, rt = doc["ppl_by_position"], doc["retrieval"]
    src = data.get("train") or {}
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    files, toks = src.get("files") or {}, src.get("tokens") or {}
    model = (f"Model: byte-level Llama, {cfg.get('num_hidden_layers', '?')} layers, hidden "
             f"{cfg.get('hidden_size', '?')}, {cfg.get('num_attention_heads', '?')} query / "
             f"{cfg.get('num_key_value_heads', '?')} KV heads of {cfg.get('head_dim', '?')} (GQA, RoPE base "
             f"{_num(rope, 'g')}), {_num(cfg.get('max_position_embeddings'), 'd')} positions")
    if tr.get("n_params"):
        model += f", {tr['n_params'] / 1e6:.1f} M parameters"
    if tr.get("steps") is not None:
        model += (f"; trained from scratch by `{doc.get('script', 'benchmarks/train_long_lm.py')}` for "
                  f"{tr['steps']} steps ({_num(tr.get('tokens_seen'), ',d')} tokens, "
                  f"{_num(tr.get('train_wall_s'), '.0f')} s, stop: {tr.get('stop_reason', '?')}), with planted "
                  f"key-value retrieval in "
                  f"{_num((tr.get('recipe') or args).get('retrieval_frac'), '.0%')} of the windows")
    if tr.get("loaded_from"):
        model += "; evaluated in a later run from the saved weights" + (
            "" if tr.get("steps") is not None else f" ({tr['loaded_from']}; no training record found)")
    text = (f"Data: {src.get('source', 'Python standard library files')}; split by file "
            f"({src.get('split_rule', 'a fixed rule')}): trained on the '{data.get('train_split', 'train')}' split "
            f"({files.get('train', '?')} files, {_num(toks.get('train'), ',d')} tokens), evaluated on the "
            f"'{data.get('eval_split', 'eval')}' split ({files.get('eval', '?')} files, "
            f"{_num(toks.get('eval'), ',d')} tokens) never trained on")
    ppl = (f"Perplexity by position: {_count(pp.get('windows'), 'held-out window')} of "
           f"{pp.get('context', '?')} tokens, "
           f"each from an empty cache, fed in chunks of {pp.get('chunk', '?')} tokens; the next-byte NLL averaged "
           f"per position bucket")
    ret = (f"Retrieval: one key-value pair planted at each depth of a held-out window (plus "
           f"{_count(rt.get('distractors'), 'distractor pair')}), queried at its end; "
           f"{_count(rt.get('trials'), 'trial')} per "
           f"(context, depth); a trial is correct when every value byte is the model's argmax (teacher forcing)")
    budgets = ", ".join(f"{b:g}" for b in args.get("budgets") or []) or "none"
    acc = (f"Budgets: each method at its paper's configuration and at equal memory, at most {budgets} bits per "
           f"element (the configuration is chosen again at each context length); accounting: "
           f"'{doc.get('accounting', EQUAL_MEMORY_ACCOUNTING)}' bits per element "
           f"(kvq.integrations.methods.bits_per_element: FP16 sinks, windows, buffers, metadata and index bits "
           f"counted), the papers' accounting beside it")
    out = ". ".join((model, text, ppl, ret, acc)) + "."
    if doc.get("complete") is False:
        out += (" This run stopped before every row was evaluated (a partial long_lm.json): the tables hold "
                "the rows it finished.")
    return out


def long_lm_ppl_table(doc: dict) -> str:
    """Markdown: one row per evaluated row of ``doc`` (FP16, each method's paper configuration and its
    equal-memory configurations), its bits per element (state / paper accounting), the perplexity over
    the whole window and per position bucket. A row that was skipped or failed shows "—" and, under the
    table, why."""
    _check_long_lm(doc)
    pp = doc["ppl_by_position"]
    buckets = [tuple(b) for b in pp.get("buckets") or []]
    head = ["row", "bits / element (state / paper)", "perplexity"] + [f"[{_tokens(a)}, {_tokens(b)})"
                                                                     for a, b in buckets]
    rows, notes = [], []
    for r in pp.get("rows") or []:
        bits = f"{_num(r.get('bits_per_element'), '.2f')} / {_num(r.get('bits_per_element_paper'), '.2f')}"
        why = _why_not(r)
        if why:
            rows.append([r.get("label", r.get("method")), bits, _NONE] + [_NONE] * len(buckets))
            notes.append(f"{r.get('label', r.get('method'))}: {why}")
            continue
        got = {(c["start"], c["end"]): c.get("ppl") for c in r.get("buckets") or []}
        rows.append([r.get("label", r.get("method")), bits, _num(r.get("ppl"), ".4f")]
                    + [_num(got.get(b), ".4f") for b in buckets])
    out = _md_table(head, rows)
    if notes:
        out += "\n\n" + " ".join(f"{n}." if not n.endswith(".") else n for n in notes)
    return out


def long_lm_retrieval_tables(doc: dict) -> str:
    """Markdown: one table per retrieval context length, one row per evaluated row of ``doc`` with its
    bits per element at that context (state accounting; the equal-memory configuration is chosen again
    per context), its accuracy at each needle depth and the mean over depths. Skipped or failed: "—",
    with the reason under the tables."""
    _check_long_lm(doc)
    rt = doc["retrieval"]
    contexts, depths = list(rt.get("contexts") or []), list(rt.get("depths") or [])
    parts, notes = [], []
    for n in contexts:
        head = ["row", f"bits / element at {_tokens(n)}"] + [f"depth {d:g}" for d in depths] + ["mean"]
        rows = []
        for r in rt.get("rows") or []:
            label = r.get("label", r.get("method"))
            why = _why_not(r)
            cells = [c for c in r.get("cells") or [] if c.get("context") == n]
            if why or not cells or all("accuracy" not in c for c in cells):
                rows.append([label, _NONE] + [_NONE] * (len(depths) + 1))
                reason = why or next((f"skipped: {c['skipped']}" for c in cells if c.get("skipped")), None)
                if reason and f"{label}: {reason}" not in notes:
                    notes.append(f"{label}: {reason}")
                continue
            by_depth = {c["depth"]: c["accuracy"] for c in cells if "accuracy" in c}
            bits = next((c.get("bits_per_element") for c in cells if "accuracy" in c), None)
            accs = [by_depth.get(d) for d in depths]
            done = [a for a in accs if a is not None]
            rows.append([label, _num(bits, ".2f")] + [_num(a, ".2f") for a in accs]
                        + [_num(float(np.mean(done)) if done else None, ".2f")])
        parts.append(f"Context {n} tokens:\n\n" + _md_table(head, rows))
    out = "\n\n".join(parts)
    if notes:
        out += "\n\n" + " ".join(f"{x}." if not x.endswith(".") else x for x in notes)
    return out


def long_lm_quality_points(doc: dict) -> tuple[list[dict], float | None]:
    """The points of :func:`kvq.viz.evaluation.plot_quality_vs_bits` from a ``long_lm.json``: one per
    evaluated row other than FP16 (method, state bits per element at the perplexity context, whole-window
    perplexity, config "paper" or "<=B"), and FP16's perplexity (None when FP16 was not evaluated).
    Skipped and failed rows give no point."""
    _check_long_lm(doc)
    rows = [r for r in doc["ppl_by_position"].get("rows") or [] if r.get("ppl") is not None and not _why_not(r)]
    points = [{"method": r["method"], "bits": r["bits_per_element"], "value": r["ppl"],
               "config": "paper" if r.get("budget") is None else f"<={r['budget']:g}"}
              for r in rows if r["method"] != "FP16"]
    fp16 = next((r["ppl"] for r in rows if r["method"] == "FP16"), None)
    return points, fp16


def long_lm_paper_rows(doc: dict) -> dict:
    """Per method of a ``long_lm.json`` (FP16 included), its paper configuration's row: ``{method: {"bits":
    state bits per element, "bits_paper": the papers' accounting, "ppl": whole-window perplexity,
    "retrieval": mean accuracy over depths at the perplexity context (None when not measured there)}}``.
    Skipped or failed rows are left out."""
    _check_long_lm(doc)
    n = doc["ppl_by_position"].get("context")
    ret = {r.get("label"): r for r in doc["retrieval"].get("rows") or []}
    out = {}
    for r in doc["ppl_by_position"].get("rows") or []:
        if r.get("budget") is not None or _why_not(r) or r.get("ppl") is None:
            continue
        cells = [c for c in (ret.get(r.get("label")) or {}).get("cells") or []
                 if c.get("context") == n and "accuracy" in c]
        out[r["method"]] = {"bits": r.get("bits_per_element"), "bits_paper": r.get("bits_per_element_paper"),
                            "ppl": r["ppl"],
                            "retrieval": float(np.mean([c["accuracy"] for c in cells])) if cells else None}
    return out


def long_lm_report(doc: dict) -> str:
    """Markdown of a ``long_lm.json``: :func:`long_lm_protocol`, the perplexity-by-position table
    (:func:`long_lm_ppl_table`) and the retrieval tables (:func:`long_lm_retrieval_tables`)."""
    return (f"{long_lm_protocol(doc)}\n\nPerplexity by position bucket (held-out windows of "
            f"{doc['ppl_by_position'].get('context', '?')} tokens):\n\n{long_lm_ppl_table(doc)}\n\n"
            f"Retrieval accuracy by needle depth (fraction of the room before the query) and context "
            f"length:\n\n{long_lm_retrieval_tables(doc)}")
