// kvq CUDA kernels: the fast Walsh-Hadamard transform and HIGGS (AQUA-KV section 4.1) quantize /
// dequantize, bit for bit the operations of kvq/reference/hadamard.py and higgs.py.
//
// Numerics (DESIGN.md section 2): butterfly stage s = 0, 1, ... uses stride h = 2^s and replaces
// (x[i], x[i + h]) by (a + b, a - b); after the last stage one multiply by FS = float32(1/sqrt(d)),
// a host constant. The HIGGS sum of squares is the halving tree a[:h] + a[h:] for h = g/2, ..., 1;
// rms = sqrt_rn(div_rn(ss, g)); z = div_rn(fwht(x), scale_s) (0 where scale_s == 0); the nearest grid
// point accumulates (v_k - c_jk)^2 over k in order and keeps the first minimum (strict <).
// Every operation that feeds a stored bit is a PTX instruction without .ftz (common.cuh ieee_*, and
// ieee_sqrt / ieee_lt of higgs.cuh), never contracted into FMA, so results do not depend on -ftz / --fmad.
// Template codes: DT / DTO = 0 fp16, 1 bf16, 2 fp32 (common.cuh); IB = index bits 8 / 16 / 32.
//
// Work layout: a block of NT threads holds a TILE of fp32 values in shared memory: whole rows (fwht)
// or R = min(MAXR, TILE / G) whole token groups (HIGGS), so every stage is a pass over the tile
// between two __syncthreads.
#include "higgs.cuh"

// Row FWHT: block b takes the TILE values [b * TILE, b * TILE + TILE) of x, i.e. TILE / N whole rows of
// N = 2^log2N values (the last block is partial; zeros fill the tile and are not stored).
// Computes: the log2N butterfly stages, then, if scale, one rounded multiply by FS; fp32 out.
// Grid: (cdiv(total, TILE),), block NT. Bytes: reads total inputs, writes total fp32.
template <int DT>
__global__ void __launch_bounds__(NT) fwht_rows(const typename Ty<DT>::S* __restrict__ x, float* __restrict__ out,
                                                i64 total, int log2N, float FS, int scale) {
    __shared__ float buf[TILE];
    const i64 base = (i64)blockIdx.x * TILE;
    for (int e = threadIdx.x; e < TILE; e += NT)
        buf[e] = base + e < total ? Ty<DT>::ld(x[base + e]) : 0.0f;
    __syncthreads();
    butterflies(buf, TILE, log2N);
    for (int e = threadIdx.x; e < TILE; e += NT)
        if (base + e < total) out[base + e] = scale ? ieee_mul(buf[e], FS) : buf[e];
}

// One late stage (stride H >= the row block of fwht_rows) on rows of 2 * HALF fp32 values, in place.
// Computes: pair p of row p / HALF, q = p % HALF, i = (q / H) * 2H + q % H: (y[i], y[i+H]) ->
// (a + b, a - b), then, if scale (the last stage), each times FS (rounded).
// Grid: grid-stride over P pairs, block NT. Bytes: reads and writes 2P fp32.
__global__ void __launch_bounds__(NT) fwht_stage(float* __restrict__ y, i64 P, i64 HALF, i64 H, float FS,
                                                 int scale) {
    for (i64 p = (i64)blockIdx.x * NT + threadIdx.x; p < P; p += (i64)gridDim.x * NT) {
        const i64 row = p / HALF;
        const i64 q = p - row * HALF;
        const i64 i = row * (2 * HALF) + (q / H) * (2 * H) + q % H;
        const float a = y[i];
        const float b = y[i + H];
        float s = ieee_add(a, b);
        float t = ieee_sub(a, b);
        if (scale) {
            s = ieee_mul(s, FS);
            t = ieee_mul(t, FS);
        }
        y[i] = s;
        y[i + H] = t;
    }
}

// Sum of squares by the halving tree (higgs.group_sum_of_squares): rows of G = 2^log2G contiguous
// values; block b takes rows [b * R, b * R + R), R = rows_per_block(log2G).
// Grid: (cdiv(nrows, R),), block NT. Bytes: reads nrows * G inputs, writes nrows fp32.
template <int DT>
__global__ void __launch_bounds__(NT) higgs_ss(const typename Ty<DT>::S* __restrict__ x, float* __restrict__ out,
                                               i64 nrows, int log2G) {
    __shared__ float buf[TILE];
    const int R = rows_per_block(log2G);
    const int E = R << log2G;
    const i64 r0 = (i64)blockIdx.x * R;
    const int nr = (int)(nrows - r0 < R ? nrows - r0 : R);
    for (int e = threadIdx.x; e < E; e += NT) {
        const float v = (e >> log2G) < nr ? Ty<DT>::ld(x[(r0 << log2G) + e]) : 0.0f;
        buf[e] = ieee_mul(v, v);
    }
    __syncthreads();
    halving_tree(buf, R, log2G);
    for (int r = threadIdx.x; r < nr; r += NT) out[r0 + r] = buf[r << log2G];
}

// Index of the nearest of the N grid points (N, D) to the D values v (fp32): dist_j = (v_0 - c_j0)^2,
// then + (v_k - c_jk)^2 for k = 1 .. D-1 (each rounded), kept on a strict < (ties to the lowest j).
__device__ __forceinline__ u32 nearest_point(const float* v, const float* __restrict__ grid, int N, int D) {
    float best = KVQ_INF;
    u32 idx = 0;
    for (int j = 0; j < N; ++j) {
        const float* c = grid + (i64)j * D;
        float t = ieee_sub(v[0], __ldg(c));
        float dist = ieee_mul(t, t);
        for (int k = 1; k < D; ++k) {
            t = ieee_sub(v[k], __ldg(c + k));
            dist = ieee_add(dist, ieee_mul(t, t));
        }
        if (ieee_lt(dist, best)) {
            best = dist;
            idx = (u32)j;
        }
    }
    return idx;
}

constexpr int MAXD = 16;          // HIGGS vector dimension d at most (registers per nearest-point search)

// Nearest grid point of M vectors of D (higgs.nearest): one vector per thread, int64 out.
// Grid: grid-stride over M, block NT. Bytes: reads M * D fp32 and the grid (cached), writes M int64.
__global__ void __launch_bounds__(NT) higgs_nearest(const float* __restrict__ v, const float* __restrict__ grid,
                                                    i64* __restrict__ out, i64 M, int N, int D) {
    for (i64 m = (i64)blockIdx.x * NT + threadIdx.x; m < M; m += (i64)gridDim.x * NT) {
        float w[MAXD];
        for (int k = 0; k < D; ++k) w[k] = v[m * D + k];
        out[m] = (i64)nearest_point(w, grid, N, D);
    }
}

// Fused HIGGS quantizer: block b takes the token groups [b * R, b * R + R) of G = 2^log2G values
// (group gi = row * NG + col-group; x is (rows, F), zero-padded past F), R = rows_per_block(log2G).
// Computes: ss = halving tree of x * x; rms = sqrt_rn(div_rn(ss, G)); scale stored in the metadata
//   dtype (meta_half: fp16, else fp32), s32 = the stored value; the x tile is loaded again,
//   butterflies(x) * FS, z = div_rn(., s32) (0 where s32 == 0); each D-vector's nearest grid point
//   stored as an IB-bit index. NaN / inf input propagates into the scale (checked by the host).
// Grid: (cdiv(NGR, R),), block NT. Bytes: reads NGR * G inputs (twice, the second from L2) and the
//   grid (N * D fp32, cached); writes NGR * G / D indices and NGR scales.
template <int DT, int IB>
__global__ void __launch_bounds__(NT) higgs_quant(const typename Ty<DT>::S* __restrict__ x,
                                                  const float* __restrict__ grid, typename Idx<IB>::T* __restrict__ idx,
                                                  void* __restrict__ scale, i64 NGR, i64 F, i64 NG, float FS, int N,
                                                  int log2G, int log2D, int meta_half) {
    __shared__ float buf[TILE];
    __shared__ float sc[MAXR];
    const int G = 1 << log2G;
    const int D = 1 << log2D;
    const int R = rows_per_block(log2G);
    const int E = R << log2G;
    const i64 g0 = (i64)blockIdx.x * R;
    const int nr = (int)(NGR - g0 < R ? NGR - g0 : R);
    // element e of the tile: group g0 + (e >> log2G), column (group % NG) * G + (e & (G - 1)) of its row
    for (int pass = 0; pass < 2; ++pass) {
        for (int e = threadIdx.x; e < E; e += NT) {
            const int r = e >> log2G;
            float v = 0.0f;
            if (r < nr) {
                const i64 gi = g0 + r;
                const i64 row = gi / NG;
                const i64 col = (gi - row * NG) * G + (e & (G - 1));
                if (col < F) v = Ty<DT>::ld(x[row * F + col]);
            }
            buf[e] = pass == 0 ? ieee_mul(v, v) : v;
        }
        __syncthreads();
        if (pass == 0) {
            halving_tree(buf, R, log2G);
            for (int r = threadIdx.x; r < nr; r += NT) {
                const float rms = ieee_sqrt(ieee_div(buf[r << log2G], (float)G));
                float s32;
                if (meta_half) {
                    const u16 h = f32_to_f16_rn(rms);                  // numerics.to_meta
                    static_cast<u16*>(scale)[g0 + r] = h;
                    s32 = f16_to_f32(h);
                } else {
                    static_cast<float*>(scale)[g0 + r] = rms;
                    s32 = rms;
                }
                sc[r] = s32;
            }
            __syncthreads();                                           // sums read before the reload
        }
    }
    butterflies(buf, E, log2G);
    const int nv = nr << (log2G - log2D);                              // vectors of this block's groups
    for (int vi = threadIdx.x; vi < nv; vi += NT) {
        const float s32 = sc[(vi << log2D) >> log2G];
        float w[MAXD];
        for (int k = 0; k < D; ++k) {
            const float y = ieee_mul(buf[(vi << log2D) + k], FS);
            w[k] = is_zero(s32) ? 0.0f : ieee_div(y, s32);
        }
        idx[(g0 << (log2G - log2D)) + vi] = (typename Idx<IB>::T)nearest_point(w, grid, N, D);
    }
}

// Fused HIGGS decoder: block b takes the token groups [b * R, b * R + R) (as higgs_quant).
// Computes: c = grid[idx] (idx clamped to N - 1: memory safety only), y = c * scale (rounded),
//   butterflies(y) * FS, rounded into DTO (fp16 saturated: numerics.to_out), the padding past F dropped.
// Grid: (cdiv(NGR, R),), block NT. Bytes: reads NGR * G / D indices, NGR scales, the grid; writes
//   rows * F values.
template <int DTO, int IB>
__global__ void __launch_bounds__(NT) higgs_dequant(const typename Idx<IB>::T* __restrict__ idx,
                                                    const void* __restrict__ scale, const float* __restrict__ grid,
                                                    typename Ty<DTO>::S* __restrict__ out, i64 NGR, i64 F, i64 NG,
                                                    float FS, int N, int log2G, int log2D, int meta_half) {
    __shared__ float buf[TILE];
    higgs_decode_groups<IB>(idx, scale, grid, buf, NGR, F, NG, FS, N, log2G, log2D, meta_half,
                            [&](i64 o, i64, float x) { out[o] = Ty<DTO>::st(sat_out<DTO>(x)); });
}
