// kvq CUDA kernel: the fused OSCAR append (section 4, Algorithm 1 Prefill / DecodeStep). ONE launch per
// append for K and one for V: rotate the new tokens (fixed order), round them to fp16 and write each
// where it belongs: the sink, the window ring, or (clipped, quantized, packed) its page slot, together
// with the OLD window tokens that the new ones push out of the window.
//
// Mirrors kvq/reference/oscar.py (append) bit for bit, as the unfused path does (oscar.cu rotate_rows,
// then oscar_quant_rows, then torch writes), with the same arithmetic: the rotation is rotate_rows' loop
// (ieee_mul / ieee_add, no FMA), the quantizer is oscar_quant_rows' (np_clip, quant.cu group_params /
// make_enc / encode_bytes, the three-op quantile interpolation). Only the selection of the two order
// statistics differs: a bisection over the int32 bit patterns of |x| (exact, see below) in registers of
// one warp instead of a bitonic sort in shared memory.
//
// Routing (host arithmetic, kvq.fast._oscar.AppendPlan): the first n_s new tokens fill the sink; the
// others follow the n_old tokens of the window as sequence index i = n_old + (idx - n_s); the oldest e of
// that sequence leave the window into page position first + i (post-sink index), the rest end in ring slot
// (first + i) % W. An OLD token i' < min(e, n_old) that leaves shares its slot with exactly one new token
// that stays, i'' = i' + k W (k >= 1), and i' = i'' % W: the warp that writes new token i'' reads the old
// token from the slot first (each lane the very channels it then overwrites: a thread's load and store
// of one address keep program order) and quantizes it into page position first + i'. No other block or
// warp touches that slot, so nothing races. The page table already holds the pages this append opens.
#include "oscar.cu"

#define APP_THREADS 128         // threads per block (4 warps); rotation: a thread per output column
#define APP_CH 32               // input channels staged in shared memory per step (divides every D)

// ---- fused append --------------------------------------------------------------------------------
// Computes, per new token idx of x (B, H, n, D) (a block: TT tokens of one (batch, head)):
//   y = fp16(x R_h), R_h = R + h * r_sh, as rotate_rows: acc = x_0 R_0, then acc = acc + x_i R_i for
//     i = 1 .. D-1 (ieee_mul, ieee_add), acc + 0.0, round to nearest even into fp16 (shared memory);
//   idx < n_s: y -> sink[b, h, T0 + idx]; else with i = n_old + idx - n_s: i < e: y -> page position
//     first + i; i >= e: y -> window slot (first + i) % W, and if i >= W and i % W < n_old the old token
//     i % W read from that slot first -> page position first + i % W;
//   a row bound for a page (one warp per row, lane l holding channels [l*VPL, l*VPL + VPL), VPL = D/32):
//     tau = quantile(|x|, clip): keys = int32 bits of |x| (non-negative floats order like their bits;
//     NaN as +inf, counted: NumPy sorts NaN last), s[lo] = the least key v with #{key <= v} >= lo + 1 by
//     bisection over [0, +inf] (31 ballot counts), s[hi] = s[lo] if #{key <= s[lo]} >= hi + 1 else the
//     least key above it; tau = s[lo] + frac * (s[hi] - s[lo]) (NaN on a NaN slot), as
//     sorted_quantile; xc = np_clip(x, tau); per group of G channels (G / VPL lanes, xor shuffles)
//     min / max of xc -> group_params (NaN scale where the RAW group holds NaN / inf) -> scale / mn
//     (metadata dtype); codes = encode_bytes<1, 8> as oscar_quant_rows, 8 / bits consecutive channel
//     codes per byte (lanes holding less than a byte combine theirs by shuffles); page position p ->
//     page table[b, p / PG], slot p % PG.
// Grid: 1-D over (B * H) x ceil(n / TT) token tiles; APP_THREADS threads.
// Bytes: reads n*D inputs, D*D fp32 of R per block (L2-resident), the old window tokens that leave (fp16)
//   and their page ids; writes the fp16 sink / window rows, D*bits/8 code bytes + 2 D/G metadata values
//   per token that enters a page.
template <int DT, int D, int TT>
__global__ void __launch_bounds__(APP_THREADS) oscar_append(
    const typename Ty<DT>::S* __restrict__ x, const float* __restrict__ R, u16* __restrict__ sink,
    u16* __restrict__ win, u8* __restrict__ q, void* __restrict__ scale, void* __restrict__ mn,
    const int* __restrict__ table, int n, int H, i64 r_sh, i64 sx_b, i64 sx_h, i64 sx_t, i64 sx_d, i64 T0,
    int n_s, int n_old, i64 first, i64 e, int W, int S0, int PG, int n_tab, int lo_i, int hi_i, float frac,
    int G, int bits, int meta_half, i64 ntiles) {
    static_assert(D % 32 == 0 && D % APP_CH == 0 && D <= 256, "D: a multiple of 32, at most 256");
    constexpr int VPL = D / 32;                     // channels per lane in the per-row phase
    __shared__ float xs[TT][APP_CH];
    __shared__ u16 ys[TT][D];                       // the rotated tile, fp16 bits
    const i64 bh = blockIdx.x / ntiles;
    const int t0 = (int)(blockIdx.x - bh * ntiles) * TT;
    const int b = (int)(bh / H), h = (int)(bh - (i64)b * H);
    const typename Ty<DT>::S* xb = x + b * sx_b + h * sx_h;
    const float* Rh = R + (i64)h * r_sh;

    // 1. rotate the tile (rotate_rows): thread = output column d, R read once for TT tokens
    for (int d0 = 0; d0 < D; d0 += APP_THREADS) {
        const int d = d0 + threadIdx.x;
        const bool active = d < D;
        float acc[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[t] = __int_as_float(0x80000000);      // -0.0: -0.0 + p == p
        for (int i0 = 0; i0 < D; i0 += APP_CH) {
            __syncthreads();
            for (int idx = threadIdx.x; idx < TT * APP_CH; idx += APP_THREADS) {
                const int t = idx / APP_CH, ii = idx - t * APP_CH;
                const int tok = t0 + t;
                xs[t][ii] = tok < n ? Ty<DT>::ld(xb[tok * sx_t + (i0 + ii) * sx_d]) : 0.0f;
            }
            __syncthreads();
            if (active) {
#pragma unroll 4
                for (int ii = 0; ii < APP_CH; ++ii) {
                    const float r = Rh[(i64)(i0 + ii) * D + d];
#pragma unroll
                    for (int t = 0; t < TT; ++t) acc[t] = ieee_add(acc[t], ieee_mul(xs[t][ii], r));
                }
            }
        }
        if (active) {
#pragma unroll
            for (int t = 0; t < TT; ++t) ys[t][d] = f32_to_f16_rn(ieee_add(acc[t], 0.0f));
        }
    }
    __syncthreads();

    // 2. route every row; quantize the rows bound for a page (one warp per row, all branches warp-uniform)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c0 = lane * VPL;                      // this lane's first channel
    const int GL = G / VPL;                         // lanes per group (G >= VPL: supported())
    const int NG = D / G;
    const int nbytes = D * bits / 8;                // code bytes per token
    const int LB = VPL * bits;                      // code bits per lane
    const float qnan = __int_as_float(0x7fffffff);
    for (int t = warp; t < TT; t += APP_THREADS / 32) {
        const int idx = t0 + t;
        if (idx >= n) break;
        u16 yr[VPL];
#pragma unroll
        for (int k = 0; k < VPL; ++k) yr[k] = ys[t][c0 + k];
        if (idx < n_s) {                                                     // sink
            u16* sp = sink + ((bh * S0 + T0 + idx) * D + c0);
#pragma unroll
            for (int k = 0; k < VPL; ++k) sp[k] = yr[k];
            continue;
        }
        const i64 i = (i64)n_old + idx - n_s;
        i64 pos;                                    // page position of the row quantized here, if any
        float v[VPL];
        if (i < e) {                                                         // new token -> its page
            pos = first + i;
#pragma unroll
            for (int k = 0; k < VPL; ++k) v[k] = f16_to_f32(yr[k]);
        } else {                                                             // new token -> window slot
            u16* wp = win + ((bh * W + (first + i) % W) * D + c0);
            const bool evict = i >= W && i % W < n_old;                      // the slot's old token leaves
            pos = evict ? first + i % W : -1;
            if (evict) {
#pragma unroll
                for (int k = 0; k < VPL; ++k) v[k] = f16_to_f32(wp[k]);    // read before this lane's write
            }
#pragma unroll
            for (int k = 0; k < VPL; ++k) wp[k] = yr[k];
            if (!evict) continue;
        }
        // quantile of |v| over the row (bisection on the bit patterns, ballot counts)
        int key[VPL];
        int nn = 0;
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            const float a = ieee_abs(v[k]);
            const bool isn = is_nan_bits(a);
            nn += isn;
            key[k] = isn ? OSCAR_INF_KEY : __float_as_int(a);
        }
        const int nnan = __reduce_add_sync(KVQ_FULL_MASK, nn);
        int klo = 0, khi = OSCAR_INF_KEY;
        while (klo < khi) {                                                  // <= 31 steps, warp-uniform
            const int mid = klo + ((khi - klo) >> 1);
            int c = 0;
#pragma unroll
            for (int k = 0; k < VPL; ++k) c += __popc(__ballot_sync(KVQ_FULL_MASK, key[k] <= mid));
            if (c >= lo_i + 1) khi = mid;
            else klo = mid + 1;
        }
        int nle = 0, above = OSCAR_INF_KEY;
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            nle += __popc(__ballot_sync(KVQ_FULL_MASK, key[k] <= klo));
            if (key[k] > klo) above = kvq_min(above, key[k]);
        }
        above = __reduce_min_sync(KVQ_FULL_MASK, above);
        const int k_hi = nle >= hi_i + 1 ? klo : above;
        const float s_lo = lo_i >= D - nnan ? qnan : __int_as_float(klo);
        const float s_hi = hi_i >= D - nnan ? qnan : __int_as_float(k_hi);
        const float tau = ieee_add(s_lo, ieee_mul(frac, ieee_sub(s_hi, s_lo)));
        // clip, group min / max over the group's GL lanes, metadata
        GroupAcc ga;
        acc_init(ga);
        int fin = 1;
        float xc[VPL];
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            fin &= is_finite(v[k]);
            xc[k] = np_clip(v[k], tau);
            acc_add(ga, xc[k]);
        }
        for (int off = 1; off < GL; off <<= 1) {                             // GL is the same for all lanes
            const float l2 = __shfl_xor_sync(KVQ_FULL_MASK, ga.lo, off);
            const float h2 = __shfl_xor_sync(KVQ_FULL_MASK, ga.hi, off);
            fin &= __shfl_xor_sync(KVQ_FULL_MASK, fin, off);
            acc_merge(ga, l2, h2);
        }
        float s32, m32;
        group_params(ga, bits, 0, meta_half, s32, m32);
        if (!fin) s32 = __int_as_float(0x7fc00000);
        const int page = table[(i64)b * n_tab + pos / PG];
        const i64 prow = ((i64)page * H + h) * PG + pos % PG;               // row of the page arrays
        if ((lane & (GL - 1)) == 0) {
            const int g = c0 / G;
            store_meta(scale, prow * NG + g, s32, meta_half);
            store_meta(mn, prow * NG + g, m32, meta_half);
        }
        // codes, packed along channels (code j of a byte at bits [bits*j, bits*j + bits)): the lane's VPL
        // codes side by side in one word are, byte for byte (little-endian), its LB / 8 packed bytes
        const Enc enc = make_enc(s32, m32, bits, 0);
        u64 w = 0;
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            u32 code;
            encode_bytes<1, 8>(&xc[k], enc, &code);
            w |= (u64)(code & ((1u << bits) - 1u)) << (bits * k);
        }
        u8* qp = q + prow * nbytes;
        if (LB >= 8) {                                                       // whole bytes per lane, aligned
            u8* p = qp + c0 * bits / 8;
            if (LB == 8) *p = (u8)w;
            else if (LB == 16) *reinterpret_cast<u16*>(p) = (u16)w;
            else if (LB == 32) *reinterpret_cast<u32*>(p) = (u32)w;
            else *reinterpret_cast<u64*>(p) = w;
        } else {                                                             // 8 / LB lanes share a byte
            const int lpb = 8 / LB;
            u32 wb = (u32)w;
            for (int j = 1; j < lpb; ++j) {
                const u32 o = __shfl_down_sync(KVQ_FULL_MASK, wb, j);
                if ((lane & (lpb - 1)) == 0) wb |= o << (LB * j);
            }
            if ((lane & (lpb - 1)) == 0) qp[lane / lpb] = (u8)wb;
        }
    }
}
