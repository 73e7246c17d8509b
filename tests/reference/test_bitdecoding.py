"""kvq.reference.bitdecoding and bitdecoding_lanes against the BitDecoding paper (sections IV-A, IV-B, V).

The induced layout is checked three ways: the vectorized packing equals the words written lane by lane
from the PTX fragment maps (``fragments``); unpacking the words lane by lane (``ldmatrix`` + ``lop3`` +
dequantization) gives every lane exactly the ``mma.m16n8k16`` B fragment of the dequantized page; and the
codes round-trip through the plain contract quantizer.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvq.reference import attention, quant
from kvq.reference import bitdecoding as bd
from kvq.reference import bitdecoding_lanes as bl
from kvq.reference import fragments as fr

from .test_attention import assert_tolerance_rule


def small(bits=2, k_mode="channel", warps_n=1, **kw):
    """N_r = 8 * warps_n * 16 / bits: 64 tokens at 2 bits, 32 at 4 bits with one warp."""
    n_r = bd.residual_block_size(bits, warps_n)
    kw.setdefault("k_group", min(32, n_r) if k_mode == "channel" else 32)
    kw.setdefault("v_group", 32)
    return bd.BitDecodingConfig(bits=bits, k_mode=k_mode, warps_n=warps_n, max_tokens=16 * n_r, **kw)


SMALL = [small(b, m) for b in (4, 2) for m in ("channel", "tensor")]
IDS = [f"K{c.k_mode[0].upper()}{c.bits}" for c in SMALL]


def page(cfg, D=64, seed=0, outlier=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((cfg.n_r, D)).astype(np.float32)
    if outlier:
        x[:, 3] *= 12                      # an outlier channel, as keys have
    return x.astype(np.float16)


# ---------------------------------------------------------------------------------------------------
# eq. 1 and the partition (IV-A(2), V-B(1))


def test_residual_block_size_is_eq1():
    # P_n = 8, W_n = 4, omega = 16: 128 tokens at 4 bits, 256 at 2 bits (the public code's blocks)
    assert bd.residual_block_size(4) == 8 * 4 * 4 == 128
    assert bd.residual_block_size(2) == 8 * 4 * 8 == 256
    assert bd.residual_block_size(2, warps_n=1) == 64
    assert bd.residual_block_size(4, warps_n=2, word_bits=32) == 8 * 2 * 8
    assert [c.n_r for c in bd.CONFIGS.values()] == [128, 256, 128, 256]
    for bad in ({"bits": 8}, {"bits": 2, "warps_n": 0}, {"bits": 4, "word_bits": 10}, {"bits": 2, "p_n": True}):
        with pytest.raises(ValueError):
            bd.residual_block_size(**bad)


@pytest.mark.parametrize("L", [0, 1, 255, 256, 257, 1000, 4096])
def test_partition(L):
    n_p, res = bd.partition(L, 256)
    assert n_p + res == L and n_p % 256 == 0 and 0 <= res < 256
    assert (n_p, res) == (L - L % 256, L % 256)


def test_partition_bad_input():
    for args in ((-1, 8), (3, 0), (2.0, 8), (True, 8)):
        with pytest.raises(ValueError):
            bd.partition(*args)


def test_config_validation():
    with pytest.raises(ValueError, match="bits"):
        bd.BitDecodingConfig(bits=8)
    with pytest.raises(ValueError, match="k_mode"):
        bd.BitDecodingConfig(k_mode="token")
    with pytest.raises(ValueError, match="divide the residual block"):
        bd.BitDecodingConfig(bits=4, k_group=96)
    with pytest.raises(ValueError, match="multiple of 8"):
        bd.BitDecodingConfig(k_mode="tensor", k_group=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        bd.BitDecodingConfig(v_group=4)
    with pytest.raises(ValueError, match="warps_n"):
        bd.BitDecodingConfig(warps_n=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        bd.init(bd.CONFIGS["BitDecoding-KC2"], 1, 1, 96)          # 2 bits: 8 x 8 channels per word block
    with pytest.raises(ValueError, match="v_group=128"):
        bd.init(bd.CONFIGS["BitDecoding-KC4"], 1, 1, 96)
    bd.init(small(4, v_group=32), 1, 1, 96)                       # 4 bits: a multiple of 32 suffices
    with pytest.raises(ValueError, match="k_group=64"):
        bd.init(small(4, "tensor", k_group=64), 1, 1, 96)
    for bad in ((0, 1, 64), (1, 1.0, 64), (1, 1, -64)):
        with pytest.raises(ValueError, match="positive int"):
            bd.init(SMALL[0], *bad)


# ---------------------------------------------------------------------------------------------------
# the induced layout (IV-A(1))


@pytest.mark.parametrize("cfg", SMALL + list(bd.CONFIGS.values()), ids=IDS + list(bd.CONFIGS))
def test_packing_holds_the_contract_codes(cfg):
    D = 128
    k, v = page(cfg, D, 1), page(cfg, D, 2, outlier=False)
    kw, kp = bd.pack_keys(cfg, k)
    vw, vp = bd.pack_values(cfg, v)
    assert kw.dtype == vw.dtype == np.uint16 and kp.dtype == vp.dtype == np.float16
    assert kw.shape == (8 * cfg.warps_n, D) and vw.shape == (cfg.n_r, D // cfg.per_word)
    axis = -2 if cfg.k_mode == "channel" else -1
    kc, ks, km = quant.quantize(k, cfg.bits, cfg.k_group, axis=axis)
    vc, vs, vm = quant.quantize(v, cfg.bits, cfg.v_group, axis=-1)
    assert np.array_equal(bd.unpack_keys(cfg, kw), kc) and np.array_equal(bd.unpack_values(cfg, vw), vc)
    # half2 pairs: [..., 0] scale, [..., 1] min; (T_n / group, d) channel-wise, (T_n, d / group) tensor-wise
    assert kp.shape == ((cfg.n_r // cfg.k_group, D, 2) if cfg.k_mode == "channel" else (cfg.n_r, D // cfg.k_group, 2))
    assert np.array_equal(kp[..., 0], ks) and np.array_equal(kp[..., 1], km)
    assert np.array_equal(vp[..., 0], vs) and np.array_equal(vp[..., 1], vm)
    K, V = bd.dequantize_page(cfg, kw, kp, vw, vp)
    assert np.array_equal(K.view(np.uint16), quant.dequantize(kc, ks, km, cfg.k_group, axis).view(np.uint16))
    assert np.array_equal(V.view(np.uint16), quant.dequantize(vc, vs, vm, cfg.v_group, -1).view(np.uint16))


def test_word_positions_written_out():
    """One word of each layout, by hand: KC2 with W_n = 4 (R = 8, N_r = 256)."""
    cfg = bd.CONFIGS["BitDecoding-KC2"]
    codes = np.random.default_rng(5).integers(0, 4, (cfg.n_r, 128)).astype(np.uint8)
    # keys: word (8 w + g, c) slot i = K[w * 64 + 8 i + g, c]; warp 2, g = 5, channel 17
    toks = [2 * 64 + 8 * i + 5 for i in range(8)]
    word = sum(int(codes[t, 17]) << (2 * i) for i, t in enumerate(toks))
    packed = bd.pack_words(np.moveaxis(codes.reshape(4, 8, 8, 128), 1, -1), 2).reshape(32, 128)
    assert packed[8 * 2 + 5, 17] == word
    # values: word (t, 8 u + g) slot i = V[t, 8 (u R + i) + g]; token 9, u = 1, g = 3
    chans = [8 * (8 + i) + 3 for i in range(8)]
    word = sum(int(codes[9, c]) << (2 * i) for i, c in enumerate(chans))
    vpacked = bd.pack_words(np.swapaxes(codes.reshape(256, 2, 8, 8), -1, -2), 2).reshape(256, 16)
    assert vpacked[9, 8 + 3] == word
    assert np.array_equal(bd.unpack_values(cfg, vpacked), codes)


@pytest.mark.parametrize("cfg", SMALL[:2] + [bd.CONFIGS["BitDecoding-KC2"], bd.CONFIGS["BitDecoding-KT4"]],
                         ids=IDS[:2] + ["KC2-Wn4", "KT4-Wn4"])
def test_residual_kernel_lane_by_lane_writes_the_same_words(cfg):
    """Each lane packs the values ldmatrix put in its own registers, stores each word where ldmatrix puts
    it back: the words equal pack_keys / pack_values, byte for byte (little-endian uint16)."""
    D = 64 if cfg.warps_n == 1 else 128
    k, v = page(cfg, D, 3), page(cfg, D, 4)
    assert np.array_equal(bl.residual_kernel_keys(cfg, k), bd.pack_keys(cfg, k)[0])
    assert np.array_equal(bl.residual_kernel_values(cfg, v), bd.pack_values(cfg, v)[0])
    assert bd.pack_keys(cfg, k)[0].tobytes() == bl.residual_kernel_keys(cfg, k).astype("<u2").tobytes()


@pytest.mark.parametrize("cfg", SMALL, ids=IDS)
def test_unpacking_yields_the_mma_fragments(cfg):
    """ldmatrix of the words, lop3, dequantize: every lane holds mma_b's fragment of the fp16 page."""
    D = 64
    k, v = page(cfg, D, 6), page(cfg, D, 7)
    kw, kp = bd.pack_keys(cfg, k)
    vw, vp = bd.pack_values(cfg, v)
    K, V = bd.dequantize_page(cfg, kw, kp, vw, vp)
    rows, cols = fr.table("b")[..., 0], fr.table("b")[..., 1]           # (32, 4): k, n of each b_i
    R = cfg.per_word
    for w in range(cfg.warps_n):
        for i in range(R):
            for kk in range(D // 16):
                got = bl.key_fragments(cfg, kw, kp, w, i, kk)
                want = K[w * 8 * R + 8 * i + cols, 16 * kk + rows]      # B[k = channel, n = token]
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (w, i, kk)
    for kk in range(cfg.n_r // 16):
        for j in range(D // 8):
            got = bl.value_fragments(cfg, vw, vp, kk, j)
            want = V[16 * kk + rows, 8 * j + cols]                       # B[k = token, n = channel]
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (kk, j)


def test_bad_pages():
    cfg = SMALL[0]
    with pytest.raises(ValueError, match="N_r"):
        bd.pack_keys(cfg, np.zeros((cfg.n_r - 1, 64), np.float16))
    with pytest.raises(TypeError, match="float16 or float32"):
        bd.pack_values(cfg, np.zeros((cfg.n_r, 64), np.int32))
    nan = page(cfg)
    nan[3, 4] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        bd.pack_keys(cfg, nan)
    with pytest.raises(ValueError, match="uint16"):
        bd.unpack_keys(cfg, np.zeros((8, 64), np.uint8))
    with pytest.raises(ValueError, match="uint16"):
        bd.unpack_values(cfg, np.zeros((cfg.n_r, 12), np.uint16))


# ---------------------------------------------------------------------------------------------------
# 75316420 and lop3 (IV-A(3))


def test_lop3_truth_tables():
    rng = np.random.default_rng(8)
    a, b, c = (rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    assert bl.LUT_AND_OR == 0xEA
    assert np.array_equal(bl.lop3(a, b, c, 0xEA), (a & b) | c)
    assert np.array_equal(bl.lop3(a, b, c, 0x96), a ^ b ^ c)        # F0 ^ CC ^ AA
    assert np.array_equal(bl.lop3(a, b, c, 0xF0), a)
    assert np.array_equal(bl.lop3(a, b, c, 0x00), np.zeros_like(a))
    assert np.array_equal(bl.lop3(a, b, c, 0xCA), (a & b) | (~a & c))   # select: a ? b : c
    with pytest.raises(ValueError, match="immLut"):
        bl.lop3(a, b, c, 256)


def test_register_order_is_75316420():
    assert bl.register_order(4) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert bl.order_digits(4) == "75316420"
    assert bl.order_digits(2) == "15 13 11 9 7 5 3 1 14 12 10 8 6 4 2 0"
    assert bl.MAGIC == 0x64006400 and np.uint16(0x6400).view(np.float16) == 1024


@pytest.mark.parametrize("bits", [4, 2])
def test_lop3_codes_equal_plain_unpacking_for_every_word(bits):
    """Every 16-bit word in the low half (exhaustive), random words in the high half."""
    lo = np.arange(2**16, dtype=np.uint32)
    hi = np.random.default_rng(bits).integers(0, 2**16, 2**16).astype(np.uint32)
    got = bl.lop3_codes(bl.registers(lo, hi), bits)                    # (65536, R, 2) fp16
    R = 16 // bits
    plain = lambda w: bd._unpack_words(w.astype(np.uint16), bits).astype(np.float16)   # noqa: E731
    assert got.shape == (2**16, R, 2)
    assert np.array_equal(got[..., 0], plain(lo)) and np.array_equal(got[..., 1], plain(hi))
    # in the register's order: position p holds logical element register_order[p] (pair i = e_2i, e_2i+1)
    reg = bl.registers(lo[:50], hi[:50])
    logical = got[:50].reshape(50, 2 * R)                               # e_0, e_1, e_2, ...
    for p, e in enumerate(bl.register_order(bits)):
        assert np.array_equal((reg >> np.uint32(bits * p)) & np.uint32(2**bits - 1), logical[:, e].astype(np.uint32))


def test_contiguous_order_gives_the_wrong_pairs():
    """Packing e_0..e_7 into nibbles 0..7 (no remap), one lop3 pairs e_0 with e_4: not a half2 pair."""
    e = np.arange(8, dtype=np.uint32) + 3                               # distinct 4-bit codes 3..10
    reg = np.bitwise_or.reduce(e << (4 * np.arange(8, dtype=np.uint32)))
    pair = bl.lop3_codes(reg, 4)[0]
    assert list(pair) == [3, 7]                                         # (e_0, e_4), not (e_0, e_1) = (3, 4)
    remapped = np.bitwise_or.reduce(e[list(bl.register_order(4))] << (4 * np.arange(8, dtype=np.uint32)))
    assert bl.lop3_codes(remapped, 4).reshape(-1).tolist() == e.tolist()


# ---------------------------------------------------------------------------------------------------
# query transformation (V-A) and the cooperative softmax (Algorithm 1, Table III)


def test_query_transformation_rows_and_attention():
    rng = np.random.default_rng(9)
    B, H_kv, g_q, T_q, D = 2, 2, 4, 3, 16
    q = rng.standard_normal((B, H_kv * g_q, T_q, D)).astype(np.float32)
    k = rng.standard_normal((B, H_kv, 40, D)).astype(np.float32)
    v = rng.standard_normal((B, H_kv, 40, D)).astype(np.float32)
    qt = bd.query_transform(q, H_kv)
    assert qt.shape == (B, H_kv, g_q * T_q, D)
    for kv in range(H_kv):
        for j in range(g_q):
            for s in range(T_q):
                assert np.array_equal(qt[:, kv, j * T_q + s], q[:, kv * g_q + j, s])
    assert np.array_equal(bd.query_untransform(qt, H_kv * g_q), q)
    # MHA over the transformed rows (one MMA tile of g_q * T_q rows per KV head) = GQA attention
    o_gqa = attention.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    o_t = attention.attention(qt.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(bd.query_untransform(o_t, H_kv * g_q), o_gqa, rtol=0, atol=1e-13)
    for bad in (3, 0, 2.0):
        with pytest.raises(ValueError, match="kv_heads"):
            bd.query_transform(q, bad)
    with pytest.raises(ValueError, match="q_heads"):
        bd.query_untransform(qt, 3)


def _softmax_attention(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


@pytest.mark.parametrize("N", [1, 37, 64, 300])
def test_cooperative_softmax(N):
    rng = np.random.default_rng(N)
    q = rng.standard_normal((8, 32))
    k = rng.standard_normal((N, 32)) * 3                               # peaky scores: maxima differ by warp
    v = rng.standard_normal((N, 32))
    truth = _softmax_attention(q, k, v)
    coop = bl.cooperative_attention(q, k, v, warps_n=4, tile_n=64)
    np.testing.assert_allclose(coop, truth, rtol=0, atol=1e-12)
    # Table III: W_n = 1 without the cooperative step is valid, W_n = 4 without it is not
    np.testing.assert_allclose(bl.cooperative_attention(q, k, v, warps_n=1, cooperative=False), truth,
                               rtol=0, atol=1e-12)
    naive = bl.cooperative_attention(q, k, v, warps_n=4, tile_n=64, cooperative=False)
    if N > 16:                                                          # at least two warps hold keys
        assert np.max(np.abs(naive - truth)) > 1e-2
    else:
        np.testing.assert_allclose(naive, truth, rtol=0, atol=1e-12)


def test_cooperative_softmax_bad_input():
    q, k = np.zeros((2, 8)), np.zeros((5, 8))
    with pytest.raises(ValueError, match="multiple of warps_n"):
        bl.cooperative_attention(q, k, k, warps_n=3, tile_n=64)
    with pytest.raises(ValueError, match="expected q"):
        bl.cooperative_attention(q, k[:0], k[:0])
    with pytest.raises(ValueError, match="tile_n"):
        bl.cooperative_attention(q, k, k, tile_n=0)


# ---------------------------------------------------------------------------------------------------
# the cache (V-B(1)): residual + pages


def tokens(B=2, H=2, T=300, D=64, seed=10):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[..., 5] *= 10
    return k, rng.standard_normal((B, H, T, D)).astype(np.float32)


def same_state(a, b):
    assert (a.length, a.next_page, a.shape) == (b.length, b.next_page, b.shape)
    for name, x in a.arrays().items():
        assert np.array_equal(x, b.arrays()[name]), name


@pytest.mark.parametrize("cfg", SMALL, ids=IDS)
@pytest.mark.parametrize("chunks", [(300,), (1,) * 70 + (230,), (63, 1, 64, 100, 72)])
def test_streaming_equals_bulk(cfg, chunks):
    K, V = tokens()
    bulk = bd.append(cfg, bd.init(cfg, 2, 2, 64), K, V)
    st, t = bd.init(cfg, 2, 2, 64), 0
    for n in chunks:
        bd.append(cfg, st, K[:, :, t:t + n], V[:, :, t:t + n])
        t += n
    same_state(st, bulk)


@pytest.mark.parametrize("cfg", SMALL, ids=IDS)
def test_state_holds_the_partition(cfg):
    K, V = tokens()
    st = bd.append(cfg, bd.init(cfg, 2, 2, 64), K, V)
    n_p, res = bd.partition(300, cfg.n_r)
    assert st.length == 300 and st.next_page == 2 * (n_p // cfg.n_r)
    assert np.array_equal(st.res_k[:, :, :res], K[:, :, n_p:].astype(np.float16))
    assert not st.res_k[:, :, res:].any() and not st.res_v[:, :, res:].any()
    for b in range(2):
        for j in range(n_p // cfg.n_r):
            pid = st.table[b, j]
            kw, kp = bd.pack_keys(cfg, K[b, :, j * cfg.n_r:(j + 1) * cfg.n_r].astype(np.float16))
            assert np.array_equal(st.k_words[pid], kw) and np.array_equal(st.k_params[pid], kp)
        assert (st.table[b, n_p // cfg.n_r:] == -1).all()
    Kh, Vh = bd.dequantize(cfg, st)
    assert Kh.shape == K.shape and np.array_equal(Kh[:, :, n_p:], K[:, :, n_p:].astype(np.float16))


@pytest.mark.parametrize("cfg", SMALL, ids=IDS)
def test_dequantization_error_is_within_half_a_step(cfg):
    K, V = tokens(T=cfg.n_r * 2)
    st = bd.append(cfg, bd.init(cfg, 2, 2, 64), K, V)
    Kh, Vh = bd.dequantize(cfg, st)
    K16 = K.astype(np.float16).astype(np.float64)
    for b in range(2):
        for j in range(2):
            kp = st.k_params[st.table[b, j]]
            axis = -2 if cfg.k_mode == "channel" else -1
            step = np.repeat(kp[..., 0].astype(np.float64), cfg.k_group, axis=axis)
            blk = slice(j * cfg.n_r, (j + 1) * cfg.n_r)
            err = np.abs(Kh[b, :, blk] - K16[b, :, blk])
            # half a step, plus the fp16 rounding of the stored min and of the dequantized value
            mag = np.abs(K16[b, :, blk]) + step
            assert (err <= step / 2 + mag * 2.0**-10).all()


@pytest.mark.parametrize("cfg", SMALL, ids=IDS)
def test_decode_attention_equals_dequantize_then_attention(cfg):
    K, V = tokens()
    st = bd.append(cfg, bd.init(cfg, 2, 2, 64), K, V)
    q = np.random.default_rng(11).standard_normal((2, 8, 2, 64)).astype(np.float32)
    out, lse = bd.decode_attention(cfg, st, q)
    truth, lse64 = bd.decode_attention(cfg, st, q.astype(np.float64))
    Kh, Vh = bd.dequantize(cfg, st)
    other = attention.attention(q, Kh[:, :, ::-1], Vh[:, :, ::-1])
    assert_tolerance_rule(out, other, truth)
    np.testing.assert_allclose(lse, lse64, rtol=1e-5)
    np.testing.assert_allclose(truth, attention.attention(q.astype(np.float64), Kh.astype(np.float64),
                                                          Vh.astype(np.float64)), atol=1e-12)


def test_bad_input_leaves_state_unchanged():
    cfg = SMALL[1]
    K, V = tokens(T=cfg.n_r + 20)
    st = bd.append(cfg, bd.init(cfg, 2, 2, 64), K, V)
    before = st.copy()
    k, v = K[:, :, :4], V[:, :, :4]
    nan = k.copy()
    nan[1, 1, 2, 3] = np.nan
    big = k.copy()
    big[0, 0, 0, :] = 7e4
    bad = [((k[:, :1], v[:, :1]), ValueError, "H_kv=2"), ((k[..., :32], v[..., :32]), ValueError, "D=64"),
           ((k.astype(np.float64), v.astype(np.float64)), TypeError, "float64"),
           ((k, v[:, :, :3]), ValueError, "same shape"),
           ((np.zeros((2, 2, cfg.max_tokens, 64), np.float32),) * 2, ValueError, "capacity"),
           ((nan, v), ValueError, "NaN"), ((big, v), ValueError, "overflows float16")]
    for (kk, vv), err, match in bad:
        with pytest.raises(err, match=match):
            bd.append(cfg, st, kk, vv)
        same_state(st, before)
    with pytest.raises(ValueError, match="H_q"):
        bd.decode_attention(cfg, st, np.zeros((2, 3, 1, 64), np.float32))
    with pytest.raises(ValueError, match="empty"):
        bd.decode_attention(cfg, bd.init(cfg, 2, 2, 64), np.zeros((2, 4, 1, 64), np.float32))
    with pytest.raises(ValueError, match="empty"):
        bd.dequantize(cfg, bd.init(cfg, 2, 2, 64))


def test_capacity_fills_exactly():
    cfg = small(4)
    K, V = tokens(B=1, H=1, T=cfg.max_tokens, D=32)
    st = bd.append(cfg, bd.init(cfg, 1, 1, 32), K, V)
    assert st.next_page == cfg.max_tokens // cfg.n_r and (st.table[0] >= 0).all()
    with pytest.raises(ValueError, match="capacity"):
        bd.append(cfg, st, K[:, :, :1], V[:, :, :1])


# ---------------------------------------------------------------------------------------------------
# issue 36: bad arguments raise a clear error naming them


@pytest.mark.parametrize("cfg", SMALL, ids=IDS)
def test_page_functions_check_their_arguments(cfg):
    k = page(cfg)
    kw, kp = bd.pack_keys(cfg, k)
    vw, vp = bd.pack_values(cfg, k)
    for bad in ("bogus", 3, {}, None):
        for call in (lambda c: bd.pack_keys(c, k), lambda c: bd.pack_values(c, k), lambda c: bd.unpack_keys(c, kw),
                     lambda c: bd.unpack_values(c, vw), lambda c: bd.dequantize_page(c, kw, kp, vw, vp),
                     lambda c: bl.residual_kernel_keys(c, k), lambda c: bl.value_fragments(c, vw, vp, 0, 0)):
            with pytest.raises(TypeError, match="cfg must be a BitDecodingConfig"):
                call(bad)
    bad_params = [(lambda p: p[..., :1], ValueError), (lambda p: None, TypeError),
                  (lambda p: p.astype(np.int32), TypeError), (lambda p: p.astype(np.float64), TypeError)]
    for make_bad, err in bad_params:
        with pytest.raises(err, match="k_params"):
            bd.dequantize_page(cfg, kw, make_bad(kp), vw, vp)
        with pytest.raises(err, match="v_params"):
            bd.dequantize_page(cfg, kw, kp, vw, make_bad(vp))
    with pytest.raises(ValueError, match="v_words"):
        bd.dequantize_page(cfg, kw, kp, vw[:-1], vp)
    K, V = bd.dequantize_page(cfg, kw, kp.astype(np.float32), vw, vp)      # fp32 pairs hold the same values
    np.testing.assert_array_equal(K, bd.dequantize_page(cfg, kw, kp, vw, vp)[0])
    with pytest.raises(ValueError, match="w must be"):
        bl.key_fragments(cfg, kw, kp, cfg.warps_n, 0, 0)
    with pytest.raises(TypeError, match="kk must be"):
        bl.key_fragments(cfg, kw, kp, 0, 0, True)
    with pytest.raises(ValueError, match="j must be"):
        bl.value_fragments(cfg, vw, vp, 0, k.shape[-1] // 8)
