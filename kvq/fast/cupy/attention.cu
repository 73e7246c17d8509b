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

// SD: how the scores' dot products are summed (attn_split.cuh): by default double where PRECISE, else one
// fp32 chain; the paged decode's gathered tail (fp32 data, half-precision queries) names it: 1 double, 2
// four fp32 chains, like paged_tail_attn.
template <int DT, int D, int QT, int NW, int PRECISE = (DT == 2), int QDT = DT, int SD = PRECISE>
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
// Grid: (ceil(rows / (4 / W)), ceil(D / (32 NDL))), blocks of 4 warps; W = 1, 2 or 4 warps per row
//   (wpr), lane l of a warp holding dims 32 i + l (i < NDL) of the block's 32 NDL dims (blockIdx.y);
//   each row's sums by merge_row (attn_split.cuh). Any S.
// Bytes: reads S * (D + 1) fp32 per row; writes D outputs + 1 lse per row.
template <int DTO, int NDL>
__global__ void __launch_bounds__(128) attn_merge(const float* __restrict__ o_part,
                                                 const float* __restrict__ lse_part,
                                                 typename Ty<DTO>::S* __restrict__ out,
                                                 float* __restrict__ lse_out, i64 rows, int D, int S, int wpr) {
    constexpr int NWB = 4;                         // warps per block (the launch bounds' 128 threads)
    __shared__ float s_a[NWB][32 * NDL], s_l[NWB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row = (i64)blockIdx.x * (NWB / wpr) + warp / wpr;
    const int d0 = blockIdx.y * 32 * NDL + lane;   // this lane's dims d0 + 32 i
    float A[NDL], M, L;
    if (!merge_row<NDL>(o_part, lse_part, rows, D, S, row, row < rows, warp % wpr, wpr, warp, lane, d0, &s_a[0][0],
                        s_l, A, M, L))
        return;
#pragma unroll
    for (int i = 0; i < NDL; ++i) {
        const int d = d0 + 32 * i;
        if (d < D) out[row * D + d] = Ty<DTO>::st(sat_out<DTO>(L > 0.0f ? A[i] / L : 0.0f));
    }
    if (blockIdx.y == 0 && lane == 0) lse_out[row] = L > 0.0f ? M + logf(L) : -KVQ_INF;
}
