"""What does one layer of an eager decode step cost in kvq's Python, launches stubbed out? (issue 37, item 3)

    TRITON_INTERPRET=1 python3 lab/2026-11-29-oscar-host/cpu_layer.py [METHOD]       # KIVI-K2V2 by default

A small Llama config on the CPU with a kvq cache (Triton backend under the interpreter) after a 300-token
prefill. Then every planned launch (``_launch.Launch.__call__``) and ``_launch.launch`` are no-ops, the decode
plans are forced ready (the address path, as on a GPU after the first call), and the family's ``write`` is a
no-op: a stubbed append would leave the page tables as they were, and a later page flush would then read page
-1. What is timed is ``KVQLayer.update`` plus ``kvq_attention_forward`` of one decode token: the cache's and
the store's checks, conversions and tagging, and the decode call's Python. Prints us per call (5 rounds of
1000) and a cProfile by own time.
"""
import time, torch, cProfile, pstats, gc, sys
from transformers import LlamaConfig, LlamaForCausalLM
from kvq.integrations.transformers import make_cache
from kvq.integrations import attention as A
from kvq.fast.triton import _launch as L, paged as P
name = sys.argv[1] if len(sys.argv) > 1 else "KIVI-K2V2"
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, vocab_size=1000, max_position_embeddings=8192)
model = LlamaForCausalLM(cfg).eval()
cache = make_cache(name, model, backend="triton", max_tokens=8192, validate=False)
ids = torch.randint(0, 1000, (1, 300))
with torch.no_grad():
    model(ids, past_key_values=cache, use_cache=True)
L.Launch.__call__ = lambda self, args, stream, dev: None
cache.store._family.write = lambda layer, kx, vx: None
L.launch = lambda *a, **k: None
L.current_stream = lambda i: 0
k = torch.randn(1, 2, 1, 128); v = torch.randn(1, 2, 1, 128); q = torch.randn(1, 8, 1, 128)
mod = model.model.layers[0].self_attn
def att():
    kk, vv = cache.layers[0].update(k, v)
    return A.kvq_attention_forward(mod, q, kk, vv, None, scaling=0.088)
att()
for o in gc.get_objects():
    if isinstance(o, P.DecodePlan): o.ready = True
for _ in range(200): att()
for o in gc.get_objects():
    if isinstance(o, P.DecodePlan): o.ready = True
r = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(1000): att()
    r.append((time.perf_counter() - t0) / 1000 * 1e6)
print(name, "update+attention us", sorted(r))
pr=cProfile.Profile(); pr.enable()
for _ in range(1000): att()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(30)
