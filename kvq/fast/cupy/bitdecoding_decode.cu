// kvq CUDA kernel: BitDecoding's fused decode attention on the tensor cores (Du et al., sections IV and
// V: the Packing Kernel of Fig. 7), reading the induced low-bit layout of kvq/reference/bitdecoding.py
// straight from the page pool. The FP16 residual is attended beside it by attention.cu's split kernel
// and all partials are merged by log-sum-exp (attn_merge); see bitdecoding_decode.py.
//
// bd_decode<BITS, KC, NW, M16>: grid (splits, H_kv * query tiles, B), NW warps (the cache's W_n). Block
// (split, (kv head hk, query tile qt), b) attends the 16 query rows qt*16 .. of kv head hk (the query
// transformation of V-A: row r -> query head hk * G_q + r / T_q, token r % T_q; rows past G_q T_q are
// zero) over pages [split * pps, min(split * pps + pps, n_pages)) of sequence b, page ids from the table.
// Every page of N_r = 8 NW R tokens (R = 16 / BITS) is shared by the block's warps: warp w owns its TW
// = 8 R tokens [w TW, (w + 1) TW) (Fig. 6), exactly the slice its Residual Kernel warp packed:
//   1. cp.async (one group per page and warp, STAGES pages in flight) of the warp's key words (rows
//      8 w .. 8 w + 7 of the (8 NW, D) words), value words (its TW rows of (N_r, D / R)) and the half2
//      params it needs (KC: its k_group row (D, 2); KT: its tokens' (scale, min); values: its tokens');
//   2. S = Q K^T on the tensor cores, Q the A operand (m16: the query rows; held in registers), K^T the
//      B operand: `ldmatrix.x4` (non-transposed) of the key words gives lane (g, t) = (lane / 4, lane % 4)
//      the words of channels (c, c + 1) = (16 kk + 2t, + 1) (and + 8) of token row g, whose slot i is the
//      code of token 8 i + g: after unpacking, exactly the B fragment of n-tile i (tokens 8 i .. 8 i + 7);
//      the codes leave the words as fp16 two at a time (0x6400 magic + lop3, codes_field_h2: no shifts
//      for slots inside the fp16 significand, one shift for the others) and are dequantized in the
//      registers (below). Each k-step (16 channels) sums from zero accumulators, the 8 k-step sums added
//      pairwise in fp32 (as attn_mma_body); the softmax takes them times scale log2(e);
//   3. the cooperative softmax of Algorithm 1: each warp's row maxima over its tokens meet in shared
//      memory (one barrier per page), so all NW warps use the page-wide running max m (the naive
//      per-warp softmax of Table III is wrong: kvq/reference/bitdecoding_lanes.py); P = 2^(s - m) in
//      fp16 (the A operand of P V straight from the score accumulators), l and O rescaled by 2^(m_old - m);
//   4. O += P V: `ldmatrix.x4.trans` of the value words gives lane (g, t) the words (tokens 2t, 2t + 1)
//      (and + 8) of word column 8 u + g, whose slot i is channel 8 (u R + i) + g: the B fragment of
//      channel n-tile u R + i after unpacking and dequantization.
// At the end the warps' (l, O) are summed (all warps share the max: a plain sum) and written as the fp32
// partial `split` of attention.cu's layout, lse in natural units: fp32(S_max * scale) + ln l, S_max the
// raw dot-product max (the scores are scaled to log2 units only for the exponentials).
//
// Dequantization (contract rule 3: fp16(fp32(code) * scale + mn)): the product of a code (<= 15) and an
// fp16 scale is exact in fp32, so the contract's value is fp16 of the fp32-rounded exact sum c s + mn;
// fma.rn.f16x2 (c, s, mn) rounds the exact sum once. The two agree whenever c s + mn is exactly a float:
// with E(x) = max(floor(log2 |x|), -14) (fp16 numbers are multiples of 2^(E - 10) below 2^(E + 1)), c s
// (< 2^(E_s + 5)) plus mn spans at most 24 bits when E_s - 8 <= E_m <= E_s + 12, or when s or mn is 0.
// The contract saturates fp16 at +-65504 (rule 3) where the fma would round to inf, so a pair also needs
// E_s <= 10 and E_m <= 14 (then |c s + mn| < 65504). A warp takes the one-fma path for a page's keys
// (and, separately, its values) when every param pair it uses satisfies that (bd_unsafe2, the vote
// __any_sync), else the exact fp32 path (cvt, fp32 multiply and add, sat_f16, cvt.rn): either way the fp16
// operands are the reference's bits.
//
// Supports D = 128, values with one group per token (v_group = D), keys channel-wise with k_group a
// multiple of the warp's TW tokens (one group row per warp slice) or tensor-wise with k_group = D, fp16 q;
// bitdecoding_decode.py routes the other configurations to the dequantize-then-attend path.
// Dynamic shared memory: NW * STAGES * SLOT bytes (bd_slot_bytes); the combine area [NW][16][128] fp32
// reuses it.
#include "mma.cuh"

template <int V>
struct KvqInt {
    static constexpr int value = V;
};

// f(KvqInt<I>{}) for I = I0 .. N - 1 (a loop whose index is a compile-time constant in the body)
template <int I, int N, class F>
__device__ __forceinline__ void bd_for(F&& f) {
    if constexpr (I < N) {
        f(KvqInt<I>{});
        bd_for<I + 1, N>(f);
    }
}

// the half2 of exact codes in slot I of the two 16-bit words of x (slot I: bits [BITS I, BITS I + BITS)):
// codes_field_h2 for slots inside the fp16 significand, after one shift for the others
template <int BITS, int I>
__device__ __forceinline__ u32 bd_slot(u32 x) {
    constexpr int SH = BITS == 2 ? (I >= 5 ? 10 : 0) : (I >= 2 ? 8 : 0);
    return codes_field_h2<BITS, I - SH / BITS>(x >> SH);
}

// nonzero where a half of (s2, m2) may make fma.rn.f16x2 (c, s, m) differ from the contract's
// sat_f16(fp32(c s) + m) rounded to fp16: outside the exponent rule, or where c s + m (c <= 15) may leave
// the fp16 range (the fma would round it to inf, the contract saturates): E_s > 10 or E_m > 14 (biased
// 25 / 29). Below both, |c s + m| <= 15 * 2047 + 32752 = 63457 < 65504.
__device__ __forceinline__ u32 bd_unsafe2(u32 s2, u32 m2) {
    const u32 es = __vmaxu2((s2 >> 10) & 0x001f001fu, 0x00010001u);      // biased E (subnormals: as 1)
    const u32 em = __vmaxu2((m2 >> 10) & 0x001f001fu, 0x00010001u);
    const u32 ok = __vcmpgeu2(em + 0x00080008u, es) & __vcmpgeu2(es + 0x000c000cu, em);
    const u32 zero = __vcmpeq2(s2 & 0x7fff7fffu, 0u) | __vcmpeq2(m2 & 0x7fff7fffu, 0u);
    const u32 big = __vcmpgtu2(es, 0x00190019u) | __vcmpgtu2(em, 0x001d001du);   // may overflow fp16
    return ~(ok | zero) | big;
}

// fp16(c s + m) of a half2 of codes: one fma.rn.f16x2 (EXACT false: only where bd_unsafe2 is 0), or the
// contract's fp32 multiply, fp32 add, saturation (sat_f16) and one rounding to fp16
template <bool EXACT>
__device__ __forceinline__ u32 bd_deq(u32 c2, u32 s2, u32 m2) {
    if constexpr (!EXACT) {
        return hfma2(c2, s2, m2);
    } else {
        float c0, c1, s0, s1, m0, m1;
        h2_to_f2(c2, c0, c1);
        h2_to_f2(s2, s0, s1);
        h2_to_f2(m2, m0, m1);
        return f2_to_h2(sat_f16(__fadd_rn(__fmul_rn(c0, s0), m0)), sat_f16(__fadd_rn(__fmul_rn(c1, s1), m1)));
    }
}

// (scale, min) of two half2 params a = (s_a, m_a), b = (s_b, m_b) -> s2 = (s_a, s_b), m2 = (m_a, m_b)
__device__ __forceinline__ void bd_params2(u32 a, u32 b, u32& s2, u32& m2) {
    s2 = __byte_perm(a, b, 0x5410);
    m2 = __byte_perm(a, b, 0x7632);
}

#define BD_D 128
#define BD_QT 16

template <int BITS, int NW>
struct BdShape {
    static constexpr int D = BD_D, R = 16 / BITS, TW = 8 * R, NR = TW * NW;
    static constexpr int KROW = 2 * D + 16;          // bytes per key-word row in shared memory (272: the 8 rows
                                                     // of an ldmatrix matrix in 8 bank groups)
    static constexpr int VRB = 2 * D / R;            // bytes of a value-word row (32 or 64)
    static constexpr int VROW = VRB + 16;            // padded likewise (48 or 80)
    static constexpr int KW_B = 8 * KROW, VW_B = TW * VROW, VP_B = TW * 4;
    static constexpr int STAGES = NW <= 4 ? 3 : 2;
};

template <int BITS, bool KC, int NW>
struct BdSlot {
    typedef BdShape<BITS, NW> S;
    static constexpr int KP_B = KC ? S::D * 4 : S::TW * 4;   // KC: the warp's group row; KT: its tokens'
    static constexpr int BYTES = S::KW_B + S::VW_B + KP_B + S::VP_B;
    static_assert(BYTES % 16 == 0, "16-byte cp.async chunks");
};

// Registers: up to 255 a thread (2 blocks of 4 warps per SM). Capping them at 168 (3 blocks) spilled and
// was slower on the H100 (8 x 128K, g_q = 1: KC2 610 / KC4 703 us against 519 / 652 us uncapped;
// lab/2026-11-24-bitdecoding/results/h100-bitdecoding-decode).
template <int BITS, bool KC, int NW, bool M16>
__global__ void __launch_bounds__(NW * 32)
bd_decode(const u16* __restrict__ q, i64 sq_b, i64 sq_h, i64 sq_t, const u16* __restrict__ kw,
          const u16* __restrict__ kp, const u16* __restrict__ vw, const u16* __restrict__ vp,
          const int* __restrict__ table, int tstride, int n_pages, int pps, int k_group,
          float* __restrict__ o_part, float* __restrict__ lse_part, int B, int Hq, int Hkv, int Tq, int n_qt,
          float sc, float qk_scale) {
    typedef BdShape<BITS, NW> S;
    constexpr int D = S::D, R = S::R, TW = S::TW, NR = S::NR, QT = BD_QT, STAGES = S::STAGES;
    constexpr int SLOT = BdSlot<BITS, KC, NW>::BYTES, KP_B = BdSlot<BITS, KC, NW>::KP_B;
    extern __shared__ u32x4 bd_smem[];
    __shared__ float s_red[2][NW][QT];
    __shared__ float s_l[NW][QT];
    __shared__ i64 s_prow[QT];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x, hk = blockIdx.y / n_qt, qt = blockIdx.y - hk * n_qt, b = blockIdx.z;
    const int Gq = Hq / Hkv, r0 = qt * QT, nq = kvq_min(QT, Gq * Tq - r0);
    const int p0 = split * pps, np = kvq_max_i(kvq_min(p0 + pps, n_pages) - p0, 0);

    // A fragments of Q for the 8 k-steps: rows g (aq[kk][0], [2]) and g + 8 ([1], [3]; zero unless M16),
    // channels 16 kk + 2t, + 1 ([0], [1]) and 16 kk + 8 + 2t, + 1 ([2], [3])
    u32 aq[8][4];
    {
        auto row = [&](int r) -> const u16* {
            if (r >= nq) return nullptr;
            const int rr = r0 + r, h = hk * Gq + rr / Tq, tq = rr - (rr / Tq) * Tq;
            return q + (i64)b * sq_b + (i64)h * sq_h + (i64)tq * sq_t;
        };
        const u16* qa = row(g);
        const u16* qb = M16 ? row(g + 8) : nullptr;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int c = 16 * kk + 2 * t + 8 * j;
                aq[kk][2 * j] = qa ? (u32)qa[c] | ((u32)qa[c + 1] << 16) : 0u;
                aq[kk][2 * j + 1] = M16 && qb ? (u32)qb[c] | ((u32)qb[c + 1] << 16) : 0u;
            }
    }

    u8* wbase = reinterpret_cast<u8*>(bd_smem) + warp * (STAGES * SLOT);
    // the warp's bytes of page j of the split into stage s: one cp.async group
    auto stage = [&](int j, int s) {
        const int pid = table[(i64)b * tstride + j];
        const i64 ph = (i64)pid * Hkv + hk;
        u8* d = wbase + s * SLOT;
        const u8* ks = reinterpret_cast<const u8*>(kw + (ph * (8 * NW) + 8 * warp) * D);
#pragma unroll
        for (int c = lane; c < 8 * (2 * D / 16); c += 32)                 // 8 rows of 16 chunks
            p_cp_async16(d + (c >> 4) * S::KROW + (c & 15) * 16, ks + c * 16);
        constexpr int VCH = S::VRB / 16;
        const u8* vs = reinterpret_cast<const u8*>(vw + (ph * NR + warp * TW) * (D / R));
        u8* dv = d + S::KW_B;
#pragma unroll
        for (int c = lane; c < TW * VCH; c += 32) p_cp_async16(dv + (c / VCH) * S::VROW + (c % VCH) * 16, vs + c * 16);
        const u8* kps = KC ? reinterpret_cast<const u8*>(kp + (ph * (NR / k_group) + (warp * TW) / k_group) * D * 2)
                           : reinterpret_cast<const u8*>(kp + (ph * NR + warp * TW) * 2);
        u8* dk = dv + S::VW_B;
        for (int c = lane; c < KP_B / 16; c += 32) p_cp_async16(dk + c * 16, kps + c * 16);
        const u8* vps = reinterpret_cast<const u8*>(vp + (ph * NR + warp * TW) * 2);
        u8* dvp = dk + KP_B;
        if (lane < S::VP_B / 16) p_cp_async16(dvp + lane * 16, vps + lane * 16);
    };

    // rows g, g + 8: the running max of the raw dot products (natural units, before the scale), l
    float m0 = -KVQ_INF, m1 = -KVQ_INF, l0 = 0.0f, l1 = 0.0f;
    float O[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) O[n][0] = O[n][1] = O[n][2] = O[n][3] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < np) stage(p0 + s, s);
        p_commit();
    }
    for (int pi = 0; pi < np; ++pi) {
        p_wait<STAGES - 2>();
        __syncwarp();
        const u8* d = wbase + (pi % STAGES) * SLOT;
        const u8* dv = d + S::KW_B;
        const u8* dk = dv + S::VW_B;
        const u8* dvp = dk + KP_B;

        // ---- which dequantization: one vote per page over every param pair the warp reads (bd_unsafe2)
        u32 kun = 0u, vun = 0u;
        {
            if (lane < KP_B / 16) {                // KC: channels 4 lane .. + 3; KT: tokens 4 lane .. + 3
                const uint4 p = *reinterpret_cast<const uint4*>(dk + 16 * lane);
                u32 s2, m2;
                bd_params2(p.x, p.y, s2, m2);
                kun |= bd_unsafe2(s2, m2);
                bd_params2(p.z, p.w, s2, m2);
                kun |= bd_unsafe2(s2, m2);
            }
            if (lane < S::VP_B / 16) {             // values: tokens 4 lane .. + 3
                const uint4 p = *reinterpret_cast<const uint4*>(dvp + 16 * lane);
                u32 s2, m2;
                bd_params2(p.x, p.y, s2, m2);
                vun |= bd_unsafe2(s2, m2);
                bd_params2(p.z, p.w, s2, m2);
                vun |= bd_unsafe2(s2, m2);
            }
        }
        const bool kex = __any_sync(KVQ_FULL_MASK, kun != 0u), vex = __any_sync(KVQ_FULL_MASK, vun != 0u);

        // ---- S = Q K^T over the warp's R n-tiles, 32 channels (two k-steps) at a time; each k-step from
        // zero accumulators, summed ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) in fp32
        float Sc[R][4], Sh[R][4];
        auto scores = [&](auto EX) {
            constexpr bool E = decltype(EX)::value;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                u32 kr[4];                         // matrix j: words of channels 32 s + 8 j + 2t, + 1 of row g
                ldsm_x4<false>(kr, d + (lane & 7) * S::KROW + (64 * s + 16 * (lane >> 3)));
                u32 ks2[4], km2[4];                // KC: their (scale, min) pairs
                if constexpr (KC) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const uint2 p = *reinterpret_cast<const uint2*>(dk + 4 * (32 * s + 8 * j + 2 * t));
                        bd_params2(p.x, p.y, ks2[j], km2[j]);
                    }
                }
                bd_for<0, R>([&](auto I_) {
                    constexpr int i = decltype(I_)::value;
                    u32 ts2 = 0u, tm2 = 0u;        // KT: token 8 i + g's (scale, min) in both halves
                    if constexpr (!KC) {
                        const u32 p = *reinterpret_cast<const u32*>(dk + 4 * (8 * i + g));
                        bd_params2(p, p, ts2, tm2);
                    }
                    u32 bb[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        bb[j] = bd_deq<E>(bd_slot<BITS, i>(kr[j]), KC ? ks2[j] : ts2, KC ? km2[j] : tm2);
                    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma16816(x, aq[2 * s], bb[0], bb[1]);
                    mma16816(y, aq[2 * s + 1], bb[2], bb[3]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (!M16 && e >= 2) continue;
                        const float pe = x[e] + y[e];
                        if (s == 0) Sc[i][e] = pe;
                        else if (s == 1) Sc[i][e] += pe;
                        else if (s == 2) Sh[i][e] = pe;
                        else Sc[i][e] = Sc[i][e] + (Sh[i][e] + pe);
                    }
                });
            }
        };
        if (kex) scores(KvqBool<true>{});
        else scores(KvqBool<false>{});

        // ---- the cooperative softmax (Algorithm 1): the page-wide row max through shared memory
        float x0 = -KVQ_INF, x1 = -KVQ_INF;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            x0 = fmaxf(x0, fmaxf(Sc[i][0], Sc[i][1]));
            if (M16) x1 = fmaxf(x1, fmaxf(Sc[i][2], Sc[i][3]));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(KVQ_FULL_MASK, x0, off));
            if (M16) x1 = fmaxf(x1, __shfl_xor_sync(KVQ_FULL_MASK, x1, off));
        }
        if constexpr (NW > 1) {
            if (t == 0) {
                s_red[pi & 1][warp][g] = x0;
                if (M16) s_red[pi & 1][warp][g + 8] = x1;
            }
            __syncthreads();
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                x0 = fmaxf(x0, s_red[pi & 1][w][g]);
                if (M16) x1 = fmaxf(x1, s_red[pi & 1][w][g + 8]);
            }
        }
        // s = S * scale * log2(e) (log2 units) from the raw S: the max of the scaled scores is the scaled max
        const float r0n = fmaxf(m0, x0), r1n = M16 ? fmaxf(m1, x1) : 0.0f;  // finite: a page has tokens
        const float n0 = __fmul_rn(r0n, qk_scale), n1 = __fmul_rn(r1n, qk_scale);
        const float a0 = m0 == r0n ? 1.0f : ex2(__fmul_rn(m0, qk_scale) - n0);
        const float a1 = M16 ? (m1 == r1n ? 1.0f : ex2(__fmul_rn(m1, qk_scale) - n1)) : 0.0f;
        m0 = r0n;
        m1 = r1n;
        l0 *= a0;
        l1 *= a1;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            O[n][0] *= a0;
            O[n][1] *= a0;
            O[n][2] *= a1;
            O[n][3] *= a1;
        }

        // ---- O += P V, one k-step of 16 tokens at a time
#pragma unroll
        for (int ksx = 0; ksx < R / 2; ++ksx) {
            u32 ap[4];
            {
                float p[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    p[h][0] = ex2(__fmul_rn(Sc[2 * ksx + h][0], qk_scale) - n0);
                    p[h][1] = ex2(__fmul_rn(Sc[2 * ksx + h][1], qk_scale) - n0);
                    p[h][2] = M16 ? ex2(__fmul_rn(Sc[2 * ksx + h][2], qk_scale) - n1) : 0.0f;
                    p[h][3] = M16 ? ex2(__fmul_rn(Sc[2 * ksx + h][3], qk_scale) - n1) : 0.0f;
                    l0 += p[h][0] + p[h][1];
                    if (M16) l1 += p[h][2] + p[h][3];
                }
                ap[0] = f2_to_h2(p[0][0], p[0][1]);         // row g, tokens 16 k + 2t, + 1
                ap[1] = M16 ? f2_to_h2(p[0][2], p[0][3]) : 0u;
                ap[2] = f2_to_h2(p[1][0], p[1][1]);         // row g, tokens 16 k + 8 + 2t, + 1
                ap[3] = M16 ? f2_to_h2(p[1][2], p[1][3]) : 0u;
            }
            // value params of tokens 16 k + 2t, + 1 (b0) and 16 k + 8 + 2t, + 1 (b1)
            u32 vs2[2], vm2[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint2 p = *reinterpret_cast<const uint2*>(dvp + 4 * (16 * ksx + 8 * h + 2 * t));
                bd_params2(p.x, p.y, vs2[h], vm2[h]);
            }
            auto pv = [&](auto EX) {
                constexpr bool E = decltype(EX)::value;
#pragma unroll
                for (int u2 = 0; u2 < 16 / R; u2 += 2) {   // word-column blocks u2, u2 + 1 (8 words each)
                    u32 v[4];
                    ldsm_x4<true>(v, dv + (16 * ksx + (lane & 7) + 8 * ((lane >> 3) & 1)) * S::VROW
                                          + 16 * (u2 + (lane >> 4)));
                    bd_for<0, R>([&](auto I_) {
                        constexpr int i = decltype(I_)::value;
#pragma unroll
                        for (int uu = 0; uu < 2; ++uu) {
                            const u32 b0 = bd_deq<E>(bd_slot<BITS, i>(v[2 * uu]), vs2[0], vm2[0]);
                            const u32 b1 = bd_deq<E>(bd_slot<BITS, i>(v[2 * uu + 1]), vs2[1], vm2[1]);
                            mma16816(O[(u2 + uu) * R + i], ap, b0, b1);
                        }
                    });
                }
            };
            if (vex) pv(KvqBool<true>{});
            else pv(KvqBool<false>{});
        }
        __syncwarp();                                   // the stage is read: the next copies may overwrite it
        if (pi + STAGES - 1 < np) stage(p0 + pi + STAGES - 1, (pi + STAGES - 1) % STAGES);
        p_commit();
    }
    p_wait<0>();

    // ---- the warps' (m, l, O) -> one partial
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l0 += __shfl_xor_sync(KVQ_FULL_MASK, l0, off);
        if (M16) l1 += __shfl_xor_sync(KVQ_FULL_MASK, l1, off);
    }
    __syncthreads();                                    // every warp is done with its stages
    float* cacc = reinterpret_cast<float*>(bd_smem);   // [NW][QT][D]
    float* cw = cacc + warp * QT * D;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const int c = 8 * n + 2 * t;
        cw[g * D + c] = O[n][0];
        cw[g * D + c + 1] = O[n][1];
        if (M16) {
            cw[(g + 8) * D + c] = O[n][2];
            cw[(g + 8) * D + c + 1] = O[n][3];
        }
    }
    if (t == 0) {
        s_l[warp][g] = l0;
        if (M16) s_l[warp][g + 8] = l1;
    }
    // the row's raw max is every warp's (the cooperative softmax): warp 0's lanes t = 0 hold it
    __shared__ float s_mx[QT];
    if (warp == 0 && t == 0) {
        s_mx[g] = np ? m0 : -KVQ_INF;
        if (M16) s_mx[g + 8] = np ? m1 : -KVQ_INF;
    }
    __syncthreads();
    // the warps share the max: L = sum_w l_w (in warp order), o = sum_w O_w / L; lse in natural units
    // straight from the raw max, fp32(S_max * scale) + ln L (a base-2 max times ln 2 carried the rounding
    // of scale * log2(e) and of ln 2 into the lse, several fp32 ulps at |lse| ~ 5)
    if (tid < nq) {
        const int qi = tid;
        float L = 0.0f;
        for (int w = 0; w < NW; ++w) L += s_l[w][qi];
        s_l[0][qi] = L;
        const int r = r0 + qi, h = hk * Gq + r / Tq, tq = r - (r / Tq) * Tq;
        const i64 prow = (((i64)split * B + b) * Hq + h) * Tq + tq;
        s_prow[qi] = prow;
        lse_part[prow] = L > 0.0f ? __fmul_rn(s_mx[qi], sc) + logf(L) : -KVQ_INF;
    }
    __syncthreads();
    for (int idx = tid; idx < QT * D; idx += NW * 32) {
        const int qi = idx / D, dd = idx - qi * D;
        if (qi >= nq) continue;
        float A = 0.0f;
        for (int w = 0; w < NW; ++w) A += cacc[(w * QT + qi) * D + dd];
        const float L = s_l[0][qi];
        o_part[s_prow[qi] * D + dd] = L > 0.0f ? A / L : 0.0f;
    }
}
