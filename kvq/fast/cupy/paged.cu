// kvq CUDA kernels: decode attention over the paged KIVI / Kitty cache (kvq/reference/paged.py).
//
// Mirrors kvq/reference/paged.py decode_attention within numerics contract rule 7 (fp32 accumulation,
// not bit-exact); the dequantization itself is bit-exact (rule 3): code * scale + mn as two rounded
// fp32 operations. With fp16 metadata code * scale is exact (an 8-bit code times an 11-bit
// significand fits fp32's 24 bits), so a single fma.rn gives the same bits; with fp32 metadata
// (gather kernel only) the product and the sum are rounded separately.
//
// Layout (kvq.fast._paged / _codecs), per pool page p and kv head h:
//   KIVI keys   codes (D, G*KB/8) u8 packed along tokens, scale / mn (D,)
//   Kitty keys  low (D, G/4) u8, high (Db, G/4) u8, idx (D,) u8 (sentinel Db): code = low | high[idx] << 2
//   values      codes (G, D*VB/8) u8 packed along channels, scale / mn (G, NGV) (groups of Gv = D/NGV)
//   page tables k_table / v_table (B, N) int32; key page j and value page j cover post-sink tokens
//   [j*G, j*G + G) of a sequence.
// Template codes: D head dim (64 or 128), KB key bits (2/4/8; Kitty: 2 with a high plane), VB value
// bits, QT query rows per block (4 or 8). The fused kernel takes G = 128 and fp16 metadata; the
// Python side (paged.py) falls back otherwise.
#include "mma.cuh"
#include "attn_split.cuh"

#define KVQ_G 128
#define GATHER_TOK 16                              // tokens per paged_gather_tail block
#define GATHER_MAXD 256                            // head dims it takes

// ---- helpers -------------------------------------------------------------------------------------

// fma without .ftz: x * s + m rounded once (bit-exact dequantization when x * s is exact)
__device__ __forceinline__ float fma_rn(float x, float s, float m) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(x), "f"(s), "f"(m));
    return r;
}

// The BITS-bit field at bit P of w as an exact float. For P + BITS <= 23 no shift: OR the field
// (in place) into the significand of 2^(23-P), whose last significand bit weighs 2^-P, so the float
// is 2^(23-P) + field; subtracting 2^(23-P) is exact. Otherwise shift first (magic 2^23).
template <int BITS, int P>
__device__ __forceinline__ float field_f32(u32 w) {
    constexpr u32 MASK = (1u << BITS) - 1u;
    if constexpr (P + BITS <= 23) {
        constexpr u32 MAGIC = (u32)(127 + 23 - P) << 23;
        return __uint_as_float((w & (MASK << P)) | MAGIC) - __uint_as_float(MAGIC);
    } else {
        return __uint_as_float(((w >> P) & MASK) | 0x4B000000u) - 8388608.0f;
    }
}

// The 4 codes of BITS bits at bits [0, 4*BITS) of w, as exact floats.
template <int BITS>
__device__ __forceinline__ void four_codes(u32 w, float* c) {
    c[0] = field_f32<BITS, 0>(w);
    c[1] = field_f32<BITS, BITS>(w);
    c[2] = field_f32<BITS, 2 * BITS>(w);
    c[3] = field_f32<BITS, 3 * BITS>(w);
}

// 4*BITS bits (1, 2 or 4 bytes) at p (aligned to their size), zero-extended.
template <int BITS>
__device__ __forceinline__ u32 load_quad(const u8* p) {
    if constexpr (BITS == 2) {
        return (u32)*p;
    } else if constexpr (BITS == 4) {
        return (u32)*reinterpret_cast<const u16*>(p);
    } else {
        return *reinterpret_cast<const u32*>(p);
    }
}

// Per-warp page buffer: byte offsets of each region (all multiples of 16); the same formula as
// paged.py's _buf_bytes.
template <int D, int KB, int VB, bool KITTY>
struct PageBuf {
    static constexpr int G = KVQ_G;
    static constexpr int GB = G * KB / 8;          // bytes per key row (per channel)
    static constexpr int VBY = D * VB / 8;         // bytes per value row (per token)
    static constexpr int KC = 0;
    static constexpr int KS = KC + D * GB;
    static constexpr int KM = KS + D * 2;
    static constexpr int KI = KM + D * 2;          // Kitty idx (D bytes)
    static constexpr int VC = KI + (KITTY ? D : 0);
    static constexpr int VS = VC + G * VBY;
    __device__ static int vm(int ngv) { return VS + G * ngv * 2; }
    __device__ static int kh(int ngv) { return vm(ngv) + G * ngv * 2; }   // Kitty high plane (Db rows)
    __device__ static int bytes(int ngv, int db) { return kh(ngv) + (KITTY ? db * GB : 0); }
    static_assert(D % 16 == 0 && GB % 16 == 0 && (G * VBY) % 16 == 0, "regions must be 16-byte multiples");
};

// Stage page j of sequence b, kv head hk (key page k_table[b, j], value page v_table[b, j]) into the
// warp's page buffer `buf` (PageBuf layout) with 16-byte cp.async copies; the caller commits / waits.
template <int D, int KB, int VB, int KITTY>
__device__ __forceinline__ void stage_page(u8* buf, int j, int b, int hk, int Hkv, int n_tab,
                                           const int* __restrict__ k_table, const int* __restrict__ v_table,
                                           const u8* __restrict__ kc, const u8* __restrict__ kh,
                                           const u8* __restrict__ ki, const u16* __restrict__ ks,
                                           const u16* __restrict__ km, const u8* __restrict__ vc,
                                           const u16* __restrict__ vs, const u16* __restrict__ vm, int ngv,
                                           int db, int lane) {
    typedef PageBuf<D, KB, VB, KITTY != 0> PB;
    constexpr int G = KVQ_G;
    constexpr int GB = PB::GB;
    constexpr int VBY = PB::VBY;
    const i64 kpid = (i64)kvq_max_i(k_table[(i64)b * n_tab + j], 0);
    const i64 vpid = (i64)kvq_max_i(v_table[(i64)b * n_tab + j], 0);
    const i64 kph = kpid * Hkv + hk;
    const i64 vph = vpid * Hkv + hk;
    warp_copy(buf + PB::KC, kc + kph * (D * GB), D * GB, lane);
    warp_copy(buf + PB::KS, reinterpret_cast<const u8*>(ks + kph * D), D * 2, lane);
    warp_copy(buf + PB::KM, reinterpret_cast<const u8*>(km + kph * D), D * 2, lane);
    if constexpr (KITTY != 0) {
        warp_copy(buf + PB::KI, ki + kph * D, D, lane);
        if (db > 0) warp_copy(buf + PB::kh(ngv), kh + kph * db * GB, db * GB, lane);
    }
    warp_copy(buf + PB::VC, vc + vph * (G * VBY), G * VBY, lane);
    warp_copy(buf + PB::VS, reinterpret_cast<const u8*>(vs + vph * G * ngv), G * ngv * 2, lane);
    warp_copy(buf + PB::vm(ngv), reinterpret_cast<const u8*>(vm + vph * G * ngv), G * ngv * 2, lane);
}

// The block's QT query rows (row r0 + qi -> query head hk * Gq + r / Tq, token r % Tq; rows qi >= nq
// are zero), times qk_scale, as fp32 into shared memory s_q[d * QT + qi].
template <int D, int QT>
__device__ __forceinline__ void load_queries(float* s_q, const void* __restrict__ q, int q_dt, i64 sq_b, i64 sq_h,
                                             i64 sq_t, int b, int hk, int Gq, int Tq, int r0, int nq,
                                             float qk_scale, int tid, int nthreads) {
    for (int idx = tid; idx < QT * D; idx += nthreads) {
        const int d = idx / QT;
        const int qi = idx - d * QT;
        float val = 0.0f;
        if (qi < nq) {
            const int r = r0 + qi;
            const int h = hk * Gq + r / Tq;
            const int t = r - (r / Tq) * Tq;
            const i64 off = (i64)b * sq_b + (i64)h * sq_h + (i64)t * sq_t + d;
            float x;
            if (q_dt == 0) {
                x = f16_to_f32(reinterpret_cast<const u16*>(q)[off]);
            } else if (q_dt == 1) {
                x = bf16_to_f32(reinterpret_cast<const u16*>(q)[off]);
            } else {
                x = reinterpret_cast<const float*>(q)[off];
            }
            val = __fmul_rn(x, qk_scale);
        }
        s_q[idx] = val;
    }
}

// ---- fused decode kernel -------------------------------------------------------------------------
// Computes: for the rows r in [qt*QT, qt*QT + QT) of the G_q * T_q query rows of kv head (b, hk)
//   (row r -> query head hk*G_q + r / T_q, token r % T_q) and the pages [split*pps, min(split*pps +
//   pps, NP)) of sequence b (post-sink tokens [j*G, j*G + G) of page j; tokens >= NF masked): key page
//   k_table[b, j] and value page v_table[b, j] dequantized in registers (code * scale + mn, bit-exact
//   fp32), s = (q . k) * scale * log2(e), online softmax in base 2, o = sum 2^(s - m) v / l; writes the
//   fp32 partial number `split`: o_part[((split * B + b) * H_q + h) * T_q + t][d] and lse_part (natural
//   log; o = 0, lse = -inf without keys), the layout of attention.cu's attn_split / attn_merge.
// Grid: (num_splits * n_qtiles, H_kv, B); block NW * 32 threads (NW = blockDim.x / 32 <= 4). Each warp
//   takes the split's pages w, w + NW, ... with its own softmax state; a page (K codes + metadata, V
//   codes + metadata, Kitty planes) is copied into the warp's shared buffer by cp.async (16-byte,
//   coalesced), the next page's copy in flight while the current one is computed (double buffer).
//   Scores: lane l owns tokens 4l .. 4l+3 (one byte / u16 / u32 of each key row), loops over the D
//   channels: unpack (mask + OR into a float significand + one subtraction, no int->float
//   conversion), dequantize, QT x 4 fp32 FMAs (q from shared memory, broadcast) into interleaved
//   chains per score (4, or 2 at QT = 8), added pairwise. P . V: lane owns 4
//   consecutive channels (D = 64: two token phases of 16 lanes), loops over the page's tokens with
//   p from shared memory. The NW warp states are merged through shared memory at the end.
// Dynamic shared memory: QT*D*4 (queries) + NW * (G*QT*4 (p) + 2 * PageBuf::bytes) bytes.
// Bytes: reads each packed K / V page of the split and its metadata once per query tile (once when
//   G_q * T_q <= QT), the page-table entries and the queries; writes (D + 1) fp32 per query row and split.
template <int D, int KB, int VB, int KITTY, int QT>
__global__ void __launch_bounds__(128, 2)
    paged_decode(const void* __restrict__ q, int q_dt, i64 sq_b, i64 sq_h, i64 sq_t,
                 const u8* __restrict__ kc, const u8* __restrict__ kh, const u8* __restrict__ ki,
                 const u16* __restrict__ ks, const u16* __restrict__ km, const u8* __restrict__ vc,
                 const u16* __restrict__ vs, const u16* __restrict__ vm, const int* __restrict__ k_table,
                 const int* __restrict__ v_table, int n_tab, float* __restrict__ o_part,
                 float* __restrict__ lse_part, int B, int Hq, int Hkv, int Tq, int NF, int NP, int pps,
                 int num_splits, int db, int ngv, float qk_scale) {
    typedef PageBuf<D, KB, VB, KITTY != 0> PB;
    constexpr int G = KVQ_G;
    constexpr int GB = PB::GB;
    constexpr int VBY = PB::VBY;
    constexpr int VLANES = D / 4;                  // lanes per token in P . V
    constexpr int TG = 32 / VLANES;                // token phases (1 for D = 128, 2 for D = 64)
    static_assert(D == 64 || D == 128, "the fused kernel takes D = 64 or 128");
    static_assert(!KITTY || KB == 2, "Kitty's dense plane is 2-bit");
    static_assert(QT == 4 || QT == 8, "QT must be 4 or 8");
    static_assert(QT * D * 4 <= G * QT * 4, "the combine area reuses the p buffers");

    extern __shared__ u32x4 dsmem4[];
    __shared__ float s_m[4][QT], s_l[4][QT];
    u8* dsmem = reinterpret_cast<u8*>(dsmem4);
    float* s_q = reinterpret_cast<float*>(dsmem);                     // [D][QT]
    const int bufb = PB::bytes(ngv, db);
    const int warp_bytes = G * QT * 4 + 2 * bufb;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int NW = blockDim.x >> 5;
    const int split = (int)(blockIdx.x % (unsigned)num_splits);
    const int qt = (int)(blockIdx.x / (unsigned)num_splits);
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int Gq = Hq / Hkv;
    const int NQ = Gq * Tq;
    const int r0 = qt * QT;
    const int nq = kvq_min(QT, NQ - r0);

    load_queries<D, QT>(s_q, q, q_dt, sq_b, sq_h, sq_t, b, hk, Gq, Tq, r0, nq, qk_scale, tid, blockDim.x);

    u8* wbase = dsmem + QT * D * 4 + warp * warp_bytes;
    float* pw = reinterpret_cast<float*>(wbase);                      // [G][QT]
    u8* bufs = wbase + G * QT * 4;                                    // two page buffers

    const int p0 = split * pps;
    const int p1 = kvq_min(p0 + pps, NP);

    auto stage = [&](int j, u8* buf) {
        stage_page<D, KB, VB, KITTY>(buf, j, b, hk, Hkv, n_tab, k_table, v_table, kc, kh, ki, ks, km, vc, vs, vm,
                                     ngv, db, lane);
    };

    float m[QT], l[QT], acc[QT][4];
#pragma unroll
    for (int qi = 0; qi < QT; ++qi) {
        m[qi] = -KVQ_INF;
        l[qi] = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[qi][e] = 0.0f;
    }
    const int cc = lane % VLANES;                  // P . V: channels 4cc .. 4cc+3
    const int tp = lane / VLANES;                  // P . V: token phase
    const int vg = (cc * 4) / (D / ngv);           // their value group (Gv % 4 == 0: one group)

    __syncthreads();                               // s_q is ready

    int j = p0 + warp;
    if (j < p1) stage(j, bufs);
    p_commit();
    int cur = 0;
    for (; j < p1; j += NW) {                      // uniform across the warp
        if (j + NW < p1) stage(j + NW, bufs + (cur ^ 1) * bufb);
        p_commit();
        p_wait<1>();                               // this lane's copies of page j have landed
        __syncwarp();                              // ... and every lane's
        const u8* buf = bufs + cur * bufb;
        const int nvalid = kvq_min(G, NF - j * G);  // >= 1 (j < NP = ceil(NF / G))

        // ---- scores: lane owns tokens 4*lane .. 4*lane + 3; each score as NCH interleaved fp32 fma
        // chains (channel d in chain d % NCH) added pairwise at the end: one 128-term chain put a K8V4
        // cache's lse at 1.27x the tolerance bound on the H100
        // (lab/2026-11-22-kivi-kitty-decode/results/h100-mixed-mma), as it did the FP16 tail's (attn_split.cuh SD); QT = 8 takes 2 chains (registers)
        constexpr int NCH = QT == 4 ? 4 : 2;
        float sch[QT][4][NCH];
#pragma unroll
        for (int qi = 0; qi < QT; ++qi)
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int h = 0; h < NCH; ++h) sch[qi][e][h] = 0.0f;
        const u8* kcs = buf + PB::KC + lane * (KB / 2);
        const u16* kss = reinterpret_cast<const u16*>(buf + PB::KS);
        const u16* kms = reinterpret_cast<const u16*>(buf + PB::KM);
#pragma unroll 1
        for (int d0 = 0; d0 < D; d0 += 4)
#pragma unroll
        for (int dd = 0; dd < 4; ++dd) {
            const int d = d0 + dd;
            float c[4];
            four_codes<KB>(load_quad<KB>(kcs + d * GB), c);
            if constexpr (KITTY != 0) {
                const int ix = buf[PB::KI + d];
                if (ix < db) {                     // uniform: every lane reads channel d
                    float h[4];
                    four_codes<2>((u32)buf[PB::kh(ngv) + ix * GB + lane], h);
#pragma unroll
                    for (int e = 0; e < 4; ++e) c[e] = fma_rn(4.0f, h[e], c[e]);   // low | high << 2, exact
                }
            }
            const float sc = f16_to_f32(kss[d]);
            const float mn = f16_to_f32(kms[d]);
            float k[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) k[e] = fma_rn(c[e], sc, mn);   // == code * scale + mn (exact product)
            float qv[QT];
            load_f32<2, QT>(s_q + d * QT, qv);
#pragma unroll
            for (int qi = 0; qi < QT; ++qi)
#pragma unroll
                for (int e = 0; e < 4; ++e) sch[qi][e][dd % NCH] = fmaf(qv[qi], k[e], sch[qi][e][dd % NCH]);
        }
        float s[QT][4];
#pragma unroll
        for (int qi = 0; qi < QT; ++qi)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[qi][e] = NCH == 4 ? (sch[qi][e][0] + sch[qi][e][1]) + (sch[qi][e][2] + sch[qi][e][3])
                                    : sch[qi][e][0] + sch[qi][e][NCH - 1];

        // ---- online softmax (base 2); p to shared memory
#pragma unroll
        for (int qi = 0; qi < QT; ++qi) {
            float tmax = -KVQ_INF;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (lane * 4 + e >= nvalid) s[qi][e] = -KVQ_INF;
                tmax = fmaxf(tmax, s[qi][e]);
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(KVQ_FULL_MASK, tmax, off));
            const float mnew = fmaxf(m[qi], tmax);
            const float alpha = m[qi] == mnew ? 1.0f : exp2f(m[qi] - mnew);
            float psum = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = s[qi][e] == -KVQ_INF ? 0.0f : exp2f(s[qi][e] - mnew);
                psum += p;
                s[qi][e] = p;
            }
            l[qi] = fmaf(l[qi], alpha, psum);      // this lane's share of the row sum
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[qi][e] *= alpha;
            m[qi] = mnew;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)                // p[token][QT] rows, 16-byte stores
#pragma unroll
            for (int v4 = 0; v4 < QT / 4; ++v4) {
                u32x4 w;
                w.x = __float_as_uint(s[4 * v4][e]);
                w.y = __float_as_uint(s[4 * v4 + 1][e]);
                w.z = __float_as_uint(s[4 * v4 + 2][e]);
                w.w = __float_as_uint(s[4 * v4 + 3][e]);
                *reinterpret_cast<u32x4*>(pw + (lane * 4 + e) * QT + 4 * v4) = w;
            }
        __syncwarp();                              // p is visible to the warp

        // ---- o += p . V: lane owns channels 4cc .. 4cc+3, tokens tp, tp + TG, ...
        const u8* vcs = buf + PB::VC + cc * (VB / 2);
        const u16* vss = reinterpret_cast<const u16*>(buf + PB::VS) + vg;
        const u16* vms = reinterpret_cast<const u16*>(buf + PB::vm(ngv)) + vg;
#pragma unroll 4
        for (int t = tp; t < nvalid; t += TG) {
            float c[4];
            four_codes<VB>(load_quad<VB>(vcs + t * VBY), c);
            const float sc = f16_to_f32(vss[t * ngv]);
            const float mn = f16_to_f32(vms[t * ngv]);
            float pv[QT];
            load_f32<2, QT>(pw + t * QT, pv);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = fma_rn(c[e], sc, mn);
#pragma unroll
                for (int qi = 0; qi < QT; ++qi) acc[qi][e] = fmaf(pv[qi], v, acc[qi][e]);
            }
        }
        __syncwarp();                              // the next stage overwrites this buffer and p
        cur ^= 1;
    }
    p_wait<0>();                                   // no copy may be in flight at exit / reuse

    // ---- merge the token phases, then the NW warp states of this block
#pragma unroll
    for (int qi = 0; qi < QT; ++qi) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) l[qi] += __shfl_xor_sync(KVQ_FULL_MASK, l[qi], off);
        if constexpr (TG == 2) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[qi][e] += __shfl_xor_sync(KVQ_FULL_MASK, acc[qi][e], 16);
        }
    }
    __syncthreads();                               // every warp is done with its buffers
    float* cacc = reinterpret_cast<float*>(dsmem + QT * D * 4);      // [NW][QT][D], over the warp areas
    if (tp == 0) {
#pragma unroll
        for (int qi = 0; qi < QT; ++qi)
#pragma unroll
            for (int e = 0; e < 4; ++e) cacc[(warp * QT + qi) * D + cc * 4 + e] = acc[qi][e];
    }
    if (lane == 0) {
#pragma unroll
        for (int qi = 0; qi < QT; ++qi) {
            s_m[warp][qi] = m[qi];
            s_l[warp][qi] = l[qi];
        }
    }
    __syncthreads();
    combine_warps<QT, D>(&s_m[0][0], &s_l[0][0], cacc, NW, nq, tid, blockDim.x, r0, hk, Gq, Tq, B, Hq, b,
                         (i64)(split), o_part, lse_part);
}

// ---- tensor-core fused decode kernel (paged_decode_mma2: fp16 q, D = 128, 2-bit keys and values, one
// value group per token) ------------------------------------------------------------------------------

// Both products put the cache on the MMA's M side and the (at most 8) query rows on N = 8, so no MMA
// row is padding: S^T (tokens x rows) = codes_K (tokens x channels) . (q * scale_k)^T and
// O^T (channels x rows) = codes_V (channels x tokens) . (p * scale_v)^T (with the query rows on M,
// as in FlashAttention, 8 of 16 rows would be padding: twice the mma and the accumulators).

// Copy the key half (K slot: codes, scale, mn, Kitty idx and high plane) or the value half (V slot:
// codes, scale, mn) of pool page `page` (its page-table entry, read ahead by the caller: the copies'
// addresses wait on no load), kv head hk, into the warp's slot (cp.async, 16 bytes).
template <int KITTY, int KB = 2>
__device__ __forceinline__ void stage_k2(u8* buf, int page, int hk, int Hkv, const u8* __restrict__ kc,
                                         const u8* __restrict__ kh, const u8* __restrict__ ki,
                                         const u16* __restrict__ ks, const u16* __restrict__ km, int db,
                                         int lane) {
    constexpr int D = 128, GB = 16 * KB;
    const i64 kph = (i64)kvq_max_i(page, 0) * Hkv + hk;
    warp_copy_c<D * GB>(buf, kc + kph * (D * GB), lane);
    warp_copy_c<D * 2>(buf + D * GB, reinterpret_cast<const u8*>(ks + kph * D), lane);
    warp_copy_c<D * 2>(buf + D * GB + 2 * D, reinterpret_cast<const u8*>(km + kph * D), lane);
    if constexpr (KITTY != 0) {
        warp_copy_c<D>(buf + D * GB + 4 * D, ki + kph * D, lane);
        u8* hdst = buf + D * GB + 5 * D;
        const u8* hsrc = kh + kph * db * GB;
        // the high plane: the paper's boost rates (12.5%: 16 rows, 25%: 32 rows) as fixed-size runs
        if (db == 16) warp_copy_c<16 * GB>(hdst, hsrc, lane);
        else if (db == 32) warp_copy_c<32 * GB>(hdst, hsrc, lane);
        else if (db > 0) warp_copy(hdst, hsrc, db * GB, lane);
    }
}

template <int VB = 2>
__device__ __forceinline__ void stage_v2(u8* buf, int page, int hk, int Hkv, const u8* __restrict__ vc,
                                         const u16* __restrict__ vs, const u16* __restrict__ vm, int lane) {
    constexpr int G = KVQ_G, VBY = 16 * VB;
    const i64 vph = (i64)kvq_max_i(page, 0) * Hkv + hk;
    warp_copy_c<G * VBY>(buf, vc + vph * (G * VBY), lane);
    warp_copy_c<G * 2>(buf + G * VBY, reinterpret_cast<const u8*>(vs + vph * G), lane);
    warp_copy_c<G * 2>(buf + G * VBY + 2 * G, reinterpret_cast<const u8*>(vm + vph * G), lane);
}

// The B fragment (k = 4 channels, n = row rb) of q * scale * inv for k-step channels c and c + 8 (pairs):
// NR = 8: hi in b[0..1], lo (2^11 (x - hi)) in b[2..3]; NR = 4: rows g < 4 hi, rows g >= 4 lo of row g - 4.
template <int NR>
__device__ __forceinline__ void qk_bfrag(u32* b, float f0, float f1, float f2, float f3, bool lo) {
    u32 h0, l0, h1, l1;
    split2(f0, f1, h0, l0);
    split2(f2, f3, h1, l1);
    if constexpr (NR == 8) {
        b[0] = h0, b[1] = h1, b[2] = l0, b[3] = l1;
    } else {
        b[0] = lo ? l0 : h0;
        b[1] = lo ? l1 : h1;
    }
}

// Computes: the partials of paged_decode (same arguments, same output layout) for up to NR <= 8 query
//   rows per kv head, fp16 q, D = 128, KB-bit keys (KIVI 2 or 4, or Kitty's 2-bit planes) and VB-bit
//   values (2 or 4), one value group per token, G = 128, fp16 metadata.
//   Scores: S^T = codes_K . B, B (channels x rows) = q~ * scale_k 2^-ek (q~ = q / max|q_row|, 2^(ek-1) <=
//   max|scale_k| < 2^ek) as hi + 2^-11 lo, both fp16: q~ is split once per block, the product by the
//   exact fp16 two-product (two_prod_h2); NR = 4: hi in columns 0-3, lo in columns 4-7 of one mma;
//   NR = 8: two mma. The key codes enter CENTERED, code - KOFF (KOFF = 2^(KB-1): the unpacking fma
//   produces it at no cost), and the bias q . (mn_k + KOFF scale_k) is an fp32 dot on the CUDA cores:
//   with raw codes, codes . B and q . mn_k are two large sums of opposite sign whose roundings the
//   cancellation amplifies (lab/2026-11-22-large-operand-accuracy/model_mma_scores.py).
//   s = (S_hi + 2^-11 S_lo) max|q_row| 2^ek + bias (log2 units).
//   Softmax and P . V: page_softmax_pv (mma.cuh).
// Fragment orders (mma.cuh mtile_pos): m-tile mt of S^T, row g <-> token mtile_pos<KB>(g, mt), row g + 8
//   <-> the next token (KB = 2: 16 g + 2 mt, word g of a key row holds tokens 16 g .. 16 g + 15: byte
//   mt / 2, fields 2 (mt % 2) + {0, 1}; KB = 4: 8 g + 2 (mt % 4) + 64 (mt / 4), words g and g + 8);
//   k-step kk <-> channels 16 kk + {2t, 2t+1, 2t+8, 2t+9}. The PV k-step mt takes the tokens of score
//   m-tile mt (columns 2t, 2t+1, 2t+8, 2t+9 <-> tokens mtile_pos<KB>(2t, mt), mtile_pos<KB>(2t+1, mt),
//   each + 1; KB = 2: 32t + 2mt, 32t + 16 + 2mt, 32t + 2mt + 1, 32t + 17 + 2mt); m-tile mc of O^T, row
//   g <-> channel mtile_pos<VB>(g, mc), row g + 8 <-> the next channel.
//   Kitty: db / 16 extra k-steps with the compact high plane and B = 4 q * scale_k of the boosted channels.
// Pages: per warp a K slot and a V slot (cp.async): the next page's keys load during this page's softmax
//   and PV, its values during the next QK. Grid and combine as paged_decode.
// Dynamic shared memory: QT*D*8 (queries [row][channel]: fp32, fp16 hi, fp16 lo) + NW * (kslot + vslot).
template <int KITTY, int NR, int KB, int VB>
__global__ void __launch_bounds__(KVQ_MMA_MAXW * 32, NR == 4 ? 4 : 3)
    paged_decode_mma2(const void* __restrict__ q, int q_dt, i64 sq_b, i64 sq_h, i64 sq_t,
                      const u8* __restrict__ kc, const u8* __restrict__ kh, const u8* __restrict__ ki,
                      const u16* __restrict__ ks, const u16* __restrict__ km, const u8* __restrict__ vc,
                      const u16* __restrict__ vs, const u16* __restrict__ vm, const int* __restrict__ k_table,
                      const int* __restrict__ v_table, int n_tab, float* __restrict__ o_part,
                      float* __restrict__ lse_part, int B, int Hq, int Hkv, int Tq, int NF, int NP, int pps,
                      int num_splits, int db, int ngv, float qk_scale) {
    constexpr int D = 128, G = KVQ_G, GB = 16 * KB, VBY = 16 * VB, QT = 8;
    constexpr int KOFF = 1 << (KB - 1);            // key codes enter the tensor cores as code - KOFF
    static_assert((KB == 2 || KB == 4) && (VB == 2 || VB == 4), "2- or 4-bit codes");
    static_assert(!KITTY || KB == 2, "Kitty's dense plane is 2-bit");
    constexpr int KS_OFF = D * GB, KM_OFF = KS_OFF + 2 * D, KH_OFF = KM_OFF + 2 * D + (KITTY ? D : 0);
    constexpr int VS_OFF = G * VBY, VM_OFF = VS_OFF + 2 * G, VSLOT = VM_OFF + 2 * G;
    extern __shared__ u32x4 dsmem4[];
    __shared__ float s_m[KVQ_MMA_MAXW][QT], s_l[KVQ_MMA_MAXW][QT], s_qmax[QT], s_qrcp[QT];
    __shared__ u8 s_inv[KVQ_MMA_MAXW][KITTY != 0 ? D : 1];
    u8* dsmem = reinterpret_cast<u8*>(dsmem4);
    float* s_q = reinterpret_cast<float*>(dsmem);                     // [QT][D] q * qk_scale, fp32
    u16* s_qh = reinterpret_cast<u16*>(dsmem + QT * D * 4);           // [QT][D] fp16(q~), q~ = q / max|q_row|
    u16* s_ql = s_qh + QT * D;                                        // [QT][D] fp16(2^11 (q~ - hi))
    const int kslot_b = KH_OFF + (KITTY ? db * GB : 0);

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
    u8* kslot = dsmem + QT * D * 8 + warp * (kslot_b + VSLOT);
    u8* vslot = kslot + kslot_b;
    const int p0 = split * pps;
    const int p1 = kvq_min(p0 + pps, NP);
    // the first page's copies go out before the queries load: its round trip overlaps the prologue
    int j = p0 + warp;
    const int* ktab = k_table + (i64)b * n_tab;
    const int* vtab = v_table + (i64)b * n_tab;
    if (j < p1) stage_k2<KITTY, KB>(kslot, ktab[j], hk, Hkv, kc, kh, ki, ks, km, db, lane);
    p_commit();
    if (j < p1) stage_v2<VB>(vslot, vtab[j], hk, Hkv, vc, vs, vm, lane);
    p_commit();
    mma_load_queries<D>(s_q, s_qh, s_ql, s_qmax, s_qrcp, q, q_dt, sq_b, sq_h, sq_t, b, hk, Gq, Tq, nq, qk_scale);

    const int rb = NR == 4 ? (g & 3) : g;          // the query row of this thread's B columns
    const bool blo = NR == 4 && g >= 4;            // NR = 4: columns 4-7 hold the lo halves
    const float* qrow = s_q + rb * D;
    const u16* qhr = s_qh + rb * D;
    const u16* qlr = s_ql + rb * D;
    // the query rows of this thread's scores: NR = 8: 2t, 2t + 1 (its columns); NR = 4: rows 2 (t % 2) +
    // {0, 1}, of the page's tokens 16 g + 2 mt (t < 2) or 16 g + 2 mt + 1 (t >= 2)
    const int r0 = NR == 4 ? 2 * (t & 1) : 2 * t;
    const float qmax0 = s_qmax[r0], qmax1 = s_qmax[r0 + 1];
    const float rqmax_b = s_qrcp[rb];

    float m0 = -KVQ_INF, m1 = -KVQ_INF, l0 = 0.0f, l1 = 0.0f, bs0 = 0.0f, bs1 = 0.0f;
    float O[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) O[i][e] = 0.0f;

    for (; j < p1; j += NW) {                      // uniform across the warp
        // the next page's key-table entry, loaded now (its value entry once its keys are staged): the
        // copies after this page's scores and after its P . V then wait on no global load
        const bool more = j + NW < p1;
        const int kpn = more ? ktab[j + NW] : 0;
        p_wait<1>();                               // the keys of page j
        __syncwarp();
        const int nvalid = kvq_min(G, NF - j * G);
        const u16* kss = reinterpret_cast<const u16*>(kslot + KS_OFF);
        const u16* kms = reinterpret_cast<const u16*>(kslot + KM_OFF);
        // the page's scale and min exponents: 2^(e-1) <= max|scale_k| < 2^e, alike for max|mn_k|
        const int ek = pow2_above(warp_absmax128(kss, lane));
        const u32 fk = h2_pow2(-ek);

        // ---- B fragments of the 8 k-steps: B = q~ * scale_k 2^-e as hi + 2^-11 lo, by the exact fp16
        // two-product
        u32 bq[8][NR == 8 ? 4 : 2];
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int c = 16 * kk + 2 * t;
            const u32 qh0 = *reinterpret_cast<const u32*>(qhr + c), qh1 = *reinterpret_cast<const u32*>(qhr + c + 8);
            const u32 ql0 = *reinterpret_cast<const u32*>(qlr + c), ql1 = *reinterpret_cast<const u32*>(qlr + c + 8);
            const u32 s0 = hmul2(*reinterpret_cast<const u32*>(kss + c), fk);
            const u32 s1 = hmul2(*reinterpret_cast<const u32*>(kss + c + 8), fk);
            u32 h0, l0, h1, l1;
            two_prod_h2(qh0, ql0, s0, h0, l0);
            two_prod_h2(qh1, ql1, s1, h1, l1);
            if constexpr (NR == 8) {
                bq[kk][0] = h0, bq[kk][1] = h1, bq[kk][2] = l0, bq[kk][3] = l1;
            } else {
                bq[kk][0] = blo ? l0 : h0;
                bq[kk][1] = blo ? l1 : h1;
            }
        }
        // ---- the bias of the centered codes, q . (mn_k + KOFF scale_k), an fp32 dot on the CUDA cores:
        // lane takes channels lane + 32 i of every row; the 32 partial sums of the 8 rows meet by a
        // reduce-scatter (xor 16, 8, 4: rows halve; xor 2, 1: sums), which leaves row g's sum in lanes
        // (g, *); this thread's rows r0, r0 + 1 come from lanes 4 r0, 4 r0 + 4. NR = 4: rows 4-7 are
        // zero queries, left out: the xor-16 step sums rows 0-3 in both halves, so lanes 0-15 add what
        // they added with the zero rows (the same bits)
        float bias0, bias1;
        {
            constexpr int NQ = NR == 4 ? 4 : 8;
            float mc[4], v[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = lane + 32 * i;
                mc[i] = __fadd_rn(f16_to_f32(kms[c]), __fmul_rn((float)KOFF, f16_to_f32(kss[c])));
            }
#pragma unroll
            for (int r = 0; r < NQ; ++r) {
                v[r] = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) v[r] = fmaf(s_q[r * D + lane + 32 * i], mc[i], v[r]);
            }
            const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                if constexpr (NR == 4) v[r] += __shfl_xor_sync(KVQ_FULL_MASK, v[r], 16);
                else v[r] = (b4 ? v[r + 4] : v[r]) + __shfl_xor_sync(KVQ_FULL_MASK, b4 ? v[r] : v[r + 4], 16);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r)
                v[r] = (b3 ? v[r + 2] : v[r]) + __shfl_xor_sync(KVQ_FULL_MASK, b3 ? v[r] : v[r + 2], 8);
            float y = (b2 ? v[1] : v[0]) + __shfl_xor_sync(KVQ_FULL_MASK, b2 ? v[0] : v[1], 4);
            y += __shfl_xor_sync(KVQ_FULL_MASK, y, 2);
            y += __shfl_xor_sync(KVQ_FULL_MASK, y, 1);
            bias0 = __shfl_sync(KVQ_FULL_MASK, y, 4 * r0);
            bias1 = __shfl_sync(KVQ_FULL_MASK, y, 4 * r0 + 4);
        }
        const float inv = rqmax_b * f_pow2(-ek);  // Kitty's high plane (fp32 q)

        // ---- S^T = codes_K . B
        float S[8][4], SL[NR == 8 ? 8 : 1][4];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                S[i][e] = 0.0f;
                if constexpr (NR == 8) SL[i][e] = 0.0f;
            }
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const u8* kr = kslot + (16 * kk + 2 * t) * GB;          // key channel rows c, c + 1, c + 8, c + 9
            mma_rows<KB, NR == 8 ? 2 : 1, KOFF>(S, SL, bq[kk], kr, kr + GB, kr + 8 * GB, kr + 9 * GB, g);
        }
        if constexpr (KITTY != 0) {
            // Algorithm 1 as extra k-steps: code = low + 4 high, B = 4 q * scale_k of the boosted channel
            // of compact row r (idx[c] = r)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = lane + 32 * e;
                const int ix = kslot[KM_OFF + 2 * D + c];
                if (ix < db) s_inv[warp][ix] = (u8)c;
            }
            __syncwarp();
            for (int kb = 0; 16 * kb < db; ++kb) {
                float f[4];
                u32 w[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {          // without branches: the four rows' loads overlap
                    const int r = 16 * kb + 2 * t + (e & 1) + 8 * (e >> 1);
                    const bool ok = r < db;
                    const int rr = ok ? r : 0;         // rows past db: read row 0, contribute 0
                    const int c = s_inv[warp][rr];
                    const float fv = 4.0f * qrow[c] * f16_to_f32(kss[c]) * inv;
                    const u32 wv = *reinterpret_cast<const u32*>(kslot + KH_OFF + rr * GB + 4 * g);
                    f[e] = ok ? fv : 0.0f;
                    w[e] = ok ? wv : 0u;
                }
                u32 bk[NR == 8 ? 4 : 2];
                qk_bfrag<NR>(bk, f[0], f[1], f[2], f[3], blo);
                mma_mtiles<2, NR == 8 ? 2 : 1>(S, SL, bk, w[0], w[1], w[2], w[3]);
            }
            __syncwarp();                          // s_inv is rewritten for the next page
        }
        __syncwarp();
        if (more) stage_k2<KITTY, KB>(kslot, kpn, hk, Hkv, kc, kh, ki, ks, km, db, lane);
        p_commit();
        const int vpn = more ? vtab[j + NW] : 0;

        // ---- scores of row r0 + e: (hi + 2^-11 lo) max|q_row| 2^ek + q . mn_k
        const float rs0 = qmax0 * f_pow2(ek), rs1 = qmax1 * f_pow2(ek);
        page_softmax_pv<NR, KB, VB>(S, SL, [&](int e, float hi, float lo, int, int) {
            const float rs = (e & 1) ? rs1 : rs0;
            return fmaf(lo, rs * (1.0f / 2048.0f), fmaf(hi, rs, (e & 1) ? bias1 : bias0));
        }, nvalid, vslot, lane, m0, m1, l0, l1, bs0, bs1, O);
        __syncwarp();
        if (more) stage_v2<VB>(vslot, vpn, hk, Hkv, vc, vs, vm, lane);
        p_commit();
    }
    p_wait<0>();                                   // no copy may be in flight at exit / reuse
    mma_finish<NR, D, VB>(dsmem + QT * D * 8, &s_m[0][0], &s_l[0][0], m0, m1, l0, l1, bs0, bs1, O, nq, hk, Gq, Tq, B, Hq,
                      b, split, o_part, lse_part);
}

// a code (< 2^23) as an exact float: its bits in the significand of 2^23, minus 2^23 (exact)
__device__ __forceinline__ float exact_f32(u32 code) {
    return ieee_add(__uint_as_float(0x4B000000u | code), -8388608.0f);
}

// element i of a scale or mn array as fp32: stored fp32 when meta32, else fp16
__device__ __forceinline__ float meta_f32(const void* __restrict__ p, i64 i, int meta32) {
    return meta32 ? reinterpret_cast<const float*>(p)[i] : f16_to_f32(reinterpret_cast<const u16*>(p)[i]);
}

// code * scale[i] + mn[i] as two rounded fp32 operations (the reference's dequantize)
__device__ __forceinline__ float dequant_meta(u32 code, const void* __restrict__ scale, const void* __restrict__ mn,
                                              i64 i, int meta32) {
    return ieee_add(ieee_mul((float)code, meta_f32(scale, i, meta32)), meta_f32(mn, i, meta32));
}

// ---- the tail: sink, Q-buffers, window and the mixed tokens ------------------------------------------
// The tail's rows (what the fused kernel does not cover), for every (b, kv head hk): row u < NS is sink
//   token u; row u >= NS is post-sink token p = NF + u - NS, whose key is key page k_table[b, p / G]
//   slot p % G dequantized (code * scale + mn, two rounded fp32 ops: bit-exact with the reference's
//   dequantize; Kitty: low | high[idx] << 2) when p < KQ, else the key Q-buffer row p - KQ; its value
//   is value page v_table[b, p / G] slot p % G when p < VQ, the value Q-buffer row p - VQ when
//   p < VQ + NVB, else the window ring-buffer slot p % R. G = 128; meta32: scale / mn are fp32 (else
//   fp16). The bit widths are arguments: paged_gather_tail passes compile-time constants (inlined,
//   every code position a shift), paged_tail_attn its runtime values (only the few mixed rows use them).
//   Mirrors kvq.fast.triton.paged._gather_tail_kernel.
struct TailRows {
    const u16 *sink_k, *sink_v, *k_buf, *v_buf, *v_win;
    const u8 *kc, *kh, *ki;
    const void *ks, *km;
    const u8* vc;
    const void *vs, *vm;
    const int *k_table, *v_table;
    int H, D, S, NS, NF, KQ, VQ, NVB, R1, n_tab, ngv, db, meta32;

    // the fp16 key row of tail row u, or nullptr when the key comes from a page (key_page)
    __device__ __forceinline__ const u16* key_row16(int b, int hk, int u) const {
        const i64 bh = (i64)b * H + hk;
        if (u < NS) return sink_k + (bh * S + u) * D;
        const int pp = NF + u - NS;
        return pp < KQ ? nullptr : k_buf + (bh * KVQ_G + (pp - KQ)) * D;
    }
    // where tail row u's key lives when it comes from a page: (page * H + hk, slot)
    __device__ __forceinline__ void key_page_row(int b, int hk, int u, i64& kph, int& slot) const {
        const int pp = NF + u - NS;
        slot = pp % KVQ_G;
        kph = (i64)k_table[(i64)b * n_tab + pp / KVQ_G] * H + hk;
    }
    // the metadata of channel d of key page-head kph: scale, mn and (Kitty) the high-plane row (db: none)
    __device__ __forceinline__ void key_meta(i64 kph, int d, int kitty, float& sc, float& m, int& ix) const {
        const i64 i = kph * D + d;
        sc = meta_f32(ks, i, meta32);
        m = meta_f32(km, i, meta32);
        ix = kitty ? (int)ki[i] : db;
    }
    // channel d of the key at (kph, slot) with its metadata (key_meta), dequantized: code * sc + m as
    // two rounded fp32 operations (kbits: 2, 4 or 8; Kitty: low | high[ix] << 2)
    __device__ __forceinline__ float key_code_meta(i64 kph, int slot, int d, int kbits, float sc, float m,
                                                   int ix) const {
        const int lper = 3 - (__ffs(kbits) - 1);            // log2(codes per byte)
        const u32 byte = kc[(kph * D + d) * (KVQ_G * kbits / 8) + (slot >> lper)];
        u32 code = (byte >> ((slot & ((1 << lper) - 1)) * kbits)) & ((1u << kbits) - 1u);
        if (ix < db) {
            const u32 hb = kh[(kph * db + ix) * (KVQ_G / 4) + slot / 4];
            code |= ((hb >> ((slot % 4) * 2)) & 3u) << 2;
        }
        return ieee_add(ieee_mul((float)code, sc), m);
    }
    __device__ __forceinline__ float key_code_f32(i64 kph, int slot, int d, int kbits, int kitty) const {
        float sc, m;
        int ix;
        key_meta(kph, d, kitty, sc, m, ix);
        return key_code_meta(kph, slot, d, kbits, sc, m, ix);
    }
    // channel d of tail row u's key from its page (key_row16(b, hk, u) == nullptr)
    __device__ __forceinline__ float key_page(int b, int hk, int u, int d, int kbits, int kitty) const {
        i64 kph;
        int slot;
        key_page_row(b, hk, u, kph, slot);
        return key_code_f32(kph, slot, d, kbits, kitty);
    }
    // the fp16 value row of tail row u, or nullptr when the value comes from a page (value_page)
    __device__ __forceinline__ const u16* value_row16(int b, int hk, int u) const {
        const i64 bh = (i64)b * H + hk;
        if (u < NS) return sink_v + (bh * S + u) * D;
        const int pp = NF + u - NS;
        if (pp < VQ) return nullptr;
        return pp < VQ + NVB ? v_buf + (bh * KVQ_G + (pp - VQ)) * D : v_win + (bh * R1 + pp % R1) * D;
    }
    // the value row (page * H + hk) * G + slot of tail row u when its value comes from a page
    __device__ __forceinline__ i64 value_page_row(int b, int hk, int u) const {
        const int pp = NF + u - NS;
        return ((i64)v_table[(i64)b * n_tab + pp / KVQ_G] * H + hk) * KVQ_G + pp % KVQ_G;
    }
    // channel d of value row vrow, dequantized (vbits: 2, 4 or 8)
    __device__ __forceinline__ float value_code_f32(i64 vrow, int d, int vbits) const {
        const int lper = 3 - (__ffs(vbits) - 1);
        const u32 byte = vc[vrow * (D * vbits / 8) + (d >> lper)];
        const u32 code = (byte >> ((d & ((1 << lper) - 1)) * vbits)) & ((1u << vbits) - 1u);
        return dequant_meta(code, vs, vm, vrow * ngv + (ngv == 1 ? 0 : d / (D / ngv)), meta32);
    }
    // channel d of tail row u's value from its page (value_row16(b, hk, u) == nullptr)
    __device__ __forceinline__ float value_page(int b, int hk, int u, int d, int vbits) const {
        return value_code_f32(value_page_row(b, hk, u), d, vbits);
    }
};

#define KVQ_TAIL_PARAMS                                                                                     \
    const u16 *__restrict__ sink_k, const u16 *__restrict__ sink_v, const u16 *__restrict__ k_buf,          \
        const u16 *__restrict__ v_buf, const u16 *__restrict__ v_win, const u8 *__restrict__ kc,             \
        const u8 *__restrict__ kh, const u8 *__restrict__ ki, const void *__restrict__ ks,                   \
        const void *__restrict__ km, const u8 *__restrict__ vc, const void *__restrict__ vs,                 \
        const void *__restrict__ vm, const int *__restrict__ k_table, const int *__restrict__ v_table
// (the head dim D is its own argument: a template value of paged_tail_attn)
#define KVQ_TAIL_INTS int H, int S, int NS, int NF, int KQ, int VQ, int NVB, int R1, int n_tab, int ngv, int db, int meta32
#define KVQ_TAIL_ROWS                                                                                       \
    TailRows{sink_k, sink_v, k_buf, v_buf, v_win, kc, kh, ki, ks, km, vc, vs, vm, k_table, v_table,         \
             H, D, S, NS, NF, KQ, VQ, NVB, R1, n_tab, ngv, db, meta32}

// ---- tail gather kernel --------------------------------------------------------------------------
// Computes: the tail's fp32 K / V rows (TailRows) in token order: ok / ov (B, H, NT, D). KB / VB: key
//   (Kitty: dense plane) / value code bits, compile-time. The float32-q (precise) decode's input.
// Grid: (ceil(NT / GATHER_TOK), H, B), 256 threads (D divides 256): a block takes GATHER_TOK tokens of
//   (b, hk); the keys are read channel-major (consecutive threads, consecutive tokens of one channel
//   row: the packed bytes are contiguous) into shared memory, then keys and values are written
//   token-major, thread -> channel tid % D.
// Bytes: reads NT rows of K and V (packed bytes + metadata, or fp16) per (b, kv head); writes 2 NT D fp32.
template <int KITTY, int KB, int VB>
__global__ void __launch_bounds__(256)
    paged_gather_tail(KVQ_TAIL_PARAMS, float* __restrict__ ok, float* __restrict__ ov, int B, int NT, int D,
                      KVQ_TAIL_INTS) {
    static_assert(!KITTY || KB == 2, "Kitty's dense plane is 2-bit");
    __shared__ float s_k[GATHER_TOK][GATHER_MAXD + 1];
    const TailRows rows = KVQ_TAIL_ROWS;
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const i64 bh = (i64)b * H + hk;
    const int u0 = blockIdx.x * GATHER_TOK;
    const int nu = kvq_min(GATHER_TOK, NT - u0);
    // keys, channel-major (a warp reads one channel row's bytes of consecutive tokens), into s_k
    for (int i = threadIdx.x; i < GATHER_TOK * D; i += blockDim.x) {
        const int d = i / GATHER_TOK;
        const int uu = i % GATHER_TOK;
        if (uu >= nu) continue;
        const u16* r16 = rows.key_row16(b, hk, u0 + uu);
        s_k[uu][d] = r16 ? f16_to_f32(r16[d]) : rows.key_page(b, hk, u0 + uu, d, KB, KITTY);
    }
    __syncthreads();
    // token-major: the keys from s_k, the values from their token rows (coalesced over d)
    const int d = threadIdx.x % D;
    for (int uu = threadIdx.x / D; uu < nu; uu += blockDim.x / D) {
        const u16* r16 = rows.value_row16(b, hk, u0 + uu);
        const float vx = r16 ? f16_to_f32(r16[d]) : rows.value_page(b, hk, u0 + uu, d, VB);
        const i64 idx = (bh * NT + u0 + uu) * D + d;
        ok[idx] = s_k[uu][d];
        ov[idx] = vx;
    }
}

// The tile source of paged_tail_attn (attn_split.cuh's Tiles contract; fp32 tiles, plain stores): the
// tail rows [kb, kb + nk) of (b, hk). Lane r works out where row r lives (once per row: the key and value
// page-table entries load together); fp16 rows are read as 16-byte vectors (all of a lane's loads issued
// before any is used; the row's address from lane r by a shuffle) and widened, values first; page rows
// (the mixed tokens: a key without its value quantized, or the reverse) are dequantized in place, lanes
// on channels: key rows by key_rows (each page's metadata and all the code words the tile needs loaded
// once per channel, in one round trip), value rows a row at a time. Rows past nk are left as they are
// (the body masks them). H100, 1 x 32K: 2-3% faster steps than one round trip per table entry and per
// word (lab/2026-11-22-kivi-kitty-decode/results/h100-d93e357).
// w[k] for 1 <= k < N (a run-time k, the registers picked by an unrolled select: a register array
// indexed at run time would live in local memory; k >= N - 1 gives w[N - 1])
template <int N>
__device__ __forceinline__ u32 word_after0(const u32 (&w)[N], int k) {
    u32 x = w[N - 1];
#pragma unroll
    for (int i = N - 2; i >= 1; --i) x = k == i ? w[i] : x;
    return x;
}

template <int D>
struct PagedTailTiles {
    TailRows rows;
    int kbits, vbits, kitty;
    int u0;                                        // tile row r is tail row u0 + r
    static constexpr int KROW = AttnCfg<2, D>::KROW;
    static constexpr int NVR = D / 8;              // 16-byte fp16 vectors per row
    static constexpr int NIT = NVR;                // vectors per lane: 32 rows x NVR / 32 lanes

    // the fp16 rows (row r at lane r's `mine`, null: not an fp16 row) widened into dst (row stride ld)
    __device__ __forceinline__ void fill16(float* dst, int ld, const u16* mine, int lane) const {
        u32x4 raw[NIT];
        u32 has = 0u;
#pragma unroll
        for (int it = 0; it < NIT; ++it) {
            const int i = lane + 32 * it;
            const int r = i / NVR, c = i % NVR;
            const u16* p = reinterpret_cast<const u16*>(
                __shfl_sync(KVQ_FULL_MASK, (unsigned long long)mine, r));
            raw[it] = p ? *reinterpret_cast<const u32x4*>(p + 8 * c) : u32x4{0u, 0u, 0u, 0u};
            if (p) has |= 1u << it;
        }
#pragma unroll
        for (int it = 0; it < NIT; ++it) {
            if (!(has >> it & 1u)) continue;
            const int i = lane + 32 * it;
            const int r = i / NVR, c = i % NVR;
            float f[8];
            load_f32<0, 8>(reinterpret_cast<const u16*>(&raw[it]), f);
            u32x4* o = reinterpret_cast<u32x4*>(dst + r * ld + 8 * c);
            o[0] = u32x4{__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3])};
            o[1] = u32x4{__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]), __float_as_uint(f[7])};
        }
    }
    // tile rows [r0, re) (at most 32) from page-head ph's slots s0, s0 + 1, ..., KB-bit keys (Kitty: 2-bit low
    // plane and the high plane's rows), lanes on channels lane + 32 j: each channel's metadata and every
    // code word the rows need (NW words of 32 / KB slots, the high plane NWH of 16) loaded up front, all
    // in flight together; the codes shifted out of them, then code * scale + mn as two rounded fp32
    // operations (key_code_meta's bits), handed to put(tile row, channel, value)
    template <int KB, class Put>
    __device__ __forceinline__ void key_rows(i64 ph, int s0, int r0, int re, int lane, Put put) const {
        constexpr int J = D / 32, PER = 32 / KB, RW = KVQ_G * KB / 32;    // slots a word, words a channel row
        constexpr int NW = 32 / PER + 1, NWH = 32 / 16 + 1;               // words 32 consecutive slots touch
        constexpr u32 MASK = (1u << KB) - 1u;
        float sc[J], mn[J];
        u32 wd[J][NW], hwd[J][NWH];
        const int w0 = s0 / PER, h0 = s0 / 16;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int d = lane + 32 * j;
            int ix;
            rows.key_meta(ph, d, kitty, sc[j], mn[j], ix);
            const u32* w = reinterpret_cast<const u32*>(rows.kc) + (ph * D + d) * RW;
#pragma unroll
            for (int k = 0; k < NW; ++k) wd[j][k] = w[kvq_min(w0 + k, RW - 1)];   // past the row: unused
            const bool hi = ix < rows.db;                                  // Kitty: a boosted channel
            const i64 hrow = (ph * rows.db + ix) * (KVQ_G / 16);           // (used only when hi)
#pragma unroll
            for (int k = 0; k < NWH; ++k)
                hwd[j][k] = hi ? reinterpret_cast<const u32*>(rows.kh)[hrow + kvq_min(h0 + k, KVQ_G / 16 - 1)] : 0u;
        }
        // the codes shifted out of the current words; at a word boundary (warp-uniform) the next word
        // (word_after0)
        u32 cur[J], hcur[J];
#pragma unroll
        for (int j = 0; j < J; ++j) {
            cur[j] = wd[j][0] >> (KB * (s0 % PER));
            hcur[j] = hwd[j][0] >> (2 * (s0 % 16));
        }
#pragma unroll 1
        for (int r = r0, slot = s0; r < re; ++r) {                         // slot: warp-uniform
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const u32 code = (cur[j] & MASK) | ((hcur[j] & 3u) << 2);
                put(r, lane + 32 * j, ieee_add(ieee_mul(exact_f32(code), sc[j]), mn[j]));
                cur[j] >>= KB;
                hcur[j] >>= 2;
            }
            ++slot;
            if (slot % PER == 0) {
#pragma unroll
                for (int j = 0; j < J; ++j) cur[j] = word_after0(wd[j], slot / PER - w0);
            }
            if (slot % 16 == 0) {
#pragma unroll
                for (int j = 0; j < J; ++j) hcur[j] = word_after0(hwd[j], slot / 16 - h0);
            }
        }
    }
    // the tile's key page rows (lane r: `mine` when row r's key is in a page, at (kph, slot); such rows are
    // contiguous), lanes on channels lane + 32 j, each page's metadata and code words loaded once
    template <class Put>
    __device__ __forceinline__ void key_page_rows(bool mine, i64 kph, int slot, int lane, Put put) const {
        const u32 pm = __ballot_sync(KVQ_FULL_MASK, mine);
        if (!pm) return;
        const int r1 = 32 - __clz(pm);
        for (int r0 = __ffs(pm) - 1; r0 < r1;) {                    // one page per pass (at most two)
            const i64 ph = (i64)__shfl_sync(KVQ_FULL_MASK, (long long)kph, r0);
            const int s0 = __shfl_sync(KVQ_FULL_MASK, slot, r0);
            const int re = kvq_min(r1, r0 + KVQ_G - s0);
            if (kbits == 2) key_rows<2>(ph, s0, r0, re, lane, put);
            else if (kbits == 4) key_rows<4>(ph, s0, r0, re, lane, put);
            else key_rows<8>(ph, s0, r0, re, lane, put);
            r0 = re;
        }
    }
    __device__ __forceinline__ void stage(float* ks, float* vs, int b, int hk, i64 kb, int nk, int lane) const {
        const int u = u0 + (int)kb + lane;            // lane r: row r
        const bool live = lane < nk;
        // where every row's key and value live (the page-table loads of both issued together)
        const u16* k16 = live ? rows.key_row16(b, hk, u) : nullptr;
        const u16* v16 = live ? rows.value_row16(b, hk, u) : nullptr;
        i64 kph = 0;
        int slot = 0;
        if (live && !k16) rows.key_page_row(b, hk, u, kph, slot);
        const i64 vrow = live && !v16 ? rows.value_page_row(b, hk, u) : 0;
        // the fp16 rows first (their loads wait on no table entry: in flight with the table loads), then
        // the key page rows (one round trip: the table entry, then their metadata and code words)
        fill16(vs, D, v16, lane);
        fill16(ks, KROW, k16, lane);
        key_page_rows(live && !k16, kph, slot, lane, [&](int r, int c, float x) { ks[r * KROW + c] = x; });
        // value page rows
        for (u32 m = __ballot_sync(KVQ_FULL_MASK, live && !v16); m; m &= m - 1u) {
            const int r = __ffs(m) - 1;
            const i64 vr = (i64)__shfl_sync(KVQ_FULL_MASK, (long long)vrow, r);
#pragma unroll
            for (int j = 0; j < D / 32; ++j) vs[r * D + lane + 32 * j] = rows.value_code_f32(vr, lane + 32 * j, vbits);
        }
    }
};

// The tile source of paged_tail16_attn and paged_tail_mma (fp16 tiles by cp.async): tail rows whose key
// and value are both fp16 (sink, Q-buffers, window), tile row r being tail row r + (r >= gap_at ? gap :
// 0) (the mixed rows [gap_at, gap_at + gap) skipped); value rows VROW elements apart in shared memory.
// Lane r works out row r's addresses once (cp_async_rows).
template <int D, int VROW = D>
struct PagedTail16Tiles {
    TailRows rows;
    int gap_at, gap;

    __device__ __forceinline__ void stage(u16* ks, u16* vs, int b, int hk, i64 kb, int nk, int lane) const {
        const int u = (int)kb + lane;
        const int ur = u + (u >= gap_at ? gap : 0);
        const bool live = lane < nk;
        cp_async_rows<0, D, VROW>(ks, vs, nk, lane, live ? rows.key_row16(b, hk, ur) : nullptr,
                                  live ? rows.value_row16(b, hk, ur) : nullptr);
    }
};

// ---- tail attention kernels ----------------------------------------------------------------------
// Computes: attention.cu's attn_split<DT, D, QT, NW, 0, QDT, SD> (base 2, QDT = fp16 / bf16 queries, the
//   score sums as SD says: 1 in double (the queries held as double in shared memory), 2 as four fp32
//   fma chains added pairwise (attn_split.cuh), P . V in float; its grid
//   and partial layout, partials from number split0 on) over tail rows read in place from the cache,
//   no gathered copy:
//   paged_tail_attn: T rows from tail row u0 on, as fp32 tiles: the same tile values as
//     paged_gather_tail writes, so with u0 = 0 and T = NT the same partials bit for bit; the decode
//     gives it the mixed rows (a key or a value from a page);
//   paged_tail16_attn: the rows whose key and value are both fp16 (PagedTail16Tiles), as fp16 tiles
//     by cp.async (half the shared memory per warp of the fp32 tiles).
//   The half-precision-q decode's tail, beside the fused kernel.
// Grid: (num_splits * n_qtiles, H_kv, B); block NW * 32 threads, the tiles in NW * AttnCfg<DT,
//   D>::WARP_BYTES bytes of dynamic shared memory (paged_tail_attn: fp32, DT = 2; paged_tail16_attn:
//   fp16, DT = 0).
template <int D, int QT, int NW, int QDT, int SD>
__global__ void __launch_bounds__(NW * 32)
    paged_tail_attn(const typename Ty<QDT>::S* __restrict__ q, KVQ_TAIL_PARAMS, int kbits, int vbits, int kitty,
                    int u0, float* __restrict__ o_part, float* __restrict__ lse_part, i64 sq_b, i64 sq_h, i64 sq_t,
                    int B, int Hq, int Tq, i64 T, i64 chunk, int num_splits, int split0, float qk_scale,
                    KVQ_TAIL_INTS) {
    const PagedTailTiles<D> tiles{KVQ_TAIL_ROWS, kbits, vbits, kitty, u0};
    attn_split_body<2, D, QT, NW, 0, QDT, SD, 1>(q, tiles, o_part, lse_part, sq_b, sq_h, sq_t, B, Hq, H, Tq, T,
                                                chunk, num_splits, split0, qk_scale);
}

template <int D, int QT, int NW, int QDT, int SD>
__global__ void __launch_bounds__(NW * 32)
    paged_tail16_attn(const typename Ty<QDT>::S* __restrict__ q, KVQ_TAIL_PARAMS, int gap_at, int gap,
                      float* __restrict__ o_part, float* __restrict__ lse_part, i64 sq_b, i64 sq_h, i64 sq_t,
                      int B, int Hq, int Tq, i64 T, i64 chunk, int num_splits, int split0, float qk_scale,
                      KVQ_TAIL_INTS) {
    const PagedTail16Tiles<D> tiles{KVQ_TAIL_ROWS, gap_at, gap};
    attn_split_body<0, D, QT, NW, 0, QDT, SD, 1>(q, tiles, o_part, lse_part, sq_b, sq_h, sq_t, B, Hq, H, Tq, T, chunk,
                                             num_splits, split0, qk_scale);
}

// Computes: paged_tail16_attn's partials (the same rows, grid and partial layout) for fp16 q and D = 128
//   on the tensor cores (mma.cuh attn_mma_body: query tiles of 8 rows, each score's 8 k-step sums added
//   pairwise in fp32, P in fp16). The half-precision-q decode's fp16 tail rows (paged.Knobs.tail_mma).
// Grid: (num_splits * ceil(G_q T_q / 8), H_kv, B); block NW * 32 threads; NW * 2 * 32 * KVQ_TMMA_ROW * 2
//   bytes of dynamic shared memory.
template <int NW>
__global__ void __launch_bounds__(NW * 32)
    paged_tail_mma(const u16* __restrict__ q, KVQ_TAIL_PARAMS, int gap_at, int gap, float* __restrict__ o_part,
                   float* __restrict__ lse_part, i64 sq_b, i64 sq_h, i64 sq_t, int B, int Hq, int Tq, i64 T,
                   i64 chunk, int num_splits, int split0, float qk_scale, KVQ_TAIL_INTS) {
    constexpr int D = 128;
    const PagedTail16Tiles<D, KVQ_TMMA_ROW> tiles{KVQ_TAIL_ROWS, gap_at, gap};
    attn_mma_body<NW, false>(q, tiles, o_part, lse_part, sq_b, sq_h, sq_t, B, Hq, H, Tq, T, chunk, num_splits, split0,
                      qk_scale);
}

// The tile source of paged_mixed_mma (attn_mma_body's KLO tiles): mixed tail rows u0 + kb + r whose key
// is in a page and whose value is fp16 (the value Q-buffer or window: the decode sends only such rows).
// The value rows go by cp.async (lane r works out row r's address, cp_async_row_group) after an empty group
// in the key group's place; the keys are dequantized as paged_tail_attn's (PagedTailTiles::key_page_rows:
// the same fp32 values), halved (exact) and stored as hi = fp16(k / 2), lo = fp16(2^11 (k / 2 - hi)) by
// plain stores.
// Rows past nk: values zero-filled, keys left as they are (attn_mma_body masks their scores).
struct PagedMixedTiles {
    PagedTailTiles<128> src;

    __device__ __forceinline__ void stage(u16* ks, u16* vs, int b, int hk, i64 kb, int nk, int lane) const {
        constexpr int ROW = KVQ_TMMA_ROW;
        const TailRows& rows = src.rows;
        const int u = src.u0 + (int)kb + lane;
        const bool live = lane < nk;
        i64 kph = 0;
        int slot = 0;
        if (live) rows.key_page_row(b, hk, u, kph, slot);
        p_commit();                                // the key group's place: empty (keys by plain stores)
        cp_async_row_group<0, 128>(vs, ROW, nk, lane, live ? rows.value_row16(b, hk, u) : nullptr);
        src.key_page_rows(live, kph, slot, lane, [&](int r, int c, float x) {
            const float h = __fmul_rn(x, 1.0f / (float)(1 << KVQ_KLO_E));   // exact
            const u16 hi = f32_to_f16_rn(h);
            ks[r * ROW + c] = hi;
            ks[64 * ROW + r * ROW + c] = f32_to_f16_rn(__fmul_rn(__fsub_rn(h, f16_to_f32(hi)), 2048.0f));
        });
    }
};

// Computes: paged_tail_attn's partials (grid and partial layout) for the mixed rows [u0, u0 + T) whose
//   key is in a page and whose value is fp16, fp16 q and D = 128, on the tensor cores: attn_mma_body with
//   each key as hi + 2^-11 lo fp16 tiles (PagedMixedTiles), each score's k-step sums added pairwise in
//   fp32, P in fp16. The half-precision-q decode's mixed rows where all of them are such rows
//   (paged.Knobs.mixed_mma; H100, KIVI-K2V2 1 x 32K: steps 0.0252 -> 0.0231 ms,
//   lab/2026-11-22-kivi-kitty-decode/results/h100-mixed-mma).
// Grid: (num_splits * ceil(G_q T_q / 8), H_kv, B); block NW * 32 threads; NW * 3 * 32 * KVQ_TMMA_ROW * 2
//   bytes of dynamic shared memory.
template <int NW>
__global__ void __launch_bounds__(NW * 32)
    paged_mixed_mma(const u16* __restrict__ q, KVQ_TAIL_PARAMS, int kbits, int kitty, int u0,
                    float* __restrict__ o_part, float* __restrict__ lse_part, i64 sq_b, i64 sq_h, i64 sq_t, int B,
                    int Hq, int Tq, i64 T, i64 chunk, int num_splits, int split0, float qk_scale, KVQ_TAIL_INTS) {
    constexpr int D = 128;
    const PagedMixedTiles tiles{PagedTailTiles<D>{KVQ_TAIL_ROWS, kbits, 16, kitty, u0}};
    attn_mma_body<NW, true>(q, tiles, o_part, lse_part, sq_b, sq_h, sq_t, B, Hq, H, Tq, T, chunk, num_splits, split0,
                            qk_scale);
}
