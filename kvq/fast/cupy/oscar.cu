// kvq CUDA kernels for OSCAR (section 4, App. A.5): per-row quantiles and the percentile clip, the
// fixed-order rotation x R, and the fused per-token clip + INT-b quantizer + packing along channels.
//
// Mirrors kvq/reference/quant.py (quantile, percentile_clip), rotations.py (rotate, quantize_tokens)
// bit for bit (numerics contract, DESIGN.md section 2), as kvq/fast/triton/{quant,rotate,oscar_quant}.py
// do. Order statistics come from a bitonic sort in shared memory of monotone int32 bit patterns (values
// are only moved, never computed on); tau = s[lo] + frac * (s[hi] - s[lo]) as three IEEE fp32 ops.
// Every operation that feeds a stored bit is a PTX instruction without .ftz (common.cuh ieee_*, and
// the setp comparisons below): CuPy compiles with -ftz=true, which would flush subnormals otherwise.
// The quantizer's arithmetic (group_params, make_enc, encode_bytes, store_meta) is quant.cu's.
#include "quant.cu"

#define OSCAR_MAX_SORT 4096     // longest row of quantile_rows (quant.MAX_SORT in Python)
#define OSCAR_MAX_TOKEN 2048    // longest row of oscar_quant_rows (oscar_quant.MAX_FUSED in Python)

// ---- comparisons and keys that keep subnormals ---------------------------------------------------

__device__ __forceinline__ bool ieee_gt(float a, float b) {
    u32 r;
    asm("{ .reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0u;
}

__device__ __forceinline__ bool ieee_lt(float a, float b) {
    u32 r;
    asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0u;
}

__device__ __forceinline__ bool is_nan_bits(float a) { return (__float_as_uint(a) & 0x7fffffffu) > 0x7f800000u; }

__device__ __forceinline__ float neg_bits(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }

// A float's bits as an int32 that orders like the float (negative floats flip their magnitude bits);
// -0.0 sorts just before +0.0 (the sign of a zero order statistic cannot change tau).
__device__ __forceinline__ int mono_key(float f) {
    const int i = __float_as_int(f);
    return i ^ ((i >> 31) & 0x7fffffff);
}

__device__ __forceinline__ float mono_val(int k) { return __int_as_float(k ^ ((k >> 31) & 0x7fffffff)); }

#define OSCAR_INF_KEY 0x7f800000        // mono_key(+inf): NaN and padding sort as +inf

// np.minimum(np.maximum(x, -t), t) bit for bit (quant._clip in the Triton backend): NumPy returns its
// second argument when the two compare equal and propagates a NaN from either argument.
__device__ __forceinline__ float np_clip(float x, float t) {
    const float nt = neg_bits(t);
    const float y = (ieee_gt(x, nt) || is_nan_bits(x)) ? x : nt;
    return (ieee_lt(y, t) || is_nan_bits(y)) ? y : t;
}

// Ascending bitonic sort of keys[0 .. bs) (bs a power of two) by the whole block.
__device__ __forceinline__ void bitonic_sort(int* keys, int bs) {
    for (int k = 2; k <= bs; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < bs; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const int a = keys[i], b = keys[ixj];
                    if ((a > b) == ((i & k) == 0)) {
                        keys[i] = b;
                        keys[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// tau of a sorted row (thread-independent): slots >= n - nnan stand for the NaNs (NumPy sorts them last).
__device__ __forceinline__ float sorted_quantile(const int* keys, int n, int nnan, int lo, int hi, float frac) {
    const float qnan = __int_as_float(0x7fffffff);
    const float s_lo = lo >= n - nnan ? qnan : mono_val(keys[lo]);
    const float s_hi = hi >= n - nnan ? qnan : mono_val(keys[hi]);
    return ieee_add(s_lo, ieee_mul(frac, ieee_sub(s_hi, s_lo)));
}

// ---- quantile / percentile clip ------------------------------------------------------------------
// Computes: per contiguous row of n elements: tau = quantile(v, rho) with v = |x| (absval) or x, sorted
//   in shared memory (bs = next_pow2(n) <= OSCAR_MAX_SORT keys); clip: also out = np_clip(x, tau), fp32.
// Grid: 1-D, one block per row (block-stride loop over rows); blockDim.x threads share the sort.
// Bytes: reads rows*n inputs (twice with clip: the second read hits L1 / L2), writes rows taus
//   (+ rows*n fp32 with clip).
template <int DT>
__global__ void __launch_bounds__(256) quantile_rows(const typename Ty<DT>::S* __restrict__ x,
                                                     float* __restrict__ tau, float* __restrict__ out, i64 rows,
                                                     int n, int bs, int lo, int hi, float frac, int absval,
                                                     int clip) {
    __shared__ int keys[OSCAR_MAX_SORT];
    __shared__ int s_nnan;
    __shared__ float s_tau;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const typename Ty<DT>::S* xr = x + row * n;
        if (threadIdx.x == 0) s_nnan = 0;
        __syncthreads();
        int nn = 0;
        for (int c = threadIdx.x; c < bs; c += blockDim.x) {
            int key = OSCAR_INF_KEY;
            if (c < n) {
                float v = Ty<DT>::ld(xr[c]);
                if (absval) v = ieee_abs(v);
                if (is_nan_bits(v)) ++nn;
                else key = mono_key(v);
            }
            keys[c] = key;
        }
        if (nn) atomicAdd(&s_nnan, nn);
        __syncthreads();
        bitonic_sort(keys, bs);
        if (threadIdx.x == 0) {
            const float t = sorted_quantile(keys, n, s_nnan, lo, hi, frac);
            s_tau = t;
            tau[row] = t;
        }
        __syncthreads();
        if (clip) {
            const float t = s_tau;
            for (int c = threadIdx.x; c < n; c += blockDim.x) out[row * n + c] = np_clip(Ty<DT>::ld(xr[c]), t);
        }
        __syncthreads();                                // keys / s_nnan / s_tau are reused by the next row
    }
}

// ---- fixed-order rotation ------------------------------------------------------------------------
// Computes: out[b, h, t, :] = x[b, h, t, :] R_h, R_h = R + (h / ratio) * r_sh, as the reference's loop:
//   acc = x_0 R_0, then acc = acc + x_i R_i for i = 1 .. D-1 (rounded mul, rounded add, no FMA), then
//   acc + 0.0 (-0.0 -> +0.0). acc starts at -0.0: -0.0 + p == p bit for bit for every p (NaN stays NaN).
// Grid: 1-D over (B * H) x ceil(T / ROT_TT) token tiles; 128 threads own output columns d (d0 + tid);
//   the tile's inputs are staged ROT_CH channels at a time in shared memory (fp32), R read coalesced
//   from global (L2-resident).
// Bytes: reads B*H*T*D inputs, D*D fp32 of R per block; writes B*H*T*D fp32.
#define ROT_TT 32
#define ROT_CH 32
#define ROT_THREADS 128

template <int DT>
__global__ void __launch_bounds__(ROT_THREADS) rotate_rows(const typename Ty<DT>::S* __restrict__ x,
                                                           const float* __restrict__ R, float* __restrict__ out,
                                                           i64 T, int H, int ratio, i64 r_sh, i64 sx_b, i64 sx_h,
                                                           i64 sx_t, i64 sx_d, int D, i64 ntiles) {
    __shared__ float xs[ROT_TT][ROT_CH];
    const i64 bh = blockIdx.x / ntiles;
    const i64 t0 = (blockIdx.x - bh * ntiles) * ROT_TT;
    const int b = (int)(bh / H), h = (int)(bh - (i64)b * H);
    const typename Ty<DT>::S* xb = x + b * sx_b + h * sx_h;
    const float* Rh = R + (i64)(h / ratio) * r_sh;
    for (int d0 = 0; d0 < D; d0 += ROT_THREADS) {
        const int d = d0 + threadIdx.x;
        const bool active = d < D;
        float acc[ROT_TT];
#pragma unroll
        for (int t = 0; t < ROT_TT; ++t) acc[t] = __int_as_float(0x80000000);      // -0.0
        for (int i0 = 0; i0 < D; i0 += ROT_CH) {
            __syncthreads();
            for (int idx = threadIdx.x; idx < ROT_TT * ROT_CH; idx += ROT_THREADS) {
                const int t = idx / ROT_CH, ii = idx - t * ROT_CH;
                const i64 tok = t0 + t;
                const int ch = i0 + ii;
                xs[t][ii] = (tok < T && ch < D) ? Ty<DT>::ld(xb[tok * sx_t + ch * sx_d]) : 0.0f;
            }
            __syncthreads();
            if (active) {
                const int nch = kvq_min(ROT_CH, D - i0);
                for (int ii = 0; ii < nch; ++ii) {
                    const float r = Rh[(i64)(i0 + ii) * D + d];
#pragma unroll
                    for (int t = 0; t < ROT_TT; ++t) acc[t] = ieee_add(acc[t], ieee_mul(xs[t][ii], r));
                }
            }
        }
        if (active) {
#pragma unroll
            for (int t = 0; t < ROT_TT; ++t)
                if (t0 + t < T) out[(bh * T + t0 + t) * D + d] = ieee_add(acc[t], 0.0f);
        }
    }
}

// ---- fused OSCAR token quantizer -----------------------------------------------------------------
// Computes, per token row of D channels (D <= OSCAR_MAX_TOKEN): tau = quantile(|x|, clip) (sorted keys
//   as quantile_rows), xc = np_clip(x, tau); per group of G channels mn / mx of xc -> scale / mn in the
//   metadata dtype (quant.cu group_params; a group whose RAW values hold NaN / inf gets a NaN scale, so
//   non-finite input shows in the metadata even where the clip made it finite); codes =
//   clamp(rint((xc - mn_s) / scale_s), 0, 2^bits - 1), per consecutive channel codes per byte (code k
//   of a byte at bits [bits*k, bits*k + bits); per = 1: plain codes). A byte may straddle two groups.
// Grid: 1-D, one block per row (block-stride loop over rows); a warp per group for min / max.
// Bytes: reads rows*D inputs, writes rows*D/per code bytes + 2 rows*D/G metadata values.
template <int DT>
__global__ void __launch_bounds__(256) oscar_quant_rows(const typename Ty<DT>::S* __restrict__ x,
                                                        u8* __restrict__ q, void* __restrict__ scale,
                                                        void* __restrict__ mn, i64 rows, int D, int G, int bs,
                                                        int lo, int hi, float frac, int bits, int per,
                                                        int meta_half) {
    __shared__ float xs[OSCAR_MAX_TOKEN];
    __shared__ int keys[OSCAR_MAX_TOKEN];           // the sort, then the groups' scales (fp32 bits)
    __shared__ float ms[OSCAR_MAX_TOKEN];           // the groups' mins
    __shared__ int s_nnan;
    __shared__ float s_tau;
    const int NG = D / G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int nbytes = D / per;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const typename Ty<DT>::S* xr = x + row * D;
        if (threadIdx.x == 0) s_nnan = 0;
        __syncthreads();
        int nn = 0;
        for (int c = threadIdx.x; c < bs; c += blockDim.x) {
            int key = OSCAR_INF_KEY;
            if (c < D) {
                const float v = Ty<DT>::ld(xr[c]);
                xs[c] = v;
                const float a = ieee_abs(v);
                if (is_nan_bits(a)) ++nn;
                else key = mono_key(a);
            }
            keys[c] = key;
        }
        if (nn) atomicAdd(&s_nnan, nn);
        __syncthreads();
        bitonic_sort(keys, bs);
        if (threadIdx.x == 0) s_tau = sorted_quantile(keys, D, s_nnan, lo, hi, frac);
        __syncthreads();
        const float t = s_tau;
        for (int g = warp; g < NG; g += nwarps) {       // the loop bound is per warp: all lanes shuffle
            GroupAcc a;
            acc_init(a);
            bool fin = true;
            for (int c = g * G + lane; c < (g + 1) * G; c += 32) {
                const float v = xs[c];
                fin = fin && is_finite(v);
                acc_add(a, np_clip(v, t));
            }
            for (int off = 16; off > 0; off >>= 1) {
                const float l2 = __shfl_xor_sync(KVQ_FULL_MASK, a.lo, off);
                const float h2 = __shfl_xor_sync(KVQ_FULL_MASK, a.hi, off);
                acc_merge(a, l2, h2);
            }
            fin = __all_sync(KVQ_FULL_MASK, fin);
            float s32, m32;
            group_params(a, bits, 0, meta_half, s32, m32);
            if (!fin) s32 = __int_as_float(0x7fc00000);
            if (lane == 0) {
                store_meta(scale, row * NG + g, s32, meta_half);
                store_meta(mn, row * NG + g, m32, meta_half);
                keys[g] = __float_as_int(s32);
                ms[g] = m32;
            }
        }
        __syncthreads();
        for (int j = threadIdx.x; j < nbytes; j += blockDim.x) {
            u32 w = 0;
            for (int k = 0; k < per; ++k) {
                const int c = j * per + k;
                const int g = c / G;
                const Enc enc = make_enc(__int_as_float(keys[g]), ms[g], bits, 0);
                const float v = np_clip(xs[c], t);
                u32 code;
                encode_bytes<1, 8>(&v, enc, &code);
                w |= (code & ((1u << bits) - 1u)) << (bits * k);
            }
            q[row * nbytes + j] = (u8)w;
        }
        __syncthreads();                                // shared buffers are reused by the next row
    }
}
