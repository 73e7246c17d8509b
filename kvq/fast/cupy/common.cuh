// kvq CUDA kernels: shared device helpers (no #include at all, so that the same text compiles
// under NVRTC, through CuPy, and under `nvcc -c`, without depending on which cuda_fp16.h /
// cuda_bf16.h a CuPy install bundles).
//
// fp16 / bf16 values travel as their 16-bit patterns (unsigned short); conversions are the PTX
// `cvt` instructions that cuda_fp16.h itself uses, with round-to-nearest-even (numerics contract
// rules 1-3). Element types are named by an int code so that kernel name expressions stay plain
// ("quant_rows<0, 2, true>"):
//     DT 0 = float16, 1 = bfloat16, 2 = float32.
//
// The loader (_loader.py) pastes this file in place of `#include "common.cuh"` before NVRTC sees a
// source, so CuPy's kernel cache keys on the full text.
#ifndef KVQ_COMMON_CUH
#define KVQ_COMMON_CUH

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// 16- and 8-byte vectors for vectorized global / shared memory access.
struct alignas(16) u32x4 { u32 x, y, z, w; };
struct alignas(8) u32x2 { u32 x, y; };

#define KVQ_INF __int_as_float(0x7f800000)

template <typename T>
__device__ __forceinline__ T kvq_min(T a, T b) { return a < b ? a : b; }
#define KVQ_FULL_MASK 0xffffffffu

// ---- conversions (round to nearest even) ---------------------------------------------------------

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16_rn(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));   // sm_80+
    return h;
}

// ---- IEEE fp32 arithmetic that keeps subnormals ---------------------------------------------------
// CuPy compiles every NVRTC source with -ftz=true, appended after the caller's options (and NVRTC
// honours the last one), so plain C++ float operations, fminf / fmaxf and even the __f*_rn
// intrinsics would flush subnormal inputs and results to zero. The numerics contract keeps them:
// arithmetic that feeds a stored bit goes through these PTX instructions, which carry no .ftz.
#define KVQ_F2(name, op)                                                         \
    __device__ __forceinline__ float name(float a, float b) {                   \
        float r;                                                                 \
        asm(op " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                       \
        return r;                                                                \
    }
KVQ_F2(ieee_add, "add.rn.f32")
KVQ_F2(ieee_sub, "sub.rn.f32")
KVQ_F2(ieee_mul, "mul.rn.f32")
KVQ_F2(ieee_div, "div.rn.f32")      // IEEE round-to-nearest division (numerics.div)
KVQ_F2(ieee_min, "min.f32")         // a NaN operand gives the other one, like fminf
KVQ_F2(ieee_max, "max.f32")
KVQ_F2(nan_min, "min.NaN.f32")      // sm_80+: NaN if either operand is NaN
KVQ_F2(nan_max, "max.NaN.f32")
#undef KVQ_F2

__device__ __forceinline__ float ieee_rcp(float a) {
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ float ieee_abs(float a) { return __uint_as_float(__float_as_uint(a) & 0x7fffffffu); }

__device__ __forceinline__ bool is_finite(float a) { return (__float_as_uint(a) & 0x7f800000u) != 0x7f800000u; }

__device__ __forceinline__ bool is_zero(float a) { return (__float_as_uint(a) << 1) == 0u; }   // +-0, not subnormals

// Rule 3's fp16 saturation (numerics.saturate_f16, Triton's _sat_f16), applied to a dequantized fp32
// value just before it is rounded to fp16: a finite value beyond +-65504 becomes +-65504 (the largest
// finite fp16) instead of rounding to inf; NaN and +-inf pass unchanged (rule 8: never silently finite).
// Values in (65504, 65520) would round to 65504 anyway, so only would-be infs change.
__device__ __forceinline__ float sat_f16(float x) {
    const u32 b = __float_as_uint(x);
    return ((b & 0x7fffffffu) > 0x477fe000u && is_finite(x)) ? __uint_as_float((b & 0x80000000u) | 0x477fe000u) : x;
}

// numerics.to_out's saturation for output type DT: sat_f16 for fp16 (DT 0), the identity for bf16 / fp32
// (their range holds every dequantized value). Use as Ty<DT>::st(sat_out<DT>(x)).
template <int DT>
__device__ __forceinline__ float sat_out(float x) {
    if constexpr (DT == 0) return sat_f16(x);
    else return x;
}

// Ty<DT>::S is the storage type; ld converts exactly to fp32 (rule 1), st rounds to nearest even.
template <int DT> struct Ty;
template <> struct Ty<0> {
    typedef u16 S;
    static __device__ __forceinline__ float ld(S v) { return f16_to_f32(v); }
    static __device__ __forceinline__ S st(float f) { return f32_to_f16_rn(f); }
};
template <> struct Ty<1> {
    typedef u16 S;
    static __device__ __forceinline__ float ld(S v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ S st(float f) { return f32_to_bf16_rn(f); }
};
template <> struct Ty<2> {
    typedef float S;
    static __device__ __forceinline__ float ld(S v) { return v; }
    static __device__ __forceinline__ S st(float f) { return f; }
};

// ---- vector access -------------------------------------------------------------------------------

// Load N consecutive elements starting at p (N * sizeof(S) in {2, 4, 8, 16, 32, ...}; p aligned to
// min(16, N * sizeof(S)) bytes) and convert them to fp32. Works on global and shared memory.
template <int DT, int N>
__device__ __forceinline__ void load_f32(const typename Ty<DT>::S* p, float* out) {
    typedef typename Ty<DT>::S S;
    constexpr int BYTES = N * (int)sizeof(S);
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / (int)sizeof(S);
#pragma unroll
        for (int i = 0; i < N / PER; ++i) {
            u32x4 v = reinterpret_cast<const u32x4*>(p)[i];
            const S* s = reinterpret_cast<const S*>(&v);
#pragma unroll
            for (int e = 0; e < PER; ++e) out[i * PER + e] = Ty<DT>::ld(s[e]);
        }
    } else if constexpr (BYTES == 8) {
        u32x2 v = *reinterpret_cast<const u32x2*>(p);
        const S* s = reinterpret_cast<const S*>(&v);
#pragma unroll
        for (int e = 0; e < N; ++e) out[e] = Ty<DT>::ld(s[e]);
    } else if constexpr (BYTES == 4) {
        u32 v = *reinterpret_cast<const u32*>(p);
        const S* s = reinterpret_cast<const S*>(&v);
#pragma unroll
        for (int e = 0; e < N; ++e) out[e] = Ty<DT>::ld(s[e]);
    } else {
#pragma unroll
        for (int e = 0; e < N; ++e) out[e] = Ty<DT>::ld(p[e]);
    }
}

// Round N fp32 values to DT and store them at p (same size / alignment rules as load_f32).
template <int DT, int N>
__device__ __forceinline__ void store_from_f32(typename Ty<DT>::S* p, const float* in) {
    typedef typename Ty<DT>::S S;
    constexpr int BYTES = N * (int)sizeof(S);
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / (int)sizeof(S);
#pragma unroll
        for (int i = 0; i < N / PER; ++i) {
            u32x4 v;
            S* s = reinterpret_cast<S*>(&v);
#pragma unroll
            for (int e = 0; e < PER; ++e) s[e] = Ty<DT>::st(in[i * PER + e]);
            reinterpret_cast<u32x4*>(p)[i] = v;
        }
    } else if constexpr (BYTES == 8) {
        u32x2 v;
        S* s = reinterpret_cast<S*>(&v);
#pragma unroll
        for (int e = 0; e < N; ++e) s[e] = Ty<DT>::st(in[e]);
        *reinterpret_cast<u32x2*>(p) = v;
    } else if constexpr (BYTES == 4) {
        u32 v;
        S* s = reinterpret_cast<S*>(&v);
#pragma unroll
        for (int e = 0; e < N; ++e) s[e] = Ty<DT>::st(in[e]);
        *reinterpret_cast<u32*>(p) = v;
    } else {
#pragma unroll
        for (int e = 0; e < N; ++e) p[e] = Ty<DT>::st(in[e]);
    }
}

// A register-sized holder of BYTES raw bytes (2, 4 or 8), and its conversion to fp32 values.
template <int BYTES> struct Raw;
template <> struct Raw<2> { typedef u16 T; };
template <> struct Raw<4> { typedef u32 T; };
template <> struct Raw<8> { typedef u32x2 T; };

template <int DT, int N>
__device__ __forceinline__ void raw_to_f32(const typename Raw<N * (int)sizeof(typename Ty<DT>::S)>::T& r,
                                           float* out) {
    typedef typename Ty<DT>::S S;
    const S* s = reinterpret_cast<const S*>(&r);
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = Ty<DT>::ld(s[e]);
}

// Store NB bytes (b[i] holds byte i in its low 8 bits) at p, aligned to NB bytes when NB in {2,4,8}.
template <int NB>
__device__ __forceinline__ void store_bytes(u8* p, const u32* b) {
    if constexpr (NB == 8) {
        u32x2 w;
        w.x = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24);
        w.y = b[4] | (b[5] << 8) | (b[6] << 16) | (b[7] << 24);
        *reinterpret_cast<u32x2*>(p) = w;
    } else if constexpr (NB == 4) {
        *reinterpret_cast<u32*>(p) = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24);
    } else if constexpr (NB == 2) {
        *reinterpret_cast<u16*>(p) = (u16)(b[0] | (b[1] << 8));
    } else {
#pragma unroll
        for (int i = 0; i < NB; ++i) p[i] = (u8)b[i];
    }
}

// Load NB bytes (aligned like store_bytes) into b[0..NB).
template <int NB>
__device__ __forceinline__ void load_bytes(const u8* p, u32* b) {
    if constexpr (NB == 8) {
        u32x2 w = *reinterpret_cast<const u32x2*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) { b[i] = (w.x >> (8 * i)) & 0xffu; b[4 + i] = (w.y >> (8 * i)) & 0xffu; }
    } else if constexpr (NB == 4) {
        u32 w = *reinterpret_cast<const u32*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = (w >> (8 * i)) & 0xffu;
    } else if constexpr (NB == 2) {
        u32 w = *reinterpret_cast<const u16*>(p);
        b[0] = w & 0xffu;
        b[1] = w >> 8;
    } else {
#pragma unroll
        for (int i = 0; i < NB; ++i) b[i] = p[i];
    }
}

// Combine the NW warps' flash-decoding states of a block into one partial (attn_split, paged_decode):
// s_m / s_l ([NW][QT], base-2 max and sum per warp and row), cacc ([NW][QT][D], un-normalized outputs);
// row qi < nq is query row r0 + qi of kv head hk (-> query head hk * Gq + r / Tq, token r % Tq), written
// to o_part / lse_part at partial `split` (natural-log lse; o = 0, lse = -inf for a row without keys).
// nat: the states are in natural-log units (exp / log), else base 2 (exp2 / log2, lse times ln 2).
// Thread qi < nq works out its row's max M, the warps' factors f_w = 2^(m_w - M) (or e^...), L = sum_w f_w
// l_w (fma chain in warp order), the lse and the partial's row once, and leaves f_w in s_m (-1: a warp
// without keys) and L in s_l[0][qi]; then every element is o = (sum_w f_w acc_w) / L (fma chain in warp
// order): the same operations as per element, without each thread redoing the row's exponentials, its
// logarithm and its integer division (a latency-bound tail kernel spent 28% of its instructions there
// under ncu: lab/2026-11-22-oscar-decode/results/h100-07376b6).
// Overwrites s_m and s_l. Ends the kernel's use of them: call it from every thread of the block.
template <int QT, int D>
__device__ __forceinline__ void combine_warps(float* s_m, float* s_l, const float* cacc, int NW,
                                              int nq, int tid, int nthreads, int r0, int hk, int Gq, int Tq,
                                              int B, int Hq, int b, i64 split, float* __restrict__ o_part,
                                              float* __restrict__ lse_part, bool nat = false) {
    __shared__ i64 s_prow[QT];
    if (tid < nq) {
        const int qi = tid;
        float M = -KVQ_INF;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w * QT + qi]);
        float L = 0.0f;
        for (int w = 0; w < NW; ++w) {
            const float mw = s_m[w * QT + qi];
            float f = -1.0f;
            if (M != -KVQ_INF && mw != -KVQ_INF) {
                f = nat ? expf(mw - M) : exp2f(mw - M);
                L = fmaf(f, s_l[w * QT + qi], L);
            }
            s_m[w * QT + qi] = f;
        }
        s_l[qi] = L;
        const int r = r0 + qi;
        const int h = hk * Gq + r / Tq;
        const int t = r - (r / Tq) * Tq;
        const i64 prow = ((split * B + b) * Hq + h) * Tq + t;
        s_prow[qi] = prow;
        lse_part[prow] = !(L > 0.0f) ? -KVQ_INF : nat ? M + logf(L) : (M + log2f(L)) * 0.693147180559945309f;
    }
    __syncthreads();
    for (int idx = tid; idx < QT * D; idx += nthreads) {
        const int qi = idx / D;
        const int d = idx - qi * D;
        if (qi >= nq) continue;
        float A = 0.0f;
        for (int w = 0; w < NW; ++w) {
            const float f = s_m[w * QT + qi];
            if (f >= 0.0f) A = fmaf(f, cacc[(w * QT + qi) * D + d], A);
        }
        const float L = s_l[qi];
        o_part[s_prow[qi] * D + d] = L > 0.0f ? A / L : 0.0f;
    }
}

#endif  // KVQ_COMMON_CUH
