"""What do kvq's integration wrappers cost per layer on the host, without the cache's own work? (issue 37, item 3)

    TRITON_INTERPRET=1 python3 lab/2026-11-29-eager-host/wrappers_cpu.py

A small Llama config on the CPU, a KIVI-K2V2 cache (Triton backend under the interpreter) after a 40-token
prefill; the family's ``write`` and the store's ``decode_attention`` are replaced by no-ops, so what is timed is
``KVQLayer.update`` (the cache's and the store's checks, conversions, tagging) and, with it,
``kvq_attention_forward``'s road to the decode: us per call, median of 7 rounds of 2000 calls.
"""
import time, statistics, torch
from transformers import LlamaConfig, LlamaForCausalLM
from kvq.integrations.transformers import make_cache
from kvq.integrations import attention as A
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=1000, max_position_embeddings=4096)
model = LlamaForCausalLM(cfg).eval()
cache = make_cache("KIVI-K2V2", model, backend="triton", max_tokens=100000, validate=False)
ids = torch.randint(0, 1000, (1, 40))
with torch.no_grad():
    model(ids, past_key_values=cache, use_cache=True)
store = cache.store
fam = store._family
fam.write = lambda layer, kx, vx: None          # the integration's Python only
store.decode_attention = lambda layer, q, scale=None: q
k = torch.randn(1, 2, 1, 64); v = torch.randn(1, 2, 1, 64); q = torch.randn(1, 4, 1, 64)
mod = model.model.layers[0].self_attn
def upd():
    return cache.layers[0].update(k, v)
def att():
    kk, vv = cache.layers[0].update(k, v)
    return A.kvq_attention_forward(mod, q, kk, vv, None, scaling=0.125)
for name, fn in (("update", upd), ("update+attention", att)):
    for _ in range(200): fn()
    r = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(2000): fn()
        r.append((time.perf_counter() - t0) / 2000 * 1e6)
    print(name, round(statistics.median(r), 2), "us")
