"""Methods compared at equal memory, and the amortized cost of a periodic flush (issue 40).

    from kvq import budgets as B
    row = B.equal_memory_config("KIVI-K2V2", 2.5, context=16384, head_dim=128, kv_heads=2, n_layers=6)
    row["overrides"], row["bits_per_element"]        # the configuration closest to 2.5 b/e, and its bits
    B.paper_config("OSCAR", context=16384, head_dim=128, kv_heads=2, n_layers=6)   # the paper's, labelled
    B.amortized_overhead(quantize_ms=0.02, rank_ms=0.005, layers=32, period=128, step_ms=20.0)["percent"]

Where the bits come from: every number of bits per element here is
``kvq.integrations.methods.bits_per_element`` of a method's configuration at the evaluated context, head
dim, KV heads and layers. Its ``accounting="paper"`` is ``kvq.reference.memory``'s paper accounting with
that configuration's sizes (``memory.bits_per_element(memory.FORMATS[...], context)`` for the papers'
sizes); its ``accounting="state"`` (:data:`EQUAL_MEMORY_ACCOUNTING`, the one every equal-memory
comparison uses) is ``kvq.reference.memory``'s "full" accounting for this exact configuration and
context: FP16 sinks, windows, Q-buffers and residual blocks at 16 bits, quantized tokens at payload +
metadata + index bits, without rounding the last page up to a whole page.

:func:`kvq.evaluation.attention_errors_at_budgets` and :func:`kvq.evaluation.perplexity_at_budgets` run
the evaluations at each budget with this module's choices (this module imports no evaluation: the
evaluation builds on it). ``kvq.evaluation`` re-exports every public name of this module, so
``from kvq import evaluation as E; E.equal_memory_config(...)`` keeps working.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["EQUAL_MEMORY_ACCOUNTING", "DEFAULT_BUDGETS", "SEARCH_SPACE", "EQUAL_MEMORY_RULE", "paper_config",
           "equal_memory_config", "amortized_overhead"]

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
    "search space (kvq.budgets.SEARCH_SPACE: FP16 sink tokens from 4 to the paper's own, none if it "
    "keeps none; recent / residual window 16 .. context tokens; group sizes 32 / 64 / 128; the quantizer "
    "itself, its bits and boost rate, kept) is accounted at the evaluated context, head dim, KV heads and layers by "
    "kvq.integrations.methods.bits_per_element(accounting='state') (sinks, windows, Q-buffers, residual "
    "blocks, metadata and index bits counted); the configuration with the most bits per element not above "
    "B is chosen, ties broken by the smallest distance to the paper's configuration. A method none of whose "
    "configurations fits B is reported as such, with the smallest bits it reaches. The paper's own "
    "configuration is a separate, labelled row.")


def search_values(fam: str, base, context: int) -> dict:
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
    per element at ``context`` (``EQUAL_MEMORY_ACCOUNTING`` and the papers' accounting).

    Accounting: ``kvq.integrations.methods.bits_per_element`` of the configuration; "paper" is
    ``kvq.reference.memory``'s paper accounting, "state" its "full" accounting for this configuration and
    context (see the module docstring)."""
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

    Accounting: ``kvq.integrations.methods.bits_per_element(accounting="state")`` of each candidate, i.e.
    ``kvq.reference.memory``'s "full" accounting for that configuration at ``context`` (sinks, windows,
    buffers, metadata and index bits counted; see the module docstring).

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
    space = {k: v for k, v in search_values(spec.family, base, context).items() if k not in fixed}
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

    Accounting: time only, no memory (``kvq.reference.memory`` is not involved); the flush's cost is
    spread evenly over the ``period`` steps it serves, as the slides do.

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
