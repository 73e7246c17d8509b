// kvq CUDA kernels: the fused AQUA-KV decode of one layer (AQUA-KV §3.2-3.3, Algorithm 3 line 5 / 7):
// x_hat = Q^-1(codes) + (y + bias), where y = prev @ W is the predictor's fp32 matrix product (torch)
// and bias its intercept; bit for bit the reference's nx.add(backbone.decode(codes), nx.add(y, bias)).
//
// Numerics (DESIGN.md section 2): HIGGS decode is higgs.cuh's higgs_decode_groups (grid[idx] * scale,
// the fixed-order butterflies, one multiply by FS); uniform decode is float(code) * scale + mn (two
// rounded operations); then + (y + bias), in that order. Every operation is a PTX instruction without
// .ftz, never contracted into FMA (common.cuh ieee_*). Template codes: IB = index bits 8 / 16 / 32,
// BITS = uniform code bits 2 / 4 / 8. has_pred = 0: no predictor (layer 0, or an ablation), x_hat =
// Q^-1(codes).
#include "higgs.cuh"

// Fused AQUA-KV decode, HIGGS backbone: block b takes the token groups [b * R, b * R + R) of
// G = 2^log2G values (group gi = row * NG + col-group), R = rows_per_block(log2G), as higgs_dequant.
// Computes: higgs_decode_groups (the tile in shared memory, x = fwht(grid[idx] * scale)); x = x + (y + bias)
//   (has_pred); fp32 out, the padding past F dropped.
// Grid: (cdiv(NGR, R),), block NT. Bytes: reads NGR * G / D indices, NGR scales, the grid and
//   (has_pred) rows * F fp32 products + F intercepts; writes rows * F fp32.
template <int IB>
__global__ void __launch_bounds__(NT) aqua_higgs(const typename Idx<IB>::T* __restrict__ idx,
                                                 const void* __restrict__ scale, const float* __restrict__ grid,
                                                 const float* __restrict__ y, const float* __restrict__ bias,
                                                 float* __restrict__ out, i64 NGR, i64 F, i64 NG, float FS, int N,
                                                 int log2G, int log2D, int meta_half, int has_pred) {
    __shared__ float buf[TILE];
    higgs_decode_groups<IB>(idx, scale, grid, buf, NGR, F, NG, FS, N, log2G, log2D, meta_half,
                            [&](i64 o, i64 col, float x) {
                                if (has_pred) x = ieee_add(x, ieee_add(y[o], __ldg(bias + col)));
                                out[o] = x;
                            });
}

// Fused AQUA-KV decode, uniform backbone: one code byte per thread (grid-stride). Byte b of row
// b / (F / PER) holds the PER = 8 / BITS codes of channels j * PER .. j * PER + PER - 1 (code k in bits
// [BITS * k, BITS * k + BITS)); channel e belongs to group e / G (metadata row * (F / G) + e / G).
// Computes: x = float(code) * scale + mn; x = x + (y + bias) (has_pred); fp32 out.
// Grid: grid-stride over rows * F / PER bytes, block NT. Bytes: reads the code bytes, 2 rows * F / G
//   metadata (cached) and (has_pred) rows * F fp32 products + F intercepts; writes rows * F fp32.
template <int BITS>
__global__ void __launch_bounds__(NT) aqua_uniform(const u8* __restrict__ codes, const void* __restrict__ scale,
                                                   const void* __restrict__ mn, const float* __restrict__ y,
                                                   const float* __restrict__ bias, float* __restrict__ out,
                                                   i64 nbytes, i64 F, int G, int meta_half, int has_pred) {
    constexpr int PER = 8 / BITS;
    constexpr u32 M = (1u << BITS) - 1u;
    const i64 NB = F / PER;
    const i64 NGF = F / G;
    for (i64 b = (i64)blockIdx.x * NT + threadIdx.x; b < nbytes; b += (i64)gridDim.x * NT) {
        const i64 row = b / NB;
        const i64 j = b - row * NB;
        const u32 byte = codes[b];
        for (int k = 0; k < PER; ++k) {
            const i64 col = j * PER + k;
            const i64 gidx = row * NGF + col / G;
            const float s = meta_half ? f16_to_f32(static_cast<const u16*>(scale)[gidx])
                                      : static_cast<const float*>(scale)[gidx];
            const float m = meta_half ? f16_to_f32(static_cast<const u16*>(mn)[gidx])
                                      : static_cast<const float*>(mn)[gidx];
            const i64 o = row * F + col;
            float x = ieee_add(ieee_mul((float)((byte >> (BITS * k)) & M), s), m);
            if (has_pred) x = ieee_add(x, ieee_add(y[o], __ldg(bias + col)));
            out[o] = x;
        }
    }
}
