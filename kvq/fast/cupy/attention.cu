// kvq CUDA kernels: FP16 / BF16 / FP32 flash-decoding (split-K decode attention) and its merge.
//
// Mirrors kvq/reference/attention.py (partial_attention, merge, decode_attention) within numerics
// contract rule 7 (order-dependent reductions: fp32 accumulation, not bit-exact).
//   q (B, H_q, T_q, D); each KV segment k, v (B, H_kv, T, D); query head h reads kv head h / (H_q/H_kv).
//   No mask: every query row sees every key (decode).
// CuPy compiles with -ftz=true: subnormal intermediates flush to zero here, which rule 7's tolerance
// covers (the bit-exact kernels of quant.cu avoid it).
// Template codes: DT = 0 fp16, 1 bf16, 2 fp32 (common.cuh); D in {16, 32, 64, 128, 256} (fp32: <= 128);
// QT = query rows per block (4 or 8); NW = warps per block (chosen by the loader, attn_warps()).
#include "attn_split.cuh"


// ---- split kernel (its body: attn_split.cuh) -------------------------------------------------------

// SD: how the scores' dot products are summed (attn_split.cuh): double where PRECISE, and by default for
// fp32 data with half-precision queries (the paged decode's gathered tail, which names SD: 1 double, 2
// four fp32 chains, like paged_tail_attn); else one fp32 chain.
template <int DT, int D, int QT, int NW, int PRECISE = (DT == 2), int QDT = DT,
          int SD = ((PRECISE || (DT == 2 && QDT != 2)) ? 1 : 0)>
__global__ void __launch_bounds__(NW * 32)
    attn_split(const typename Ty<QDT>::S* __restrict__ q, const typename Ty<DT>::S* __restrict__ k,
               const typename Ty<DT>::S* __restrict__ v, float* __restrict__ o_part,
               float* __restrict__ lse_part, i64 sq_b, i64 sq_h, i64 sq_t, i64 sk_b, i64 sk_h, i64 sk_t,
               i64 sv_b, i64 sv_h, i64 sv_t, int B, int Hq, int Hkv, int Tq, i64 T, i64 chunk, int num_splits,
               int split0, float qk_scale) {
    const CopyTiles<DT, D> tiles{k, v, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t};
    attn_split_body<DT, D, QT, NW, PRECISE, QDT, SD>(
        q, tiles, o_part, lse_part, sq_b, sq_h, sq_t, B, Hq, Hkv, Tq, T, chunk, num_splits, split0, qk_scale);
}

// ---- merge kernel --------------------------------------------------------------------------------
// Computes: per row (of rows = B * H_q * T_q) and dim d, over the S partials s:
//   M = max_s lse_s; w_s = exp(lse_s - M); o = sum_s w_s o_s / sum_s w_s (rounded to DTO);
//   lse = M + log(sum_s w_s); rows whose partials are all -inf get o = 0, lse = -inf.
//   o_part is (S, rows, D) fp32, lse_part (S, rows) fp32, natural log.
// Grid: one block per row, NT = 256 or 1024 threads (blockDim; 1024 where there are few rows, so that
//   each thread's chain of partial loads is short: at batch 1 a row's ~70 partials took 5.7 us with 256):
//   the S weights are computed once into shared memory (block max and sum), then thread (j, d) (d < D,
//   j < NT / D) sums the partials s = j, j + NT / D, ... of dim d (independent loads, four in flight) and
//   the NT / D sums are added through shared memory.
// Dynamic shared memory: (S + NT + 64) * 4 bytes.
// Bytes: reads S * (D + 1) fp32 per row; writes D outputs + 1 lse per row.
template <int DTO>
__global__ void __launch_bounds__(1024) attn_merge(const float* __restrict__ o_part,
                                                  const float* __restrict__ lse_part,
                                                  typename Ty<DTO>::S* __restrict__ out,
                                                  float* __restrict__ lse_out, i64 rows, int D, int S) {
    extern __shared__ float smf[];
    float* w = smf;                                // [S]
    const int nt = blockDim.x, nwarps = nt >> 5;
    float* red = smf + S;                          // [nt]
    float* wr = red + nt;                          // [64]: per-warp reductions (nwarps <= 32)
    const i64 row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float M = -KVQ_INF;
    for (int s = tid; s < S; s += nt) {
        const float ls = lse_part[(i64)s * rows + row];
        w[s] = ls;
        M = fmaxf(M, ls);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(KVQ_FULL_MASK, M, off));
    if (lane == 0) wr[warp] = M;
    __syncthreads();
    M = wr[0];
    for (int i = 1; i < nwarps; ++i) M = fmaxf(M, wr[i]);
    float L = 0.0f;
    for (int s = tid; s < S; s += nt) {
        const float x = M == -KVQ_INF || w[s] == -KVQ_INF ? 0.0f : expf(w[s] - M);
        w[s] = x;
        L += x;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(KVQ_FULL_MASK, L, off);
    if (lane == 0) wr[32 + warp] = L;
    __syncthreads();                               // w[] and the partial sums are ready
    L = 0.0f;
    for (int i = 0; i < nwarps; ++i) L += wr[32 + i];
    const int ns = nt / D;                         // partial groups
    const int j = tid / D, d = tid - (tid / D) * D;
    float A = 0.0f;
    if (j < ns) {
        const float* op = o_part + row * D + d;
        const i64 step = rows * D;
        int s = j;
        for (; s + 3 * ns < S; s += 4 * ns) {
            const float o0 = op[(i64)s * step], o1 = op[(i64)(s + ns) * step];
            const float o2 = op[(i64)(s + 2 * ns) * step], o3 = op[(i64)(s + 3 * ns) * step];
            A = fmaf(w[s], o0, A);
            A = fmaf(w[s + ns], o1, A);
            A = fmaf(w[s + 2 * ns], o2, A);
            A = fmaf(w[s + 3 * ns], o3, A);
        }
        for (; s < S; s += ns) A = fmaf(w[s], op[(i64)s * step], A);
        red[tid] = A;
    }
    __syncthreads();
    if (tid < D) {
        A = red[tid];
        for (int i = 1; i < ns; ++i) A += red[i * D + tid];
        out[row * D + tid] = Ty<DTO>::st(L > 0.0f ? A / L : 0.0f);
        if (tid == 0) lse_out[row] = L > 0.0f ? M + logf(L) : -KVQ_INF;
    }
}
