"""One layer of an eager decode step in kvq's Python on the CPU, every launch stubbed out, the append included
(issue 37, item 3). The successor of ``lab/2026-11-29-oscar-host/cpu_layer.py``, which stubbed the family's
``write`` and so left the append's own Python out.

    TRITON_INTERPRET=1 python3 lab/2026-11-30-layer-host/cpu_layer.py [METHOD] [--profile]   # KIVI-K2V2

A small Llama config on the CPU with a kvq cache (Triton backend under the interpreter) after a 300-token
prefill. Then every planned launch (``_launch.Launch.__call__``) and ``_launch.launch`` are no-ops, and the decode
plans are forced ready (the address path, as on a GPU after the first call). Each timed call is
``KVQLayer.update`` plus ``kvq_attention_forward`` of one decode token (fp16 k, v and q, as a GPU model's); after it the layer state's host
counters (length, next page ids) are put back, so every call appends at the same position by the same route
(a stubbed launch writes nothing, so the device tables must not move on). Prints us per call (min and median
of 7 rounds of 1000) for the whole and for its parts, and with ``--profile`` a cProfile by own time.
"""
import cProfile
import gc
import pstats
import statistics
import sys
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvq.fast.triton import _launch as L
from kvq.fast.triton import paged as P
from kvq.integrations import attention as A
from kvq.integrations.transformers import make_cache

warnings.filterwarnings("ignore")
args = [a for a in sys.argv[1:] if not a.startswith("--")]
name = args[0] if args else "KIVI-K2V2"
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, vocab_size=1000, max_position_embeddings=8192)
model = LlamaForCausalLM(cfg).eval()
cache = make_cache(name, model, backend="triton", max_tokens=8192, validate=False)
with torch.no_grad():
    model(torch.randint(0, 1000, (1, 300)), past_key_values=cache, use_cache=True)
    model(torch.randint(0, 1000, (1, 1)), past_key_values=cache, use_cache=True)    # one decode token, real
L.Launch.__call__ = lambda self, args, stream, dev: None
L.launch = lambda *a, **k: None
L.current_stream = lambda i: 0
store = cache.store
k = torch.randn(1, 2, 1, 128, dtype=torch.float16)        # a GPU model's dtype: no conversion on the way
v = torch.randn(1, 2, 1, 128, dtype=torch.float16)
q = torch.randn(1, 8, 1, 128, dtype=torch.float16)
mod = model.model.layers[0].self_attn
layer = cache.layers[0]
held = store.layer_states[0]
saved = {f: getattr(held, f) for f in ("length", "k_next", "v_next") if hasattr(held, f)}


def restore():
    st = store.layer_states[0]
    for f, x in saved.items():
        setattr(st, f, x)


def update():
    out = layer.update(k, v)
    restore()
    return out


def step():
    kk, vv = layer.update(k, v)
    o = A.kvq_attention_forward(mod, q, kk, vv, None, scaling=0.088)
    restore()
    return o


step()
for o in gc.get_objects():
    if isinstance(o, P.DecodePlan):
        o.ready = True
kk, vv = update()


def timed(label, fn, n=1000):
    for _ in range(200):
        fn()
    r = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        r.append((time.perf_counter() - t0) / n * 1e6)
    print(f"{name} {label:28s} min {min(r):7.1f}  median {statistics.median(r):7.1f} us")


timed("update + attention", step)
timed("update", update)
timed("attention", lambda: A.kvq_attention_forward(mod, q, kk, vv, None, scaling=0.088))
timed("restore (subtract)", restore)
if "--profile" in sys.argv:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(1000):
        step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(40)
