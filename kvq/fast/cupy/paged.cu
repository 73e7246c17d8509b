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
#include "common.cuh"

#define KVQ_G 128

// ---- helpers -------------------------------------------------------------------------------------

__device__ __forceinline__ u32 p_smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

__device__ __forceinline__ void p_cp_async16(void* dst_smem, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(p_smem_addr(dst_smem)), "l"(src) : "memory");
}

__device__ __forceinline__ void p_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void p_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

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

__device__ __forceinline__ int kvq_max_i(int a, int b) { return a > b ? a : b; }

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

// Copy nbytes (a multiple of 16) from global src (16-byte aligned) to shared dst, the warp's lanes
// taking 16-byte chunks in turn.
__device__ __forceinline__ void warp_copy(u8* dst, const u8* src, int nbytes, int lane) {
    for (int i = lane * 16; i < nbytes; i += 32 * 16) p_cp_async16(dst + i, src + i);
}

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
//   conversion), dequantize, QT x 4 fp32 FMAs (q from shared memory, broadcast). P . V: lane owns 4
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

        // ---- scores: lane owns tokens 4*lane .. 4*lane + 3
        float s[QT][4];
#pragma unroll
        for (int qi = 0; qi < QT; ++qi)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[qi][e] = 0.0f;
        const u8* kcs = buf + PB::KC + lane * (KB / 2);
        const u16* kss = reinterpret_cast<const u16*>(buf + PB::KS);
        const u16* kms = reinterpret_cast<const u16*>(buf + PB::KM);
#pragma unroll 4
        for (int d = 0; d < D; ++d) {
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
                for (int e = 0; e < 4; ++e) s[qi][e] = fmaf(qv[qi], k[e], s[qi][e]);
        }

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

// ---- tensor-core fused decode kernel (fp16 q, D = 128, 2-bit keys and values, one value group per token)

// (lo, hi) -> one half2 register, lo in bits 0-15 (the element order of the mma fragments)
__device__ __forceinline__ u32 f2_to_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void h2_to_f2(u32 h, float& lo, float& hi) {
    asm("{.reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}"
        : "=f"(lo), "=f"(hi) : "r"(h));
}

// x0, x1 as hi = fp16(x) and lo = fp16((x - hi) * 2^11): x = hi + 2^-11 lo to about 22 bits
__device__ __forceinline__ void split2(float x0, float x1, u32& hi, u32& lo) {
    hi = f2_to_h2(x0, x1);
    float h0, h1;
    h2_to_f2(hi, h0, h1);
    lo = f2_to_h2((x0 - h0) * 2048.0f, (x1 - h1) * 2048.0f);
}

// d += a b: mma.sync m16n8k16, f16 inputs, f32 accumulators (a: 4 registers, b: 2)
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// byte BB of w0 to byte 0 and byte BB of w1 to byte 2 (bytes 1 and 3: don't care)
template <int BB>
__device__ __forceinline__ u32 byte_pair(u32 w0, u32 w1) {
    return __byte_perm(w0, w1, BB | (BB << 4) | ((4 + BB) << 8) | ((4 + BB) << 12));
}

// the 2-bit fields I of bytes 0 and 2 of x as a half2 of exact codes, two per 32-bit operation and
// without shifts: the field stays at bit 2I of each half, one lop3 masks it and ORs 0x6400 in (the
// half is then 1024 + code * 4^I, exact), one fma.f16x2 by 4^-I with addend -1024 * 4^-I leaves the
// code (exact: powers of two).
template <int I>
__device__ __forceinline__ u32 codes_h2(u32 x) {
    constexpr u32 M = 0x00030003u << (2 * I);
    constexpr u32 SCALE = I == 0 ? 0x3C003C00u : I == 1 ? 0x34003400u : I == 2 ? 0x2C002C00u : 0x24002400u;
    constexpr u32 BIAS = I == 0 ? 0xE400E400u : I == 1 ? 0xDC00DC00u : I == 2 ? 0xD400D400u : 0xCC00CC00u;
    u32 h, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(x), "n"(M), "n"(0x64006400u));      // (x & M) | magic
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(SCALE), "r"(BIAS));
    return r;
}

// 2^x (approximate, flush-to-zero: probabilities of the online softmax, rule 7)
__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// 16 mma of one k-step: n-tile 4 BB + I takes fields I of byte BB of the word pairs (w0, w1), (w2, w3)
__device__ __forceinline__ void mma_ktile(float (*c)[4], const u32* a, u32 w0, u32 w1, u32 w2, u32 w3) {
#define KVQ_MMA_BYTE(BB)                                                                  \
    {                                                                                     \
        const u32 xa = byte_pair<BB>(w0, w1), xb = byte_pair<BB>(w2, w3);                 \
        mma16816(c[4 * BB + 0], a, codes_h2<0>(xa), codes_h2<0>(xb));                     \
        mma16816(c[4 * BB + 1], a, codes_h2<1>(xa), codes_h2<1>(xb));                     \
        mma16816(c[4 * BB + 2], a, codes_h2<2>(xa), codes_h2<2>(xb));                     \
        mma16816(c[4 * BB + 3], a, codes_h2<3>(xa), codes_h2<3>(xb));                     \
    }
    KVQ_MMA_BYTE(0)
    KVQ_MMA_BYTE(1)
    KVQ_MMA_BYTE(2)
    KVQ_MMA_BYTE(3)
#undef KVQ_MMA_BYTE
}

// Computes: the partials of paged_decode (same arguments, same output layout) for up to QT = 8 query
//   rows per kv head, with both products on the tensor cores (mma.sync m16n8k16, fp16 in, fp32 out):
//   s = (q * scale_k) . codes + q . mn_k  and  o = (p * scale_v) . codes + p . mn_v. Codes are exact in
//   fp16 (the 0x6400 magic, two per 32-bit operation, no shared-memory transpose); the fp32 factors
//   q * scale_k (normalized by max|q| max|scale_k| per page) and p * scale_v are split as hi + 2^-11 lo:
//   hi in MMA rows 0-7 and lo in rows 8-15 of the same tile (rows g and g + 8 of an mma fragment live
//   in the same thread), so one mma computes both.
// Fragment orders (the page's tokens and the value channels are visited in a fixed permuted order;
//   the softmax and the final store undo nothing else): thread (g = lane / 4, t = lane % 4).
//   QK: k-step kk covers channels 16 kk + 0..15; n-tile jj (0..15), column n <-> token 16 n + jj:
//     thread g reads word g (tokens 16 g .. 16 g + 15) of the key rows of channels 16 kk + 2t, 2t+1,
//     2t+8, 2t+9 and pairs two channels' bytes with one byte_perm (the B fragment).
//   PV: the score fragment is the A fragment (k-step kk <- QK n-tiles 2kk, 2kk+1): columns 2t, 2t+1,
//     2t+8, 2t+9 <-> tokens 32t + 2kk, 32t + 16 + 2kk, 32t + 2kk + 1, 32t + 17 + 2kk; n-tile jn (0..15),
//     column n <-> channel 16 n + jn: thread g reads word g of the value rows of those four tokens.
//   Kitty: the low plane takes the 8 k-steps above; the compact high plane adds db / 16 k-steps with
//   A = 4 q * scale_k of the boosted channels (Algorithm 1: code = low + 4 high).
// Grid, block, page staging (cp.async, double buffer per warp) and the warp combine as paged_decode.
// Dynamic shared memory: QT*D*4 (queries) + NW * 2 * PageBuf::bytes.
#define KVQ_MMA_MAXW 4                             // warps per block at most (5 would cap registers at 168: spills)
template <int KITTY>
__global__ void __launch_bounds__(KVQ_MMA_MAXW * 32, 2)
    paged_decode_mma(const void* __restrict__ q, int q_dt, i64 sq_b, i64 sq_h, i64 sq_t,
                     const u8* __restrict__ kc, const u8* __restrict__ kh, const u8* __restrict__ ki,
                     const u16* __restrict__ ks, const u16* __restrict__ km, const u8* __restrict__ vc,
                     const u16* __restrict__ vs, const u16* __restrict__ vm, const int* __restrict__ k_table,
                     const int* __restrict__ v_table, int n_tab, float* __restrict__ o_part,
                     float* __restrict__ lse_part, int B, int Hq, int Hkv, int Tq, int NF, int NP, int pps,
                     int num_splits, int db, int ngv, float qk_scale) {
    constexpr int D = 128, KB = 2, VB = 2, QT = 8;
    typedef PageBuf<D, KB, VB, KITTY != 0> PB;
    constexpr int G = KVQ_G;
    constexpr int GB = PB::GB;
    constexpr int VBY = PB::VBY;
    static_assert(GB == 32 && VBY == 32, "one 32-bit word per thread and row");
    extern __shared__ u32x4 dsmem4[];
    __shared__ float s_m[KVQ_MMA_MAXW][QT], s_l[KVQ_MMA_MAXW][QT];
    __shared__ u8 s_inv[KVQ_MMA_MAXW][KITTY != 0 ? D : 1];                       // Kitty: high-plane row -> channel
    u8* dsmem = reinterpret_cast<u8*>(dsmem4);
    float* s_q = reinterpret_cast<float*>(dsmem);                     // [D][QT]
    const int bufb = PB::bytes(1, db);

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
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
    u8* bufs = dsmem + QT * D * 4 + warp * 2 * bufb;
    const int p0 = split * pps;
    const int p1 = kvq_min(p0 + pps, NP);
    __syncthreads();                               // s_q is ready

    // this thread's query values (row g, channels 16 kk + 2t + {0, 1, 8, 9}) are read from s_q where
    // used (registers for the page's fragments instead); their range over the row:
    const float* qg = s_q + g;                     // qg[c * QT] = q of row g, channel c
    float qmax = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) qmax = fmaxf(qmax, fabsf(qg[(16 * kk + 2 * t + (e & 1) + 8 * (e >> 1)) * QT]));
    qmax = fmaxf(qmax, __shfl_xor_sync(KVQ_FULL_MASK, qmax, 1));
    qmax = fmaxf(qmax, __shfl_xor_sync(KVQ_FULL_MASK, qmax, 2));

    float m = -KVQ_INF, l = 0.0f, bsum = 0.0f;
    float acc[16][4];
#pragma unroll
    for (int jn = 0; jn < 16; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[jn][e] = 0.0f;

    int j = p0 + warp;
    if (j < p1) stage_page<D, KB, VB, KITTY>(bufs, j, b, hk, Hkv, n_tab, k_table, v_table, kc, kh, ki, ks, km, vc,
                                             vs, vm, 1, db, lane);
    p_commit();
    int cur = 0;
    for (; j < p1; j += NW) {                      // uniform across the warp
        if (j + NW < p1)
            stage_page<D, KB, VB, KITTY>(bufs + (cur ^ 1) * bufb, j + NW, b, hk, Hkv, n_tab, k_table, v_table, kc,
                                         kh, ki, ks, km, vc, vs, vm, 1, db, lane);
        p_commit();
        p_wait<1>();
        __syncwarp();
        const u8* buf = bufs + cur * bufb;
        const int nvalid = kvq_min(G, NF - j * G);
        const u16* kss = reinterpret_cast<const u16*>(buf + PB::KS);
        const u16* kms = reinterpret_cast<const u16*>(buf + PB::KM);

        // ---- the page's key scale range and q . mn (log2 units)
        // channels 2t, 2t+1 (and 2t+8, 2t+9) are adjacent: one 32-bit load per pair; max |scale| on the
        // fp16 bits (|x| = bits & 0x7fff orders like the values), two at a time
        u32 kmax2 = 0u;
        float bias = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int c = 16 * kk + 2 * t + 8 * (e >> 1);
                kmax2 = __vmaxu2(kmax2, *reinterpret_cast<const u32*>(kss + c) & 0x7fff7fffu);
                const u32 mm = *reinterpret_cast<const u32*>(kms + c);
                bias = fmaf(qg[c * QT], f16_to_f32((u16)(mm & 0xffffu)), bias);
                bias = fmaf(qg[(c + 1) * QT], f16_to_f32((u16)(mm >> 16)), bias);
            }
        float kmax = f16_to_f32((u16)kvq_max_i((int)(kmax2 & 0xffffu), (int)(kmax2 >> 16)));
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            kmax = fmaxf(kmax, __shfl_xor_sync(KVQ_FULL_MASK, kmax, off));
            bias += __shfl_xor_sync(KVQ_FULL_MASK, bias, off);
        }
        const float rs = qmax * kmax;
        const float inv = rs > 0.0f ? 1.0f / rs : 0.0f;

        // ---- scores: 8 k-steps x 16 n-tiles
        float S[16][4];
#pragma unroll
        for (int jj = 0; jj < 16; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) S[jj][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int c0 = 16 * kk + 2 * t;
            float f[4];
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int c = c0 + 8 * (e >> 1);
                const u32 sc2 = *reinterpret_cast<const u32*>(kss + c);
                f[e] = qg[c * QT] * f16_to_f32((u16)(sc2 & 0xffffu)) * inv;
                f[e + 1] = qg[(c + 1) * QT] * f16_to_f32((u16)(sc2 >> 16)) * inv;
            }
            u32 a[4];
            split2(f[0], f[1], a[0], a[1]);
            split2(f[2], f[3], a[2], a[3]);
            const u8* kw = buf + PB::KC + 4 * g;
            const u32 w0 = *reinterpret_cast<const u32*>(kw + c0 * GB);
            const u32 w1 = *reinterpret_cast<const u32*>(kw + (c0 + 1) * GB);
            const u32 w2 = *reinterpret_cast<const u32*>(kw + (c0 + 8) * GB);
            const u32 w3 = *reinterpret_cast<const u32*>(kw + (c0 + 9) * GB);
            mma_ktile(S, a, w0, w1, w2, w3);     // Kitty: the low plane
        }
        if constexpr (KITTY != 0) {
            // Algorithm 1 as extra k-steps: code = low + 4 high, so s += sum over boosted channels of
            // (4 q * scale_k) . high, with the compact high plane (row r <-> the channel c with idx[c] = r)
            // as the B operand: db / 16 k-steps instead of a high-plane gather in every k-step.
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = lane + 32 * e;
                const int ix = buf[PB::KI + c];
                if (ix < db) s_inv[warp][ix] = (u8)c;
            }
            __syncwarp();
            for (int kh = 0; 16 * kh < db; ++kh) {
                float f[4];
                u32 w[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 16 * kh + 2 * t + (e & 1) + 8 * (e >> 1);
                    f[e] = 0.0f;
                    w[e] = 0u;
                    if (r < db) {
                        const int c = s_inv[warp][r];
                        f[e] = 4.0f * qg[c * QT] * f16_to_f32(kss[c]) * inv;
                        w[e] = *reinterpret_cast<const u32*>(buf + PB::kh(1) + r * GB + 4 * g);
                    }
                }
                u32 a[4];
                split2(f[0], f[1], a[0], a[1]);
                split2(f[2], f[3], a[2], a[3]);
                mma_ktile(S, a, w[0], w[1], w[2], w[3]);
            }
            __syncwarp();                          // s_inv is rewritten for the next page
        }

        // ---- online softmax (base 2): S[jj][e] (e = 0, 1) <- p of token 32t + 16e + jj
        float tmax = -KVQ_INF;
#pragma unroll
        for (int jj = 0; jj < 16; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = fmaf(S[jj][e + 2], rs * (1.0f / 2048.0f), fmaf(S[jj][e], rs, bias));
                S[jj][e] = 32 * t + 16 * e + jj < nvalid ? v : -KVQ_INF;
                tmax = fmaxf(tmax, S[jj][e]);
            }
        tmax = fmaxf(tmax, __shfl_xor_sync(KVQ_FULL_MASK, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(KVQ_FULL_MASK, tmax, 2));
        const float mnew = fmaxf(m, tmax);
        const float alpha = m == mnew ? 1.0f : ex2(m - mnew);
        if (__any_sync(KVQ_FULL_MASK, alpha != 1.0f)) {   // rescale only when some row's max moved
            l *= alpha;
            bsum *= alpha;
#pragma unroll
            for (int jn = 0; jn < 16; ++jn)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[jn][e] *= alpha;
        }
#pragma unroll
        for (int jj = 0; jj < 16; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = ex2(S[jj][e] - mnew);       // -inf -> 0
                l += p;
                S[jj][e] = p;
            }
        m = mnew;

        // ---- o += (p * scale_v) . codes + p . mn_v: 8 k-steps x 16 n-tiles
        const u16* vss = reinterpret_cast<const u16*>(buf + PB::VS);
        const u16* vms = reinterpret_cast<const u16*>(buf + PB::vm(1));
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int tk[4] = {32 * t + 2 * kk, 32 * t + 16 + 2 * kk, 32 * t + 2 * kk + 1, 32 * t + 17 + 2 * kk};
            const float pk[4] = {S[2 * kk][0], S[2 * kk][1], S[2 * kk + 1][0], S[2 * kk + 1][1]};
            float f[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                f[e] = pk[e] * f16_to_f32(vss[tk[e]]);
                bsum = fmaf(pk[e], f16_to_f32(vms[tk[e]]), bsum);
            }
            u32 a[4];
            split2(f[0], f[1], a[0], a[1]);
            split2(f[2], f[3], a[2], a[3]);
            const u8* vw = buf + PB::VC + 4 * g;
            mma_ktile(acc, a, *reinterpret_cast<const u32*>(vw + tk[0] * VBY),
                      *reinterpret_cast<const u32*>(vw + tk[1] * VBY), *reinterpret_cast<const u32*>(vw + tk[2] * VBY),
                      *reinterpret_cast<const u32*>(vw + tk[3] * VBY));
        }
        __syncwarp();                              // the next stage overwrites this buffer
        cur ^= 1;
    }
    p_wait<0>();                                   // no copy may be in flight at exit / reuse

#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l += __shfl_xor_sync(KVQ_FULL_MASK, l, off);
        bsum += __shfl_xor_sync(KVQ_FULL_MASK, bsum, off);
    }
    __syncthreads();                               // every warp is done with its buffers
    float* cacc = reinterpret_cast<float*>(dsmem + QT * D * 4);      // [NW][QT][D], over the warp areas
    float* row = cacc + (warp * QT + g) * D + 32 * t;
#pragma unroll
    for (int jn = 0; jn < 16; ++jn) {              // channel 16 n + jn of columns n = 2t, 2t + 1
        row[jn] = fmaf(acc[jn][2], 1.0f / 2048.0f, acc[jn][0]) + bsum;
        row[16 + jn] = fmaf(acc[jn][3], 1.0f / 2048.0f, acc[jn][1]) + bsum;
    }
    if (t == 0) {
        s_m[warp][g] = m;
        s_l[warp][g] = l;
    }
    __syncthreads();
    combine_warps<QT, D>(&s_m[0][0], &s_l[0][0], cacc, NW, nq, tid, blockDim.x, r0, hk, Gq, Tq, B, Hq, b,
                         (i64)(split), o_part, lse_part);
}

// ---- tail gather kernel --------------------------------------------------------------------------
// Computes: the fp32 K / V rows the fused kernel does not cover, in token order, for every (b, kv
//   head hk): row u < NS is sink token u; row u >= NS is post-sink token p = NF + u - NS, whose key is
//   key page k_table[b, p / G] slot p % G dequantized (code * scale + mn, two rounded fp32 ops:
//   bit-exact with the reference's dequantize; Kitty: low | high[idx] << 2) when p < KQ, else the key
//   Q-buffer row p - KQ; its value is value page v_table[b, p / G] slot p % G when p < VQ, the value
//   Q-buffer row p - VQ when p < VQ + NVB, else the window ring-buffer slot p % R. Out: (B, H, NT, D).
//   meta32: scale / mn are fp32 (else fp16). Mirrors kvq.fast.triton.paged._gather_tail_kernel.
// Grid: 1-D grid-stride over B * H * NT * D elements, one element per thread.
// Bytes: reads NT rows of K and V (packed bytes + metadata, or fp16) per (b, kv head); writes 2 NT D fp32.
template <int KITTY>
__global__ void __launch_bounds__(256)
    paged_gather_tail(const u16* __restrict__ sink_k, const u16* __restrict__ sink_v,
                      const u16* __restrict__ k_buf, const u16* __restrict__ v_buf,
                      const u16* __restrict__ v_win, const u8* __restrict__ kc, const u8* __restrict__ kh,
                      const u8* __restrict__ ki, const void* __restrict__ ks, const void* __restrict__ km,
                      const u8* __restrict__ vc, const void* __restrict__ vs, const void* __restrict__ vm,
                      const int* __restrict__ k_table, const int* __restrict__ v_table,
                      float* __restrict__ ok, float* __restrict__ ov, int B, int H, int D, int S, int NS,
                      int NF, int NT, int KQ, int VQ, int NVB, int R1, int n_tab, int G, int k_bits,
                      int v_bits, int ngv, int db, int meta32) {
    const i64 total = (i64)B * H * NT * D;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const int d = (int)(idx % D);
        const i64 row = idx / D;                   // (b * H + hk) * NT + u
        const int u = (int)(row % NT);
        const i64 bh = row / NT;
        const int hk = (int)(bh % H);
        const int b = (int)(bh / H);
        float kx, vx;
        if (u < NS) {
            kx = f16_to_f32(sink_k[(bh * S + u) * D + d]);
            vx = f16_to_f32(sink_v[(bh * S + u) * D + d]);
        } else {
            const int pp = NF + u - NS;
            const int page = pp / G;
            const int slot = pp - page * G;
            // key
            if (pp < KQ) {
                const i64 kph = (i64)k_table[(i64)b * n_tab + page] * H + hk;
                const int per = 8 / k_bits;
                const int gb = G * k_bits / 8;
                const u32 byte = kc[(kph * D + d) * gb + slot / per];
                u32 code = (byte >> ((slot % per) * k_bits)) & ((1u << k_bits) - 1u);
                if (KITTY) {
                    const int ix = ki[kph * D + d];
                    if (ix < db) {
                        const u32 hb = kh[(kph * db + ix) * gb + slot / 4];
                        code |= ((hb >> ((slot % 4) * 2)) & 3u) << 2;
                    }
                }
                const i64 mi = kph * D + d;
                const float sc = meta32 ? reinterpret_cast<const float*>(ks)[mi]
                                        : f16_to_f32(reinterpret_cast<const u16*>(ks)[mi]);
                const float mn = meta32 ? reinterpret_cast<const float*>(km)[mi]
                                        : f16_to_f32(reinterpret_cast<const u16*>(km)[mi]);
                kx = ieee_add(ieee_mul((float)code, sc), mn);
            } else {
                kx = f16_to_f32(k_buf[(bh * G + (pp - KQ)) * D + d]);
            }
            // value
            if (pp < VQ) {
                const i64 vrow = ((i64)v_table[(i64)b * n_tab + page] * H + hk) * G + slot;
                const int per = 8 / v_bits;
                const int vby = D * v_bits / 8;
                const u32 byte = vc[vrow * vby + d / per];
                const u32 code = (byte >> ((d % per) * v_bits)) & ((1u << v_bits) - 1u);
                const i64 mi = vrow * ngv + d / (D / ngv);
                const float sc = meta32 ? reinterpret_cast<const float*>(vs)[mi]
                                        : f16_to_f32(reinterpret_cast<const u16*>(vs)[mi]);
                const float mn = meta32 ? reinterpret_cast<const float*>(vm)[mi]
                                        : f16_to_f32(reinterpret_cast<const u16*>(vm)[mi]);
                vx = ieee_add(ieee_mul((float)code, sc), mn);
            } else if (pp < VQ + NVB) {
                vx = f16_to_f32(v_buf[(bh * G + (pp - VQ)) * D + d]);
            } else {
                vx = f16_to_f32(v_win[(bh * R1 + pp % R1) * D + d]);
            }
        }
        ok[idx] = kx;
        ov[idx] = vx;
    }
}
