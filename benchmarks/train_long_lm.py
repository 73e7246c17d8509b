"""Train a small long-context Llama (16K positions) that has learned to retrieve, then evaluate kvq's caches on it.

The evaluation model of issue 40: a byte-level Llama-style causal LM (RoPE, GQA 4:2, head_dim 128, the
``tiny_llama_config`` shape with ``max_position_embeddings = --context``), trained from scratch in one GPU
run on the same local text as ``train_tiny_lm.py`` (``kvq.integrations.text.byte_tokens("train")``, the
Python standard library's files; held out: ``byte_tokens("eval")``, files never seen in training), with a
synthetic retrieval skill mixed in. Then the same run measures, for FP16 and each kvq method at its paper
configuration and at equal memory (``kvq.budgets.equal_memory_config``, budgets ``--budgets``):

* held-out perplexity by position bucket ([0, 256), [256, 512), ... up to the context), every window fed
  through the method's cache in chunks of ``--chunk`` tokens (``kvq.integrations.transformers.make_cache``,
  the protocol of ``kvq.evaluation.PPL_PROTOCOL``);
* retrieval accuracy by needle depth and context length: one key-value pair planted at a depth of the
  held-out text (plus ``--distractors`` other pairs), queried at the end; a trial is correct when every
  byte of the value is the model's argmax given the bytes before it (teacher forcing; equal to greedy
  decoding's exact match).

    python3 benchmarks/train_long_lm.py --out runs/long-lm                        # H200: 3.5 min training + eval
    python3 benchmarks/train_long_lm.py --out /tmp/l --tiny --device cpu         # CPU smoke, < 1 minute
    python3 benchmarks/train_long_lm.py --out runs/long-lm --load runs/long-lm    # evaluate a saved model
    python3 benchmarks/train_long_lm.py --merge a.json b.json --json long_lm.json  # join --load runs' methods

The retrieval format (bytes): a plant ``"\\n@key abcde = 123456\\n"`` overwrites the text at its depth; the
query block at the document's end is ``"\\n@get abcde = "`` followed by the value and ``"\\n"``. Training
documents (``--retrieval-frac`` of them) carry ``--pairs`` plants at uniform depths before the query
block and one query per plant, in random order, at the end; the loss is the mean next-byte
cross-entropy plus ``--answer-weight`` times the mean cross-entropy of the value bytes. Curriculum: the
first ``--short-frac`` of the training budget uses windows of ``--short-context`` tokens, the rest
``--context``, at the same tokens per step (``--batch-tokens``). AdamW, warm-up then cosine as in
``train_tiny_lm.py``; bf16 autocast on CUDA.

Output: ``--out``/``long_lm.json`` (and ``--json``): the model config, data source and split, training
curve, then ``ppl_by_position`` and ``retrieval`` per row (method, configuration label, overrides, bits
per element in the state and paper accountings), the protocol, device, versions and commit; the model is
saved to ``--out`` (``save_pretrained``) unless ``--no-save``. The JSON is rewritten after every row
with ``"complete": false`` and a last time with ``"complete": true``, so a run stopped by a time limit
keeps the rows it finished. With ``--load DIR``, the training record of ``DIR/long_lm.json`` (the run
that trained and saved the model there) is carried into ``training``, with ``loaded_from``. Progress
lines go to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                     # the device copy has no installed kvq package
    sys.path.insert(0, str(ROOT))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_tiny_lm as base  # noqa: E402  (git_commit, device_name, lr_at, the optimizer recipe)
from kvq import budgets as B  # noqa: E402
from kvq.integrations.models import tiny_llama_config  # noqa: E402
from kvq.integrations.text import BYTE_VOCAB, byte_tokens, describe  # noqa: E402

KEY_LETTERS = 5                    # "@key abcde = 123456"
VALUE_DIGITS = 6
PLANT_LEN = len(f"\n@key {'a' * KEY_LETTERS} = {'0' * VALUE_DIGITS}\n")      # 21 bytes
QUERY_LEN = len(f"\n@get {'a' * KEY_LETTERS} = ") + VALUE_DIGITS + 1           # 21 bytes, value and newline
DEFAULT_METHODS = ("FP16", "KIVI-K2V2", "KIVI-K2V2*", "KIVI-K4V4", "Kitty", "Kitty-Pro", "OSCAR",
                   "BitDecoding-2", "BitDecoding-4")
PROTOCOL = (
    "Model: a byte-level Llama (RoPE, GQA, head_dim 128) trained from scratch by this script on the Python "
    "standard library's train split with planted key-value retrieval; data: the eval split (files never "
    "trained on). Perplexity: each window of the context's length starts from an empty cache of the method "
    "and is fed in chunks (kvq.evaluation.PPL_PROTOCOL); the NLL of each position's next byte is averaged "
    "per position bucket. Retrieval: one pair planted at a depth of an eval-split window (plus distractor "
    "pairs at random depths), queried at its end; exact match of the value under teacher forcing. Budget: "
    "each method at its paper configuration and at equal memory (kvq.budgets.EQUAL_MEMORY_RULE); "
    "accounting: bits per element of the configuration at the evaluated context, state accounting "
    "(kvq.integrations.methods.bits_per_element) and the papers'.")


# ----------------------------------------------------------------------------------------------- options

def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring); --tiny changes the defaults to a CPU smoke run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the model and long_lm.json")
    p.add_argument("--json", default=None, help="also write long_lm.json's content to this path")
    p.add_argument("--load", default=None, help="evaluate this saved model (a directory) instead of training")
    p.add_argument("--no-save", action="store_true", help="do not save the trained model")
    p.add_argument("--tiny", action="store_true", help="2-layer model, short contexts, few trials: a CPU smoke run")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, sampler and planted pairs (default 0)")
    t = p.add_argument_group("training")
    t.add_argument("--minutes", type=float, default=None,
                   help="training wall budget in minutes (default 3.5: the recipe that learned retrieval in both "
                        "H200 runs, where a 5-minute run did not: lab/2026-11-28-long-lm/NOTE.md; tiny 0.15)")
    t.add_argument("--steps", type=int, default=None, help="cap on optimizer steps (default: none; tiny 3)")
    t.add_argument("--context", type=int, default=None, help="model positions and long training windows "
                   "(default 16384; tiny 256)")
    t.add_argument("--short-context", type=int, default=None, 
                   help="curriculum's first windows (default 2048; tiny 128)")
    t.add_argument("--short-frac", type=float, default=0.4, help="share of the budget at --short-context (default 0.4)")
    t.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 131072; tiny 256)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    t.add_argument("--min-lr-frac", type=float, default=0.1, help="final lr as a fraction of --lr (default 0.1)")
    t.add_argument("--warmup", type=int, default=100, help="warm-up steps (default 100; capped at steps/10)")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default 0.1)")
    t.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip, 0: off (default 1.0)")
    t.add_argument("--rope-theta", type=float, default=500000.0, help="RoPE base (default 500000)")
    t.add_argument("--retrieval-frac", type=float, default=0.5, 
                   help="share of training windows with plants (default 0.5)")
    t.add_argument("--pairs", type=int, default=None, 
                   help="plants (and queries) per retrieval window (default 8; tiny 1)")
    t.add_argument("--answer-weight", type=float, default=1.0, help="weight of the value bytes' loss (default 1)")
    t.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    t.add_argument("--log-every", type=int, default=None, help="steps between progress lines (default 20; tiny 1)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--methods", nargs="+", default=None, help=f"kvq methods (default: {' '.join(DEFAULT_METHODS)}; "
                   "tiny: FP16 KIVI-K2V2)")
    e.add_argument("--budgets", type=float, nargs="*", default=list(B.DEFAULT_BUDGETS),
                   help="bits-per-element budgets of the equal-memory rows (default 2.5 4.5; none: paper rows only)")
    e.add_argument("--no-paper-configs", action="store_true", help="omit the papers' configurations")
    e.add_argument("--eval-contexts", type=int, nargs="+", default=None,
                   help="retrieval context lengths (default 2048 4096 8192 16384; tiny 128 256)")
    e.add_argument("--depths", type=float, nargs="+", default=None,
                   help="needle depths as fractions of the document (default 0.1 0.3 0.5 0.7 0.9; tiny 0.1 0.5 0.9)")
    e.add_argument("--trials", type=int, default=None, 
                   help="retrieval trials per (context, depth) (default 8; tiny 1)")
    e.add_argument("--distractors", type=int, default=None, help="other planted pairs per retrieval trial (default 3; "
                   "tiny 1)")
    e.add_argument("--ppl-windows", type=int, default=None, help="held-out windows of --context for perplexity "
                   "(default 4; tiny 1)")
    e.add_argument("--chunk", type=int, default=None, 
                   help="tokens per forward through a cache (default 1024; tiny 128)")
    e.add_argument("--eval-batch", type=int, default=None, help="sequences per forward (default 8; tiny 4)")
    e.add_argument("--backend", default="auto", help="kvq backend of the caches (default auto)")
    e.add_argument("--calib-tokens", type=int, default=None, help="train-split tokens for OSCAR / AQUA-KV "
                   "calibration (default 65536; tiny 256)")
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(pairs=1 if tiny else 8, distractors=1 if tiny else 3, minutes=0.15 if tiny else 3.5,
                    steps=3 if tiny else None, context=256 if tiny else 16384, short_context=128 if tiny else 2048,
                    batch_tokens=256 if tiny else 131072, log_every=1 if tiny else 20, trials=1 if tiny else 8,
                    ppl_windows=1 if tiny else 4, chunk=128 if tiny else 1024, eval_batch=4 if tiny else 8,
                    calib_tokens=256 if tiny else 65536,
                    methods=["FP16", "KIVI-K2V2"] if tiny else list(DEFAULT_METHODS),
                    eval_contexts=[128, 256] if tiny else [2048, 4096, 8192, 16384],
                    depths=[0.1, 0.5, 0.9] if tiny else [0.1, 0.3, 0.5, 0.7, 0.9])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    need = args.pairs * (PLANT_LEN + QUERY_LEN) + PLANT_LEN
    for name in ("context", "short_context", "batch_tokens", "chunk", "trials", "ppl_windows", "eval_batch",
                 "calib_tokens", "pairs", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.short_context > args.context:
        p.error("--short-context must not exceed --context")
    if args.distractors < 0:
        p.error("--distractors must be >= 0")
    if (args.short_context + 1 - args.pairs * QUERY_LEN) // PLANT_LEN - 1 < args.pairs:
        p.error(f"--short-context {args.short_context} is too short for {args.pairs} plants and queries "
                f"(needs >= {need}); lower --pairs or raise it")
    shortest = PLANT_LEN * (3 + 2 * args.distractors) + QUERY_LEN          # room for the needle and distractors
    if max(args.eval_contexts) > args.context or min(args.eval_contexts) < shortest:
        p.error(f"--eval-contexts must lie in [{shortest}, --context {args.context}]")
    if not all(0.0 <= d <= 1.0 for d in args.depths):
        p.error("--depths must be fractions in [0, 1]")
    if not 0.0 <= args.short_frac < 1.0 or not 0.0 <= args.retrieval_frac <= 1.0:
        p.error("--short-frac must be in [0, 1) and --retrieval-frac in [0, 1]")
    if any(b <= 0 for b in args.budgets):
        p.error("--budgets must be positive bits per element")
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1):
        p.error("--minutes and --steps must be positive")
    return args


def model_config(args):
    """tiny_llama_config at ``--context`` positions and ``--rope-theta`` (2 layers, 2 x 128 heads with --tiny)."""
    over = {"max_position_embeddings": args.context, "rope_theta": args.rope_theta}
    if args.tiny:
        over.update(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                    num_hidden_layers=2, intermediate_size=512)
    return tiny_llama_config(**over)


# ----------------------------------------------------------------------------------------------- data

def plant_bytes(key: str, value: str) -> bytes:
    return f"\n@key {key} = {value}\n".encode()


def query_bytes(key: str) -> bytes:
    return f"\n@get {key} = ".encode()


def random_pairs(rng, n: int) -> list[tuple[str, str]]:
    """``n`` distinct random (key, value) pairs: 5 lowercase letters, 6 digits."""
    keys: set = set()
    while len(keys) < n:
        keys.add("".join(chr(97 + c) for c in rng.integers(0, 26, KEY_LETTERS)))
    return [(k, "".join(str(d) for d in rng.integers(0, 10, VALUE_DIGITS))) for k in sorted(keys)]


def plant_document(window: np.ndarray, pairs, positions, queried) -> tuple[np.ndarray, np.ndarray]:
    """``window`` (L,) byte ids with each pair's plant written over the text at its position and, at the
    end, one query per pair of ``queried`` (query, value, newline). Returns (ids (L,), answer mask (L,)
    True at the value bytes of the queries)."""
    doc = window.copy()
    for (k, v), pos in zip(pairs, positions):
        b = np.frombuffer(plant_bytes(k, v), dtype=np.uint8)
        doc[pos:pos + len(b)] = b
    tail, mask = [], []
    for k, v in queried:
        q = list(query_bytes(k))
        tail += q + list(v.encode()) + [10]
        mask += [False] * len(q) + [True] * VALUE_DIGITS + [False]
    L = len(doc)
    doc[L - len(tail):] = tail
    answer = np.zeros(L, dtype=bool)
    answer[L - len(tail):] = mask
    return doc, answer


def training_batch(stream: np.ndarray, rng, n: int, L: int, args) -> tuple[np.ndarray, np.ndarray]:
    """``n`` windows of ``L + 1`` training ids (a share ``--retrieval-frac`` with ``--pairs`` plants at uniform
    depths before the query block and their queries at the end) and their answer masks."""
    starts = rng.integers(0, len(stream) - L - 1, size=n)
    ids, ans = np.empty((n, L + 1), np.int64), np.zeros((n, L + 1), bool)
    room = L + 1 - args.pairs * QUERY_LEN                   # plants lie before the query block
    for i, s in enumerate(starts):
        w = stream[s:s + L + 1].astype(np.int64)
        if rng.random() < args.retrieval_frac:
            pairs = random_pairs(rng, args.pairs)
            slots = rng.choice(room // PLANT_LEN - 1, size=args.pairs, replace=False) * PLANT_LEN
            order = rng.permutation(args.pairs)
            w, a = plant_document(w, pairs, slots, [pairs[j] for j in order])
            ans[i] = a
        ids[i] = w
    return ids, ans


def retrieval_case(stream: np.ndarray, rng, L: int, depth: float, distractors: int):
    """One trial: an eval-split window of ``L`` ids with the needle at ``depth`` of the room before the
    query, ``distractors`` other pairs at random depths (not overlapping it), the needle queried at the end.
    Returns (ids (L,), answer mask (L,), needle position)."""
    pairs = random_pairs(rng, 1 + distractors)
    plant = len(plant_bytes("a" * KEY_LETTERS, "0" * VALUE_DIGITS))
    tail = len(query_bytes("a" * KEY_LETTERS)) + VALUE_DIGITS + 1
    room = L - tail - plant
    pos = int(round(depth * room))
    slots = [s * plant for s in range(room // plant) if abs(s * plant - pos) >= plant]
    others = [slots[j] for j in rng.choice(len(slots), size=distractors, replace=False)]
    s = int(rng.integers(0, len(stream) - L))
    doc, ans = plant_document(stream[s:s + L].astype(np.int64), pairs, [pos, *others], [pairs[0]])
    return doc, ans, pos


# ----------------------------------------------------------------------------------------------- training

def train(args, device) -> tuple:
    """Train the model as the options say; returns (model, config, summary of the training)."""
    from transformers import LlamaForCausalLM

    t0 = time.monotonic()
    stream = byte_tokens("train")
    torch.manual_seed(args.seed)
    config = model_config(args)
    model = LlamaForCausalLM(config).to(device).train()
    fwd = torch.compile(model) if args.compile else model
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {}))
    warmup = max(1, min(args.warmup, args.steps // 10 if args.steps else args.warmup))
    budget = args.minutes * 60.0
    rng = np.random.default_rng(args.seed)
    n_params = sum(q.numel() for q in model.parameters())
    print(f"train_long_lm: {n_params / 1e6:.2f} M params, {len(stream):,} train tokens, context {args.context} "
          f"(first {args.short_frac:.0%} of the budget at {args.short_context}), {args.batch_tokens} tokens a "
          f"step, device {base.device_name(device)}, budget {budget:.0f} s", flush=True)
    curve, step, seen, reason = [], 0, 0, "steps"
    while True:
        elapsed = time.monotonic() - t0
        if args.steps is not None and step >= args.steps:
            break
        if elapsed >= budget:
            reason = "wall budget"
            break
        progress = max(step / args.steps if args.steps else 0.0, elapsed / budget)
        L = args.short_context if progress < args.short_frac else args.context
        n = max(1, args.batch_tokens // L)
        lr = base.lr_at(step, progress, args, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, ans = training_batch(stream, rng, n, L, args)
        ids, ans = torch.from_numpy(ids).to(device), torch.from_numpy(ans[:, 1:]).to(device)
        with base._autocast(device):
            logits = fwd(input_ids=ids[:, :-1], use_cache=False).logits
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = ce.mean()
        a = ans.reshape(-1)
        ans_loss = ce[a].mean() if bool(a.any()) else torch.zeros((), device=device)
        total = loss + args.answer_weight * ans_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        seen += n * L
        if step % args.log_every == 0 or step == 1:
            lv, av = float(loss.detach()), float(ans_loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"non-finite training loss at step {step}: {lv}")
            curve.append({"step": step, "context": L, "tokens": seen, "loss": lv, "answer_loss": av, "lr": lr,
                          "elapsed_s": round(time.monotonic() - t0, 3)})
            print(f"step {step:6d}  ctx {L:6d}  loss {lv:.4f}  answer loss {av:.4f}  lr {lr:.2e}  "
                  f"{time.monotonic() - t0:6.1f} s", flush=True)
    model.eval()
    recipe = {k: getattr(args, k) for k in ("minutes", "steps", "context", "short_context", "short_frac",
                                             "batch_tokens", "lr", "pairs", "retrieval_frac", "answer_weight", "seed")}
    return model, config, {"steps": step, "tokens_seen": seen, "stop_reason": reason, "n_params": n_params,
                           "train_wall_s": round(time.monotonic() - t0, 3), "recipe": recipe, "curve": curve}


# ----------------------------------------------------------------------------------------------- evaluation

def rows_to_evaluate(args, geo: dict, context: int) -> list[dict]:
    """FP16, then each method's paper configuration and its equal-memory configurations at ``context``."""
    dims = dict(context=context, head_dim=geo["head_dim"], kv_heads=geo["kv_heads"], n_layers=geo["n_layers"])
    rows = []
    for m in args.methods:
        if m == "FP16":
            rows.append({"method": m, "label": "FP16", "budget": None, "overrides": {}, "feasible": True,
                         "bits_per_element": 16.0, "bits_per_element_paper": 16.0})
            continue
        if not args.no_paper_configs:
            try:
                rows.append(B.paper_config(m, **dims))
            except ValueError as e:
                rows.append({"method": m, "label": f"{m} (paper)", "budget": None, "feasible": False,
                             "reason": str(e)})
        for b in args.budgets:
            rows.append(B.equal_memory_config(m, b, **dims))
    return rows


def row_at(row: dict, context: int, geo: dict) -> dict:
    """``row``'s configuration at another ``context``: the paper configuration (its bits at that context), or
    the method's equal-memory configuration chosen again at that context (equal memory holds per context)."""
    dims = dict(context=context, head_dim=geo["head_dim"], kv_heads=geo["kv_heads"], n_layers=geo["n_layers"])
    if row["method"] == "FP16":
        return row
    if row.get("budget") is None:
        return B.paper_config(row["method"], **dims)
    return B.equal_memory_config(row["method"], row["budget"], **dims)


@torch.no_grad()
def feed(model, ids: torch.Tensor, row: dict, args, calibrations: dict) -> torch.Tensor:
    """Log-probabilities (B, S, V) float64 of ids (B, S) fed in chunks of ``--chunk`` through the row's
    cache (FP16 included: kvq's FP16 cache), every sequence from an empty cache."""
    from kvq.integrations.transformers import cache_argument, make_cache
    S = ids.shape[1]
    cache = make_cache(row["method"], model, backend=args.backend, calibration=calibrations.get(row["method"]),
                       max_tokens=S, **(row.get("overrides") or {}))
    out = []
    for c0 in range(0, S, args.chunk):
        logits = model(input_ids=ids[:, c0:c0 + args.chunk], use_cache=True, **{cache_argument(model): cache}).logits
        out.append(torch.log_softmax(logits.float(), dim=-1).double())
    return torch.cat(out, dim=1)


def cached_nll(model, ids: torch.Tensor, row: dict, args, calibrations: dict) -> torch.Tensor:
    """Per-position next-token NLL (B, S - 1) float64 through the row's cache."""
    lp = feed(model, ids, row, args, calibrations)[:, :-1]                    # predicts ids[:, 1:]
    return -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def retrieval_hits(model, ids: torch.Tensor, answer: torch.Tensor, row: dict, args, calibrations: dict) -> torch.Tensor:
    """(B,) bool: every value byte (``answer`` (B, S) True) is the argmax given the bytes before it."""
    pred = feed(model, ids, row, args, calibrations).argmax(-1)[:, :-1]       # predicts ids[:, 1:]
    m = answer[:, 1:]
    return ((pred == ids[:, 1:]) | ~m).all(dim=1)


def position_buckets(context: int) -> list[tuple[int, int]]:
    """[0, 256), [256, 512), [512, 1K), ... doubling up to ``context`` (the last bucket ends there)."""
    edges = [0, min(256, context)]
    while edges[-1] < context:
        edges.append(min(2 * edges[-1], context))
    return list(zip(edges[:-1], edges[1:]))


def evaluate(model, args, device, calibrations: dict, on_row=None) -> dict:
    """Perplexity by position bucket and retrieval accuracy by depth and context, for every row.
    ``on_row(results so far)`` is called after each row (main writes a partial long_lm.json with it, so
    that a run stopped by a time limit keeps the rows it finished)."""
    from kvq.integrations.models import attention_geometry
    geo = attention_geometry(model)
    eval_stream = byte_tokens("eval")
    L = args.context
    n_win = min(args.ppl_windows, (len(eval_stream) - 1) // L)
    ppl_ids = torch.as_tensor(eval_stream[: n_win * L].reshape(n_win, L).astype(np.int64), device=device)
    buckets = position_buckets(L - 1)
    rng = np.random.default_rng(args.seed + 1)
    cases = {(n, d): [retrieval_case(eval_stream, rng, n, d, args.distractors) for _ in range(args.trials)]
             for n in args.eval_contexts for d in args.depths}
    ppl_rows, ret_rows = [], []

    def results():
        return {"ppl_by_position": {"context": L, "windows": n_win, "chunk": args.chunk,
                                    "buckets": [list(b) for b in buckets], "rows": ppl_rows},
                "retrieval": {"contexts": args.eval_contexts, "depths": args.depths, "trials": args.trials,
                              "distractors": args.distractors, "rows": ret_rows}}

    for row in rows_to_evaluate(args, geo, L):
        if on_row is not None and (ppl_rows or ret_rows):
            on_row(results())
        info = {k: row.get(k) for k in ("method", "label", "budget", "overrides", "bits_per_element",
                                        "bits_per_element_paper")}
        if not row.get("feasible", True):
            ppl_rows.append({**info, "skipped": row.get("reason")})
            ret_rows.append({**info, "skipped": row.get("reason")})
            print(f"  {row['label']}: skipped ({row.get('reason')})", flush=True)
            continue
        t0 = time.monotonic()
        try:
            nll = torch.cat([cached_nll(model, ppl_ids[i:i + args.eval_batch], row, args, calibrations)
                             for i in range(0, n_win, args.eval_batch)])                 # (N, L - 1)
            by_bucket = [{"start": a, "end": b, "nll": float(nll[:, a:b].mean()),
                          "ppl": float(torch.exp(nll[:, a:b].mean()))} for a, b in buckets]
            ppl_rows.append({**info, "buckets": by_bucket, "nll": float(nll.mean()),
                             "ppl": float(torch.exp(nll.mean())), "windows": n_win,
                             "seconds": round(time.monotonic() - t0, 3)})
            acc = []
            for n in args.eval_contexts:
                r = row_at(row, n, geo)
                if not r.get("feasible", True):
                    acc.append({"context": n, "skipped": r.get("reason")})
                    continue
                for d in args.depths:
                    docs = torch.as_tensor(np.stack([c[0] for c in cases[(n, d)]]), device=device)
                    masks = torch.as_tensor(np.stack([c[1] for c in cases[(n, d)]]), device=device)
                    ok = 0
                    for i in range(0, len(docs), args.eval_batch):
                        sl = slice(i, i + args.eval_batch)
                        ok += int(retrieval_hits(model, docs[sl], masks[sl], r, args, calibrations).sum())
                    acc.append({"context": n, "depth": d, "trials": len(docs), "correct": ok,
                                "accuracy": ok / len(docs), "overrides": r.get("overrides"),
                                "bits_per_element": r.get("bits_per_element")})
            done = [c["accuracy"] for c in acc if "accuracy" in c]
            ret_rows.append({**info, "cells": acc, "accuracy": float(np.mean(done)) if done else None})
            print(f"  {row['label']}: ppl {ppl_rows[-1]['ppl']:.4f}, retrieval {ret_rows[-1]['accuracy']} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - one method's failure must not lose the others' results
            msg = f"{type(e).__name__}: {e}"
            print(f"  {row['label']}: error {msg}", flush=True)
            for rows in (ppl_rows, ret_rows):
                if not rows or rows[-1].get("label") != row["label"]:
                    rows.append({**info, "error": msg})
    return results()


def calibrate(model, args, device) -> tuple[dict, dict]:
    """OSCAR / AQUA-KV calibrations from the train split (never the eval split), for the methods asked."""
    from kvq.commands.calibrate import calibrate_aqua_model, calibrate_oscar_model
    stream = byte_tokens("train")
    T = min(2048, args.context)
    n = max(1, args.calib_tokens // T)
    rng = np.random.default_rng(args.seed + 2)
    starts = rng.integers(0, len(stream) - T, size=n)
    seqs = np.stack([stream[s:s + T] for s in starts]).astype(np.int64)
    batches = [seqs[i:i + args.eval_batch] for i in range(0, n, args.eval_batch)]
    cal, src = {}, {}
    data = {"source": "stdlib", "split": "train", "sequences": int(n), "seq_len": int(T)}
    if "OSCAR" in args.methods:
        print("calibrating OSCAR", flush=True)
        cal["OSCAR"] = calibrate_oscar_model(model, batches, progress=False)
        src["OSCAR"] = data
    for m in ("AQUA-KV", "AQUA-KV-uniform"):
        if m in args.methods:
            print(f"calibrating {m}", flush=True)
            cal[m], _ = calibrate_aqua_model(model, batches, progress=False)
            src[m] = data
    return cal, src


# ----------------------------------------------------------------------------------------------- main

def main(argv=None) -> dict:
    """Parse ``argv``, train (or --load), evaluate, write long_lm.json; returns its dict."""
    args = parse_args(argv)
    t0 = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.load:
        from kvq.integrations.models import load_model
        model, _ = load_model(args.load, device=str(device), dtype="float32")
        config, training = model.config, {"loaded_from": str(Path(args.load).resolve())}
        earlier = Path(args.load) / "long_lm.json"          # the training run's own record, when it is there
        if earlier.is_file():
            prev = json.loads(earlier.read_text())
            training = {**(prev.get("training") or {}), **training, "trained_by": {
                k: prev.get(k) for k in ("argv", "commit", "date_utc", "device_name")}}
    else:
        model, config, training = train(args, device)
        if not args.no_save:
            model.save_pretrained(out)
    model.float().eval()
    calibrations, cal_src = calibrate(model, args, device)
    print(f"evaluating {len(args.methods)} method(s) at context {args.context}", flush=True)

    static = _summary(args, argv, config, training, cal_src, device)

    def record(results: dict, complete: bool) -> dict:
        """Write long_lm.json (and --json): ``complete`` False while rows are still to come."""
        summary = {**static, **results, "complete": complete,
                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "wall_s": round(time.monotonic() - t0, 3)}
        text = json.dumps(summary, indent=1, default=str)
        (out / "long_lm.json").write_text(text)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text)
        return summary

    summary = record(evaluate(model, args, device, calibrations, on_row=lambda r: record(r, False)), True)
    print(f"wrote {out / 'long_lm.json'} ({summary['wall_s']:.1f} s)", flush=True)
    return summary


def _summary(args, argv, config, training, cal_src, device) -> dict:
    """long_lm.json's fields other than the results: run, model, data, training, calibrations, device."""
    return {
        "script": "benchmarks/train_long_lm.py", "argv": list(sys.argv[1:] if argv is None else argv),
        "args": vars(args), "config": config.to_dict(), "protocol": PROTOCOL,
        "equal_memory_rule": B.EQUAL_MEMORY_RULE, "accounting": B.EQUAL_MEMORY_ACCOUNTING,
        "data": {"train": describe(english=False), "train_split": "train", "eval_split": "eval",
                 "vocab_size": BYTE_VOCAB,
                 "retrieval_format": {"plant": plant_bytes("<key>", "<value>").decode(),
                                      "query": query_bytes("<key>").decode() + "<value>\\n",
                                      "key_letters": KEY_LETTERS, "value_digits": VALUE_DIGITS}},
        "training": training, "calibrations": cal_src,
        "device": str(device), "device_name": base.device_name(device), "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__, "commit": base.git_commit(),
    }


#: the args every part of a merged run must share (the model, the data, the protocol); methods and
#: calibration sizes may differ per part (each calibration's size is in ``calibrations``)
MERGE_SAME_ARGS = ("context", "budgets", "no_paper_configs", "eval_contexts", "depths", "trials", "distractors",
                   "ppl_windows", "chunk", "backend", "seed", "tiny")


def merge_runs(parts: list[dict]) -> dict:
    """One long_lm.json from evaluation runs of ONE saved model that split the methods between them
    (``--load DIR --methods ...`` in parallel processes or consecutive calls).

    Every part must be complete, be a ``--load`` of the same trained model (the same ``training``
    record), share :data:`MERGE_SAME_ARGS`, the model config, the protocol and the per-cell layout, and
    evaluate methods no other part evaluates. The result keeps the first part's fields, the rows of all
    parts in the order of the parts, ``args.methods`` as their union, every part's calibrations, and
    ``parts``: each part's argv, methods, calibration tokens, commit, date and wall seconds. Raises
    ValueError naming the first field in which two parts differ.
    """
    if len(parts) < 2:
        raise ValueError(f"merge needs at least two runs; got {len(parts)}")
    first = parts[0]
    seen: set[str] = set()
    for i, part in enumerate(parts):
        if part.get("complete") is not True:
            raise ValueError(f"part {i} is not complete (a run stopped before its last row)")
        if not (part.get("training") or {}).get("loaded_from"):
            raise ValueError(f"part {i} trained its own model: only --load runs of one saved model merge")
        for field in ("training", "config", "protocol", "equal_memory_rule", "accounting", "data", "device_name"):
            if part.get(field) != first.get(field):
                raise ValueError(f"part {i} differs from part 0 in {field!r}: not runs of one model and protocol")
        for name in MERGE_SAME_ARGS:
            if part["args"].get(name) != first["args"].get(name):
                raise ValueError(f"part {i} differs from part 0 in --{name.replace('_', '-')}: "
                                 f"{part['args'].get(name)!r} != {first['args'].get(name)!r}")
        for table in ("ppl_by_position", "retrieval"):
            layout = {k: v for k, v in part[table].items() if k != "rows"}
            if layout != {k: v for k, v in first[table].items() if k != "rows"}:
                raise ValueError(f"part {i} differs from part 0 in the layout of {table!r}")
        methods = set(part["args"]["methods"])
        if methods & seen:
            raise ValueError(f"part {i} evaluates {sorted(methods & seen)} again")
        seen |= methods
    merged = json.loads(json.dumps(first))
    merged["args"]["methods"] = [m for part in parts for m in part["args"]["methods"]]
    for table in ("ppl_by_position", "retrieval"):
        merged[table]["rows"] = [row for part in parts for row in part[table]["rows"]]
    merged["calibrations"] = {k: v for part in parts for k, v in (part.get("calibrations") or {}).items()}
    merged["parts"] = [{"argv": part["argv"], "methods": part["args"]["methods"],
                        "calib_tokens": part["args"].get("calib_tokens"), "commit": part["commit"],
                        "date_utc": part["date_utc"], "wall_s": part["wall_s"]} for part in parts]
    merged["commit"] = ",".join(dict.fromkeys(part["commit"] for part in parts))
    merged["wall_s"] = round(sum(part["wall_s"] for part in parts), 3)
    merged["date_utc"] = max(part["date_utc"] for part in parts)
    merged["argv"] = ["--merge"] + [f"<part {i}>" for i in range(len(parts))]    # the parts' own argv: ``parts``
    return merged


def merge_main(argv) -> dict:
    """``train_long_lm.py --merge A.json B.json ... --json OUT.json``: :func:`merge_runs`, written to OUT."""
    p = argparse.ArgumentParser(prog="train_long_lm.py --merge",
                                description="merge long_lm.json files of --load runs of one model")
    p.add_argument("--merge", nargs="+", required=True, help="long_lm.json files of the parts, in row order")
    p.add_argument("--json", required=True, help="where to write the merged long_lm.json")
    args = p.parse_args(argv)
    merged = merge_runs([json.loads(Path(f).read_text()) for f in args.merge])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(merged, indent=1, default=str))
    print(f"merged {len(args.merge)} runs ({len(merged['args']['methods'])} methods) into {args.json}")
    return merged


if __name__ == "__main__":
    if "--merge" in sys.argv[1:]:
        merge_main(sys.argv[1:])
    else:
        main()
