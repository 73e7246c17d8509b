// kvq CUDA kernel: fused INT2 decode attention over the OSCAR cache's paged history (kvq/reference/oscar.py,
// section 4 and Algorithm 1 of App. B), on the tensor cores.
//
// Mirrors the history segment of kvq/reference/oscar.py decode_attention within numerics contract rule 7
// (order-dependent reductions: the tolerance rule); the codes are exact fp16 numbers and every
// dequantization factor enters in fp32.
//
// Layout (kvq.fast._oscar.OSCARTensorState, all in the rotated frame), per pool page p and kv head h:
//   k_codes / v_codes (Pg = 128 tokens, D / 4 bytes) u8: 2-bit codes packed along channels (byte j of a
//   token row holds channels 4j .. 4j + 3 at bits 0, 2, 4, 6), k_scale / k_mn / v_scale / v_mn (Pg, D / G)
//   fp16 with one group per token here (G = D = 128); table (B, N) int32: page j of sequence b holds the
//   history tokens [j Pg, j Pg + Pg).
#include "mma.cuh"
#include "attn_split.cuh"

// Computes: the partials of the INT2 history of the OSCAR cache for the (at most 8) query rows of kv head
//   (b, hk) (row r -> query head hk * G_q + r / T_q, token r % T_q) over the pages [split * pps,
//   min(split * pps + pps, NP)) (history tokens >= NH masked): s = (q_rot . k) * scale * log2(e) with
//   k = code * scale_k + mn_k per token, online softmax in base 2, o = sum 2^(s - m) v / l with v = code *
//   scale_v + mn_v; writes partial `split` in attention.cu's layout (o_part / lse_part, natural log).
//   q is the rotated query, fp32 (B, H_q, T_q, D) with strides.
// Scores: S^T (tokens x rows) = codes_K . q~^T on the s8 tensor cores (mma m16n8k32: the codes as u8,
//   exact; q~ = q / max|q_row| as Q = rint(2^30 q~), |Q| <= 2^30 + 2^7, in four signed base-256 digits d0
//   (the top) .. d3, one digit per column: NR = 4 d0 / d1 of rows 0-3 in columns 0-3 / 4-7 of one n-tile,
//   d2 / d3 in a second; NR = 8 one n-tile per digit), so the digit sums Dn = sum_c code_c dn_c are exact
//   s32 and sum_c code_c q~_c = 2^-22 (2^16 D0 + D2) + 2^-30 (2^16 D1 + D3), each bracket exact in s32,
//   rounded once to fp32 ("hi" and 2^11 times "lo": the operands page_softmax_pv takes, hi + 2^-11 lo);
//   then s = max|q_row| (scale_k (hi + 2^-11 lo) + mn_k sum_c q~_c) per token (scale and min per token:
//   they multiply the product, not the operand). Fragment orders: m-tile mt, row g <-> token 16 g + 2 mt,
//   row g + 8 <-> token 16 g + 2 mt + 1 (their 32-byte rows are adjacent in shared memory); k-step kq <->
//   field kq (bits 2 kq, 2 kq + 1) of bytes 8 t .. 8 t + 7 of a token row (one 8-byte load per token and
//   m-tile; the 4 fields of a word are 4 registers by a shift and a mask), k 4t + i <-> channel 32 t + 4 i +
//   kq, k 16 + 4t + i <-> channel 32 t + 16 + 4 i + kq. (On fp16 tensor cores, the codes as exact fp16 by a
//   lop3 and a fma.f16x2 per two codes and q~ as fp16 hi + 2^-11 lo, the decode took 12% longer at 8 x
//   64K and 9% at 1 x 128K: lab/2026-11-22-oscar-decode/results/h100-imma-ab.)
// Softmax and P . V: page_softmax_pv (mma.cuh), the value page has the layout of a KIVI value page.
// Grid: (num_splits, H_kv, B); block NW * 32 threads, each warp its own pages with a key and a value
//   slot in shared memory (cp.async: the next page's keys load during this page's softmax and P . V,
//   its values during the next scores; the key codes XOR-swizzled in 16-byte chunks, warp_copy_c<...,
//   true>, so that the lanes' row reads are free of bank conflicts); warps combined at the end.
// Dynamic shared memory: 8 * D * 4 (the queries, fp32) + NW * 2 * (Pg * 32 + 4 * Pg).
// Prologue: each warp sends its first page's copies before the queries load (the round trip overlaps the
//   prologue), then builds its q~ digit fragments.
// Bytes: reads each packed K / V page of the split and its metadata once, the page-table entries and
//   the queries; writes (D + 1) fp32 per query row and split.
// Registers at NR = 4: 161 from nvcc for sm_90, 155 in the H100 run (ncu), so at most 3 blocks per SM (a
// bound of 4 blocks spilled 136 bytes).
template <int NR>
__global__ void __launch_bounds__(KVQ_MMA_MAXW * 32, 3)
    oscar_decode_mma(const float* __restrict__ q, i64 sq_b, i64 sq_h, i64 sq_t, const u8* __restrict__ kc,
                     const u16* __restrict__ ks, const u16* __restrict__ km, const u8* __restrict__ vc,
                     const u16* __restrict__ vs, const u16* __restrict__ vm, const int* __restrict__ table,
                     int n_tab, float* __restrict__ o_part, float* __restrict__ lse_part, int B, int Hq, int Hkv,
                     int Tq, int NH, int NP, int pps, int num_splits, float qk_scale) {
    constexpr int D = 128, PG = 128, ROW = 32, QT = 8;
    constexpr int S_OFF = PG * ROW, M_OFF = S_OFF + 2 * PG, SLOT = M_OFF + 2 * PG;
    extern __shared__ u32x4 dsmem4[];
    __shared__ float s_m[KVQ_MMA_MAXW][QT], s_l[KVQ_MMA_MAXW][QT], s_qmax[QT], s_qrcp[QT], s_qsum[QT];
    u8* dsmem = reinterpret_cast<u8*>(dsmem4);
    float* s_q = reinterpret_cast<float*>(dsmem);                     // [QT][D] q * qk_scale, fp32

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int NW = blockDim.x >> 5;
    const int split = (int)(blockIdx.x % (unsigned)num_splits);
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int Gq = Hq / Hkv;
    const int nq = kvq_min(QT, Gq * Tq);
    u8* kslot = dsmem + QT * D * 4 + warp * 2 * SLOT;
    u8* vslot = kslot + SLOT;
    const int p0 = split * pps;
    const int p1 = kvq_min(p0 + pps, NP);

    // stage the key (SWZ: codes XOR-swizzled) or value half of pool page `page` (its table entry, read
    // ahead: the copies wait on no global load) into a slot
    auto stage = [&](auto swz, u8* slot, const u8* codes, const u16* sc, const u16* mn, int page) {
        const i64 ph = (i64)kvq_max_i(page, 0) * Hkv + hk;
        warp_copy_c<PG * ROW, decltype(swz)::value>(slot, codes + ph * (PG * ROW), lane);
        warp_copy_c<PG * 2>(slot + S_OFF, reinterpret_cast<const u8*>(sc + ph * PG), lane);
        warp_copy_c<PG * 2>(slot + M_OFF, reinterpret_cast<const u8*>(mn + ph * PG), lane);
    };
    const KvqBool<true> KEYS;
    const KvqBool<false> VALUES;
    const int* tab = table + (i64)b * n_tab;
    // the first page's copies go out before the queries load: its round trip overlaps the prologue
    int j = p0 + warp;
    if (j < p1) stage(KEYS, kslot, kc, ks, km, tab[j]);
    p_commit();
    if (j < p1) stage(VALUES, vslot, vc, vs, vm, tab[j]);
    p_commit();

    mma_load_queries<D, false>(s_q, nullptr, nullptr, s_qmax, s_qrcp, q, 2, sq_b, sq_h, sq_t, b, hk, Gq, Tq, nq,
                               qk_scale);
    if (tid < 32) {                                // sum_c q~_c per row (fp32): the factor of mn_k
        float sm = 0.0f;
        const float r = s_qrcp[lane & 7];
        for (int c = 32 * (lane >> 3); c < 32 * (lane >> 3) + 32; ++c) sm += s_q[(lane & 7) * D + c] * r;
        sm += __shfl_xor_sync(KVQ_FULL_MASK, sm, 8);
        sm += __shfl_xor_sync(KVQ_FULL_MASK, sm, 16);
        if (lane < QT) s_qsum[lane] = sm;
    }
    __syncthreads();

    // the B fragments (constant) of the 4 k-steps kq (32 channels each: c = 32 t + 16 jr + 4 i + kq for
    // register jr, byte i) and the NT n-tiles: column g <-> digit nt (NR = 8) or 2 nt + (g >= 4) (NR = 4) of
    // row rb; Q = rint(2^30 q~) = 2^24 d0 + 2^16 d1 + 2^8 d2 + d3 with d1 .. d3 in [-128, 127], |d0| <= 65
    constexpr int NT = NR == 8 ? 4 : 2;
    const int rb = NR == 4 ? (g & 3) : g;
    const bool odd_digit = NR == 4 && g >= 4;
    // The digits of a channel in one word: W = (Q + 0x808080) ^ 0x808080 holds d3, d2, d1 in bytes 0, 1, 2
    // as s8 (byte k of Q + 0x808080 is d + 128 in [0, 255]; the bias carries nothing) and d0 in byte 3 (the
    // top of the sum, |d0| <= 65); digit dk is byte 3 - k, and three byte permutes gather it from the words
    // of the register's 4 channels (the same digits as a shift-and-subtract chain, in 2 + 3 / 4 operations
    // a channel, not ~20: this runs in every warp's prologue)
    u32 bq[4][2 * NT];
    {
        const float r = s_qrcp[rb];
#pragma unroll
        for (int kq = 0; kq < 4; ++kq)
#pragma unroll
            for (int jr = 0; jr < 2; ++jr) {
                u32 w[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int c = 32 * t + 16 * jr + 4 * i + kq;
                    const int Q = __float2int_rn(s_q[rb * D + c] * r * 1073741824.0f);
                    w[i] = ((u32)Q + 0x00808080u) ^ 0x00808080u;
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const u32 k = NR == 8 ? (u32)nt : (u32)(2 * nt + odd_digit);   // the digit
                    const u32 sel = (3u - k) | ((7u - k) << 4);                     // byte 3 - k of a, of b
                    const u32 lo2 = __byte_perm(w[0], w[1], sel), hi2 = __byte_perm(w[2], w[3], sel);
                    bq[kq][2 * nt + jr] = __byte_perm(lo2, hi2, 0x5410);
                }
            }
    }
    // the query rows of this thread's scores: NR = 8: 2t, 2t + 1; NR = 4: 2 (t % 2) + {0, 1}
    const int r0 = NR == 4 ? 2 * (t & 1) : 2 * t;
    const float qmax0 = s_qmax[r0], qmax1 = s_qmax[r0 + 1];
    const float qs0 = s_qsum[r0], qs1 = s_qsum[r0 + 1];

    float m0 = -KVQ_INF, m1 = -KVQ_INF, l0 = 0.0f, l1 = 0.0f, bs0 = 0.0f, bs1 = 0.0f;
    float O[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) O[i][e] = 0.0f;

    for (; j < p1; j += NW) {                      // uniform across the warp
        const bool more = j + NW < p1;
        const int pn = more ? tab[j + NW] : 0;     // the next page's table entry, loaded now
        p_wait<1>();                               // the keys of page j
        __syncwarp();
        const int nvalid = kvq_min(PG, NH - j * PG);

        // ---- S^T = codes_K . q~^T (hi / lo)
        float S[8][4], SL[NR == 8 ? 8 : 1][4];
        // k-step kq: field kq of bytes 8 t .. 8 t + 7 of the token rows; hi / lo as the header says
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
            int acc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] = 0;
            const u8* rows = kslot + 512 * g + 8 * (t & 1);
            const uint2 xa = *reinterpret_cast<const uint2*>(rows + 16 * ((4 * mt + (t >> 1)) ^ g));
            const uint2 xb = *reinterpret_cast<const uint2*>(rows + 16 * ((4 * mt + 2 + (t >> 1)) ^ g));
#pragma unroll
            for (int kq = 0; kq < 4; ++kq) {
                const u32 a[4] = {(xa.x >> (2 * kq)) & 0x03030303u, (xb.x >> (2 * kq)) & 0x03030303u,
                                  (xa.y >> (2 * kq)) & 0x03030303u, (xb.y >> (2 * kq)) & 0x03030303u};
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) imma16832(acc[nt], a, bq[kq][2 * nt], bq[kq][2 * nt + 1]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (NR == 8) {
                    S[mt][e] = (float)(acc[0][e] * 65536 + acc[2][e]) * (1.0f / 4194304.0f);
                    SL[mt][e] = (float)(acc[1][e] * 65536 + acc[3][e]) * (1.0f / 524288.0f);
                } else {                           // t < 2: D0, D2 (hi); t >= 2: D1, D3 (2^11 lo)
                    S[mt][e] = (float)(acc[0][e] * 65536 + acc[1][e]) * (t >= 2 ? 1.0f / 524288.0f
                                                                                 : 1.0f / 4194304.0f);
                }
            }
        }
        __syncwarp();
        const u16* kss = reinterpret_cast<const u16*>(kslot + S_OFF);
        const u16* kms = reinterpret_cast<const u16*>(kslot + M_OFF);
        // scale and min of this thread's tokens (16 g + 2 mt, + 1), before the slot is reused
        u32 ksc[8], kmn[8];
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
            ksc[mt] = *reinterpret_cast<const u32*>(kss + 16 * g + 2 * mt);
            kmn[mt] = *reinterpret_cast<const u32*>(kms + 16 * g + 2 * mt);
        }
        __syncwarp();
        if (more) stage(KEYS, kslot, kc, ks, km, pn);
        p_commit();

        // ---- scores of row r0 + e and this thread's token: max|q_row| (scale (hi + 2^-11 lo) + mn sum q~)
        page_softmax_pv<NR>(S, SL, [&](int e, float hi, float lo, int mt, int odd) {
            const float sc = odd ? h_hi(ksc[mt]) : h_lo(ksc[mt]), mn = odd ? h_hi(kmn[mt]) : h_lo(kmn[mt]);
            const float qm = e ? qmax1 : qmax0;
            return qm * fmaf(sc, fmaf(lo, 1.0f / 2048.0f, hi), mn * (e ? qs1 : qs0));
        }, nvalid, vslot, lane, m0, m1, l0, l1, bs0, bs1, O);
        __syncwarp();
        if (more) stage(VALUES, vslot, vc, vs, vm, pn);
        p_commit();
    }
    p_wait<0>();                                   // no copy may be in flight at exit / reuse
    mma_finish<NR, D>(dsmem + QT * D * 4, &s_m[0][0], &s_l[0][0], m0, m1, l0, l1, bs0, bs1, O, nq, hk, Gq, Tq, B, Hq,
                      b, split, o_part, lse_part);
}

// ---- the FP16 sink and window in one launch -------------------------------------------------------
// Computes: attn_split_body<fp16 K / V, fp32 q, PREC> (attention.cu's split kernel, natural units; PREC 1:
//   double sums and accumulators, PREC 2: four fp32 chains per score, fp32 accumulators; same grid and
//   partial layout) over the sink (keys [0, n1)) and the window (keys [n1, T)) of the cache, both read in
//   place from their fp16 buffers (TwoSegmentTiles), as one sequence.
// Grid: (num_splits * n_qtiles, H_kv, B); block NW * 32 threads.
template <int QT, int NW, int PREC>
__global__ void __launch_bounds__(NW * 32)
    oscar_tail_attn(const float* __restrict__ q, const u16* __restrict__ k1, const u16* __restrict__ v1,
                    const u16* __restrict__ k2, const u16* __restrict__ v2, i64 s1_b, i64 s1_h, i64 s2_b, i64 s2_h,
                    i64 s_t, i64 n1, float* __restrict__ o_part, float* __restrict__ lse_part, i64 sq_b, i64 sq_h,
                    i64 sq_t, int B, int Hq, int Hkv, int Tq, i64 T, i64 chunk, int num_splits, int split0,
                    float qk_scale) {
    const TwoSegmentTiles<0, 128> tiles{k1, v1, k2, v2, s1_b, s1_h, s2_b, s2_h, s_t, n1};
    attn_split_body<0, 128, QT, NW, PREC, 2>(q, tiles, o_part, lse_part, sq_b, sq_h, sq_t, B, Hq, Hkv, Tq, T, chunk,
                                          num_splits, split0, qk_scale);
}

// ---- the query-side rotations ----------------------------------------------------------------------
// Computes: y = x R for a query-side tensor x (B, H_q, T, D) (any strides; input dtype DTI): row (b, h, t)
//   times R[h / (H_q / H_R)] (R: (H_R, D, D) float64, or float32 RT: read as float64, the same sums;
//   half the bytes for an fp32 calibration, whose values are fp32; contiguous), the D products summed in float64
//   (RS_SLICES partial sums over i % RS_SLICES, then added in slice order), rounded to fp32 and then to
//   DTO; out (B, H_q, T, D) contiguous. (The decode's q and output rotations: a few rows, so one launch
//   replaces cast, batched matmul, cast; float64 sums are at least as accurate as the reference's
//   float32 rotation: rule 7.)
// Grid: (B * H_q * T, ceil(D / 32)); block (32, RS_SLICES): thread (jj, s) -> output channel
//   32 blockIdx.y + jj, products i = s, s + RS_SLICES, ... (D / RS_SLICES independent loads of R, one
//   128-byte row segment per warp and i: at batch 1 the launch is latency-bound, and one thread per
//   channel waited on D dependent load rounds; issuing them before the row's loads and the barrier made
//   it slower: 3.3 -> 4.6 us at 1 x 64K, and more at batch 32, 106 registers a thread); the partials meet
//   in shared memory. D <= 256.
// Bytes: reads the row and R[h] (L2-resident across rows), writes one row.
#define RS_SLICES 8

// The rotations' last step (rotate_heads_f64, oscar_merge_rotate: one code, the same bits): thread (jj, sl)
// holds its slice's float64 sum `acc` of output channel j; the RS_SLICES sums meet in `part`, are added in
// slice order and rounded to fp32, then to DTO, into *dst (where `ok`). Has a barrier: call it from every
// thread of the block.
template <int DTO>
__device__ __forceinline__ void rotation_store(double (*part)[32], double acc, int sl, int jj,
                                               typename Ty<DTO>::S* dst, bool ok) {
    part[sl][jj] = acc;
    __syncthreads();
    if (sl == 0 && ok) {
        double y = part[0][jj];
#pragma unroll
        for (int k = 1; k < RS_SLICES; ++k) y += part[k][jj];
        *dst = Ty<DTO>::st(sat_out<DTO>((float)y));
    }
}

template <int DTI, int DTO, class RT>
__global__ void __launch_bounds__(32 * RS_SLICES)
    rotate_heads_f64(const typename Ty<DTI>::S* __restrict__ x, const RT* __restrict__ R,
                     typename Ty<DTO>::S* __restrict__ out, int Hq, int T, int HR, int D, i64 sx_b, i64 sx_h,
                     i64 sx_t, i64 sx_d) {
    __shared__ double xs[256];
    __shared__ double part[RS_SLICES][32];
    const i64 row = blockIdx.x;
    const int t = (int)(row % T);
    const int h = (int)((row / T) % Hq);
    const i64 b = row / ((i64)T * Hq);
    const int jj = threadIdx.x, sl = threadIdx.y;
    const int j = 32 * blockIdx.y + jj;
    for (int i = sl * 32 + jj; i < D; i += 32 * RS_SLICES)
        xs[i] = (double)Ty<DTI>::ld(x[b * sx_b + (i64)h * sx_h + (i64)t * sx_t + (i64)i * sx_d]);
    __syncthreads();
    const RT* Rh = R + (i64)(h / (Hq / HR)) * D * D;
    double acc = 0.0;
    if (j < D) {
#pragma unroll 8
        for (int i = sl; i < D; i += RS_SLICES) acc = fma(xs[i], (double)Rh[(i64)i * D + j], acc);
    }
    rotation_store<DTO>(part, acc, sl, jj, out + row * D + j, j < D);
}

// ---- the merge with the output rotation -----------------------------------------------------------
// Computes: for query row blockIdx.x (of rows = B * H_q * T_q; (b, h, t) as attn_merge's rows) the merge
//   of its S partials as attn_merge does it (merge_row with the same wpr warps per row: the same fp32
//   row), the lse (natural log) to lse_out, then y = o R[h / (H_q / H_R)] as rotate_heads_f64 does it (R:
//   (H_R, D, D) contiguous, float64 or float32 RT read as float64; the D products of each output channel
//   in float64, RS_SLICES partial sums over i % RS_SLICES added in slice order, rounded to fp32, then to
//   DTO), out (rows, D): the decode's output rotated back by R_V^T in the merge's launch (one launch and
//   one round trip of the merged rows fewer; the same bits as attn_merge to fp32 then rotate_heads_f64).
// Grid: (rows, D / 32); block (32, RS_SLICES): warps y < wpr merge the whole row (lane l: dims l + 32 i;
//   each of the row's D / 32 blocks merges it: its partials are read from L2 D / 32 times, but the
//   rotation's products are spread as rotate_heads_f64 spreads them: one block holding all D channels
//   took 8.1 us at 1 x 64K, against 3.4 + 3.4 for the two kernels), then thread (jj, sl) the products
//   i = sl, sl + RS_SLICES, ... of output channel 32 blockIdx.y + jj (its R entries loaded before the merge,
//   their latency hidden behind it). D = 128.
// Bytes: reads S * (D + 1) fp32 per row and block, R[h]'s 32 columns (L2-resident across rows); writes
//   D outputs + 1 lse per row. (oscar_decode.decode takes it while its blocks are at most one per SM:
//   beyond, the redundant merges' reads cost more than the second launch.)
template <int DTO, class RT>
__global__ void __launch_bounds__(32 * RS_SLICES)
    oscar_merge_rotate(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                       const RT* __restrict__ R, typename Ty<DTO>::S* __restrict__ out, float* __restrict__ lse_out,
                       i64 rows, int S, int wpr, int Hq, int T, int HR) {
    constexpr int D = 128, NDL = D / 32;
    static_assert(RS_SLICES >= 4, "the merge's up to 4 warps per row are warps of the block");
    __shared__ float s_a[RS_SLICES][32 * NDL], s_l[RS_SLICES];
    __shared__ double xs[D];
    __shared__ double part[RS_SLICES][32];
    const int jj = threadIdx.x, sl = threadIdx.y;
    const i64 row = blockIdx.x;
    const int h = (int)((row / T) % Hq);
    const RT* Rh = R + (i64)(h / (Hq / HR)) * D * D;
    const int j = 32 * blockIdx.y + jj;
    double rv[D / RS_SLICES];                      // this thread's R column entries, loaded during the merge
#pragma unroll
    for (int n = 0; n < D / RS_SLICES; ++n) rv[n] = (double)Rh[(i64)(sl + RS_SLICES * n) * D + j];
    float A[NDL], M, L;
    if (merge_row<NDL>(o_part, lse_part, rows, D, S, row, sl < wpr, sl % wpr, wpr, sl, jj, jj, &s_a[0][0], s_l, A,
                       M, L)) {
#pragma unroll
        for (int i = 0; i < NDL; ++i) xs[jj + 32 * i] = (double)(L > 0.0f ? A[i] / L : 0.0f);
        if (jj == 0 && blockIdx.y == 0) lse_out[row] = L > 0.0f ? M + logf(L) : -KVQ_INF;
    }
    __syncthreads();
    double acc = 0.0;
#pragma unroll
    for (int n = 0; n < D / RS_SLICES; ++n) acc = fma(xs[sl + RS_SLICES * n], rv[n], acc);
    rotation_store<DTO>(part, acc, sl, jj, out + row * D + j, true);
}
