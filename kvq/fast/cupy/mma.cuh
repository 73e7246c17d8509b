// kvq CUDA device helpers of the tensor-core decode kernels (paged.cu, oscar_decode.cu): cp.async
// page staging, fp16 splitting and the exact fp16 two-product, mma.sync m16n8k16 with the 2-bit code
// unpacking that feeds it (0x6400 magic, lop3 + fma.f16x2), movmatrix, warp reductions.
// The loader (_loader.py) pastes this file (and common.cuh) in place of `#include "mma.cuh"`.
#ifndef KVQ_MMA_CUH
#define KVQ_MMA_CUH
#include "common.cuh"

__device__ __forceinline__ u32 p_smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

__device__ __forceinline__ void p_cp_async16(void* dst_smem, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(p_smem_addr(dst_smem)), "l"(src) : "memory");
}

__device__ __forceinline__ void p_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void p_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ int kvq_max_i(int a, int b) { return a > b ? a : b; }

// Copy nbytes (a multiple of 16) from global src (16-byte aligned) to shared dst, the warp's lanes
// taking 16-byte chunks in turn.
__device__ __forceinline__ void warp_copy(u8* dst, const u8* src, int nbytes, int lane) {
    for (int i = lane * 16; i < nbytes; i += 32 * 16) p_cp_async16(dst + i, src + i);
}

// a compile-time flag as a value (a generic lambda's argument: KvqBool<true>{})
template <bool V>
struct KvqBool {
    static constexpr bool value = V;
};

// One 16-byte cp.async from src + OFF to the shared address dst + OFF: the offset is an immediate of both
// addresses, so a run of copies needs no address arithmetic between them.
template <int OFF>
__device__ __forceinline__ void p_cp_async16_at(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;\n" ::"r"(dst), "l"(src), "n"(OFF) : "memory");
}

// Copies K .. N - 1 of a warp's run (copy k: 16 bytes at 512 k from this lane's dst / src); SWZ: copy k
// lands at chunk lane ^ (k & 7) of its 512-byte round, i.e. chunk i of the run at i ^ ((i >> 5) & 7), so
// that the 8 rows of 512 bytes a tensor-core kernel's lanes g = 0..7 read at one time fall in 8 different
// bank groups.
template <int K, int N, bool SWZ>
__device__ __forceinline__ void cp_rounds(u32 d, const u8* s, int lane) {
    if constexpr (K < N) {
        if constexpr (SWZ) p_cp_async16_at<512 * K>(d + 16 * ((lane ^ (K & 7)) - lane), s);
        else p_cp_async16_at<512 * K>(d, s);
        cp_rounds<K + 1, N, SWZ>(d, s, lane);
    }
}

// warp_copy (SWZ: XOR-swizzled as in cp_rounds) of a compile-time NBYTES, every copy one instruction: the
// lanes' shared and global addresses are worked out once; the last, partial round (NBYTES % 512) by the
// lanes it needs.
template <int NBYTES, bool SWZ = false>
__device__ __forceinline__ void warp_copy_c(u8* dst, const u8* src, int lane) {
    static_assert(NBYTES % 16 == 0, "16-byte chunks");
    static_assert(!SWZ || (NBYTES % 512 == 0 && NBYTES <= 4096), "swizzled runs: whole rounds, up to 4096 bytes");
    constexpr int FULL = NBYTES / 512, REST = NBYTES % 512;
    const u32 d = p_smem_addr(dst) + 16 * lane;
    const u8* s = src + 16 * lane;
    cp_rounds<0, FULL, SWZ>(d, s, lane);
    if constexpr (REST != 0) {
        if (16 * lane < REST) cp_rounds<FULL, FULL + 1, SWZ>(d, s, lane);
    }
}


// (lo, hi) -> one half2 register, lo in bits 0-15 (the element order of the mma fragments)
__device__ __forceinline__ u32 f2_to_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void h2_to_f2(u32 h, float& lo, float& hi) {
    asm("{.reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}"
        : "=f"(lo), "=f"(hi) : "r"(h));
}

// x0, x1 as hi = fp16(x) and lo = fp16((x - hi) * 2^11): x = hi + 2^-11 lo to about 22 bits
__device__ __forceinline__ void split2(float x0, float x1, u32& hi, u32& lo) {
    hi = f2_to_h2(x0, x1);
    float h0, h1;
    h2_to_f2(hi, h0, h1);
    lo = f2_to_h2((x0 - h0) * 2048.0f, (x1 - h1) * 2048.0f);
}

// d += a b: mma.sync m16n8k16, f16 inputs, f32 accumulators (a: 4 registers, b: 2)
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b: mma.sync m16n8k32, u8 a (4 registers of 4 bytes), s8 b (2 registers), s32 accumulators: exact
// integer products and sums. Fragments (thread (g, t) = (lane / 4, lane % 4)): a[0] row g, columns 4t ..
// 4t + 3 (byte i: column 4t + i), a[1] row g + 8, same columns, a[2] row g, columns 16 + 4t .. 19 + 4t, a[3]
// row g + 8 likewise; b[0] rows (k) 4t .. 4t + 3 of column g, b[1] rows 16 + 4t ..; c as mma16816's.
__device__ __forceinline__ void imma16832(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// byte BB of w0 to byte 0 and byte BB of w1 to byte 2 (bytes 1 and 3: don't care)
template <int BB>
__device__ __forceinline__ u32 byte_pair(u32 w0, u32 w1) {
    return __byte_perm(w0, w1, BB | (BB << 4) | ((4 + BB) << 8) | ((4 + BB) << 12));
}

// the B-bit fields I of bytes 0 and 2 of x as a half2 of exact codes, two per 32-bit operation and
// without shifts: the field stays at bit K = B I of each half (inside the fp16 significand: K + B <= 10),
// one lop3 masks it and ORs 0x6400 in (the half is then 1024 + code * 2^K, exact), one fma.f16x2 by
// 2^-K with addend -(2^(10-K) + OFF) leaves code - OFF (exact: the addend is an fp16 number, 2^(10-K) +
// OFF with OFF < 2^(10-K) has the significand bits OFF 2^K, and code - OFF is a small integer).
template <int B, int I, int OFF = 0>
__device__ __forceinline__ u32 codes_field_h2(u32 x) {
    constexpr int K = B * I;
    static_assert(K + B <= 10, "the field must lie in the fp16 significand");
    static_assert(OFF >= 0 && (OFF << K) < 1024, "the offset must fit the addend's significand");
    constexpr u32 M = (((1u << B) - 1u) * 0x00010001u) << K;
    constexpr u32 SC = (u32)(15 - K) << 10;                                        // 2^-K
    constexpr u32 BI = 0x8000u | ((u32)(25 - K) << 10) | ((u32)OFF << K);          // -(2^(10-K) + OFF)
    constexpr u32 SCALE = SC | (SC << 16), BIAS = BI | (BI << 16);
    u32 h, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(x), "n"(M), "n"(0x64006400u));      // (x & M) | magic
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(SCALE), "r"(BIAS));
    return r;
}

// O^T's 8 m-tiles times the online softmax's correction: this thread's entries of its first query row
// (columns c0, c2) by a0, of its second (c1, c3) by a1
__device__ __forceinline__ void scale_o_rows(float (*O)[4], float a0, float a1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        O[i][0] *= a0;
        O[i][1] *= a1;
        O[i][2] *= a0;
        O[i][3] *= a1;
    }
}

// 2^x (approximate, flush-to-zero: probabilities of the online softmax, rule 7)
__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// transpose an 8x8 matrix of 16-bit elements held in the mma fragment layout (thread (g, t): row g,
// columns 2t, 2t + 1) across the warp
__device__ __forceinline__ u32 movmatrix_t(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

// m-tile BB * (4 / B) + I of one k-step (B-bit codes: 8 / B fields a byte, two per m-tile): the A
// fragment takes fields 2I (rows g) and 2I + 1 (rows g + 8) of byte BB of the word pairs (w0, w1)
// (columns 2t, 2t + 1) and (w2, w3) (columns 2t + 8, 2t + 9); c0[mt] += A . (b[0], b[1]) and, NB = 2,
// c1[mt] += A . (b[2], b[3]). Nothing for I >= 4 / B. OFF: the codes enter as code - OFF.
template <int B, int NB, int BB, int I, int OFF = 0>
__device__ __forceinline__ void mma_mtile(float (*c0)[4], float (*c1)[4], const u32* b, u32 w0, u32 w1, u32 w2,
                                          u32 w3) {
    if constexpr (2 * I < 8 / B) {
        constexpr int mt = BB * (4 / B) + I;
        const u32 xa = byte_pair<BB>(w0, w1), xb = byte_pair<BB>(w2, w3);
        const u32 a[4] = {codes_field_h2<B, 2 * I, OFF>(xa), codes_field_h2<B, 2 * I + 1, OFF>(xa),
                          codes_field_h2<B, 2 * I, OFF>(xb), codes_field_h2<B, 2 * I + 1, OFF>(xb)};
        mma16816(c0[mt], a, b[0], b[1]);
        if constexpr (NB == 2) mma16816(c1[mt], a, b[2], b[3]);
    }
}

// NB accumulator sets += A . B_k over one k-step for the 32 / B m-tiles whose codes the four bytes of the
// word pairs hold (B = 2: 8 m-tiles, m-tile 2 BB + i from byte BB; B = 4: 4 m-tiles, m-tile BB).
template <int B, int NB, int OFF = 0>
__device__ __forceinline__ void mma_mtiles(float (*c0)[4], float (*c1)[4], const u32* b, u32 w0, u32 w1, u32 w2,
                                           u32 w3) {
    mma_mtile<B, NB, 0, 0, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 0, 1, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 1, 0, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 1, 1, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 2, 0, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 2, 1, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 3, 0, OFF>(c0, c1, b, w0, w1, w2, w3);
    mma_mtile<B, NB, 3, 1, OFF>(c0, c1, b, w0, w1, w2, w3);
}

// The cache side of the tensor-core fragments. B-bit codes packed 8 / B to a byte along a row of 128
// (a key channel row: tokens; a value token row: channels); thread g reads 32-bit word g of a row, and
// for B = 4 also word g + 8. M-tile mt, fragment row g holds element mtile_pos<B>(g, mt), row g + 8 the
// next one: B = 2: 16 g + 2 mt (byte mt / 2 of word g, fields 2 (mt % 2) + {0, 1}); B = 4:
// 8 g + 2 (mt % 4) + 64 (mt / 4) (byte mt % 4 of word g + 8 (mt / 4), fields {0, 1}).
template <int B>
__device__ __forceinline__ int mtile_pos(int g, int mt) {
    static_assert(B == 2 || B == 4, "2- or 4-bit codes");
    return B == 2 ? 16 * g + 2 * mt : 8 * g + 2 * (mt & 3) + 64 * (mt >> 2);
}

// S (8 m-tiles) += codes . B over one k-step whose 4 rows (k = 2t, 2t+1, 2t+8, 2t+9) start at r0, r1, r2,
// r3 (row bytes: 128 B / 8; thread g's word g at 4 g, and for B = 4 word g + 8 at 4 g + 32)
template <int B, int NB, int OFF = 0>
__device__ __forceinline__ void mma_rows(float (*c0)[4], float (*c1)[4], const u32* b, const u8* r0, const u8* r1,
                                         const u8* r2, const u8* r3, int g) {
    const auto w = [&](const u8* r, int o) { return *reinterpret_cast<const u32*>(r + 4 * g + o); };
    mma_mtiles<B, NB, OFF>(c0, c1, b, w(r0, 0), w(r1, 0), w(r2, 0), w(r3, 0));
    if constexpr (B == 4)
        mma_mtiles<B, NB, OFF>(c0 + 4, c1 + 4, b, w(r0, 32), w(r1, 32), w(r2, 32), w(r3, 32));
}

// max |x| of the 128 fp16 values at p (16-byte aligned) over the warp, as a float
__device__ __forceinline__ float warp_absmax128(const u16* p, int lane) {
    const uint2 v = reinterpret_cast<const uint2*>(p)[lane];
    const u32 m2 = __vmaxu2(v.x & 0x7fff7fffu, v.y & 0x7fff7fffu);
    const u32 m = __reduce_max_sync(KVQ_FULL_MASK, kvq_max_i((int)(m2 & 0xffffu), (int)(m2 >> 16)));
    return f16_to_f32((u16)m);
}

__device__ __forceinline__ float h_lo(u32 x) { return f16_to_f32((u16)(x & 0xffffu)); }
__device__ __forceinline__ float h_hi(u32 x) { return f16_to_f32((u16)(x >> 16)); }

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// e with 2^(e-1) <= x < 2^e for a positive normal float (0 for x = 0), clamped to [-14, 14] so that
// 2^-e is a normal fp16 (a tiny page keeps 2^-e = 2^14: values stay < 1, only less normalized)
__device__ __forceinline__ int pow2_above(float x) {
    const int e = (int)((__float_as_uint(x) >> 23) & 0xffu) - 126;
    return x > 0.0f ? kvq_min(kvq_max_i(e, -14), 14) : 0;
}

// 2^k as a float (|k| <= 126; x * f_pow2(k) is ldexpf(x, k), one multiply)
__device__ __forceinline__ float f_pow2(int k) { return __int_as_float((127 + k) << 23); }

// 2^k (|k| <= 14) in both halves of a half2
__device__ __forceinline__ u32 h2_pow2(int k) {
    const u32 h = (u32)(k + 15) << 10;
    return h | (h << 16);
}

// x = (qh + 2^-11 ql) * s as hi + 2^-11 lo, two at a time in fp16: hi = fp16(qh s); the residual
// 2^11 (qh s - hi) is exact in fp16 (the error of a rounded product of two fp16 numbers is one, here
// scaled by 2^11 out of the subnormal range: one fma, no rounding); lo = fp16(ql s + that residual).
// Needs |qh s| <= 1 (no overflow at 2^11).
__device__ __forceinline__ void two_prod_h2(u32 qh, u32 ql, u32 s, u32& hi, u32& lo) {
    hi = hmul2(qh, s);
    const u32 r = hfma2(hmul2(qh, 0x68006800u), s, hmul2(hi, 0xE800E800u));   // 2^11 qh s - 2^11 hi
    lo = hfma2(ql, s, r);
}


#define KVQ_MMA_MAXW 4                             // warps per block of the tensor-core decode kernels at most

// The block's 8 query rows (row qi < nq -> query head hk * Gq + qi / Tq, token qi % Tq; rows >= nq are
// zero) times qk_scale: s_q [8][D] fp32, s_qmax[8] = max |row|, s_qrcp[8] = 1 / max |row| (0 for a zero
// row) and, with HILO, q~ = row / max |row| as fp16 hi (s_qh) + 2^-11 lo (s_ql), [8][D] each (the KIVI /
// Kitty kernels; OSCAR's takes q~ as integer digits and passes HILO = false, s_qh = s_ql = nullptr).
// q_dt: 0 fp16, 2 fp32. A thread's loads of q are all in flight at once (a loop of one load per element
// waited out one round trip per element: 8 in a row at every block's start with 128 threads). Ends with
// __syncthreads.
template <int D, bool HILO = true>
__device__ __forceinline__ void mma_load_queries(float* s_q, u16* s_qh, u16* s_ql, float* s_qmax, float* s_qrcp,
                                                 const void* __restrict__ q, int q_dt, i64 sq_b, i64 sq_h, i64 sq_t,
                                                 int b, int hk, int Gq, int Tq, int nq, float qk_scale) {
    constexpr int QT = 8, DL = D / 32;
    static_assert(D % 32 == 0, "D / 32 channels per lane");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    // warp w loads rows w, w + nw, ..., lane l channels DL l .. DL l + DL - 1: every load of a thread is
    // issued before the first is used (one round trip, not one per element), one row address per row
    float val[QT][DL];
#pragma unroll
    for (int k = 0; k < QT; ++k) {
        const int qi = warp + k * nw;
#pragma unroll
        for (int e = 0; e < DL; ++e) val[k][e] = 0.0f;
        if (qi < nq) {
            const int h = hk * Gq + qi / Tq, tq = qi - (qi / Tq) * Tq;
            const i64 off = (i64)b * sq_b + (i64)h * sq_h + (i64)tq * sq_t + DL * lane;
#pragma unroll
            for (int e = 0; e < DL; ++e) {
                const float x = q_dt == 0 ? f16_to_f32(reinterpret_cast<const u16*>(q)[off + e])
                                          : reinterpret_cast<const float*>(q)[off + e];
                val[k][e] = __fmul_rn(x, qk_scale);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < QT; ++k) {
        const int qi = warp + k * nw;
        if (qi < QT) {
            if constexpr (DL == 4)
                *reinterpret_cast<float4*>(s_q + qi * D + 4 * lane) =
                    make_float4(val[k][0], val[k][1], val[k][2], val[k][3]);
            else
#pragma unroll
                for (int e = 0; e < DL; ++e) s_q[qi * D + DL * lane + e] = val[k][e];
        }
    }
    __syncthreads();
    if (tid < 32) {                                // max |q| per row: lane -> row lane % 8, quarter lane / 8
        float mx = 0.0f;
        for (int c = (D / 4) * (lane >> 3); c < (D / 4) * (lane >> 3) + D / 4; ++c)
            mx = fmaxf(mx, fabsf(s_q[(lane & 7) * D + c]));
        mx = fmaxf(mx, __shfl_xor_sync(KVQ_FULL_MASK, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(KVQ_FULL_MASK, mx, 16));
        if (lane < QT) {
            s_qmax[lane] = mx;
            s_qrcp[lane] = mx > 0.0f ? 1.0f / mx : 0.0f;   // once per row, not per element
        }
    }
    __syncthreads();
    if constexpr (HILO) {
        for (int idx = 2 * tid; idx < QT * D; idx += 2 * blockDim.x) {   // q~ as hi + 2^-11 lo, pairs
            const float r = s_qrcp[idx / D];
            u32 hi, lo;
            split2(s_q[idx] * r, s_q[idx + 1] * r, hi, lo);
            *reinterpret_cast<u32*>(s_qh + idx) = hi;
            *reinterpret_cast<u32*>(s_ql + idx) = lo;
        }
        __syncthreads();
    }
}

// One page's softmax and P . V for a warp of a tensor-core decode kernel (thread (g, t) = (lane / 4,
// lane % 4)), given the page's score accumulators S^T (m-tile mt: rows g <-> token tk = mtile_pos<KB>(g,
// mt) (KB: the key codes' bits, whose layout put the tokens there), rows g + 8 <-> token tk + 1; columns:
// NR = 8 the 8 query rows (hi in S, lo in SL), NR = 4 hi of rows 0-3 in columns 0-3, lo in 4-7) and a
// value slot in shared memory: codes (128 tokens x 16 VB bytes, VB-bit packed along the 128 channels),
// scale and mn (one fp16 each per token).
//   score(e, hi, lo, mt, odd) -> the log2-unit score of query row r0 + e (r0 = 2t, NR = 4: 2 (t % 2))
//   and token tk + odd.
// NR = 4: threads t and t + 2 swap halves so that each ends with one token per m-tile (tk + 1 for
// t >= 2). Online softmax in base 2 whose reference M runs over max_page(s) + E, 2^(E-1) <=
// max|scale_v| < 2^E (exact): B (tokens x rows) = 2^(s - M) scale_v <= 1 in fp16, transposed from the
// score fragments by movmatrix; O^T (m-tile mc: rows g <-> channel mtile_pos<VB>(g, mc), g + 8 <-> the
// next channel; columns 2t, 2t + 1) += codes_V . B; l += 2^(s - M); bs += 2^(s - M) mn_v (per thread,
// reduced in mma_finish).
// The value slot's cp.async group is waited for after the scores (p_wait<1>: one later group, the next
// page's keys, may still be in flight).
template <int NR, int KB = 2, int VB = 2, class F>
__device__ __forceinline__ void page_softmax_pv(float (*S)[4], float (*SL)[4], F score, int nvalid, const u8* vslot,
                                                int lane, float& m0, float& m1, float& l0, float& l1, float& bs0,
                                                float& bs1, float (*O)[4]) {
    constexpr int G = 128, VBY = 16 * VB, VS_OFF = G * VBY, VM_OFF = VS_OFF + 2 * G;
    constexpr int NE = NR == 4 ? 2 : 4;
    const int g = lane >> 2, t = lane & 3;
    const bool tl = t < 2;
    float mp0 = -KVQ_INF, mp1 = -KVQ_INF;
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
        float hi[NE], lo[NE];
        int tok[NE];
        if constexpr (NR == 8) {
#pragma unroll
            for (int e = 0; e < 4; ++e) hi[e] = S[mt][e], lo[e] = SL[mt][e], tok[e] = mtile_pos<KB>(g, mt) + (e >> 1);
        } else {
            const float x0 = __shfl_xor_sync(KVQ_FULL_MASK, tl ? S[mt][2] : S[mt][0], 2);
            const float x1 = __shfl_xor_sync(KVQ_FULL_MASK, tl ? S[mt][3] : S[mt][1], 2);
            hi[0] = tl ? S[mt][0] : x0, hi[1] = tl ? S[mt][1] : x1;
            lo[0] = tl ? x0 : S[mt][2], lo[1] = tl ? x1 : S[mt][3];
            tok[0] = tok[1] = mtile_pos<KB>(g, mt) + (tl ? 0 : 1);
        }
#pragma unroll
        for (int e = 0; e < NE; ++e) {
            const float v = score(e & 1, hi[e], lo[e], mt, tok[e] & 1);
            S[mt][e] = tok[e] < nvalid ? v : -KVQ_INF;
            if (e & 1) mp1 = fmaxf(mp1, S[mt][e]);
            else mp0 = fmaxf(mp0, S[mt][e]);
        }
    }
#pragma unroll
    for (int off = NR == 4 ? 2 : 4; off <= 16; off <<= 1) {
        if (off == 2 && NR == 8) continue;
        mp0 = fmaxf(mp0, __shfl_xor_sync(KVQ_FULL_MASK, mp0, off));
        mp1 = fmaxf(mp1, __shfl_xor_sync(KVQ_FULL_MASK, mp1, off));
    }
    p_wait<1>();                                   // the page's values (the next page's keys may be in flight)
    __syncwarp();
    const u16* vss = reinterpret_cast<const u16*>(vslot + VS_OFF);
    const u16* vms = reinterpret_cast<const u16*>(vslot + VM_OFF);
    const float vmax = warp_absmax128(vss, lane);
    const float voff = vmax > 0.0f ? (float)((int)(__float_as_uint(vmax) >> 23) - 126) : 0.0f;
    const float mn0 = fmaxf(m0, mp0 + voff), mn1 = fmaxf(m1, mp1 + voff);
    const float a0 = m0 == mn0 ? 1.0f : ex2(m0 - mn0), a1 = m1 == mn1 ? 1.0f : ex2(m1 - mn1);
    if (__any_sync(KVQ_FULL_MASK, a0 != 1.0f || a1 != 1.0f)) {     // rescale when some row's M moved
        scale_o_rows(O, a0, a1);
        l0 *= a0;
        l1 *= a1;
        bs0 *= a0;
        bs1 *= a1;
    }
    m0 = mn0;
    m1 = mn1;
    const float ms0 = mn0 == -KVQ_INF ? 0.0f : mn0, ms1 = mn1 == -KVQ_INF ? 0.0f : mn1;
    u32 bp[8][2];
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
        const int tk = mtile_pos<KB>(g, mt);
        const u32 sv = *reinterpret_cast<const u32*>(vss + tk), mv = *reinterpret_cast<const u32*>(vms + tk);
        if constexpr (NR == 8) {
            const float pa0 = ex2(S[mt][0] - ms0), pa1 = ex2(S[mt][1] - ms1);   // token tk
            const float pb0 = ex2(S[mt][2] - ms0), pb1 = ex2(S[mt][3] - ms1);   // token tk + 1
            l0 += pa0 + pb0;
            l1 += pa1 + pb1;
            const float sa = h_lo(sv), sb = h_hi(sv), na = h_lo(mv), nb = h_hi(mv);
            bs0 = fmaf(pa0, na, fmaf(pb0, nb, bs0));
            bs1 = fmaf(pa1, na, fmaf(pb1, nb, bs1));
            bp[mt][0] = movmatrix_t(f2_to_h2(pa0 * sa, pa1 * sa));
            bp[mt][1] = movmatrix_t(f2_to_h2(pb0 * sb, pb1 * sb));
        } else {                                   // this thread's token: tk (t < 2) or tk + 1
            const float p0 = ex2(S[mt][0] - ms0), p1 = ex2(S[mt][1] - ms1);
            l0 += p0;
            l1 += p1;
            const float sw = tl ? h_lo(sv) : h_hi(sv), nw = tl ? h_lo(mv) : h_hi(mv);
            bs0 = fmaf(p0, nw, bs0);
            bs1 = fmaf(p1, nw, bs1);
            const u32 pk = f2_to_h2(p0 * sw, p1 * sw);
            const u32 other = __shfl_xor_sync(KVQ_FULL_MASK, pk, 2);   // token tk + 1, from t + 2
            bp[mt][0] = movmatrix_t(tl ? pk : 0u);                     // columns 4-7: zero
            bp[mt][1] = movmatrix_t(tl ? other : 0u);
        }
    }
    // O += codes_V . B: k-step mt <-> the tokens of score m-tile mt (movmatrix: columns 2t, 2t+1, 2t+8,
    // 2t+9 <-> tokens mtile_pos<KB>(2t, mt), mtile_pos<KB>(2t+1, mt), and each + 1); their value rows
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
        const u8* ra = vslot + mtile_pos<KB>(2 * t, mt) * VBY;
        const u8* rb = vslot + mtile_pos<KB>(2 * t + 1, mt) * VBY;
        mma_rows<VB, 1>(O, O, bp[mt], ra, rb, ra + VBY, rb + VBY, g);
    }
}

// End of a tensor-core decode kernel: reduce each thread's l and sum p mn_v over its tokens, write the
// warp's un-normalized rows (O + sum p mn_v) and (m, l) over its page area (cacc, [NW][8][D] fp32; all
// warps must be done with their slots) and combine the block's warps into partial `split`.
template <int NR, int D, int VB = 2>
__device__ __forceinline__ void mma_finish(u8* area, float* s_m, float* s_l, float m0, float m1, float l0, float l1,
                                           float bs0, float bs1, float (*O)[4], int nq, int hk, int Gq, int Tq,
                                           int B, int Hq, int b, int split, float* __restrict__ o_part,
                                           float* __restrict__ lse_part) {
    constexpr int QT = 8;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int off = NR == 4 ? 2 : 4; off <= 16; off <<= 1) {
        if (off == 2 && NR == 8) continue;
        l0 += __shfl_xor_sync(KVQ_FULL_MASK, l0, off);
        l1 += __shfl_xor_sync(KVQ_FULL_MASK, l1, off);
        bs0 += __shfl_xor_sync(KVQ_FULL_MASK, bs0, off);
        bs1 += __shfl_xor_sync(KVQ_FULL_MASK, bs1, off);
    }
    __syncthreads();                               // every warp is done with its slots
    float* cacc = reinterpret_cast<float*>(area);
    const int c0s = 2 * t, c1s = 2 * t + 1;
    float* r0p = cacc + (warp * QT + c0s) * D;
    float* r1p = cacc + (warp * QT + c1s) * D;
#pragma unroll
    for (int mc = 0; mc < 8; ++mc) {               // channels mtile_pos<VB>(g, mc) (+1)
        const int ch = mtile_pos<VB>(g, mc);
        *reinterpret_cast<float2*>(r0p + ch) = make_float2(O[mc][0] + bs0, O[mc][2] + bs0);
        *reinterpret_cast<float2*>(r1p + ch) = make_float2(O[mc][1] + bs1, O[mc][3] + bs1);
    }
    if (g == 0) {
        s_m[warp * QT + c0s] = m0;
        s_m[warp * QT + c1s] = m1;
        s_l[warp * QT + c0s] = l0;
        s_l[warp * QT + c1s] = l1;
    }
    __syncthreads();
    combine_warps<QT, D>(s_m, s_l, cacc, blockDim.x >> 5, nq, tid, blockDim.x, 0, hk, Gq, Tq, B, Hq, b, (i64)split,
                         o_part, lse_part);
}

// ---- tensor-core split attention over fp16 tiles (paged.cu paged_tail_mma) ---------------------------

// a[0..3] = the four 8x8 b16 matrices whose rows lanes 8i .. 8i + 7 address (ldmatrix .x4; TRANS: each
// matrix transposed), every address 16-byte aligned in shared memory
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(u32* a, const void* p) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(p_smem_addr(p)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(p_smem_addr(p)));
}

// fp16 elements per row of paged_tail_mma's K and V tiles in shared memory (D = 128 padded by 16 bytes:
// the 8 rows an ldmatrix matrix reads fall in 8 different bank groups)
#define KVQ_TMMA_ROW 136
// paged_mixed_mma's key tiles hold k 2^-KVQ_KLO_E (attn_mma_body KLO)
#define KVQ_KLO_E 1

// Computes: attn_split_body's partials (its grid (num_splits * n_qtiles, H_kv, B), partial layout, base-2
//   softmax and natural-log lse) for fp16 q, D = 128 and fp16 K / V tiles, query tiles of QT = 8 rows,
//   on the tensor cores. Per warp and 32-key tile (tiles.stage: K and V rows [32][KVQ_TMMA_ROW], two
//   cp.async groups): S^T (keys x rows) = K . q^T by mma.m16n8k16 with q exact in the B fragments; each
//   k-step (16 channels) sums from zero accumulators and the 8 k-step sums are added pairwise in fp32,
//   ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): one accumulator over all 8 k-steps (the
//   tensor cores' truncating accumulation at every step) reached 1.8x the tolerance rule's bound on
//   the large-operand caches, the pairwise sums 0.3x
//   (lab/2026-11-22-large-operand-accuracy/model_tail_scores.py); then s = S *
//   qk_scale (log2 units), online softmax per row (ex2.approx), P to fp16 and transposed into the B
//   fragments by movmatrix, O^T (channels x rows) += V^T . P^T (ldmatrix.trans of the V tile). The NW
//   warps take tiles w, w + NW, ... of the split and are combined as attn_split_body's.
// Thread (g, t) = (lane / 4, lane % 4): S^T m-tile mt rows g, g + 8 <-> keys 16 mt + g, + 8; columns
//   2t, 2t + 1 <-> query rows; O^T m-tile mc rows g, g + 8 <-> channels 16 mc + g, + 8.
// KLO: keys that fp16 does not hold (paged_mixed_mma: dequantized in fp32) come as two fp16 tiles, hi =
//   fp16(k 2^-KVQ_KLO_E) and lo = fp16(2^11 (k 2^-KVQ_KLO_E - hi)), k to 22 bits or more (the 2^-1 keeps
//   the largest dequantized fp16 key finite), lo [32][KVQ_TMMA_ROW] after the warp's V tile: each k-step
//   pair's sum is (hi sums) + 2^-11 (lo sums), the score times 2^KVQ_KLO_E. (A third tile, holding k
//   exactly, moved no error the H100 parity tests measure: lab/2026-11-22-kivi-kitty-decode/results/h100-mixed-mma.)
// Dynamic shared memory: NW * (KLO ? 3 : 2) * 32 * KVQ_TMMA_ROW * 2 bytes (the combine area [NW][8][128]
//   fp32 reuses it).
template <int NW, bool KLO, class Tiles>
__device__ __forceinline__ void attn_mma_body(const u16* __restrict__ q, const Tiles& tiles,
                                              float* __restrict__ o_part, float* __restrict__ lse_part, i64 sq_b,
                                              i64 sq_h, i64 sq_t, int B, int Hq, int Hkv, int Tq, i64 T, i64 chunk,
                                              int num_splits, int split0, float qk_scale) {
    constexpr int D = 128, QT = 8, ROW = KVQ_TMMA_ROW;
    extern __shared__ u32x4 kvq_tmma_tiles[];
    __shared__ float s_m[NW][QT], s_l[NW][QT];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int split = (int)(blockIdx.x % (unsigned)num_splits);
    const int qt = (int)(blockIdx.x / (unsigned)num_splits);
    const int hk = blockIdx.y, b = blockIdx.z;
    const int Gq = Hq / Hkv, NQ = Gq * Tq, r0 = qt * QT, nq = kvq_min(QT, NQ - r0);
    const i64 k0 = (i64)split * chunk, k1 = kvq_min(k0 + chunk, T);

    // B fragments of q^T for the 8 k-steps: column g = query row r0 + g (zero past nq), k rows 2t, 2t + 1
    // (bq[kk][0]) and 2t + 8, 2t + 9 (bq[kk][1]) of channels 16 kk ..
    u32 bq[8][2];
    {
        const u16* qr = nullptr;
        if (g < nq) {
            const int r = r0 + g, h = hk * Gq + r / Tq, tq = r - (r / Tq) * Tq;
            qr = q + (i64)b * sq_b + (i64)h * sq_h + (i64)tq * sq_t;
        }
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int c = 16 * kk + 2 * t + 8 * j;
                bq[kk][j] = qr ? (u32)qr[c] | ((u32)qr[c + 1] << 16) : 0u;
            }
    }

    u16* ks = reinterpret_cast<u16*>(kvq_tmma_tiles) + warp * ((KLO ? 96 : 64) * ROW);   // [32][ROW]
    u16* vs = ks + 32 * ROW;                                    // [32][ROW]; KLO: lo at ks + 64 ROW
    float m0 = -KVQ_INF, m1 = -KVQ_INF, l0 = 0.0f, l1 = 0.0f;               // query rows 2t, 2t + 1
    float O[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
    // ldmatrix row addresses: K (A of S^T, not transposed): lane -> key (lane & 7) + 8 ((lane >> 3) & 1),
    // channel 8 (lane >> 4); V (A of O^T, transposed): key (lane & 7) + 8 (lane >> 4), channel
    // 8 ((lane >> 3) & 1)
    const u16* ka = ks + ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROW + 8 * (lane >> 4);
    const u16* va = vs + ((lane & 7) + 8 * (lane >> 4)) * ROW + 8 * ((lane >> 3) & 1);
    const i64 ntile = k1 > k0 ? (k1 - k0 + 31) / 32 : 0;

    for (i64 ti = warp; ti < ntile; ti += NW) {        // uniform across the warp
        const i64 kb = k0 + ti * 32;
        const int nk = (int)kvq_min((i64)32, k1 - kb);
        tiles.stage(ks, vs, b, hk, kb, nk, lane);         // K: one cp.async group, V: the next
        p_wait<1>();
        __syncwarp();
        float S[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            float pr[4][4];                            // k-step pairs (2 kp, 2 kp + 1)
#pragma unroll
            for (int kp = 0; kp < 4; ++kp) {
                float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                u32 a[4];
                ldsm_x4<false>(a, ka + 16 * mt * ROW + 32 * kp);
                mma16816(x, a, bq[2 * kp][0], bq[2 * kp][1]);
                ldsm_x4<false>(a, ka + 16 * mt * ROW + 32 * kp + 16);
                mma16816(y, a, bq[2 * kp + 1][0], bq[2 * kp + 1][1]);
                if constexpr (KLO) {
                    float xl[4] = {0.0f, 0.0f, 0.0f, 0.0f}, yl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    ldsm_x4<false>(a, ka + 64 * ROW + 16 * mt * ROW + 32 * kp);
                    mma16816(xl, a, bq[2 * kp][0], bq[2 * kp][1]);
                    ldsm_x4<false>(a, ka + 64 * ROW + 16 * mt * ROW + 32 * kp + 16);
                    mma16816(yl, a, bq[2 * kp + 1][0], bq[2 * kp + 1][1]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) pr[kp][e] = fmaf(xl[e] + yl[e], 1.0f / 2048.0f, x[e] + y[e]);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) pr[kp][e] = x[e] + y[e];
                }
            }
            constexpr float KS = KLO ? (float)(1 << KVQ_KLO_E) : 1.0f;   // exact
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sv = __fmul_rn((pr[0][e] + pr[1][e]) + (pr[2][e] + pr[3][e]), qk_scale * KS);
                S[mt][e] = 16 * mt + g + 8 * (e >> 1) < nk ? sv : -KVQ_INF;
            }
        }
        // online softmax of rows 2t (e even) and 2t + 1 (e odd) over the tile's keys (lanes g)
        float x0 = fmaxf(fmaxf(S[0][0], S[0][2]), fmaxf(S[1][0], S[1][2]));
        float x1 = fmaxf(fmaxf(S[0][1], S[0][3]), fmaxf(S[1][1], S[1][3]));
#pragma unroll
        for (int off = 4; off <= 16; off <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(KVQ_FULL_MASK, x0, off));
            x1 = fmaxf(x1, __shfl_xor_sync(KVQ_FULL_MASK, x1, off));
        }
        const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);    // finite: the tile has a key
        const float a0 = m0 == n0 ? 1.0f : ex2(m0 - n0), a1 = m1 == n1 ? 1.0f : ex2(m1 - n1);
        m0 = n0;
        m1 = n1;
        l0 *= a0;
        l1 *= a1;
        scale_o_rows(O, a0, a1);
        u32 bp[2][2];                                  // B fragments of P^T: k-step mt = the keys of m-tile mt
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) p[e] = ex2(S[mt][e] - ((e & 1) ? n1 : n0));   // -inf -> 0
            l0 += p[0] + p[2];
            l1 += p[1] + p[3];
            bp[mt][0] = movmatrix_t(f2_to_h2(p[0], p[1]));   // keys 16 mt + 2t, + 1 of row g
            bp[mt][1] = movmatrix_t(f2_to_h2(p[2], p[3]));   // keys 16 mt + 8 + 2t, + 1
        }
        p_wait<0>();                                   // the V tile has landed
        __syncwarp();
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int mc = 0; mc < 8; ++mc) {
                u32 a[4];
                ldsm_x4<true>(a, va + 16 * mt * ROW + 16 * mc);
                mma16816(O[mc], a, bp[mt][0], bp[mt][1]);
            }
        __syncwarp();                                  // the next tile overwrites ks, vs
    }

    // the warp's rows: l over its lanes g, then (m, l, O) per warp into shared memory for combine_warps
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) {
        l0 += __shfl_xor_sync(KVQ_FULL_MASK, l0, off);
        l1 += __shfl_xor_sync(KVQ_FULL_MASK, l1, off);
    }
    __syncthreads();                                   // every warp is done with its tiles
    float* cacc = reinterpret_cast<float*>(kvq_tmma_tiles);   // [NW][QT][D]
    float* cw = cacc + warp * QT * D;
#pragma unroll
    for (int mc = 0; mc < 8; ++mc) {
        const int c = 16 * mc + g;
        cw[(2 * t) * D + c] = O[mc][0];
        cw[(2 * t + 1) * D + c] = O[mc][1];
        cw[(2 * t) * D + c + 8] = O[mc][2];
        cw[(2 * t + 1) * D + c + 8] = O[mc][3];
    }
    if (g == 0) {
        s_m[warp][2 * t] = m0, s_m[warp][2 * t + 1] = m1;
        s_l[warp][2 * t] = l0, s_l[warp][2 * t + 1] = l1;
    }
    __syncthreads();
    combine_warps<QT, D>(&s_m[0][0], &s_l[0][0], cacc, NW, nq, tid, NW * 32, r0, hk, Gq, Tq, B, Hq, b,
                         (i64)(split0 + split), o_part, lse_part);
}

#endif  // KVQ_MMA_CUH
