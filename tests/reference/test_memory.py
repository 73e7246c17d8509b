"""kvq.reference.memory: the published bits per element, derived by the accounting; bytes; batch."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.reference.memory import (FORMATS, CacheFormat, bits_per_element, cache_bytes, max_batch,
                                  quantized_bits)

K32, K128 = 32768, 131072


@pytest.mark.parametrize("name,context,published", [
    ("KIVI-KV2", K32, 2.25),      # OSCAR Table 1
    ("KIVI-KV2*", K32, 2.26),
    ("Kitty", K32, 2.39),
    ("OSCAR", K32, 2.38),
    ("OSCAR", K128, 2.28),        # OSCAR Table 2
])
def test_published_bits_per_element(name, context, published):
    assert round(bits_per_element(FORMATS[name], context), 2) == published


def test_paper_accounting_is_the_formula():
    # bpe = (1 - f) * q + f * 16, f = FP16 tokens / context, q = quantized bits incl. metadata
    for name, fp_tokens, q in [("KIVI-KV2", 0, 2.25), ("KIVI-KV2*", 32, 2.25), ("KIVI-KV4", 0, 4.25),
                               ("Kitty", 32, ((2 + 0.125 * 2 + 0.25) + 2.25) / 2),
                               ("Kitty-Pro", 32, ((2 + 0.25 * 2 + 0.25) + 2.25) / 2),
                               ("OSCAR", 64 + 256, 2.25)]:
        for context in (K32, K128, 1000):
            f = fp_tokens / context
            assert bits_per_element(FORMATS[name], context) == pytest.approx((1 - f) * q + f * 16, rel=1e-15)
    q_k, q_v = quantized_bits(FORMATS["Kitty"])
    assert (q_k, q_v) == (2.5, 2.25)
    assert quantized_bits(FORMATS["Kitty"], "full")[0] == 2.5 + 8 / 128    # + uint8 index per channel/page


def test_fp16_and_llama_70b():
    fp16 = FORMATS["FP16"]
    assert bits_per_element(fp16, 12345) == 16.0
    assert bits_per_element(fp16, 12345, "full") == 16.0
    # Llama-3.1-70B: 80 layers, 8 KV heads, head dim 128, 128K tokens: 2*80*8*128*131072*2 bytes
    assert cache_bytes(fp16, layers=80, kv_heads=8, head_dim=128, tokens=K128) == 40 * 2 ** 30
    assert cache_bytes(fp16, 80, 8, 128, K128, batch=3) == 120 * 2 ** 30
    assert cache_bytes(fp16, 80, 8, 128, 0) == 0


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("context", [1, 31, 100, 129, 4096, 5000, K32, K128 + 17])
def test_full_is_at_least_paper(name, context):
    fmt = FORMATS[name]
    assert bits_per_element(fmt, context, "full") >= bits_per_element(fmt, context, "paper")
    assert cache_bytes(fmt, 2, 2, 64, context, accounting="full") >= \
        cache_bytes(fmt, 2, 2, 64, context, accounting="paper")


def test_full_counts_buffers_index_and_pages():
    kivi = FORMATS["KIVI-KV2"]
    # 32768 tokens: 128 FP16 key tokens, 32640 = 255 pages; value the same
    expect = (128 * 16 + 32640 * 2.25) / 32768
    assert bits_per_element(kivi, K32, "full") == pytest.approx(expect, rel=1e-15)
    # a partially filled page is charged whole: 129 quantized tokens take 2 pages
    fmt = CacheFormat("x", k_bits=2, v_bits=2)
    assert bits_per_element(fmt, 129, "full") == pytest.approx(256 * 2.25 / 129, rel=1e-15)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), t1=st.integers(1, 300_000), t2=st.integers(1, 300_000),
       budget=st.integers(0, 2 ** 40), extra=st.integers(0, 2 ** 36))
def test_max_batch_monotone_and_consistent(name, t1, t2, budget, extra):
    fmt = FORMATS[name]
    lo, hi = sorted((t1, t2))
    dims = (32, 8, 128)
    assert max_batch(fmt, budget, *dims, hi) <= max_batch(fmt, budget, *dims, lo)
    assert max_batch(fmt, budget, *dims, lo) <= max_batch(fmt, budget + extra, *dims, lo)
    b = max_batch(fmt, budget, *dims, lo)
    assert cache_bytes(fmt, *dims, lo, batch=b) <= budget < cache_bytes(fmt, *dims, lo, batch=b + 1)


def test_quantization_fits_more_sequences():
    budget = 80 * 2 ** 30
    n = {k: max_batch(FORMATS[k], budget, 80, 8, 128, K128) for k in ("FP16", "KIVI-KV2", "Kitty")}
    assert n["FP16"] == 2 and n["KIVI-KV2"] > 5 * n["FP16"] and n["Kitty"] <= n["KIVI-KV2"]


def test_bad_inputs():
    fmt = FORMATS["OSCAR"]
    with pytest.raises(ValueError, match="accounting"):
        bits_per_element(fmt, K32, "exact")
    with pytest.raises(ValueError, match="context must be >= 1"):
        bits_per_element(fmt, 0)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        cache_bytes(fmt, 1, 1, 128, -1)
    with pytest.raises(ValueError, match="layers"):
        cache_bytes(fmt, 0, 1, 128, 10)
    with pytest.raises(TypeError, match="tokens must be an int"):
        cache_bytes(fmt, 1, 1, 128, 10.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        max_batch(fmt, -1, 1, 1, 128, 10)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        max_batch(fmt, 10, 1, 1, 128, 0)
    with pytest.raises(ValueError, match="accounting"):
        max_batch(fmt, 10, 1, 1, 128, 10, accounting="paperish")
    with pytest.raises(ValueError, match="k_boost_rate"):
        CacheFormat("bad", k_boost_rate=1.5)
    with pytest.raises(ValueError, match="group_size"):
        CacheFormat("bad", group_size=0)
    with pytest.raises(Exception):
        fmt.k_bits = 4                                          # frozen
    assert isinstance(max_batch(fmt, np.int64(2 ** 33), 32, 8, 128, 1000), int)


def test_format_argument_is_checked():
    """issue 36: ``fmt`` must be a CacheFormat (a name is not: FORMATS[name] is)."""
    for bad in ("OSCAR", 3, {}, None):
        for call in (lambda f: quantized_bits(f), lambda f: bits_per_element(f, 1024),
                     lambda f: cache_bytes(f, 1, 1, 128, 1024), lambda f: max_batch(f, 2 ** 30, 1, 1, 128, 1024)):
            with pytest.raises(TypeError, match="fmt must be a CacheFormat"):
                call(bad)
    with pytest.raises(ValueError, match="accounting"):
        bits_per_element(FORMATS["OSCAR"], 1024, accounting=["paper"])
