// kvq CUDA device code of the split (flash-decoding) attention kernel, shared by attention.cu (attn_split:
// K / V tiles copied from one tensor's rows) and oscar_decode.cu (oscar_tail_attn: the OSCAR cache's
// fp16 sink and window read as one sequence). The body is written once, over a tile source `Tiles`:
//   tiles.stage(ks, vs, b, hk, kb, nk, lane): the warp's K tile [32][KROW] and V tile [32][D] (element
//   type Ty<DT>::S) of keys [kb, kb + nk) of (b, kv head hk) into shared memory; asynchronous copies as
//   two cp.async groups (K, then V) or plain stores (then the body's cp_async_wait calls are no-ops).
// The loader (_loader.py) pastes this file (and common.cuh) in place of `#include "attn_split.cuh"`.
#ifndef KVQ_ATTN_SPLIT_CUH
#define KVQ_ATTN_SPLIT_CUH
#include "common.cuh"

// ---- cp.async (sm_80+): global -> shared copies that bypass registers ------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// Copy 16 bytes (src_bytes = 16) or zero-fill them (src_bytes = 0); both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* dst_smem, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst_smem)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- configuration -------------------------------------------------------------------------------

template <int DT, int D>
struct AttnCfg {
    typedef typename Ty<DT>::S S;
    static constexpr int SZ = (int)sizeof(S);
    static constexpr int VE = 16 / SZ;                 // elements per 16-byte vector
    static constexpr int NVEC = D / VE;                // 16-byte vectors per K / V row
    static constexpr int KROW = D + VE;                // padded K row in shared memory (conflict-free reads)
    static constexpr int WARP_ELEMS = 32 * KROW + 32 * D;   // one warp's K tile + V tile (32 keys each)
    static constexpr int WARP_BYTES = WARP_ELEMS * SZ;
    static constexpr int DPL = D >= 32 ? D / 32 : 1;   // output dims per lane (lanes >= D idle if D < 32)
    static_assert(D % VE == 0 && D >= 16 && D <= 256, "head dim D must be a power of two in [16, 256]");
};

// The two cp.async groups of a warp's tiles (K, then V): key row r < nk from krow(r), value row from
// vrow(r) (16-byte aligned, last dim contiguous); rows past nk zero-filled.
template <int DT, int D, class KRow, class VRow>
__device__ __forceinline__ void cp_async_tiles(typename Ty<DT>::S* ks, typename Ty<DT>::S* vs, int nk, int lane,
                                               KRow krow, VRow vrow) {
    typedef AttnCfg<DT, D> Cfg;
    constexpr int VE = Cfg::VE, NVEC = Cfg::NVEC, KROW = Cfg::KROW;
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
        const int idx = lane + 32 * i;                 // 32 rows x NVEC vectors, row-major: coalesced
        const int r = idx / NVEC;
        const int col = idx - r * NVEC;
        cp_async16(ks + r * KROW + col * VE, krow(r < nk ? r : 0) + col * VE, r < nk ? 16 : 0);
    }
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
        const int idx = lane + 32 * i;
        const int r = idx / NVEC;
        const int col = idx - r * NVEC;
        cp_async16(vs + r * D + col * VE, vrow(r < nk ? r : 0) + col * VE, r < nk ? 16 : 0);
    }
    cp_async_commit();
}

// cp_async_tiles with each row's address worked out once, by its own lane: lane r < nk passes the key
// and value rows of tile row r (kmine, vmine), every copy takes its row's address by a shuffle (a tile
// source whose row addresses cost many instructions: paged.cu's fp16 tail rows); rows past nk
// zero-filled (lane 0's row as their address). Value rows VROW elements apart in shared memory (D, or
// padded: paged_tail_mma's ldmatrix), key rows AttnCfg::KROW. cp_async_row_group: one such group (32
// rows ld elements apart).
template <int DT, int D>
__device__ __forceinline__ void cp_async_row_group(typename Ty<DT>::S* dst, int ld, int nk, int lane,
                                                   const typename Ty<DT>::S* mine) {
    typedef AttnCfg<DT, D> Cfg;
    typedef typename Ty<DT>::S S;
    constexpr int VE = Cfg::VE, NVEC = Cfg::NVEC;
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {               // one cp.async group: 32 rows of NVEC vectors
        const int idx = lane + 32 * i;
        const int r = idx / NVEC;
        const int col = idx - r * NVEC;
        const S* p = reinterpret_cast<const S*>(__shfl_sync(KVQ_FULL_MASK, (unsigned long long)mine, r < nk ? r : 0));
        cp_async16(dst + r * ld + col * VE, p + col * VE, r < nk ? 16 : 0);
    }
    cp_async_commit();
}

template <int DT, int D, int VROW = D>
__device__ __forceinline__ void cp_async_rows(typename Ty<DT>::S* ks, typename Ty<DT>::S* vs, int nk, int lane,
                                              const typename Ty<DT>::S* kmine, const typename Ty<DT>::S* vmine) {
    cp_async_row_group<DT, D>(ks, AttnCfg<DT, D>::KROW, nk, lane, kmine);
    cp_async_row_group<DT, D>(vs, VROW, nk, lane, vmine);
}

// The tile source of attn_split: K / V rows of (B, H_kv, T, D) tensors with strides (elements), the
// last dim contiguous and rows 16-byte aligned; rows past nk zero-filled.
template <int DT, int D>
struct CopyTiles {
    typedef typename Ty<DT>::S S;
    const S* __restrict__ k;
    const S* __restrict__ v;
    i64 sk_b, sk_h, sk_t, sv_b, sv_h, sv_t;

    __device__ __forceinline__ void stage(S* ks, S* vs, int b, int hk, i64 kb, int nk, int lane) const {
        const S* kbase = k + (i64)b * sk_b + (i64)hk * sk_h + kb * sk_t;
        const S* vbase = v + (i64)b * sv_b + (i64)hk * sv_h + kb * sv_t;
        cp_async_tiles<DT, D>(ks, vs, nk, lane, [&](int r) { return kbase + r * sk_t; },
                              [&](int r) { return vbase + r * sv_t; });
    }
};

// The tile source over two segments (B, H_kv, T_i, D) read as one sequence: keys [0, n1) are rows of
// (k1, v1), keys [n1, T) rows u - n1 of (k2, v2); batch / head strides per segment, one row stride
// (elements), last dim contiguous, rows 16-byte aligned; rows past nk zero-filled.
template <int DT, int D>
struct TwoSegmentTiles {
    typedef typename Ty<DT>::S S;
    const S *__restrict__ k1, *__restrict__ v1, *__restrict__ k2, *__restrict__ v2;
    i64 s1_b, s1_h, s2_b, s2_h, s_t, n1;

    __device__ __forceinline__ const S* row(const S* a1, const S* a2, int b, int hk, i64 u) const {
        return u < n1 ? a1 + (i64)b * s1_b + (i64)hk * s1_h + u * s_t
                      : a2 + (i64)b * s2_b + (i64)hk * s2_h + (u - n1) * s_t;
    }
    __device__ __forceinline__ void stage(S* ks, S* vs, int b, int hk, i64 kb, int nk, int lane) const {
        cp_async_tiles<DT, D>(ks, vs, nk, lane, [&](int r) { return row(k1, k2, b, hk, kb + r); },
                              [&](int r) { return row(v1, v2, b, hk, kb + r); });
    }
};

// ---- split kernel body (attention.cu attn_split, oscar_decode.cu oscar_tail_attn) --------------------
// Computes: for the rows r in [qt*QT, qt*QT + QT) of the G_q * T_q query rows of kv head (b, hk)
//   (row r -> head hk*G_q + r / T_q, token r % T_q) and the keys [split*chunk, min(split*chunk + chunk,
//   T)): s = (q . k) * scale * log2(e) in fp32; online softmax in base 2 (PRECISE, the float32 default:
//   natural units, s = (q . k) * scale, exp / log); o = sum 2^(s - m) v / l; lse = (m + log2 l) * ln 2
//   (natural log; -inf and o = 0 for no keys). Written as fp32 partial
//   number split0 + split: o_part[(((p * B + b) * H_q + h) * T_q + t) * D + d], lse_part[...].
// Grid: (num_splits * n_qtiles, H_kv, B); block (NW * 32) threads, exactly. The warps of a block take the split's
//   tiles of 32 keys in turn (tile w, w + NW, ...), each with its own softmax state: a tile's K and V
//   rows are copied once into the warp's shared memory by cp.async (16-byte, coalesced; rows past
//   the end zero-filled); lane j computes the score of key j for all QT rows (K row read from padded
//   shared memory, q broadcast); then each lane accumulates D/32 output dims over the 32 keys. At the
//   end the NW warp states are merged through shared memory.
// Bytes: reads each K and V element of the split once per query tile (once when G_q*T_q <= QT);
//   writes (D + 1) fp32 per query row and split.
// SD, how each score's dot product is summed: 0 one fp32 fma chain; 1 (the default when PRECISE) in
// double, rounded once to float; 2 four interleaved fp32 fma chains (channels d = 4 i + j in chain j, in
// order of d) added pairwise at the end, (c0 + c1) + (c2 + c3) (not with PRECISE). The paged decode's
// FP16 tail for half-precision q takes 2 (paged.Knobs.tail_sums) or 1: one 128-term fp32 chain per score
// reached several fp32 ulps at |score| ~ 1e3, beyond the tolerance rule, where four chains stay at about
// a fifth of the bound (lab/2026-11-22-large-operand-accuracy/model_tail_scores.py) with no conversions to double.
// Accumulator of the dot products and of P.V: float, or double when PRECISE = 1 (the default for float32
// inputs: the fp32 path is the precise one, its sums then carry no more rounding than the float32
// reference's pairwise sums; PRECISE also means natural-log units, else base 2 with log2(e) in the
// scale). PRECISE = 2: natural-log units with float accumulators and the scores as four fp32 chains (SD
// = 2): OSCAR's FP16 sink / window beside its tensor-core history kernel (oscar_tail_attn), whose fp32
// lse bound takes the natural units but not the cost of double arithmetic.
// attn_split<2, D, QT, NW, 0, QDT>: fp32 keys / values with float accumulators and QDT (fp16 / bf16)
// queries: the paged decode's tail for half-precision queries, whose fused part carries about 22 bits.
template <int DT>
struct AccT {
    typedef float T;
};
template <>
struct AccT<2> {
    typedef double T;
};

// The tiles' shared memory: a static array (the default), or with DYN the launch's dynamic shared memory
// (NW * AttnCfg::WARP_BYTES bytes), so that a block may hold more warps than 48 KiB of static memory
// allow (fp32 tiles at D = 128: one warp).
template <bool DYN, int N>
struct TileSmem {
    static __device__ __forceinline__ u32x4* get() {
        __shared__ u32x4 a[N];
        return a;
    }
};
template <int N>
struct TileSmem<true, N> {
    static __device__ __forceinline__ u32x4* get() {
        extern __shared__ u32x4 kvq_dyn_tiles[];
        return kvq_dyn_tiles;
    }
};

template <int DT, int D, int QT, int NW, int PRECISE, int QDT, int SD = PRECISE, int DYN = 0, class Tiles>
__device__ __forceinline__ void attn_split_body(const typename Ty<QDT>::S* __restrict__ q, const Tiles& tiles,
                                                float* __restrict__ o_part, float* __restrict__ lse_part,
                                                i64 sq_b, i64 sq_h, i64 sq_t, int B, int Hq, int Hkv, int Tq,
                                                i64 T, i64 chunk, int num_splits, int split0, float qk_scale) {
    typedef AttnCfg<DT, D> Cfg;
    typedef typename Ty<DT>::S S;
    typedef typename AccT<PRECISE == 1 ? 2 : 0>::T Acc;
    typedef typename AccT<(PRECISE == 1 || SD == 1) ? 2 : 0>::T SAcc;   // the score sums
    constexpr int NCH = (SD == 2 && PRECISE != 1) ? 4 : 1;                // fma chains per score
    static_assert(PRECISE >= 0 && PRECISE <= 2, "PRECISE: 0 base 2, 1 natural + double, 2 natural + float");
    static_assert(SD >= 0 && SD <= 2, "SD: 0 one fp32 chain, 1 double, 2 four fp32 chains");
    static_assert(Cfg::VE % NCH == 0, "a 16-byte vector holds whole groups of the chains' channels");
    constexpr int VE = Cfg::VE;
    constexpr int NVEC = Cfg::NVEC;
    constexpr int KROW = Cfg::KROW;
    constexpr int DPL = Cfg::DPL;
    static_assert(QT % 4 == 0, "QT must be a multiple of 4 (16-byte rows of p)");
    static_assert(QT * D * 4 <= Cfg::WARP_BYTES, "the combine area [NW][QT][D] fp32 reuses the tiles");
    // the queries held in the score sums' type where it fits (converted once, not once per key and row)
    constexpr int SMEM_REST = (DYN ? 0 : NW * Cfg::WARP_BYTES) + NW * 32 * QT * 4 + 2 * NW * QT * 4;
    constexpr bool QW = sizeof(SAcc) == 8 && SMEM_REST + QT * D * 8 <= 48 * 1024;
    typedef typename AccT<QW ? 2 : 0>::T QS;
    static_assert(SMEM_REST + QT * D * (int)sizeof(QS) <= 48 * 1024,
                  "static shared memory is limited to 48 KiB (fp32 supports D <= 128)");

    u32x4* s_tiles = TileSmem<DYN != 0, NW * Cfg::WARP_BYTES / 16>::get();   // per warp: K [32][KROW], V [32][D]
    __shared__ u32x4 s_q4[QT * D * sizeof(QS) / 16];        // [QT][D] pre-scaled queries (fp32 values)
    __shared__ u32x4 s_p4[NW * 32 * QT / 4];                // per warp: [32 keys][QT] probabilities
    __shared__ float s_m[NW][QT], s_l[NW][QT];
    QS* s_q = reinterpret_cast<QS*>(s_q4);

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int split = (int)(blockIdx.x % (unsigned)num_splits);
    const int qt = (int)(blockIdx.x / (unsigned)num_splits);
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int Gq = Hq / Hkv;
    const int NQ = Gq * Tq;
    const int r0 = qt * QT;
    const int nq = kvq_min(QT, NQ - r0);
    const i64 k0 = (i64)split * chunk;
    const i64 k1 = kvq_min(k0 + chunk, T);

    for (int idx = tid; idx < QT * D; idx += NW * 32) {
        const int qi = idx / D;
        const int d = idx - qi * D;
        float val = 0.0f;
        if (qi < nq) {
            const int r = r0 + qi;
            const int h = hk * Gq + r / Tq;
            const int t = r - (r / Tq) * Tq;
            val = __fmul_rn(Ty<QDT>::ld(q[(i64)b * sq_b + (i64)h * sq_h + (i64)t * sq_t + d]), qk_scale);
        }
        s_q[idx] = (QS)val;
    }
    __syncthreads();

    S* ks = reinterpret_cast<S*>(s_tiles) + warp * Cfg::WARP_ELEMS;   // [32][KROW]
    S* vs = ks + 32 * KROW;                                            // [32][D]
    float* pw = reinterpret_cast<float*>(s_p4) + warp * 32 * QT;       // [32][QT]

    float m[QT], l[QT];
    Acc acc[QT][DPL];
#pragma unroll
    for (int qi = 0; qi < QT; ++qi) {
        m[qi] = -KVQ_INF;
        l[qi] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[qi][e] = 0.0f;
    }
    const bool lane_has_dims = D >= 32 || lane * DPL < D;
    const i64 ntile = k1 > k0 ? (k1 - k0 + 31) / 32 : 0;

    for (i64 ti = warp; ti < ntile; ti += NW) {        // uniform across the warp
        const i64 kb = k0 + ti * 32;
        const int nk = (int)kvq_min((i64)32, k1 - kb);
        tiles.stage(ks, vs, b, hk, kb, nk, lane);         // K: one cp.async group, V: the next
        cp_async_wait<1>();                            // this lane's K copies have landed
        __syncwarp();                                  // ... and every lane's

        // scores: lane j <-> key kb + j, all QT query rows
        SAcc s[QT][NCH];                               // chain j: channels d = j mod NCH
#pragma unroll
        for (int qi = 0; qi < QT; ++qi)
#pragma unroll
            for (int j = 0; j < NCH; ++j) s[qi][j] = 0.0f;
        const S* krow = ks + lane * KROW;
#pragma unroll 4
        for (int cv = 0; cv < NVEC; ++cv) {
            float kf[VE];
            load_f32<DT, VE>(krow + cv * VE, kf);
            SAcc kd[VE];
#pragma unroll
            for (int e = 0; e < VE; ++e) kd[e] = (SAcc)kf[e];
#pragma unroll
            for (int qi = 0; qi < QT; ++qi) {
                const QS* qr = s_q + qi * D + cv * VE;
#pragma unroll
                for (int e = 0; e < VE; ++e) s[qi][e % NCH] = fma((SAcc)qr[e], kd[e], s[qi][e % NCH]);
            }
        }
        float sd[QT];                                  // the scores, rounded once to float
#pragma unroll
        for (int qi = 0; qi < QT; ++qi) {
            if constexpr (NCH == 4) sd[qi] = (s[qi][0] + s[qi][1]) + (s[qi][2] + s[qi][3]);
            else sd[qi] = (float)s[qi][0];
        }

        // online softmax, base 2 (PRECISE: natural); p goes to shared memory for the P.V step
#pragma unroll
        for (int qi = 0; qi < QT; ++qi) {
            const float sc = lane < nk ? sd[qi] : -KVQ_INF;
            float tmax = sc;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(KVQ_FULL_MASK, tmax, off));
            const float mnew = fmaxf(m[qi], tmax);
            const float alpha = m[qi] == mnew ? 1.0f : PRECISE ? expf(m[qi] - mnew) : exp2f(m[qi] - mnew);
            const float p = sc == -KVQ_INF ? 0.0f : PRECISE ? expf(sc - mnew) : exp2f(sc - mnew);
            l[qi] = fmaf(l[qi], alpha, p);             // this lane's share of the row sum
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[qi][e] *= alpha;
            m[qi] = mnew;
            pw[lane * QT + qi] = p;
        }
        cp_async_wait<0>();                            // V copies have landed
        __syncwarp();

        // o += p . V: lane owns dims [lane*DPL, lane*DPL + DPL)
#pragma unroll 4
        for (int j = 0; j < nk; ++j) {
            float pj[QT];
            load_f32<2, QT>(pw + j * QT, pj);
            float vf[DPL];
            if (lane_has_dims) {
                load_f32<DT, DPL>(vs + j * D + lane * DPL, vf);
            } else {
#pragma unroll
                for (int e = 0; e < DPL; ++e) vf[e] = 0.0f;
            }
#pragma unroll
            for (int qi = 0; qi < QT; ++qi)
#pragma unroll
                for (int e = 0; e < DPL; ++e)
                    acc[qi][e] = fma((Acc)pj[qi], (Acc)vf[e], acc[qi][e]);
        }
        __syncwarp();                                  // the next tile overwrites ks, vs, pw
    }

    // merge the NW warp states of this block
#pragma unroll
    for (int qi = 0; qi < QT; ++qi)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) l[qi] += __shfl_xor_sync(KVQ_FULL_MASK, l[qi], off);
    __syncthreads();                                   // every warp is done with its tiles
    float* cacc = reinterpret_cast<float*>(s_tiles);  // [NW][QT][D]
    if (lane_has_dims) {
#pragma unroll
        for (int qi = 0; qi < QT; ++qi)
#pragma unroll
            for (int e = 0; e < DPL; ++e) cacc[(warp * QT + qi) * D + lane * DPL + e] = (float)acc[qi][e];
    }
    if (lane == 0) {
#pragma unroll
        for (int qi = 0; qi < QT; ++qi) {
            s_m[warp][qi] = m[qi];
            s_l[warp][qi] = l[qi];
        }
    }
    __syncthreads();
    combine_warps<QT, D>(&s_m[0][0], &s_l[0][0], cacc, NW, nq, tid, NW * 32, r0, hk, Gq, Tq, B, Hq, b,
                         (i64)(split0 + split), o_part, lse_part, PRECISE != 0);
}

// ---- the merge of one row's split partials (attention.cu attn_merge, oscar_decode.cu oscar_merge_rotate) ---
// Computes, for query row `row` (valid: it exists) over its S partials s (o_part (S, rows, D) fp32, lse_part
//   (S, rows) fp32, natural log): M = max_s lse_s, w_s = exp(lse_s - M), L = sum_s w_s, A_d = sum_s w_s o_s,d
//   at this lane's dims d0 + 32 i (i < NDL; dims >= D read as 0); rows whose partials are all -inf get
//   M = -inf, L = 0, A = 0.
// The row's W = wpr warps (k = 0 .. W-1 this one; warp: its index in the block) take its chunks of CH = 8
//   partials k, k + W, ...: every load of a chunk in flight together, the first issued before the max lse
//   is known (a decode merges 10-70 partials: each warp then waits on L2 a few times, where a block per
//   row with barriers between its phases took 5-8 us on the H100). Each warp sums its chunks' partials
//   in order (one fma chain per dim) and its weights per lane (lane c: the chunk's partial c) then across
//   lanes (xor butterfly); with W > 1 the W warps' sums meet in shared memory (s_a [warps][32 NDL], s_l
//   [warps]: the block's warps that call it, with a barrier: call it from every thread of the block),
//   added in warp order. Returns true in warp k = 0 of a valid row, whose M, L and A then hold the sums.
template <int NDL>
__device__ __forceinline__ bool merge_row(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                          i64 rows, int D, int S, i64 row, bool valid, int k, int wpr, int warp,
                                          int lane, int d0, float* s_a, float* s_l, float (&A)[NDL], float& M,
                                          float& L) {
    constexpr int CH = 8;                          // partials whose loads are in flight together
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
    M = -KVQ_INF;
    if (valid)
        for (int s = lane; s < S; s += 32) M = fmaxf(M, lse_part[(i64)s * rows + row]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(KVQ_FULL_MASK, M, off));
    L = 0.0f;
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
        for (int i = 0; i < NDL; ++i) s_a[warp * 32 * NDL + 32 * i + lane] = A[i];
        if (lane == 0) s_l[warp] = L;
        __syncthreads();
        if (k != 0) return false;
        for (int w2 = 1; w2 < wpr; ++w2) {
#pragma unroll
            for (int i = 0; i < NDL; ++i) A[i] += s_a[(warp + w2) * 32 * NDL + 32 * i + lane];
            L += s_l[warp + w2];
        }
    }
    return valid && k == 0;
}

#endif  // KVQ_ATTN_SPLIT_CUH
