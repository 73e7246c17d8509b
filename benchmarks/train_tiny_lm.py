"""Train the tiny byte-level Llama (kvq.integrations.models.tiny_llama_config) on the Python stdlib.

A model with real trained keys and values (RoPE, GQA, head_dim 128) for KV-cache quantization
experiments, made from scratch in about five minutes on one H100, with no network: the training text is
``byte_tokens("train")`` of ``kvq.integrations.text`` and the held-out loss is measured on
``byte_tokens("eval")`` (files never seen in training).

    python3 benchmarks/train_tiny_lm.py --out runs/tiny-lm                   # GPU, ~5.5 min wall
    python3 benchmarks/train_tiny_lm.py --out $OUT/tiny-lm --save-dtype bfloat16 --max-shard-size 15MB
                                          # device machine: 3 bf16 shards < 16 MiB each come back
    python3 benchmarks/train_tiny_lm.py --out /tmp/t --tiny --steps 3 --seq-len 64 --batch 2  # smoke
    model, tok = kvq.integrations.models.load_model("runs/tiny-lm")

Method: AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to
10 % of ``--lr``; the schedule's progress is the larger of steps / ``--steps`` and elapsed / training
budget, so a wall-bounded run still anneals. Batches are random contiguous windows of ``seq_len + 1``
tokens of the training stream (NumPy generator seeded with ``--seed``). bf16 autocast on CUDA; fp32
weights and optimizer. ``--minutes`` is the wall budget of the whole ``main`` (data, model, training,
final evaluation, saving): training stops early enough to leave ``--reserve-s`` seconds for the rest.
The final evaluation covers the eval stream in non-overlapping windows (every token predicted once,
with the context of its window; the tail shorter than a window is dropped), reported in nats per token
and bits per byte (the SEP token between files counts as one byte-sized token).

Output in ``--out``: ``model.safetensors`` + ``config.json`` (``save_pretrained``) and ``train.json``
(config, arguments, steps, tokens seen, wall time, loss curves, final eval bits per byte, a logits probe,
device, versions, commit from ``KVQ_COMMIT`` or ``git rev-parse HEAD``, the corpus description).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                     # the device copy has no installed kvq package
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvq.integrations.models import tiny_llama_config  # noqa: E402
from kvq.integrations.text import BYTE_VOCAB, byte_tokens, describe  # noqa: E402

PROBE_PROMPT = "def main(argv=None):\n    "   # train.json records the saved model's logits here
PROBE_VALUES = 16                               # ... the first 16 logits of the last position


# ----------------------------------------------------------------------------------------------- setup

def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the model, config.json and train.json")
    p.add_argument("--minutes", type=float, default=5.5, help="wall budget of the whole run in minutes (default 5.5)")
    p.add_argument("--steps", type=int, default=None, help="cap on optimizer steps (default: none)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per training window (default 1024)")
    p.add_argument("--batch", type=int, default=None, help="windows per step (default 32 on CUDA, 4 on CPU)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="final lr as a fraction of --lr (default 0.1)")
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps, capped at --steps/10 (default 200)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default 0.1)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip, 0: off (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the window sampler (default 0)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--tiny", action="store_true", help="2-layer config (hidden 256, 2 x 128 heads) for CPU tests")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (falls back to eager)")
    p.add_argument("--log-every", type=int, default=None, help="steps between progress lines (default 50; tiny 1)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evals (default 250; tiny 2)")
    p.add_argument("--eval-batches", type=int, default=4, help="batches of the periodic held-out eval (default 4)")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="tokens of the eval stream in the final eval (default: all; tiny: 4 windows)")
    p.add_argument("--reserve-s", type=float, default=20.0, help="seconds of the budget kept for final eval and saving (default 20)")
    p.add_argument("--json", default=None, help="also write train.json's content to this path")
    p.add_argument("--save-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the saved weights (default float32; training keeps fp32 weights)")
    p.add_argument("--max-shard-size", default=None,
                   help="safetensors shard size for save_pretrained, e.g. 15MB (default: transformers')")
    args = p.parse_args(argv)
    if args.seq_len < 2:
        p.error("--seq-len must be at least 2")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be positive")
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    return args


def model_config(args):
    """The LlamaConfig to train: tiny_llama_config(), or its 2-layer variant with --tiny."""
    overrides = {"max_position_embeddings": max(2048, args.seq_len)}
    if args.tiny:
        overrides.update(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                         num_hidden_layers=2, intermediate_size=512)
    return tiny_llama_config(**overrides)


def git_commit() -> str:
    """KVQ_COMMIT when set, else ``git rev-parse HEAD`` (suffix ``-dirty`` with local changes)."""
    env = os.environ.get("KVQ_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's description."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def lr_at(step: int, progress: float, args, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``lr`` to ``min_lr_frac * lr``."""
    if step < warmup:
        return args.lr * (step + 1) / warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return args.lr * (args.min_lr_frac + (1.0 - args.min_lr_frac) * cos)


# ----------------------------------------------------------------------------------------------- eval

def _autocast(device: torch.device):
    """bf16 autocast on CUDA, a no-op elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def loss_of(model, windows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of windows (B, L + 1): predict tokens 1..L from 0..L-1."""
    with _autocast(device):
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits   # (B, L, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch: int, device, max_windows=None) -> dict:
    """Held-out loss over non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``)."""
    model.eval()
    n_win = max(0, (len(stream) - 1) // seq_len)
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win == 0:
        raise ValueError(f"the eval stream ({len(stream)} tokens) is shorter than one window of "
                         f"{seq_len + 1} tokens")
    ar = torch.arange(seq_len + 1, device=stream.device)
    total, count = 0.0, 0
    for s in range(0, n_win, batch):
        starts = torch.arange(s, min(s + batch, n_win), device=stream.device) * seq_len
        w = stream[starts[:, None] + ar[None, :]].to(device)
        loss = loss_of(model, w, device)
        n = w.shape[0] * seq_len
        total += float(loss) * n
        count += n
    model.train()
    nats = total / count
    return {"loss": nats, "bits_per_byte": nats / math.log(2), "tokens": count, "windows": n_win}


@torch.no_grad()
def probe(model, device) -> list[float]:
    """The first PROBE_VALUES fp32 logits at the last position of PROBE_PROMPT (a weights fingerprint)."""
    model.eval()
    ids = torch.tensor([list(PROBE_PROMPT.encode("utf-8"))], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, -1, :PROBE_VALUES].float()
    return [float(x) for x in logits.cpu()]


# ----------------------------------------------------------------------------------------------- train

def train(args) -> tuple:
    """Train, evaluate and save as the options say; returns (model, summary dict = train.json)."""
    from transformers import LlamaForCausalLM

    t0 = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")                    # TF32 outside autocast
    batch = args.batch or (32 if device.type == "cuda" else 4)
    log_every = args.log_every or (1 if args.tiny else 50)
    eval_every = args.eval_every or (2 if args.tiny else 250)
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (
        4 * args.seq_len if args.tiny else None)
    budget_s = args.minutes * 60.0
    train_budget_s = max(1.0, budget_s - args.reserve_s)

    train_np = byte_tokens("train")
    eval_np = byte_tokens("eval")
    if len(train_np) < args.seq_len + 2:
        raise ValueError(f"the training stream ({len(train_np)} tokens) is shorter than --seq-len")
    train_stream = torch.from_numpy(train_np).to(device)
    eval_stream = torch.from_numpy(eval_np).to(device)
    corpus = describe(english=False)

    torch.manual_seed(args.seed)
    config = model_config(args)
    model = LlamaForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    fwd = model
    compiled = False
    if args.compile:
        try:
            fwd = torch.compile(model)
            compiled = True
        except Exception as e:  # noqa: BLE001 - compile is an optional speed-up
            print(f"torch.compile failed, training eager: {type(e).__name__}: {e}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt_kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kwargs)
    warmup = max(1, min(args.warmup, args.steps // 10 if args.steps else args.warmup))

    rng = np.random.default_rng(args.seed)
    ar = torch.arange(args.seq_len + 1, device=device)
    hi = len(train_np) - args.seq_len - 1                              # last valid window start + 1
    eval_windows = args.eval_batches * batch
    print(f"train_tiny_lm: {n_params / 1e6:.2f} M params, {len(train_np):,} train / {len(eval_np):,} eval "
          f"tokens, batch {batch} x {args.seq_len}, device {device_name(device)}, budget "
          f"{budget_s:.0f} s", flush=True)

    train_curve, eval_curve = [], []
    step, tokens_seen, t_train = 0, 0, time.monotonic()
    stop_reason = "steps"
    while True:
        if args.steps is not None and step >= args.steps:
            stop_reason = "steps"
            break
        if time.monotonic() - t0 >= train_budget_s:
            stop_reason = "wall budget"
            break
        progress = max(step / args.steps if args.steps else 0.0,
                       (time.monotonic() - t0) / train_budget_s)
        lr = lr_at(step, progress, args, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.from_numpy(rng.integers(0, hi, size=batch)).to(device)
        windows = train_stream[starts[:, None] + ar[None, :]]          # (B, L + 1)
        loss = loss_of(fwd, windows, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += batch * args.seq_len
        if step % log_every == 0 or step == 1:
            elapsed = time.monotonic() - t0
            lv = float(loss.detach())                                 # syncs only at log steps
            if not math.isfinite(lv):
                raise FloatingPointError(f"non-finite training loss at step {step}: {lv}")
            train_curve.append({"step": step, "tokens": tokens_seen, "loss": lv, "lr": lr,
                                "elapsed_s": round(elapsed, 3)})
            rate = tokens_seen / max(time.monotonic() - t_train, 1e-9)
            print(f"step {step:6d}  loss {lv:.4f}  lr {lr:.2e}  {rate / 1e3:8.1f} K tok/s  "
                  f"{elapsed:6.1f} s", flush=True)
        if step % eval_every == 0:
            ev = evaluate(model, eval_stream, args.seq_len, batch, device, max_windows=eval_windows)
            eval_curve.append({"step": step, "tokens": tokens_seen, "loss": ev["loss"],
                               "bits_per_byte": ev["bits_per_byte"],
                               "elapsed_s": round(time.monotonic() - t0, 3)})
            print(f"step {step:6d}  eval loss {ev['loss']:.4f}  ({ev['bits_per_byte']:.3f} bits/byte "
                  f"on {ev['tokens']:,} tokens)", flush=True)
    train_s = time.monotonic() - t_train

    max_windows = None if eval_tokens is None else max(1, eval_tokens // args.seq_len)
    final = evaluate(model, eval_stream, args.seq_len, batch, device, max_windows=max_windows)
    print(f"final: {step} steps, {tokens_seen:,} tokens, eval loss {final['loss']:.4f} = "
          f"{final['bits_per_byte']:.4f} bits/byte on {final['tokens']:,} held-out tokens", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.to(getattr(torch, args.save_dtype))
    save_kwargs = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}
    model.save_pretrained(out, **save_kwargs)
    model.float()                     # the saved (rounded) weights, computed in fp32 for the probe
    summary = {
        "script": "benchmarks/train_tiny_lm.py",
        "argv": list(sys.argv[1:]) if getattr(args, "_argv", None) is None else list(args._argv),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "config": config.to_dict(),
        "n_params": n_params,
        "batch": batch,
        "seq_len": args.seq_len,
        "steps": step,
        "tokens_seen": tokens_seen,
        "stop_reason": stop_reason,
        "compiled": compiled,
        "train_wall_s": round(train_s, 3),
        "tokens_per_s": tokens_seen / max(train_s, 1e-9),
        "curve": {"train": train_curve, "eval": eval_curve},
        "final_eval": final,
        "final_eval_bits_per_byte": final["bits_per_byte"],
        "save_dtype": args.save_dtype,
        "saved_files": sorted(p.name for p in out.iterdir() if p.is_file()),
        "probe": {"prompt": PROBE_PROMPT, "last_logits_head": probe(model, device),
                  "how": f"fp32 forward of the saved weights on {device.type}, last position"},
        "device": str(device),
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "python_version": platform.python_version(),
        "commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "corpus": corpus,
        "vocab_size": BYTE_VOCAB,
    }
    summary["wall_s"] = round(time.monotonic() - t0, 3)
    text = json.dumps(summary, indent=1)
    (out / "train.json").write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    print(f"saved {out} ({summary['wall_s']:.1f} s)", flush=True)
    return model, summary


def main(argv=None) -> dict:
    """Command-line entry: parse ``argv`` (default sys.argv[1:]), train, save; returns train.json's dict."""
    args = parse_args(argv)
    args._argv = None if argv is None else list(argv)
    return train(args)[1]


if __name__ == "__main__":
    main()
