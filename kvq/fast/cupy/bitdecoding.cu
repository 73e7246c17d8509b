// kvq CUDA kernels: BitDecoding's Residual Kernel (quantize and pack a page into the induced layout) and
// the page's unpack + dequantization. Mirrors kvq/reference/bitdecoding.py bit for bit.
//
// The induced layout (bitdecoding.py, IV-A(1)), per page of N_r = 8 NW R tokens (R = 16 / BITS):
//   keys   words (8 NW, D) u16: word (8 w + g, c), slot i (bits [BITS i, BITS i + BITS)) = code of
//          K[w * 8R + 8 i + g, c];
//   values words (N_r, D / R) u16: word (t, 8 u + g), slot i = code of V[t, 8 (u R + i) + g];
//   params half2 (scale, min): keys channel-wise (N_r / kg, D, 2) or tensor-wise (N_r, D / kg, 2),
//          values (N_r, D / vg, 2).
//
// bd_pack_keys: one block per page, NW warps; warp w owns tokens [w 8R, (w + 1) 8R). Lane (g = lane / 4,
// t = lane % 4) holds, for channel step s (32 channels), register m (0..3), half h and tile i, the
// element K[w 8R + 8 i + g, 32 s + 8 m + 2 t + h]: the registers `ldmatrix.x4` (non-transposed) gives
// it for the warp's R tiles (loaded here straight from global memory, 4 or 8 bytes per (s, m, i)).
// Pass 1, the group min / max: in the lane over its tiles (or channels) of the group, then across the
// lanes that share the group with __shfl_xor_sync (xor 4, 8, 16 over g for channel groups; xor 1, 2
// over t for token groups), then across warps in shared memory where a channel group spans warps;
// the params are written to global memory. Pass 2 (after __syncthreads, which makes the block's global
// writes visible to it): every lane encodes its own values with the contract's division and packs the
// R codes of each (m, h) into the word that `ldmatrix.x4` of the word matrix returns to it.
// bd_pack_values: same, for `ldmatrix.x2.trans` fragments of 16-token tiles: lane holds V[16 kk + 8 m +
// 2 t + h, 8 j + g] for channel tiles j; token groups of vg channels reduce in the lane (over j) and
// across g (xor 4, 8, 16).
// Bytes: each page reads N_r D input elements twice (the second pass mostly from L1 / L2) and writes
// N_r D BITS / 8 bytes of words and its params. Arithmetic that feeds a stored bit: quant.cu's helpers.
#include "quant.cu"

// code = clamp(rint((x - mn_s) / scale_s), 0, qmax), 0 where scale_s == 0 (contract rule 2)
template <int BITS>
__device__ __forceinline__ u32 bd_code(float x, float s32, float m32) {
    if (is_zero(s32)) return 0u;
    const float y = ieee_min(ieee_max(ieee_div(ieee_sub(x, m32), s32), 0.0f), (float)((1 << BITS) - 1));
    return (u32)rint_to_int(y);
}

__device__ __forceinline__ void bd_store_params(u16* p, const GroupAcc& a, int bits) {
    float s32, m32;
    group_params(a, bits, 0, 1, s32, m32);
    *reinterpret_cast<u32*>(p) = (u32)f32_to_f16_rn(s32) | ((u32)f32_to_f16_rn(m32) << 16);
}

__device__ __forceinline__ void bd_load_params(const u16* p, float& s32, float& m32) {
    const u32 v = *reinterpret_cast<const u32*>(p);
    s32 = f16_to_f32((u16)(v & 0xffffu));
    m32 = f16_to_f32((u16)(v >> 16));
}

// a[h] (h = 0, 1) takes channels c2 + h of tiles [i0, i1) (tokens tok0 + 8 i), one 2-element load each
template <int DT>
__device__ __forceinline__ void bd_acc_tiles(GroupAcc* a, const typename Ty<DT>::S* xp, int tok0, int i0, int i1,
                                             int D, int c2) {
    acc_init(a[0]);
    acc_init(a[1]);
    for (int i = i0; i < i1; ++i) {
        float v[2];
        load_f32<DT, 2>(xp + (i64)(tok0 + 8 * i) * D + c2, v);
        acc_add(a[0], v[0]);
        acc_add(a[1], v[1]);
    }
}

__device__ __forceinline__ void bd_shfl_merge(GroupAcc& a, int lane_mask) {
    acc_merge(a, __shfl_xor_sync(KVQ_FULL_MASK, a.lo, lane_mask), __shfl_xor_sync(KVQ_FULL_MASK, a.hi, lane_mask));
}

// min / max across the 8 lanes of a fragment column (g = lane / 4 varies, t = lane % 4 fixed)
__device__ __forceinline__ void bd_merge_over_g(GroupAcc& a) {
    bd_shfl_merge(a, 4);
    bd_shfl_merge(a, 8);
    bd_shfl_merge(a, 16);
}

// x: pages (n, N_r, D) with page stride `pstride` elements (rows contiguous); words (n, 8 NW, D);
// params (n, N_r / kg, D, 2) if channel else (n, N_r, D / kg, 2). Dynamic shared memory: 2 NW D floats
// when a channel group spans warps (kg > 8R), else none.
template <int DT, int BITS, int NW>
__global__ void __launch_bounds__(32 * NW) bd_pack_keys(const typename Ty<DT>::S* __restrict__ x, i64 pstride,
                                                        int D, int channel, int kg, u16* __restrict__ words,
                                                        u16* __restrict__ params) {
    constexpr int R = 16 / BITS;
    constexpr int NR = 8 * NW * R;
    extern __shared__ float s_part[];                 // [2][NW][D]: lo, hi per warp and channel
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 page = blockIdx.x;
    const typename Ty<DT>::S* xp = x + page * pstride;
    u16* pp = params + page * (i64)NR * D * 2 / kg;
    u16* wp = words + page * (i64)8 * NW * D;
    const int tok0 = w * 8 * R + g;                   // token of tile i: tok0 + 8 i
    // ---- pass 1: params
    if (channel) {
        const int tiles = kg / 8;                     // tiles of a group (a group never splits a tile)
        for (int c2 = 2 * t; c2 < D; c2 += 8) {                 // the lane's channel pairs: 8 m + 2 t
            if (kg <= 8 * R) {
                for (int i0 = 0; i0 < R; i0 += tiles) {
                    GroupAcc a[2];
                    bd_acc_tiles<DT>(a, xp, tok0, i0, i0 + tiles, D, c2);
                    bd_merge_over_g(a[0]);
                    bd_merge_over_g(a[1]);
                    if (g == 0) {
                        const int grp = (w * 8 * R + 8 * i0) / kg;
#pragma unroll
                        for (int h = 0; h < 2; ++h) bd_store_params(pp + ((i64)grp * D + c2 + h) * 2, a[h], BITS);
                    }
                }
            } else {
                GroupAcc a[2];
                bd_acc_tiles<DT>(a, xp, tok0, 0, R, D, c2);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    bd_merge_over_g(a[h]);
                    if (g == 0) {
                        s_part[w * D + c2 + h] = a[h].lo;
                        s_part[(NW + w) * D + c2 + h] = a[h].hi;
                    }
                }
            }
        }
        if (kg > 8 * R) {                              // a group spans kg / 8R warps: combine them
            __syncthreads();
            const int wpg = kg / (8 * R);
            for (int idx = threadIdx.x; idx < (NW / wpg) * D; idx += 32 * NW) {
                const int grp = idx / D, c = idx - grp * D;
                GroupAcc a;
                acc_init(a);
                for (int ww = grp * wpg; ww < (grp + 1) * wpg; ++ww) acc_merge(a, s_part[ww * D + c], s_part[(NW + ww) * D + c]);
                bd_store_params(pp + ((i64)grp * D + c) * 2, a, BITS);
            }
        }
    } else {
        const int ng = D / kg;
        for (int i = 0; i < R; ++i) {
            const int tok = tok0 + 8 * i;
            for (int grp = 0; grp < ng; ++grp) {
                GroupAcc a;
                acc_init(a);
                for (int c2 = grp * kg + 2 * t; c2 < (grp + 1) * kg; c2 += 8) {   // kg % 8 == 0
                    float v[2];
                    load_f32<DT, 2>(xp + (i64)tok * D + c2, v);
                    acc_add(a, v[0]);
                    acc_add(a, v[1]);
                }
                bd_shfl_merge(a, 1);
                bd_shfl_merge(a, 2);
                if (t == 0) bd_store_params(pp + ((i64)tok * ng + grp) * 2, a, BITS);
            }
        }
    }
    __syncthreads();
    // ---- pass 2: every lane encodes its own fragment values and packs one word per (channel, tile set)
    for (int c2 = 2 * t; c2 < D; c2 += 8) {
        u32 wd[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int tok = tok0 + 8 * i;
            float v[2];
            load_f32<DT, 2>(xp + (i64)tok * D + c2, v);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 pi = channel ? (i64)(tok / kg) * D + c2 + h : (i64)tok * (D / kg) + (c2 + h) / kg;
                float s32, m32;
                bd_load_params(pp + pi * 2, s32, m32);
                wd[h] |= bd_code<BITS>(v[h], s32, m32) << (BITS * i);
            }
        }
        *reinterpret_cast<u32*>(wp + (i64)(8 * w + g) * D + c2) = wd[0] | (wd[1] << 16);
    }
}

// x: pages (n, N_r, D), page stride pstride; words (n, N_r, D / R); params (n, N_r, D / vg, 2).
// Warp w takes the 16-token k-tiles kk = w, w + NW, ...; lane (g, t) holds tokens 16 kk + 8 m + 2 t + h
// (m, h in {0, 1}: ldmatrix.x2.trans) and, of each, channels 8 j + g for every channel tile j.
template <int DT, int BITS, int NW>
__global__ void __launch_bounds__(32 * NW) bd_pack_values(const typename Ty<DT>::S* __restrict__ x, i64 pstride,
                                                          int D, int vg, u16* __restrict__ words,
                                                          u16* __restrict__ params) {
    constexpr int R = 16 / BITS;
    constexpr int NR = 8 * NW * R;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 page = blockIdx.x;
    const typename Ty<DT>::S* xp = x + page * pstride;
    const int ng = D / vg, nj = D / 8;
    u16* pp = params + page * (i64)NR * ng * 2;
    u16* wp = words + page * (i64)NR * (D / R);
    for (int kk = w; kk < NR / 16; kk += NW) {
#pragma unroll
        for (int mh = 0; mh < 4; ++mh) {
            const int tok = 16 * kk + 8 * (mh >> 1) + 2 * t + (mh & 1);
            const auto* row = xp + (i64)tok * D;
            for (int grp = 0; grp < ng; ++grp) {       // pass 1: the token's groups, in the lane over j
                GroupAcc a;
                acc_init(a);
                for (int j = grp * vg / 8; j < (grp + 1) * vg / 8; ++j) acc_add(a, Ty<DT>::ld(row[8 * j + g]));
                bd_merge_over_g(a);
                if (g == 0) bd_store_params(pp + ((i64)tok * ng + grp) * 2, a, BITS);
            }
        }
    }
    __syncthreads();
    for (int kk = w; kk < NR / 16; kk += NW) {
#pragma unroll
        for (int mh = 0; mh < 4; ++mh) {
            const int tok = 16 * kk + 8 * (mh >> 1) + 2 * t + (mh & 1);
            const auto* row = xp + (i64)tok * D;
            for (int u = 0; u < nj / R; ++u) {         // pass 2: one word per R channel tiles
                u32 wd = 0u;
#pragma unroll
                for (int i = 0; i < R; ++i) {
                    const int c = 8 * (u * R + i) + g;
                    float s32, m32;
                    bd_load_params(pp + ((i64)tok * ng + c / vg) * 2, s32, m32);
                    wd |= bd_code<BITS>(Ty<DT>::ld(row[c]), s32, m32) << (BITS * i);
                }
                wp[(i64)tok * (D / R) + 8 * u + g] = (u16)wd;
            }
        }
    }
}

// One page's K and V as fp16 (n, N_r, D) each, one thread per element: fp16(fp32(code) * scale + mn),
// saturated at +-65504 before the rounding (sat_f16: numerics.to_out).
template <int BITS, int NW>
__global__ void bd_dequantize(const u16* __restrict__ kw, const u16* __restrict__ kp, const u16* __restrict__ vw,
                              const u16* __restrict__ vp, i64 n, int D, int channel, int kg, int vg,
                              u16* __restrict__ ko, u16* __restrict__ vo) {
    constexpr int R = 16 / BITS;
    constexpr int NR = 8 * NW * R;
    const i64 per = (i64)NR * D;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < 2 * n * per; idx += (i64)gridDim.x * blockDim.x) {
        const bool isv = idx >= n * per;
        const i64 e = isv ? idx - n * per : idx;
        const i64 page = e / per;
        const int rem = (int)(e - page * per), tok = rem / D, c = rem - tok * D;
        u32 word, slot;
        i64 pi;
        if (!isv) {
            const int w = tok / (8 * R), i = (tok % (8 * R)) / 8, g = tok % 8;
            word = kw[page * 8 * NW * D + (i64)(8 * w + g) * D + c];
            slot = i;
            pi = page * (i64)NR * D / kg + (channel ? (i64)(tok / kg) * D + c : (i64)tok * (D / kg) + c / kg);
        } else {
            const int j = c / 8, g = c % 8, u = j / R;
            word = vw[page * (i64)NR * (D / R) + (i64)tok * (D / R) + 8 * u + g];
            slot = j % R;
            pi = page * (i64)NR * (D / vg) + (i64)tok * (D / vg) + c / vg;
        }
        float s32, m32;
        bd_load_params((isv ? vp : kp) + pi * 2, s32, m32);
        const float x = decode((word >> (BITS * slot)) & ((1u << BITS) - 1u), s32, m32);
        (isv ? vo : ko)[e] = f32_to_f16_rn(sat_f16(x));
    }
}
