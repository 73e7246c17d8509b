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
//   (wpr), lane l of a warp holding dims 32 i + l (i < NDL) of the block's 32 NDL dims (blockIdx.y).
//   The partials come in chunks of CH = 8, every load of a chunk in flight together, the first issued
//   before the max lse is known; warp k of a row takes the chunks k, k + W, ... (a decode merges 10-40
//   partials: each warp then waits on L2 a few times, where a block per row with barriers between its
//   phases took 5-8 us on the H100). Each warp sums its chunks' partials in order (one fma chain per
//   dim) and its weights per lane (lane c: the chunk's partial c) then across lanes (xor butterfly);
//   with W > 1 the W warps' sums meet in shared memory, added in warp order. Any S.
// Bytes: reads S * (D + 1) fp32 per row; writes D outputs + 1 lse per row.
template <int DTO, int NDL>
__global__ void __launch_bounds__(128) attn_merge(const float* __restrict__ o_part,
                                                 const float* __restrict__ lse_part,
                                                 typename Ty<DTO>::S* __restrict__ out,
                                                 float* __restrict__ lse_out, i64 rows, int D, int S, int wpr) {
    constexpr int CH = 8;                          // partials whose loads are in flight together
    constexpr int NWB = 4;                         // warps per block (the launch bounds' 128 threads)
    __shared__ float s_a[NWB][32 * NDL], s_l[NWB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k = warp % wpr;                      // this warp's share of its row's chunks
    const i64 row = (i64)blockIdx.x * (NWB / wpr) + warp / wpr;
    const bool valid = row < rows;                 // (whole warps; every warp reaches the barrier)
    const int d0 = blockIdx.y * 32 * NDL + lane;   // this lane's dims d0 + 32 i
    const i64 step = rows * (i64)D;
    const float* op = o_part + (valid ? row : 0) * D;
    float o[CH][NDL];
    auto load = [&](int base) {
#pragma unroll
        for (int c = 0; c < CH; ++c)
#pragma unroll
            for (int i = 0; i < NDL; ++i) {
                const int s = base + c, d = d0 + 32 * i;
                o[c][i] = valid && s < S && d < D ? op[(i64)s * step + d] : 0.0f;
            }
    };
    load(k * CH);
    float M = -KVQ_INF;
    if (valid)
        for (int s = lane; s < S; s += 32) M = fmaxf(M, lse_part[(i64)s * rows + row]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(KVQ_FULL_MASK, M, off));
    float L = 0.0f, A[NDL];
#pragma unroll
    for (int i = 0; i < NDL; ++i) A[i] = 0.0f;
    for (int base = k * CH; base < S; base += wpr * CH) {
        if (base > k * CH) load(base);
        const int sw = base + (lane & (CH - 1));   // lane c (and c + CH, ...): the weight of partial base + c
        const float ls = valid && sw < S ? lse_part[(i64)sw * rows + row] : -KVQ_INF;
        const float w = M == -KVQ_INF || ls == -KVQ_INF ? 0.0f : expf(ls - M);
        if (lane < CH) L += w;
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const float wc = __shfl_sync(KVQ_FULL_MASK, w, c);
#pragma unroll
            for (int i = 0; i < NDL; ++i) A[i] = fmaf(wc, o[c][i], A[i]);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(KVQ_FULL_MASK, L, off);
    if (wpr > 1) {                                 // the row's W warps' sums, added in warp order
#pragma unroll
        for (int i = 0; i < NDL; ++i) s_a[warp][32 * i + lane] = A[i];
        if (lane == 0) s_l[warp] = L;
        __syncthreads();
        if (k != 0) return;
        for (int w2 = 1; w2 < wpr; ++w2) {
#pragma unroll
            for (int i = 0; i < NDL; ++i) A[i] += s_a[warp + w2][32 * i + lane];
            L += s_l[warp + w2];
        }
    }
    if (!valid) return;
#pragma unroll
    for (int i = 0; i < NDL; ++i) {
        const int d = d0 + 32 * i;
        if (d < D) out[row * D + d] = Ty<DTO>::st(L > 0.0f ? A[i] / L : 0.0f);
    }
    if (blockIdx.y == 0 && lane == 0) lse_out[row] = L > 0.0f ? M + logf(L) : -KVQ_INF;
}
