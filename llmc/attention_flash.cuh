/*
 * attention_flash.cuh: fast mode's causal attention, flash-attention style (FlashAttention-2:
 * tiles of 64 queries x 64 keys in shared memory, the online softmax in registers, the T x T
 * matrix never stored), on bf16 tensor cores (mma.sync m16n8k16, sm_80+), fp32 accumulation.
 * Same contract as train_gpt2.c attention_forward / attention_backward, except that the
 * forward keeps per-row softmax statistics (B,NH,T) instead of the probabilities.
 *
 * Layouts are the trainer's: qkv (B,T,3C) with q | k | v and head h at channels [h*HS,
 * (h+1)*HS) of each; out (B,T,C); dqkv (B,T,3C). Scores are kept in base 2:
 * s2 = (q.k) * scale * log2(e), stats = max + log2(sum exp2(s2 - max)), P = exp2(s2 - stats).
 *
 * Backward without atomics (deterministic run to run): a preprocessing kernel forms
 * D = rowsum(dO * O); one kernel owns a tile of keys and walks the queries (dK, dV), another
 * owns a tile of queries and walks the keys (dQ). Head sizes 16, 32, 64.
 *
 * The kernels compute a FaProblem: where q, k and v are and which keys each query sees (one
 * rank's causal attention is one; the ring's blocks of kernels_fast_cp.cuh are others), into
 * bf16 outputs (one rank's) or fp32 ones (the ring's partial outputs, dq accumulated over the
 * blocks and dk|dv partials): the same tiles, masks and roundings of P and dS either way.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16, lane = 4 * group + tig): A (16x16) a0: (group,
 * 2tig..+1), a1: (group+8, 2tig..), a2: (group, 2tig+8..), a3: (group+8, 2tig+8..);
 * B (16x8) b0: (k = 2tig..+1, n = group), b1: (k = 2tig+8.., n = group); C (16x8) c0,c1:
 * (group, 2tig..+1), c2,c3: (group+8, 2tig..+1). Two C tiles side by side are one A
 * fragment, which is how P and dS feed the next product straight from registers.
 */
#ifndef LLMC_ATTENTION_FLASH_CUH
#define LLMC_ATTENTION_FLASH_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/gpu_plan.h"

#define FA_ROWS 64        // rows of a block tile (queries, or keys in the dK/dV kernel)
#define FA_COLS 64        // columns of a score tile
#define FA_THREADS 128    // 4 warps x 16 rows
#define FA_LOG2E 1.4426950408889634f

// ---- PTX wrappers ------------------------------------------------------------------------
// Under the emulator (dev/gpu/emu/ptx_emu.h) each has a C++ body with the instruction's
// semantics: the fragment layouts and cp.async's asynchrony are checked there, on the CPU.
#ifdef LLMC_CUDA_EMU
#include "ptx_emu.h"
#endif

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef LLMC_CUDA_EMU
    emu_cp_async16(smem, gmem, valid);
#else
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int bytes = valid ? 16 : 0;   // 0: the 16 bytes are zero-filled, nothing is read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef LLMC_CUDA_EMU
    emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef LLMC_CUDA_EMU
    emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const floatX* p) {
#ifdef LLMC_CUDA_EMU
    emu_ldmatrix_x4(r, p, false);
#else
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const floatX* p) {
#ifdef LLMC_CUDA_EMU
    emu_ldmatrix_x4(r, p, true);
#else
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
#endif
}

// c (16x8 fp32) += a (16x16 bf16) . b (16x8 bf16)
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b0, const uint32_t b1) {
#ifdef LLMC_CUDA_EMU
    emu_mma_m16n8k16_bf16(c, a, b0, b1);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {
#ifdef LLMC_CUDA_EMU
    return emu_ex2_approx(x);
#else
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// ---- the problem ----------------------------------------------------------------------------

// Which keys a query sees, in rows of the problem: query t sees key j iff t >= q_lo, j < k_hi
// and, if causal, j <= t (causal only with q_lo = 0: the query tiles then line up with the key
// tiles). One rank's attention over T rows: {0, T, 1}.
struct FaMask { int q_lo, k_hi, causal; };

// B sequences x NH heads of T query rows and T key rows: row t of sequence b of q at
// q + (b T + t) ldq, head h at its columns h*HS; k and v likewise with ldkv.
struct FaProblem {
    const floatX *q, *k, *v;
    long ldq, ldkv;
    int T, NH;
    FaMask mask;
};

// one rank's causal attention over qkv (B,T,3C)
static FaProblem fa_causal(const floatX* qkv, int T, int C, int NH) {
    return FaProblem{qkv, qkv + C, qkv + 2 * C, 3L * C, 3L * C, T, NH, FaMask{0, T, 1}};
}

__device__ __forceinline__ bool fa_hidden(FaMask m, int q, int key) { return key >= m.k_hi || (m.causal && key > q); }

// ---- shared-memory tiles: 64 rows x HS, rows padded by 16 bytes (conflict-free ldmatrix) --

template <int HS> struct FaTile {
    static constexpr int PITCH = HS + 8;            // elements per shared row
    static constexpr int ELEMS = FA_ROWS * PITCH;
};

// rows r0.. of a (rows, HS) slice with row stride ld into shared memory; rows >= T are zeros
template <int HS>
__device__ __forceinline__ void fa_load_tile(floatX* s, const floatX* g, long ld, int r0, int T) {
    constexpr int CHUNKS = HS / 8;
    for (int i = threadIdx.x; i < FA_ROWS * CHUNKS; i += FA_THREADS) {
        int r = i / CHUNKS, c = i % CHUNKS;
        int row = r0 + r;
        bool valid = row < T;
        cp_async16(s + r * FaTile<HS>::PITCH + c * 8, g + (long)(valid ? row : 0) * ld + c * 8, valid);
    }
}

// A fragment: rows r0..r0+15, columns c0..c0+15 of a row-major tile
template <int HS>
__device__ __forceinline__ void fa_frag_a(uint32_t a[4], const floatX* s, int r0, int c0) {
    int lane = threadIdx.x % 32, i = lane / 8, r = lane % 8;
    ldmatrix_x4(a, s + (r0 + r + (i & 1) * 8) * FaTile<HS>::PITCH + c0 + (i >> 1) * 8);
}

// B fragments of two n-tiles (n0.., n0+8..) for k-step k0.. from a tile stored [n][k]:
// b[0], b[1] for n-tile n0, b[2], b[3] for n0 + 8
template <int HS>
__device__ __forceinline__ void fa_frag_b_nk(uint32_t b[4], const floatX* s, int n0, int k0) {
    int lane = threadIdx.x % 32, i = lane / 8, r = lane % 8;
    ldmatrix_x4(b, s + (n0 + (i >> 1) * 8 + r) * FaTile<HS>::PITCH + k0 + (i & 1) * 8);
}

// the same from a tile stored [k][n] (transposing load)
template <int HS>
__device__ __forceinline__ void fa_frag_b_kn(uint32_t b[4], const floatX* s, int k0, int n0) {
    int lane = threadIdx.x % 32, i = lane / 8, r = lane % 8;
    ldmatrix_x4_trans(b, s + (k0 + (i & 1) * 8 + r) * FaTile<HS>::PITCH + n0 + (i >> 1) * 8);
}

// acc (16 rows x 64 columns: 8 C tiles) += A (16 x HS, rows r0 of sa) . B^T (B: 64 x HS, [n][k])
template <int HS>
__device__ __forceinline__ void fa_scores(float acc[8][4], const floatX* sa, int r0, const floatX* sb) {
    #pragma unroll
    for (int ks = 0; ks < HS / 16; ks++) {
        uint32_t a[4];
        fa_frag_a<HS>(a, sa, r0, ks * 16);
        #pragma unroll
        for (int np = 0; np < 4; np++) {
            uint32_t b[4];
            fa_frag_b_nk<HS>(b, sb, np * 16, ks * 16);
            mma_16816(acc[2 * np], a, b[0], b[1]);
            mma_16816(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// out (16 rows x HS: HS/8 C tiles) += P (16 x 64, in registers as 8 C tiles) . V (64 x HS, [k][n])
template <int HS>
__device__ __forceinline__ void fa_apply(float out[HS / 8][4], const float p[8][4], const floatX* sv) {
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t a[4] = {pack_bf16x2(p[2 * j][0], p[2 * j][1]), pack_bf16x2(p[2 * j][2], p[2 * j][3]),
                         pack_bf16x2(p[2 * j + 1][0], p[2 * j + 1][1]), pack_bf16x2(p[2 * j + 1][2], p[2 * j + 1][3])};
        #pragma unroll
        for (int dp = 0; dp < HS / 16; dp++) {
            uint32_t b[4];
            fa_frag_b_kn<HS>(b, sv, j * 16, dp * 16);
            mma_16816(out[2 * dp], a, b[0], b[1]);
            mma_16816(out[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// two adjacent outputs: rounded to bf16, or fp32 (written, or added to what is there)
__device__ __forceinline__ void fa_store_pair(floatX* p, float a, float b, bool) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void fa_store_pair(float* p, float a, float b, bool accumulate) {
    float2 v = {a, b};
    if (accumulate) {
        float2 was = *reinterpret_cast<const float2*>(p);
        v.x = was.x + a;
        v.y = was.y + b;
    }
    *reinterpret_cast<float2*>(p) = v;
}

// writes 16 rows x HS of fp32 C tiles, times scale, to rows row0 (this thread: group and
// group + 8) of a (T, ld) slice; bf16 outputs are rounded, fp32 ones added to when accumulate
template <int HS, typename OutT>
__device__ __forceinline__ void fa_store_rows(OutT* g, long ld, int row0, int T, const float acc[HS / 8][4],
                                              float scale0, float scale1, bool accumulate = false) {
    int lane = threadIdx.x % 32, group = lane / 4, tig = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        int row = row0 + group + half * 8;
        if (row >= T) { continue; }
        float sc = half ? scale1 : scale0;
        #pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            fa_store_pair(g + (long)row * ld + dt * 8 + tig * 2, acc[dt][2 * half] * sc, acc[dt][2 * half + 1] * sc,
                          accumulate);
        }
    }
}

// ---- forward -----------------------------------------------------------------------------

// out (B,T,C) and stats (B,NH,T) of problem p's query rows [q_lo, T): a block per query tile
// counted from q_lo (blockIdx.x) and (b, h) (blockIdx.y)
template <int HS, typename OutT>
__global__ void __launch_bounds__(FA_THREADS) flash_forward_kernel(OutT* out, float* stats, FaProblem p,
                                                                   float scale_log2, int q_tile) {
    DYNAMIC_SHARED(fa_smem);
    floatX* sQ = reinterpret_cast<floatX*>(fa_smem);
    floatX* sK = sQ + FaTile<HS>::ELEMS;         // 2 buffers
    floatX* sV = sK + 2 * FaTile<HS>::ELEMS;     // 2 buffers
    // the longest rows first; q_tile >= 0: that query tile alone (one launch of one tile)
    const int qt = q_tile >= 0 ? q_tile : (int)(gridDim.x - 1 - blockIdx.x);
    const int T = p.T, NH = p.NH, k_hi = p.mask.k_hi, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const long C = (long)NH * HS;
    const floatX* q_g = p.q + (long)b * T * p.ldq + h * HS;
    const floatX* k_g = p.k + (long)b * T * p.ldkv + h * HS;
    const floatX* v_g = p.v + (long)b * T * p.ldkv + h * HS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, tig = lane % 4;
    const int q0 = p.mask.q_lo + qt * FA_ROWS;
    const int row0 = q0 + warp * 16;   // this warp's rows; the thread's are row0 + group (+ 8)

    fa_load_tile<HS>(sQ, q_g, p.ldq, q0, T);
    fa_load_tile<HS>(sK, k_g, p.ldkv, 0, k_hi);
    fa_load_tile<HS>(sV, v_g, p.ldkv, 0, k_hi);
    cp_async_commit();

    float o[HS / 8][4];
    #pragma unroll
    for (int i = 0; i < HS / 8; i++) { o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f; }
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};   // lrow: this thread's part
    // causal: the key tiles up to the diagonal; otherwise those below k_hi
    const int nkt = p.mask.causal ? qt + 1 : (k_hi + FA_COLS - 1) / FA_COLS;
    for (int kt = 0; kt < nkt; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < nkt) {
            fa_load_tile<HS>(sK + (buf ^ 1) * FaTile<HS>::ELEMS, k_g, p.ldkv, (kt + 1) * FA_COLS, k_hi);
            fa_load_tile<HS>(sV + (buf ^ 1) * FaTile<HS>::ELEMS, v_g, p.ldkv, (kt + 1) * FA_COLS, k_hi);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float s[8][4];
        #pragma unroll
        for (int i = 0; i < 8; i++) { s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f; }
        fa_scores<HS>(s, sQ, warp * 16, sK + buf * FaTile<HS>::ELEMS);
        float tmax[2] = {-INFINITY, -INFINITY};
        #pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = kt * FA_COLS + nt * 8 + tig * 2 + (e & 1);
                int q = row0 + group + (e >> 1) * 8;
                float v = s[nt][e] * scale_log2;
                if (fa_hidden(p.mask, q, key)) { v = -INFINITY; }
                s[nt][e] = v;
                tmax[e >> 1] = fmaxf(tmax[e >> 1], v);
            }
        }
        float corr[2];
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(FULL_MASK, tmax[r], 1));
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(FULL_MASK, tmax[r], 2));
            float mnew = fmaxf(mrow[r], tmax[r]);   // finite: every row sees key 0
            corr[r] = fast_exp2(mrow[r] - mnew);     // exp2(-inf) = 0 on the first tile
            mrow[r] = mnew;
            lrow[r] *= corr[r];
        }
        #pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float pe = fast_exp2(s[nt][e] - mrow[e >> 1]);
                s[nt][e] = pe;
                lrow[e >> 1] += pe;
            }
        }
        #pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            o[dt][0] *= corr[0]; o[dt][1] *= corr[0];
            o[dt][2] *= corr[1]; o[dt][3] *= corr[1];
        }
        fa_apply<HS>(o, s, sV + buf * FaTile<HS>::ELEMS);
        __syncthreads();   // this buffer is refilled two tiles on
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        lrow[r] += __shfl_xor_sync(FULL_MASK, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(FULL_MASK, lrow[r], 2);
    }
    fa_store_rows<HS>(out + (long)b * T * C + h * HS, C, row0, T, o, 1.0f / lrow[0], 1.0f / lrow[1]);
    if (tig == 0) {
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            int q = row0 + group + r * 8;
            if (q < T) { stats[(long)bh * T + q] = mrow[r] + __log2f(lrow[r]); }
        }
    }
}

// ---- backward ----------------------------------------------------------------------------

// D[b,h,t] = sum over d of dout * out (fp32), one thread per (b, t, h)
template <int HS>
__global__ void flash_backward_preprocess_kernel(float* D, const floatX* dout, const floatX* out, int B, int T, int NH) {
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * T * NH) { return; }
    int h = (int)(idx % NH);
    long bt = idx / NH;
    const floatX* dy = dout + idx * HS;   // (b, t, h) rows are contiguous: idx * HS
    const floatX* y = out + idx * HS;
    float acc = 0.0f;
    #pragma unroll
    for (int d = 0; d < HS; d += 8) {
        float a[8], c[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(dy + d), a);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(y + d), c);
        #pragma unroll
        for (int k = 0; k < 8; k++) { acc = __fmaf_rn(a[k], c[k], acc); }
    }
    D[((bt / T) * NH + h) * T + bt % T] = acc;
}

// dQ for a tile of 64 queries (from q_lo): walk the key tiles it sees; S = Q K^T,
// P = exp2(S - stats), dP = dO V^T, dS = P (dP - D), dQ += dS K; dq (B,T,ld_dq) = dQ scale at
// the end (added to it when accumulate).
template <int HS, typename OutT>
__global__ void __launch_bounds__(FA_THREADS) flash_backward_dq_kernel(
        OutT* dq, long ld_dq, int accumulate, const floatX* dout, const float* stats, const float* Dsum, FaProblem p,
        float scale_log2, float scale) {
    DYNAMIC_SHARED(fa_smem);
    floatX* sQ = reinterpret_cast<floatX*>(fa_smem);
    floatX* sdO = sQ + FaTile<HS>::ELEMS;
    floatX* sK = sdO + FaTile<HS>::ELEMS;       // 2 buffers
    floatX* sV = sK + 2 * FaTile<HS>::ELEMS;    // 2 buffers
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int T = p.T, NH = p.NH, k_hi = p.mask.k_hi, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const long C = (long)NH * HS;
    const floatX* q_g = p.q + (long)b * T * p.ldq + h * HS;
    const floatX* k_g = p.k + (long)b * T * p.ldkv + h * HS;
    const floatX* v_g = p.v + (long)b * T * p.ldkv + h * HS;
    const floatX* do_g = dout + (long)b * T * C + h * HS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, tig = lane % 4;
    const int q0 = p.mask.q_lo + qt * FA_ROWS, row0 = q0 + warp * 16;

    fa_load_tile<HS>(sQ, q_g, p.ldq, q0, T);
    fa_load_tile<HS>(sdO, do_g, C, q0, T);
    fa_load_tile<HS>(sK, k_g, p.ldkv, 0, k_hi);
    fa_load_tile<HS>(sV, v_g, p.ldkv, 0, k_hi);
    cp_async_commit();
    float L[2], Dr[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        int q = row0 + group + r * 8;
        L[r] = q < T ? stats[(long)bh * T + q] : 0.0f;
        Dr[r] = q < T ? Dsum[(long)bh * T + q] : 0.0f;
    }
    float acc[HS / 8][4];
    #pragma unroll
    for (int i = 0; i < HS / 8; i++) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
    const int nkt = p.mask.causal ? qt + 1 : (k_hi + FA_COLS - 1) / FA_COLS;
    for (int kt = 0; kt < nkt; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < nkt) {
            fa_load_tile<HS>(sK + (buf ^ 1) * FaTile<HS>::ELEMS, k_g, p.ldkv, (kt + 1) * FA_COLS, k_hi);
            fa_load_tile<HS>(sV + (buf ^ 1) * FaTile<HS>::ELEMS, v_g, p.ldkv, (kt + 1) * FA_COLS, k_hi);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const floatX* Kb = sK + buf * FaTile<HS>::ELEMS;
        const floatX* Vb = sV + buf * FaTile<HS>::ELEMS;
        float s[8][4], dp[8][4];
        #pragma unroll
        for (int i = 0; i < 8; i++) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
        }
        fa_scores<HS>(s, sQ, warp * 16, Kb);
        fa_scores<HS>(dp, sdO, warp * 16, Vb);
        #pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = kt * FA_COLS + nt * 8 + tig * 2 + (e & 1);
                int q = row0 + group + (e >> 1) * 8;
                float pe = fa_hidden(p.mask, q, key) ? 0.0f : fast_exp2(s[nt][e] * scale_log2 - L[e >> 1]);
                s[nt][e] = pe * (dp[nt][e] - Dr[e >> 1]);   // dS
            }
        }
        fa_apply<HS>(acc, s, Kb);
        __syncthreads();
    }
    fa_store_rows<HS>(dq + (long)b * T * ld_dq + h * HS, ld_dq, row0, T, acc, scale, scale, accumulate != 0);
}

// dK, dV for a tile of 64 keys: walk the query tiles that may see it (from the diagonal if
// causal, else from q_lo; none for a tile at or past k_hi, whose rows get zeros);
// S^T = K Q^T, P^T = exp2(S^T - stats), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D),
// dK += dS^T Q; dk (B,T,ld_dkv) = dK scale, dv likewise = dV.
template <int HS, typename OutT>
__global__ void __launch_bounds__(FA_THREADS) flash_backward_dkdv_kernel(
        OutT* dk, OutT* dv, long ld_dkv, const floatX* dout, const float* stats, const float* Dsum, FaProblem p,
        float scale_log2, float scale) {
    DYNAMIC_SHARED(fa_smem);
    floatX* sK = reinterpret_cast<floatX*>(fa_smem);
    floatX* sV = sK + FaTile<HS>::ELEMS;
    floatX* sQ = sV + FaTile<HS>::ELEMS;        // 2 buffers
    floatX* sdO = sQ + 2 * FaTile<HS>::ELEMS;   // 2 buffers
    float* sL = reinterpret_cast<float*>(sdO + 2 * FaTile<HS>::ELEMS);   // 2 x 64
    float* sD = sL + 2 * FA_COLS;                                        // 2 x 64
    const int kt = blockIdx.x;   // the first key tiles see the most queries: launched first
    const int T = p.T, NH = p.NH, k_hi = p.mask.k_hi, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const long C = (long)NH * HS;
    const floatX* q_g = p.q + (long)b * T * p.ldq + h * HS;
    const floatX* k_g = p.k + (long)b * T * p.ldkv + h * HS;
    const floatX* v_g = p.v + (long)b * T * p.ldkv + h * HS;
    const floatX* do_g = dout + (long)b * T * C + h * HS;
    const float* L_g = stats + (long)bh * T;
    const float* D_g = Dsum + (long)bh * T;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, tig = lane % 4;
    const int k0 = kt * FA_ROWS, row0 = k0 + warp * 16;   // this warp's keys
    const int q_first = p.mask.causal ? k0 : p.mask.q_lo;
    const int nqt = k0 < k_hi ? (T - q_first + FA_COLS - 1) / FA_COLS : 0;

    if (nqt > 0) {
        fa_load_tile<HS>(sK, k_g, p.ldkv, k0, k_hi);
        fa_load_tile<HS>(sV, v_g, p.ldkv, k0, k_hi);
        fa_load_tile<HS>(sQ, q_g, p.ldq, q_first, T);
        fa_load_tile<HS>(sdO, do_g, C, q_first, T);
        cp_async_commit();
        if (threadIdx.x < FA_COLS) {
            int q = q_first + threadIdx.x;
            sL[threadIdx.x] = q < T ? L_g[q] : 0.0f;
            sD[threadIdx.x] = q < T ? D_g[q] : 0.0f;
        }
    }
    float dk_acc[HS / 8][4], dv_acc[HS / 8][4];
    #pragma unroll
    for (int i = 0; i < HS / 8; i++) {
        dk_acc[i][0] = dk_acc[i][1] = dk_acc[i][2] = dk_acc[i][3] = 0.0f;
        dv_acc[i][0] = dv_acc[i][1] = dv_acc[i][2] = dv_acc[i][3] = 0.0f;
    }
    for (int i = 0; i < nqt; i++) {
        const int buf = i & 1, qbase = q_first + i * FA_COLS;
        float next_L = 0.0f, next_D = 0.0f;
        if (i + 1 < nqt) {
            fa_load_tile<HS>(sQ + (buf ^ 1) * FaTile<HS>::ELEMS, q_g, p.ldq, qbase + FA_COLS, T);
            fa_load_tile<HS>(sdO + (buf ^ 1) * FaTile<HS>::ELEMS, do_g, C, qbase + FA_COLS, T);
            cp_async_commit();
            if (threadIdx.x < FA_COLS) {
                int q = qbase + FA_COLS + threadIdx.x;
                next_L = q < T ? L_g[q] : 0.0f;
                next_D = q < T ? D_g[q] : 0.0f;
            }
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const floatX* Qb = sQ + buf * FaTile<HS>::ELEMS;
        const floatX* dOb = sdO + buf * FaTile<HS>::ELEMS;
        const float* Lb = sL + buf * FA_COLS;
        const float* Db = sD + buf * FA_COLS;
        float pt[8][4], dpt[8][4];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            pt[j][0] = pt[j][1] = pt[j][2] = pt[j][3] = 0.0f;
            dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.0f;
        }
        fa_scores<HS>(pt, sK, warp * 16, Qb);     // S^T: rows keys, columns queries
        fa_scores<HS>(dpt, sV, warp * 16, dOb);   // dP^T
        #pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int qc = nt * 8 + tig * 2 + (e & 1);
                int q = qbase + qc;
                int key = row0 + group + (e >> 1) * 8;
                float pe = (q >= T || fa_hidden(p.mask, q, key)) ? 0.0f : fast_exp2(pt[nt][e] * scale_log2 - Lb[qc]);
                pt[nt][e] = pe;
                dpt[nt][e] = pe * (dpt[nt][e] - Db[qc]);   // dS^T
            }
        }
        fa_apply<HS>(dv_acc, pt, dOb);
        fa_apply<HS>(dk_acc, dpt, Qb);
        if (i + 1 < nqt && threadIdx.x < FA_COLS) {   // the other buffer was last read a tile ago
            sL[(buf ^ 1) * FA_COLS + threadIdx.x] = next_L;
            sD[(buf ^ 1) * FA_COLS + threadIdx.x] = next_D;
        }
        __syncthreads();
    }
    fa_store_rows<HS>(dk + (long)b * T * ld_dkv + h * HS, ld_dkv, row0, T, dk_acc, scale, scale);
    fa_store_rows<HS>(dv + (long)b * T * ld_dkv + h * HS, ld_dkv, row0, T, dv_acc, 1.0f, 1.0f);
}

// ---- launchers ---------------------------------------------------------------------------

template <int HS> static size_t fa_forward_smem() { return 5 * FaTile<HS>::ELEMS * sizeof(floatX); }
template <int HS> static size_t fa_dq_smem() { return 6 * FaTile<HS>::ELEMS * sizeof(floatX); }
template <int HS> static size_t fa_dkdv_smem() {
    return 6 * FaTile<HS>::ELEMS * sizeof(floatX) + 4 * FA_COLS * sizeof(float);
}

template <int HS, typename OutT> static void flash_setup_out() {
    cudaCheck(cudaFuncSetAttribute(flash_forward_kernel<HS, OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fa_forward_smem<HS>()));
    cudaCheck(cudaFuncSetAttribute(flash_backward_dq_kernel<HS, OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fa_dq_smem<HS>()));
    cudaCheck(cudaFuncSetAttribute(flash_backward_dkdv_kernel<HS, OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fa_dkdv_smem<HS>()));
}
template <int HS> static void flash_setup_hs() {
    flash_setup_out<HS, floatX>();   // one rank's attention
    flash_setup_out<HS, float>();    // the ring's blocks
}

// once, before the first call: allows the kernels' shared memory above 48 KB
static void flash_attention_setup(void) {
    flash_setup_hs<16>();
    flash_setup_hs<32>();
    flash_setup_hs<64>();
}

// The softmax scale, computed once for the forward and the backward: the backward recomputes
// P = exp2(s * scale_log2 - stats) from the forward's stats, so both must scale by the same float.
template <int HS> static float fa_scale() { return 1.0f / sqrtf((float)HS); }
template <int HS> static float fa_scale_log2() { return FA_LOG2E * fa_scale<HS>(); }

// q_tile >= 0: that query tile alone
template <int HS, typename OutT>
static void flash_forward_hs(OutT* out, float* stats, const FaProblem& p, int B, int q_tile) {
    if (p.mask.causal && p.mask.q_lo != 0) { fatal("internal: a causal flash problem's queries start at row 0"); }
    dim3 grid(q_tile >= 0 ? 1 : (p.T - p.mask.q_lo + FA_ROWS - 1) / FA_ROWS, B * p.NH);
    LAUNCH_SMEM((flash_forward_kernel<HS, OutT>), grid, FA_THREADS, fa_forward_smem<HS>(), out, stats, p,
                fa_scale_log2<HS>(), q_tile);
    cudaLaunchCheck("flash_forward_kernel");
}

template <int HS>
static void flash_backward_D_hs(float* D, const floatX* dout, const floatX* out, int B, int T, int NH) {
    LAUNCH(flash_backward_preprocess_kernel<HS>, ceil_div_u((long)B * T * NH, 256), 256, D, dout, out, B, T, NH);
    cudaLaunchCheck("flash_backward_preprocess_kernel");
}

// dq (B,T,ld_dq), added to when accumulate; dk, dv (B,T,ld_dkv), every row (zeros for keys no
// query sees)
template <int HS, typename OutT>
static void flash_backward_hs(OutT* dq, long ld_dq, int accumulate, OutT* dk, OutT* dv, long ld_dkv,
                              const floatX* dout, const float* stats, const float* D, const FaProblem& p, int B) {
    if (p.mask.causal && p.mask.q_lo != 0) { fatal("internal: a causal flash problem's queries start at row 0"); }
    float scale = fa_scale<HS>(), scale_log2 = fa_scale_log2<HS>();
    dim3 key_tiles((p.T + FA_ROWS - 1) / FA_ROWS, B * p.NH), query_tiles((p.T - p.mask.q_lo + FA_ROWS - 1) / FA_ROWS, B * p.NH);
    LAUNCH_SMEM((flash_backward_dkdv_kernel<HS, OutT>), key_tiles, FA_THREADS, fa_dkdv_smem<HS>(), dk, dv, ld_dkv, dout,
                stats, D, p, scale_log2, scale);
    cudaLaunchCheck("flash_backward_dkdv_kernel");
    LAUNCH_SMEM((flash_backward_dq_kernel<HS, OutT>), query_tiles, FA_THREADS, fa_dq_smem<HS>(), dq, ld_dq, accumulate,
                dout, stats, D, p, scale_log2, scale);
    cudaLaunchCheck("flash_backward_dq_kernel");
}

// CALL with HS the head size hs as a constant
#define FA_HS_DISPATCH(hs, ...)                                                                    \
    switch (hs) {                                                                                  \
        case 16: { constexpr int HS = 16; __VA_ARGS__; } break;                                    \
        case 32: { constexpr int HS = 32; __VA_ARGS__; } break;                                    \
        case 64: { constexpr int HS = 64; __VA_ARGS__; } break;                                    \
        default: fatal("fast-mode attention supports head sizes 16, 32 and 64, not %d", (int)(hs)); \
    }

// qkv (B,T,3C) -> out (B,T,C), stats (B,NH,T)
static void attention_forward_fast(floatX* out, float* stats, const floatX* qkv, int B, int T, int C, int NH) {
    FA_HS_DISPATCH(C / NH, flash_forward_hs<HS>(out, stats, fa_causal(qkv, T, C, NH), B, -1));
}

// The sampler's KV cache: row t of out (1,T,C) from qkv (1,T,3C) rows 0..t; stats: (NH, t + 1)
// scratch. One launch of the query tile holding row t over the prefix T = t + 1: each of its
// rows is what the full forward computes for it (the keys after a row carry a weight of exactly
// 0 there, and are not loaded here); its rows before t are written again, unchanged.
static void attention_forward_fast_row(floatX* out, float* stats, const floatX* qkv, int t, int C, int NH) {
    FA_HS_DISPATCH(C / NH, flash_forward_hs<HS>(out, stats, fa_causal(qkv, t + 1, C, NH), 1, t / FA_ROWS));
}

// dqkv (B,T,3C) <- dout (B,T,C), given the forward's qkv, out and stats; D: (B,NH,T) scratch
static void attention_backward_fast(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out,
                                    const float* stats, float* D, int B, int T, int C, int NH) {
    FA_HS_DISPATCH(C / NH, {
        flash_backward_D_hs<HS>(D, dout, out, B, T, NH);
        flash_backward_hs<HS>(dqkv, 3L * C, 0, dqkv + C, dqkv + 2 * C, 3L * C, dout, stats, D,
                              fa_causal(qkv, T, C, NH), B);
    });
}

// The same kernels in fp32 (the ring's blocks, kernels_fast_cp.cuh), for a problem p with C
// channels: out (B,T,C) and stats (B,NH,T) of the rows [q_lo, T)
static void attention_forward_fast_fp32(float* out, float* stats, const FaProblem& p, int B, int C) {
    FA_HS_DISPATCH(C / p.NH, flash_forward_hs<HS>(out, stats, p, B, -1));
}

// D (B,NH,T) = rowsum(dout * out), the backward's per-row term, for attention_backward_fast_fp32
static void attention_backward_D_fast(float* D, const floatX* dout, const floatX* out, int B, int T, int C, int NH) {
    FA_HS_DISPATCH(C / NH, flash_backward_D_hs<HS>(D, dout, out, B, T, NH));
}

// dq (B,T,C) of the rows [q_lo, T) (added to it when accumulate) and dkv (B,T,2C), dk | dv
// of every key, fp32, given the statistics and D of each query row
static void attention_backward_fast_fp32(float* dq, int accumulate, float* dkv, const floatX* dout, const float* stats,
                                         const float* D, const FaProblem& p, int B, int C) {
    FA_HS_DISPATCH(C / p.NH, flash_backward_hs<HS>(dq, C, accumulate, dkv, dkv + C, 2L * C, dout, stats, D, p, B));
}

#endif // LLMC_ATTENTION_FLASH_CUH
