"""``kvq calibrate oscar|aqua``: fit OSCAR rotations or AQUA-KV predictors on a real model, write a file.

OSCAR (Algorithm 1, Calibrate) needs each layer's post-RoPE Q, K, V; AQUA-KV (Algorithm 1) each layer's
clean K, V. Both are captured from a Hugging Face model (``kvq.integrations.capture``) on calibration
text: the Python standard library's bytes for the byte-level tiny LM, English prose otherwise
(``kvq.integrations.text``), or a text file. The result is a checked safetensors file
(``kvq.calibration``) that ``load_oscar`` / ``load_aqua`` read back.

    kvq calibrate oscar --model runs/tiny-lm --out tiny.oscar.safetensors --tokens 16384
    kvq calibrate aqua --model Qwen/Qwen3-8B --out qwen3.aqua.safetensors --backbone higgs --device cuda
    kvq calibrate oscar --model minilm --out minilm.oscar.safetensors --seq-len 256   # an encoder
    calibs = calibrate_oscar_model(model, batches)           # the same, from Python

OSCAR's value target ``C_S = (SV)^T (SV) / N`` uses the attention the model computes, decided from the
model (``kvq.integrations.models.is_causal``): causal for a decoder, bidirectional (no mask) for an
encoder such as MiniLM / BERT; the file's config records it (``"causal"``).

Arguments are checked before the model is loaded (:func:`validate`); a bad one ends in one line and
exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from kvq.commands import emit

__all__ = ["calibrate_oscar_model", "calibrate_aqua_model", "calibration_batches", "model_shape", "build_parser",
           "validate", "main"]


def _bar(iterable, progress: bool, **kw):
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kw)


def model_shape(model, name=None) -> dict:
    """The ``model_shape`` a calibration file records: ``attention_geometry`` (n_layers, kv_heads,
    head_dim, rope_theta; ``n_heads`` as ``q_heads``), the model type and ``name`` when given."""
    from kvq.integrations.models import attention_geometry

    g = attention_geometry(model)
    out = {"n_layers": g["n_layers"], "kv_heads": g["kv_heads"], "head_dim": g["head_dim"],
           "rope_theta": g["rope_theta"], "q_heads": g["n_heads"],
           "model_type": getattr(getattr(model, "config", None), "model_type", None)}
    if name is not None:
        out["model"] = os.fspath(name)
    return out


# ---------------------------------------------------------------------------------------------------
# calibration on a model


def calibrate_oscar_model(model, token_batches, *, rotation: str = "oscar", target: str = "attention",
                          per_head: bool = False, clip=None, group_size: int = 128, bits: int = 2,
                          seed: int = 0, causal: bool | None = None, progress: bool = True) -> list:
    """One ``OSCARCalibration`` per layer of ``model``, from its post-RoPE Q, K, V on ``token_batches``.

    ``token_batches``: an iterable of (B, T) integer id arrays / tensors. The target covariances
    (``rotations.target_covariances``, with each layer's own softmax scale) are accumulated batch by
    batch, weighted by tokens, so only one batch of activations is held at a time (equal to computing
    them on all batches at once, up to float64 summation order); then ``oscar.calibrate`` per layer.
    ``clip``: (c_K, c_V) (default the paper's 0.96, 0.92) or "fit" (keeps K and V of every batch).
    ``causal``: the attention of the value target ``C_S = (SV)^T (SV) / N``: None (default) decides it from
    the model (``kvq.integrations.models.is_causal``: a causal LM is masked, an encoder such as MiniLM /
    BERT attends both ways, unmasked); True or False forces it (a model ``is_causal`` cannot tell needs it).
    """
    from kvq.integrations.capture import capture_qkv
    from kvq.integrations.models import is_causal
    from kvq.reference import oscar
    from kvq.reference.rotations import target_covariances

    if causal is None:
        causal = is_causal(model)            # ValueError (asking for causal=) when the model does not say
    elif not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be None (from the model), True (a decoder) or False (an encoder), got "
                        f"{causal!r}")
    causal = bool(causal)
    clip = (oscar.DEFAULT_CLIP_K, oscar.DEFAULT_CLIP_V) if clip is None else clip
    fit = isinstance(clip, str)
    sums, n_tok, last, kv = None, 0, None, None
    for ids in _bar(token_batches, progress, desc="capture q/k/v", unit="batch"):
        recs = capture_qkv(model, ids)
        N = recs[0]["k"].shape[0] * recs[0]["k"].shape[2]
        covs = [target_covariances(r["q"], r["k"], r["v"], per_head=per_head, scale=r["scaling"], causal=causal)
                for r in recs]
        if sums is None:
            sums = [{n: C * N for n, C in c.items()} for c in covs]
            kv = [([], []) for _ in recs] if fit else None
        else:
            for s, c in zip(sums, covs):
                for n in s:
                    s[n] += c[n] * N
        if fit:
            for (ks, vs), r in zip(kv, recs):
                ks.append(r["k"])
                vs.append(r["v"])
        n_tok += N
        last = recs
    if sums is None:
        raise ValueError("token_batches is empty: no calibration tokens")
    out = []
    for l in _bar(range(len(sums)), progress, desc="OSCAR rotations", unit="layer"):
        targets = {n: S / n_tok for n, S in sums[l].items()}
        q, k, v = last[l]["q"], last[l]["k"], last[l]["v"]
        if fit:
            k, v = np.concatenate(kv[l][0], axis=0), np.concatenate(kv[l][1], axis=0)
        gs = min(group_size, k.shape[-1])
        out.append(oscar.calibrate(q, k, v, rotation=rotation, target=target, per_head=per_head, clip=clip,
                                   group_size=gs, bits=bits, seed=seed + l, targets=targets,
                                   scale=last[l]["scaling"]))
    return out


def _rope_check(model, cfg) -> None:
    """Pre-RoPE keys need plain RoPE over the whole head (kvq.reference.model.apply_rope) at the model's base."""
    if not cfg.pre_rope:
        return
    from kvq.integrations.models import attention_geometry

    theta = attention_geometry(model)["rope_theta"]
    conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    params = getattr(conf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    partial = getattr(conf, "partial_rotary_factor", None) or (params.get("partial_rotary_factor", 1.0)
                                                               if isinstance(params, dict) else 1.0)
    problems = []
    if theta is None:
        problems.append("the model has no RoPE base (rope_theta)")
    elif float(theta) != float(cfg.rope_theta):
        problems.append(f"cfg.rope_theta={cfg.rope_theta} but the model's is {theta}")
    if rope_type not in (None, "default"):
        problems.append(f"the model uses rope_type={rope_type!r}, which undoing plain RoPE does not invert")
    if float(partial) != 1.0:
        problems.append(f"the model rotates only part of each head (partial_rotary_factor={partial})")
    if problems:
        raise ValueError("AQUA-KV with pre_rope=True: " + "; ".join(problems) + " (use pre_rope=False / --post-rope)")


def calibrate_aqua_model(model, token_batches, *, cfg=None, ridge: float = 1e-3, rank: int | None = None,
                         quantizer_agnostic: bool = False, progress: bool = True):
    """``(AquaPredictors, AquaConfig)`` fit on ``model``'s clean K, V over ``token_batches`` (Algorithm 1).

    ``cfg``: an ``AquaConfig`` (default: the paper's, at the model's RoPE base, pre-RoPE keys when the
    model has plain RoPE, post-RoPE otherwise). K and V of every layer are kept (N * F floats each).
    """
    from kvq.integrations.capture import collect_calibration
    from kvq.integrations.models import attention_geometry
    from kvq.reference import aqua

    if cfg is None:
        theta = attention_geometry(model)["rope_theta"]
        cfg = aqua.AquaConfig(rope_theta=theta, pre_rope=theta is not None)
        try:
            _rope_check(model, cfg)
        except ValueError:
            cfg = aqua.AquaConfig(rope_theta=theta, pre_rope=False)
    _rope_check(model, cfg)
    layers = collect_calibration(model, token_batches, progress=progress, keep=("k", "v"))
    T = layers[0]["k"].shape[2]
    if T <= cfg.sink + 1:
        raise ValueError(f"sequences of {T} tokens leave fewer than 2 after the {cfg.sink} sink tokens")
    kv = [(r["k"], r["v"]) for r in layers]
    if progress:
        print(f"fitting AQUA-KV predictors over {len(kv)} layers ...", file=sys.stderr)
    P = aqua.calibrate(cfg, kv, ridge=ridge, rank=rank, quantizer_agnostic=quantizer_agnostic)
    return P, cfg


# ---------------------------------------------------------------------------------------------------
# calibration text


def _tokenize(tokenizer, text: str) -> np.ndarray:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return np.asarray(ids, dtype=np.int64)


def calibration_batches(tokenizer, *, source: str = "auto", tokens: int = 16384, seq_len: int = 512,
                        batch_size: int = 4):
    """``(batches, description)``: ``tokens // seq_len`` sequences of ``seq_len`` ids in batches of
    ``batch_size`` ((B, T) int64 arrays), and a JSON dict saying where they came from.

    ``source``: "stdlib" (Python standard library files, train split), "english" (docstrings and
    license texts), a path of a UTF-8 text file, or "auto" (stdlib for a ``ByteTokenizer``, else english).
    """
    from kvq.integrations import text
    from kvq.integrations.models import ByteTokenizer

    for name, v in (("tokens", tokens), ("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if tokens < seq_len:
        raise ValueError(f"tokens={tokens} is less than one sequence of seq_len={seq_len}")
    byte_level = isinstance(tokenizer, ByteTokenizer)
    if source == "auto":
        source = "stdlib" if byte_level else "english"
    chars = 8 * tokens                                          # generous: BPE averages ~4 chars per token
    if source == "stdlib":
        raw = text.byte_tokens("train", tokens if byte_level else chars)
        if byte_level:
            ids = raw
        else:
            ids = _tokenize(tokenizer, bytes(np.where(raw > 255, 10, raw).astype(np.uint8)).decode("utf-8", "replace"))
        desc = {"source": "stdlib", "split": "train"}
    elif source == "english":
        ids = _tokenize(tokenizer, "\n\n".join(text.english_texts(chars)))
        desc = {"source": "english"}
    else:
        if not os.path.isfile(source):
            raise FileNotFoundError(f"--source {source!r} is not 'stdlib', 'english' or an existing text file")
        with open(source, encoding="utf-8", errors="replace") as f:
            ids = _tokenize(tokenizer, f.read(chars))
        desc = {"source": "file", "path": os.path.abspath(source)}
    n_seq = min(tokens, len(ids)) // seq_len
    if n_seq == 0:
        raise ValueError(f"the {desc['source']} text gives {len(ids)} tokens, less than one sequence of {seq_len}")
    seqs = ids[: n_seq * seq_len].reshape(n_seq, seq_len)
    batches = [seqs[i:i + batch_size] for i in range(0, n_seq, batch_size)]
    desc.update(tokens=int(n_seq * seq_len), sequences=int(n_seq), seq_len=int(seq_len), batch_size=int(batch_size),
                tokenizer=type(tokenizer).__name__)
    return batches, desc


# ---------------------------------------------------------------------------------------------------
# the command


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq calibrate`` argument parser (subcommands ``oscar`` and ``aqua``); numbers are range-checked
    as they are parsed (one-line errors, exit status 2)."""
    from kvq.commands import Parser, non_negative_float, non_negative_int, positive_int, ratio
    from kvq.reference.oscar import DEFAULT_CLIP_K, DEFAULT_CLIP_V
    from kvq.reference.rotations import ROTATIONS

    p = Parser(prog="kvq calibrate", description="Fit OSCAR rotations or AQUA-KV predictors on a "
               "Hugging Face model and write them to a checked safetensors file.")
    sub = p.add_subparsers(dest="method", required=True, metavar="{oscar,aqua}")

    def common(sp):
        sp.add_argument("--model", required=True, help="Hugging Face hub id or local model directory of a causal "
                        "LM, or 'minilm' (the packaged MiniLM encoder, calibrated with bidirectional attention)")
        sp.add_argument("--out", required=True, help="the calibration file to write (.safetensors)")
        sp.add_argument("--tokens", type=positive_int, default=16384, help="calibration tokens (default 16384)")
        sp.add_argument("--seq-len", type=positive_int, default=512, help="tokens per sequence (default 512)")
        sp.add_argument("--batch-size", type=positive_int, default=4, help="sequences per forward pass (default 4)")
        sp.add_argument("--source", default="auto", help="stdlib | english | a text FILE (default: stdlib for "
                        "byte-level models, english otherwise)")
        sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
        sp.add_argument("--dtype", default=None, help="model dtype, e.g. float32, bfloat16 (default: the checkpoint's)")
        sp.add_argument("--json", action="store_true", help="print the summary as JSON")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")

    so = sub.add_parser("oscar", help="OSCAR rotations R_K, R_V and clip ratios per layer")
    common(so)
    so.add_argument("--rotation", default="oscar", choices=tuple(ROTATIONS), help="rotation kind (default oscar)")
    so.add_argument("--target", default="attention", choices=("attention", "tensor"),
                    help="covariance target: attention (C_Q / C_S, OSCAR) or tensor (K^T K / V^T V)")
    so.add_argument("--per-head", action="store_true", help="one rotation per KV head instead of per layer")
    so.add_argument("--clip-k", type=ratio, default=DEFAULT_CLIP_K, help=f"key clip ratio in (0, 1] (default "
                    f"{DEFAULT_CLIP_K})")
    so.add_argument("--clip-v", type=ratio, default=DEFAULT_CLIP_V, help=f"value clip ratio in (0, 1] (default "
                    f"{DEFAULT_CLIP_V})")
    so.add_argument("--fit-clip", action="store_true", help="fit the clip ratios per layer instead")
    so.add_argument("--group-size", type=positive_int, default=128, help="quantization group the clip fit assumes")
    so.add_argument("--seed", type=non_negative_int, default=0, help="seed of the 'random' rotation")

    sa = sub.add_parser("aqua", help="AQUA-KV inter-layer predictors (ridge / reduced rank)")
    common(sa)
    sa.add_argument("--rank", type=positive_int, default=None, help="reduced-rank predictors of this rank "
                    "(default: full)")
    sa.add_argument("--ridge", type=non_negative_float, default=1e-3, help="ridge relative to mean diag(X^T X) "
                    "(default 1e-3)")
    sa.add_argument("--backbone", default="higgs", choices=("higgs", "uniform"),
                    help="residual quantizer: HIGGS d=2 n=16, or uniform 2-bit groups of 64 (default higgs)")
    sa.add_argument("--first-layer", default="higgs", choices=("higgs", "fp16"),
                    help="layer 0: HIGGS d=2 n=256 (4 bits) or kept FP16 (default higgs)")
    sa.add_argument("--post-rope", action="store_true", help="predict keys after RoPE (default: before, "
                    "when the model has plain RoPE)")
    sa.add_argument("--quantizer-agnostic", action="store_true", help="fit on clean inputs (ablation)")
    return p


def validate(args) -> None:
    """Every check of the parsed arguments that needs no model: ``kvq.commands.CommandError`` (one line,
    exit status 2) before anything is loaded or computed."""
    from kvq.commands import (CommandError, check_device, check_dtype, check_model, check_out_file,
                              check_text_source, usage_errors)

    prog = f"kvq calibrate {args.method}"
    with usage_errors(prog):
        check_model(args.model, prog=prog)
        check_out_file(args.out, prog=prog)
        check_device(args.device, prog=prog)
        check_dtype(args.dtype, prog=prog)
        check_text_source(args.source, ("auto", "stdlib", "english"), prog=prog)
    if args.tokens < args.seq_len:
        raise CommandError(f"--tokens {args.tokens} is less than one sequence of --seq-len {args.seq_len}", prog)


def _aqua_cfg(args, model):
    """The AQUA-KV configuration ``kvq.integrations.methods.configure`` gives this model (HIGGS / uniform
    groups adapted to its head_dim and KV heads, so small models pad nothing), with the options asked."""
    from kvq.integrations.methods import configure
    from kvq.integrations.models import attention_geometry
    from kvq.reference import aqua

    geo = attention_geometry(model)
    theta = geo["rope_theta"]
    pre = not args.post_rope and theta is not None
    name = "AQUA-KV" if args.backbone == "higgs" else "AQUA-KV-uniform"
    extra = {} if args.first_layer == "higgs" else {"first_layer": aqua.KeepFP16()}
    return configure(name, head_dim=geo["head_dim"], kv_heads=geo["kv_heads"], max_tokens=4096, pre_rope=pre,
                     rope_theta=theta, **extra)


def _run(args) -> dict:
    import torch

    from kvq import calibration
    from kvq.integrations.models import load_minilm, load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    if args.model == "minilm":                  # the packaged MiniLM encoder, as `kvq eval attention` loads it
        model, tokenizer = load_minilm(device=device)
        if args.dtype is not None:
            from kvq.integrations.models import resolve_dtype
            dt = resolve_dtype(args.dtype)
            model = model.to(dt) if dt is not None else model
    else:
        model, tokenizer = load_model(args.model, device=device, dtype=args.dtype)
    batches, data = calibration_batches(tokenizer, source=args.source, tokens=args.tokens, seq_len=args.seq_len,
                                        batch_size=args.batch_size)
    data.update(device=device, dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    shape = model_shape(model, args.model)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t1 = time.perf_counter()
    progress = not args.quiet
    if args.method == "oscar":
        clip = "fit" if args.fit_clip else (args.clip_k, args.clip_v)
        from kvq.integrations.models import is_causal

        causal = is_causal(model)            # an encoder (MiniLM / BERT): the bidirectional target C_S
        config = {"rotation": args.rotation, "target": args.target, "per_head": args.per_head, "clip": clip,
                  "group_size": args.group_size, "bits": 2, "seed": args.seed, "causal": causal}
        calibs = calibrate_oscar_model(model, batches, rotation=args.rotation, target=args.target,
                                       per_head=args.per_head, clip=clip, group_size=args.group_size,
                                       seed=args.seed, causal=causal, progress=progress)
        meta = calibration.save_oscar(args.out, calibs, model_shape=shape, config=config, data=data)
        detail = {"clip_k": [c.clip_k for c in calibs], "clip_v": [c.clip_v for c in calibs],
                  "rotation_shape": list(np.shape(calibs[0].R_K)), "causal": causal}
    else:
        cfg = _aqua_cfg(args, model)
        P, cfg = calibrate_aqua_model(model, batches, cfg=cfg, ridge=args.ridge, rank=args.rank,
                                      quantizer_agnostic=args.quantizer_agnostic, progress=progress)
        data.update(ridge=args.ridge, rank=args.rank, quantizer_agnostic=args.quantizer_agnostic)
        meta = calibration.save_aqua(args.out, P, cfg, model_shape=shape, data=data)
        detail = {"n_params": P.n_params, "backbone": cfg.backbone.label, "first_layer": cfg.first_layer.label,
                  "pre_rope": cfg.pre_rope}
    t2 = time.perf_counter()
    return {"kind": args.method, "out": os.path.abspath(args.out), "bytes": os.path.getsize(args.out),
            "model_shape": shape, "data": data, "checksum": meta["checksum"], **detail,
            "seconds": {"load": round(t1 - t0, 3), "calibrate": round(t2 - t1, 3)}}


def _print_summary(s: dict) -> None:
    ms, d = s["model_shape"], s["data"]
    print(f"wrote {s['out']} ({s['bytes']:,} bytes, {s['checksum'][:23]}...)")
    print(f"  {s['kind']} calibration of {ms.get('model')}: {ms['n_layers']} layers, {ms['kv_heads']} KV heads, "
          f"head_dim {ms['head_dim']}, rope_theta {ms['rope_theta']}")
    print(f"  data: {d['tokens']} tokens ({d['sequences']} x {d['seq_len']}) from {d['source']} on {d['device']}")
    if s["kind"] == "oscar":
        attention = "causal" if s.get("causal", True) else "bidirectional"
        print(f"  rotations {tuple(s['rotation_shape'])} per layer ({attention} attention target); clip_k "
              f"{min(s['clip_k'])}..{max(s['clip_k'])}, clip_v {min(s['clip_v'])}..{max(s['clip_v'])}")
    else:
        print(f"  predictors: {s['n_params']:,} parameters; backbone {s['backbone']}, first layer "
              f"{s['first_layer']}, pre_rope {s['pre_rope']}")
    print(f"  {s['seconds']['load']} s loading, {s['seconds']['calibrate']} s calibrating")


def main(argv=None) -> int:
    """``kvq calibrate oscar|aqua ...``; returns the exit status (argparse exits 0 on ``--help``)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from kvq.calibration import CalibrationFileError
    from kvq.commands import CommandError, report

    try:
        validate(args)
    except CommandError as e:
        return report(e)
    try:
        summary = _run(args)
    except (OSError, ValueError, CalibrationFileError) as e:
        print(f"kvq calibrate {args.method}: error: {e}", file=sys.stderr)
        return 1
    emit(summary, out=None, as_json=args.json, printer=_print_summary)
    return 0


if __name__ == "__main__":
    from kvq.cli import main as _cli

    raise SystemExit(_cli(["calibrate", *sys.argv[1:]]))
