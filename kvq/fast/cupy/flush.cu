// kvq CUDA kernels: the paged cache's writes as single kernels, straight into the preallocated pool
// (the CuPy twins of kvq/fast/triton/_flush.py; the quantizer's arithmetic is quant.cu's, bit for bit).
//
// key_flush: full pages of fp16 keys -> the key pool, one launch for all of a flush's pages. Per (page,
//   head) one block quantizes every channel over the page's G tokens (rule 2) and packs the codes along
//   tokens (rule 6: token PER j + k of byte j at bits [BITS k, BITS k + BITS)), at pool slot first + j B
//   + b (page j of sequence b: page-major, then batch, the reference's allocation order).
//   - KIVI: codes (D, G BITS / 8), scale / mn (D,).
//   - Kitty (kvq.reference.kitty.encode_page, in the reference's order of decisions): the channel scores
//     of eq. 2, s_i = (1/G) sum_t |x_{t,i}| (an fp32 sum over the tokens in order, then an IEEE division
//     by G: contract rule 7); the DB largest scores boosted, ties to the lower channel (each channel's
//     rank counted against all others: the reference's stable sort on -s); every channel at 2 and at 4
//     bits; low (D, G/4): the 2-bit code of an unboosted channel, the low two bits of a boosted one's
//     4-bit code; high (DB, G/4): the boosted channels' high two bits in channel order; idx (D,): a
//     boosted channel's row in high, DB otherwise; scale / mn: the 4-bit metadata of a boosted channel,
//     the 2-bit metadata of the others.
// value_evict: the tokens that leave the value window (or a full value Q-buffer), quantized per token in
//   groups of GV channels and packed along channels, each written to its page slot: token q = q0 + t
//   goes to page v_table[b, q / G], slot q % G.
// append_token: one decode token's key into the key Q-buffer, its value into the window and the value it
//   evicts into the value Q-buffer or, quantized as value_evict does, into its page: one launch for what
//   kvq.fast.caches.paged._append_token does with torch copies and value_evict.
// MH: the metadata is fp16 (1) or fp32 (0).
#include "quant.cu"

#define KVQ_FLUSH_MAXD 1024
#define KVQ_FLUSH_STAGE 16384          // key_flush: a (page, head)'s code bytes staged in shared memory up to this

// the code of one value under encoder e (quant.cu's encoder: the IEEE division wherever RN(a * r) could
// differ)
__device__ __forceinline__ u32 code_of(float v, const Enc& e) {
    u32 c;
    encode_bytes<1, 8>(&v, e, &c);
    return c;
}

// Computes: the key-page arrays of one (page, head) into the pool (file comment).
// Grid: (n * B, H): block (j * B + b, h) takes page j of sequence b, kv head h; x's last three
//   dimensions (n, G, D) contiguous, batch and head strides sx_b, sx_h (a slice of the keys, no copy).
// Block: (DX, TY), DX >= D a multiple of 32, DX * TY <= KVQ_FLUSH_MAXD: thread (d, ty) takes channel d
//   and the byte chunks c = ty + k TY (tokens PER c .. PER c + PER - 1), so a warp reads 32 consecutive
//   channels of a token. Its partial min / max (and Kitty's partial |x| sum) meet in shared memory;
//   every thread merges the TY partials of its channel in the order ty = 0, 1, ... (the same bits in
//   each), the threads ty = 0 rank the channels (Kitty), and every thread encodes its chunks from a
//   second read of its tokens (L1) into shared memory, which the block then writes out coalesced
//   (directly where D G BITS / 8 > KVQ_FLUSH_STAGE).
// Bytes: reads 2 G D fp16 keys (the second pass mostly from L1 / L2); writes D G BITS / 8 code bytes and
//   2 D metadata (Kitty: also DB G / 4 high-plane bytes and D index bytes).
template <int BITS, int KITTY, int MH>
__global__ void __launch_bounds__(KVQ_FLUSH_MAXD) key_flush(const u16* __restrict__ x, i64 sx_b, i64 sx_h,
                                                           u8* __restrict__ low, u8* __restrict__ high,
                                                           u8* __restrict__ idx, void* __restrict__ scale,
                                                           void* __restrict__ mn, int B, int G, int D, int DB,
                                                           i64 first) {
    static_assert(BITS == 2 || BITS == 4 || BITS == 8, "2-, 4- or 8-bit codes");
    static_assert(!KITTY || BITS == 2, "Kitty's planes hold 2-bit codes");
    constexpr int PER = 8 / BITS;
    __shared__ float s_lo[KVQ_FLUSH_MAXD], s_hi[KVQ_FLUSH_MAXD];
    __shared__ float s_sum[KITTY ? KVQ_FLUSH_MAXD : 1];
    __shared__ u8 s_boost[KITTY ? KVQ_FLUSH_MAXD : 1];
    __shared__ __align__(16) u8 s_codes[KVQ_FLUSH_STAGE];
    const int pid = blockIdx.x, h = blockIdx.y, H = gridDim.y;
    const int jp = pid / B, b = pid % B;
    const int d = threadIdx.x, ty = threadIdx.y, DX = blockDim.x, TY = blockDim.y;
    const bool on = d < D;
    const int NJ = G / PER;                                      // code bytes per channel row
    const u16* xp = x + (i64)b * sx_b + (i64)h * sx_h + (i64)jp * G * D + (on ? d : 0);
    GroupAcc a;
    acc_init(a);
    float ssum = 0.0f;
    if (on) {
#pragma unroll 4
        for (int c = ty; c < NJ; c += TY) {
            float v[PER];
#pragma unroll
            for (int k = 0; k < PER; ++k) v[k] = f16_to_f32(xp[(i64)(PER * c + k) * D]);
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                acc_add(a, v[k]);
                if (KITTY) ssum = ieee_add(ssum, ieee_abs(v[k]));
            }
        }
    }
    s_lo[ty * DX + d] = a.lo;
    s_hi[ty * DX + d] = a.hi;
    if (KITTY) s_sum[ty * DX + d] = ssum;
    __syncthreads();
    acc_init(a);
    ssum = 0.0f;
    for (int y = 0; y < TY; ++y) {                               // the same order in every thread
        acc_merge(a, s_lo[y * DX + d], s_hi[y * DX + d]);
        if (KITTY) ssum = ieee_add(ssum, s_sum[y * DX + d]);
    }
    const i64 ph = (first + pid) * H + h;                        // the pool row of (slot, head)
    float sa, ma;
    group_params(a, BITS, 0, MH, sa, ma);
    bool boost = false;
    int row = 0;
    if constexpr (KITTY) {
        const float sc = on ? ieee_div(ssum, (float)G) : -KVQ_INF;
        __syncthreads();                                         // every partial is read: s_sum is free
        if (ty == 0) s_sum[d] = sc;
        __syncthreads();
        if (ty == 0) {                                           // the ranks: one thread per channel
            int rank = 0;                                        // channels ahead of d in the stable order
            for (int c = 0; c < D; ++c) {
                const float o = s_sum[c];
                rank += (o > sc) || (o == sc && c < d);
            }
            s_boost[d] = on && rank < DB;
        }
        __syncthreads();
        boost = s_boost[d];
        for (int c = 0; c < d && c < D; ++c) row += s_boost[c];  // boosted channels before d
        if (boost) group_params(a, 4, 0, MH, sa, ma);
        if (on && ty == 0) idx[ph * D + d] = (u8)(boost ? row : DB);
    }
    // the code bytes of the whole (page, head): staged in shared memory and written out coalesced when
    // they fit (one thread's channel row is NJ bytes: direct stores would touch a sector per thread)
    const bool staged = D * NJ <= KVQ_FLUSH_STAGE;
    if (on) {
        if (ty == 0) {
            store_meta(scale, ph * D + d, sa, MH);
            store_meta(mn, ph * D + d, ma, MH);
        }
        const Enc enc = make_enc(sa, ma, boost ? 4 : BITS, 0);
        u8* hrow = boost ? high + (ph * DB + row) * NJ : nullptr;
#pragma unroll 4
        for (int c = ty; c < NJ; c += TY) {
            u32 lb = 0, hb = 0;
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const u32 q = code_of(f16_to_f32(xp[(i64)(PER * c + k) * D]), enc);
                lb |= (q & ((1u << BITS) - 1u)) << (BITS * k);
                if (KITTY) hb |= (q >> 2) << (2 * k);
            }
            if (staged) s_codes[d * NJ + c] = (u8)lb;
            else low[(ph * D + d) * NJ + c] = (u8)lb;
            if (KITTY && boost) hrow[c] = (u8)hb;
        }
    }
    if (staged) {
        __syncthreads();
        const int n = D * NJ, tid = ty * DX + d, nt = DX * TY;
        u8* dst = low + ph * D * NJ;
        if (n % 4 == 0 && (reinterpret_cast<u64>(low) & 3u) == 0) {    // then dst is 4-byte aligned too
            for (int i = tid; i < n / 4; i += nt)
                reinterpret_cast<u32*>(dst)[i] = reinterpret_cast<const u32*>(s_codes)[i];
        } else {
            for (int i = tid; i < n; i += nt) dst[i] = s_codes[i];
        }
    }
}

// The body of value_evict and append_token: value v of channel c (on: c < D) of one token, quantized per
//   token in groups of GV channels (rule 2) and packed along channels (rule 6) into pool row `row`. Every
//   thread of the block calls it (it synchronizes the block). A group's min / max: POW2 (GV a power of
//   two): a butterfly over the group's lanes (groups of more than 32 channels: then over its warps'
//   results in shared memory); else each thread scans its group in shared memory (a group need not fill
//   whole bytes). The thread of a group's first channel stores its metadata, the thread of a byte's first
//   channel packs the byte from the codes in shared memory.
template <int BITS, int MH, int POW2>
__device__ __forceinline__ void quantize_token_row(float v, bool on, int c, int D, int GV, i64 row,
                                                   u8* __restrict__ codes, void* __restrict__ scale,
                                                   void* __restrict__ mn) {
    static_assert(BITS == 2 || BITS == 4 || BITS == 8, "2-, 4- or 8-bit codes");
    constexpr int PER = 8 / BITS;
    __shared__ float s_x[POW2 ? 1 : KVQ_FLUSH_MAXD];
    __shared__ float s_wlo[POW2 ? KVQ_FLUSH_MAXD / 32 : 1], s_whi[POW2 ? KVQ_FLUSH_MAXD / 32 : 1];
    __shared__ u8 s_c[KVQ_FLUSH_MAXD];
    const int g = on ? c / GV : 0;
    GroupAcc a;
    acc_init(a);
    if constexpr (POW2) {
        if (on) acc_add(a, v);
        for (int off = 1; off < GV && off < 32; off <<= 1) {     // lanes of one group (groups never straddle warps)
            const float lo = __shfl_xor_sync(KVQ_FULL_MASK, a.lo, off);
            const float hi = __shfl_xor_sync(KVQ_FULL_MASK, a.hi, off);
            acc_merge(a, lo, hi);
        }
        if (GV > 32) {                                           // whole warps of one group
            if ((c & 31) == 0) s_wlo[c >> 5] = a.lo, s_whi[c >> 5] = a.hi;
            __syncthreads();
            acc_init(a);
            for (int w = g * (GV >> 5); w < (g + 1) * (GV >> 5); ++w) acc_merge(a, s_wlo[w], s_whi[w]);
        }
    } else {
        s_x[c] = v;
        __syncthreads();
        for (int i = g * GV; i < g * GV + GV; ++i) acc_add(a, s_x[i]);
    }
    float s32, m32;
    group_params(a, BITS, 0, MH, s32, m32);
    if (on) s_c[c] = (u8)code_of(v, make_enc(s32, m32, BITS, 0));
    __syncthreads();
    if (!on) return;
    if (c % GV == 0) {
        const int ngv = D / GV;
        store_meta(scale, row * ngv + g, s32, MH);
        store_meta(mn, row * ngv + g, m32, MH);
    }
    if (c % PER == 0) {
        u32 byte = 0;
#pragma unroll
        for (int k = 0; k < PER; ++k) byte |= (u32)s_c[c + k] << (BITS * k);
        codes[row * (D / PER) + c / PER] = (u8)byte;
    }
}

// Computes: one token's values quantized per token in groups of GV channels (rule 2) and packed along
//   channels (rule 6), written to the token's page slot (file comment).
// Grid: (e, H, B): block (t, h, b) takes token t of sequence b, kv head h; x strides sx_b, sx_h, sx_t,
//   channels contiguous.
// Block: one thread per channel (blockDim.x >= D, a multiple of 32, <= KVQ_FLUSH_MAXD): quantize_token_row.
// Bytes: reads D fp16 values and one page-table entry; writes D BITS / 8 code bytes and 2 D / GV metadata.
template <int BITS, int MH, int POW2>
__global__ void __launch_bounds__(KVQ_FLUSH_MAXD) value_evict(const u16* __restrict__ x, i64 sx_b, i64 sx_h,
                                                             i64 sx_t, u8* __restrict__ codes,
                                                             void* __restrict__ scale, void* __restrict__ mn,
                                                             const int* __restrict__ table, int q0, int G, int D,
                                                             int GV, int n_tab) {
    const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const int c = threadIdx.x;
    const bool on = c < D;
    const float v = on ? f16_to_f32(x[(i64)b * sx_b + (i64)h * sx_h + (i64)t * sx_t + c]) : 0.0f;
    const int q = q0 + t;
    const i64 page = table[(i64)b * n_tab + q / G];
    quantize_token_row<BITS, MH, POW2>(v, on, c, D, GV, (page * H + h) * G + q % G, codes, scale, mn);
}

// Computes: the paged cache's append of one decode token past the sink whose key does not complete a page
//   (kvq.fast.caches.paged._append_token, the same state bit for bit), in one launch:
//   - the key into slot nb of the key Q-buffer k_buf (B, H, GK, D);
//   - the value into slot `slot` of the value window v_win (B, H, R, D) (R = 0: no window; the value
//     itself is then the evicted one);
//   - the evicted value (the slot's old value, where the window was full): mode 1 into slot
//     nvb of the value Q-buffer v_buf (B, H, GB, D) (Kitty); mode 2 quantized per token into its page slot
//     (value_evict's arithmetic, quantize_token_row): history token q0 of sequence b goes to page `page`
//     = first_id + b where new_page (which this launch enters in the page table v_table[b, q0 / G]:
//     block h = 0), else v_table[b, q0 / G], slot q0 % G. mode 0: nothing is evicted.
// Grid: (H, B): block (h, b) takes kv head h of sequence b. k, v: the token's (B, H, 1, D) with batch and
//   head strides, channels contiguous.
// Block: one thread per channel (blockDim.x >= D, a multiple of 32, <= KVQ_FLUSH_MAXD); the evicted value
//   is read into a register before the new one overwrites its slot (the same thread).
// Bytes: reads 2 D fp16 (and D of the window); writes 2 D fp16, and mode 2's D BITS / 8 code bytes and
//   2 D / GV metadata.
template <int BITS, int MH, int POW2>
__global__ void __launch_bounds__(KVQ_FLUSH_MAXD) append_token(
        const u16* __restrict__ k, i64 sk_b, i64 sk_h, const u16* __restrict__ v, i64 sv_b, i64 sv_h,
        u16* __restrict__ k_buf, int GK, int nb, u16* __restrict__ v_win, int R, int slot,
        u16* __restrict__ v_buf, int GB, int nvb, int mode, u8* __restrict__ codes, void* __restrict__ scale,
        void* __restrict__ mn, int* __restrict__ table, int q0, int G, int D, int GV, int n_tab, int new_page,
        int first_id) {
    const int h = blockIdx.x, b = blockIdx.y, H = gridDim.x;
    const int c = threadIdx.x;
    const bool on = c < D;
    const i64 bh = (i64)b * H + h;
    u16 vnew = 0, old = 0;
    if (on) {
        k_buf[(bh * GK + nb) * D + c] = k[(i64)b * sk_b + (i64)h * sk_h + c];
        vnew = v[(i64)b * sv_b + (i64)h * sv_h + c];
        old = vnew;
        if (R > 0) {
            const i64 w = (bh * R + slot) * D + c;
            old = v_win[w];
            v_win[w] = vnew;
        }
    }
    if (mode == 0) return;                                      // uniform over the block
    if (mode == 1) {
        if (on) v_buf[(bh * GB + nvb) * D + c] = old;
        return;
    }
    const i64 entry = (i64)b * n_tab + q0 / G;
    const i64 page = new_page ? (i64)first_id + b : (i64)table[entry];
    if (new_page && h == 0 && c == 0) table[entry] = (int)page;
    quantize_token_row<BITS, MH, POW2>(on ? f16_to_f32(old) : 0.0f, on, c, D, GV, (page * H + h) * G + q0 % G,
                                       codes, scale, mn);
}
