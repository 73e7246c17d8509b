// kvq CUDA device helpers shared by the HIGGS kernels (higgs.cu) and the fused AQUA-KV decode
// (aqua.cu): the block shape, IEEE helpers, the index types, the fixed-order butterflies, the halving
// tree, and the HIGGS decode of a tile of token groups. Numerics: higgs.cu's header.
//
// The loader (_loader.py) pastes this file (and common.cuh) in place of `#include "higgs.cuh"`.
#ifndef KVQ_HIGGS_CUH
#define KVQ_HIGGS_CUH

#include "common.cuh"

constexpr int NT = 256;           // threads per block (every kernel here)
constexpr int TILE = 8192;        // fp32 values per block in shared memory (32 KiB): rows / groups <= TILE
constexpr int MAXR = 256;         // HIGGS token groups per block at most (their scales sit in shared memory)

__device__ __forceinline__ float ieee_sqrt(float a) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// a < b as IEEE compares (false when either is NaN), subnormals kept (no .ftz).
__device__ __forceinline__ bool ieee_lt(float a, float b) {
    unsigned r;
    asm("{\n\t.reg .pred p;\n\tsetp.lt.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}" : "=r"(r) : "f"(a), "f"(b));
    return r != 0u;
}

template <int IB> struct Idx;
template <> struct Idx<8> { typedef u8 T; };
template <> struct Idx<16> { typedef u16 T; };
template <> struct Idx<32> { typedef u32 T; };

// Butterfly stages s = 0 .. log2N - 1 on the E values of buf (rows of N = 2^log2N, E a multiple of N):
// stage stride h = 2^s; pair p -> i = (p / h) * 2h + p % h (blocks of 2h never straddle a row).
__device__ __forceinline__ void butterflies(float* buf, int E, int log2N) {
    for (int s = 0; s < log2N; ++s) {
        const int h = 1 << s;
        for (int p = threadIdx.x; p < (E >> 1); p += NT) {
            const int i = ((p >> s) << (s + 1)) | (p & (h - 1));
            const float a = buf[i];
            const float b = buf[i + h];
            buf[i] = ieee_add(a, b);
            buf[i + h] = ieee_sub(a, b);
        }
        __syncthreads();
    }
}

// Halving tree over R rows of G = 2^log2G values of buf: a[i] = a[i] + a[i + h] for h = G/2, ..., 1;
// row r's sum ends in buf[r * G].
__device__ __forceinline__ void halving_tree(float* buf, int R, int log2G) {
    for (int l = log2G - 1; l >= 0; --l) {
        const int h = 1 << l;
        for (int p = threadIdx.x; p < R * h; p += NT) {
            const int i = ((p >> l) << log2G) | (p & (h - 1));
            buf[i] = ieee_add(buf[i], buf[i + h]);
        }
        __syncthreads();
    }
}

__device__ __forceinline__ int rows_per_block(int log2G) { return kvq_min(MAXR, TILE >> log2G); }

// HIGGS decode of block b's token groups [b * R, b * R + R) of G = 2^log2G values (group gi = row * NG +
// col-group), R = rows_per_block(log2G), the tile in buf (TILE floats of shared memory): buf[e] =
// grid[idx] * scale (idx clamped to N - 1: memory safety only; one rounded multiply), the butterflies,
// then store(o, col, x) with x = buf[e] * FS (rounded) for every value of the block, o = row * F + col,
// the padding past F dropped. Shared by higgs_dequant (higgs.cu) and aqua_higgs (aqua.cu).
template <int IB, typename Store>
__device__ __forceinline__ void higgs_decode_groups(const typename Idx<IB>::T* __restrict__ idx,
                                                    const void* __restrict__ scale, const float* __restrict__ grid,
                                                    float* buf, i64 NGR, i64 F, i64 NG, float FS, int N, int log2G,
                                                    int log2D, int meta_half, Store store) {
    const int G = 1 << log2G;
    const int R = rows_per_block(log2G);
    const int E = R << log2G;
    const i64 g0 = (i64)blockIdx.x * R;
    const int nr = (int)(NGR - g0 < R ? NGR - g0 : R);
    for (int e = threadIdx.x; e < E; e += NT) {
        const int r = e >> log2G;
        float y = 0.0f;
        if (r < nr) {
            u32 j = (u32)idx[(g0 << (log2G - log2D)) + (e >> log2D)];
            j = j < (u32)N ? j : (u32)(N - 1);
            const float c = __ldg(grid + (((i64)j) << log2D) + (e & ((1 << log2D) - 1)));
            const float s = meta_half ? f16_to_f32(static_cast<const u16*>(scale)[g0 + r])
                                      : static_cast<const float*>(scale)[g0 + r];
            y = ieee_mul(c, s);
        }
        buf[e] = y;
    }
    __syncthreads();
    butterflies(buf, E, log2G);
    for (int e = threadIdx.x; e < E; e += NT) {
        const int r = e >> log2G;
        if (r >= nr) continue;
        const i64 gi = g0 + r;
        const i64 row = gi / NG;
        const i64 col = (gi - row * NG) * G + (e & (G - 1));
        if (col < F) store(row * F + col, col, ieee_mul(buf[e], FS));
    }
}

#endif  // KVQ_HIGGS_CUH
