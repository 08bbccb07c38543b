/*
 * canonical.h: the canonical arithmetic of the project, defined once for gcc and nvcc.
 *
 * Floating-point addition is not associative, so a result is reproducible only if the ORDER
 * of every reduction is fixed independently of how the work is divided (threads, SIMD lanes,
 * GPU blocks, tensor-parallel ranks, data-parallel ranks, pipeline stages, microbatches).
 * This header is that order, and the per-element functions every kernel calls. The CPU build
 * (train_gpt2.c) and the CUDA build in deterministic mode (train_gpt2.cu) both follow it, so
 * both produce the same bits, and so does every parallel layout.
 *
 * THE RULES
 *
 * R1. Halving tree. A tree sum of n leaves l[0..n) is: n == 1: l[0]; otherwise cut at
 *     mid = ceil(n/2): tree(l[0..mid)) + tree(l[mid..n)). For n a power of two this is the
 *     familiar pairwise tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). A contiguous block of leaves
 *     that the recursion reaches as one node (e.g. n/K leaves for K a power of two dividing n)
 *     is a complete subtree, so K workers can each sum their block and the K block sums are
 *     combined by the same rule: the result is bit-identical to one worker's.
 *     Leaves are streamed left to right with a small stack: after pushing leaf i, pop-and-add
 *     canon_tree_merges_after(i, n) times (see the function).
 *
 * R2. Chunked reduction over a dimension of length n (matmul over K, layernorm over C, the
 *     head dimension in attention, the vocabulary in cross-entropy): the
 *     dimension is cut into CANON_R = 8 contiguous chunks, chunk c = [c*n/8, (c+1)*n/8)
 *     (integer division; chunks may be empty when n < 8). Each chunk is accumulated
 *     sequentially from 0.0f in increasing index order, a product term with fmaf(a, b, acc);
 *     the 8 chunk partials are combined by the R1 tree. A tensor-parallel partition of the
 *     dimension into K | 8 equal parts gives each rank 8/K whole chunks (because
 *     floor(r*(8/K)*n/8) == floor(r*n/K)): the rank reduces its subtree, the cross-rank R1
 *     tree finishes it, bit-identical to one rank.
 *
 * R2Z. Zig-zag chunks, for every reduction along the positions of a sequence (the keys and
 *     the queries in attention, the positions in R3): the sequence of length n is cut into
 *     2 * CANON_R = 16 pieces, piece p = [p*n/16, (p+1)*n/16), and chunk c (of 8) is piece c
 *     followed by piece 15-c, i.e. its two mirror-image stretches. Each chunk is accumulated
 *     sequentially from 0.0f (piece c in increasing index order, then piece 15-c), the 8
 *     partials combined by the R1 tree. This is the layout context parallelism balances
 *     causal attention with (Megatron's zig-zag): D ranks (D | 8, 2D | n) cut the sequence
 *     into 2D stretches and rank r holds stretches r and 2D-1-r, which are exactly chunks
 *     [r*8/D, (r+1)*8/D): a complete subtree. Stored locally as its low stretch followed by
 *     its high one (length n/D), those chunks are again zig-zag chunks of the local sequence,
 *     with 8/D chunks (2*8/D pieces) instead of 8 (canon_zz_global maps local positions to
 *     global ones). So a rank reduces its positions by the same rule with nchunks = 8/D, and
 *     the R1 tree over ranks in rank order finishes the sum, bit-identical to one rank. A
 *     slice of a slice is a slice: D1-way then D2-way is the D1*D2-way slice of rank
 *     r1*D2 + r2. For any other n >= 2D (--varlen) rank r holds the same chunks, now R2Z's
 *     unequal pieces of n: its stretches are floor or ceil of n/2D, and its local chunk c is
 *     global chunk r*8/D + c at its own offsets (canon_zz_slice_half), still a complete
 *     subtree reduced by the same rule.
 *
 * R3. Reduction over positions (weight and bias gradients, the loss): position (b, t) of a
 *     batch of sequences. Each sequence b is reduced by R2Z over t; the sequence sums are
 *     combined by the R1 tree over the sequences of the GLOBAL batch, in order.
 *     Microbatches and data-parallel ranks own contiguous blocks of sequences, so for
 *     power-of-two numbers of microbatches M and ranks N (dividing the sequence count) each
 *     owns a complete subtree: changing B x M x N at a fixed global batch changes nothing.
 *     Sequence and context parallelism cut T into zig-zag slices (R2Z): each rank owns
 *     whole chunks of every sequence, so the per-sequence sums are finished across the group
 *     and then R1 over sequences.
 *     Variable-length sequences (--varlen, dataloader.h): sequence i of a step has its own
 *     length n_i, and R3 is R2Z over each sequence's n_i positions (piece p = [p*n/16,
 *     (p+1)*n/16) with floor division: for n not a multiple of 16 the pieces differ by at most
 *     one position, for n < 16 some are empty and add nothing), then R1 over the step's G
 *     sequences in their index order. The trainer runs each sequence as its own microbatch
 *     (one row of n_i positions), so that R1 is the microbatch tree over the global microbatch
 *     index: the same sum whichever rank, stage or microbatch slot computed a sequence. With
 *     every n_i = T and power-of-two counts it is the fixed-T run's order exactly.
 *
 * R4. Products are written as explicit fmaf where they accumulate, plain * elsewhere; the
 *     compiler must not contract a*b+c on its own (gcc -ffp-contract=off, nvcc -fmad=false).
 *     Division and sqrtf are IEEE correctly rounded on both (nvcc -prec-div=true
 *     -prec-sqrt=true, no --use_fast_math). exp, log and tanh are our own (below), built from
 *     +, *, fmaf and bit operations only, so libm / CUDA math library differences never enter.
 *
 * R5. Max and selection are exact in any order (softmax max, target logit pick).
 *
 * R6. The squared gradient norm is summed EXACTLY (integer fixed-point accumulator, see
 *     SumSq below) and rounded once. An exact sum has no order at all, so it is the same for
 *     any partition of the parameters across ranks: data-parallel/ZeRO shards of the flat buffer,
 *     tensor-parallel slices (rows or columns) and pipeline stages alike.
 */
#ifndef LLMC_CANONICAL_H
#define LLMC_CANONICAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define HD __host__ __device__ __forceinline__
#else
#define HD static inline
#endif

#define CANON_R 8            // chunks per reduced dimension (rule R2)
#define CANON_LOG2_R 3

// ------------------------------------------------------------------------------------------
// R1: the halving tree

// Number of pop-and-add steps to do after pushing leaf i of an n-leaf R1 tree: the number of
// internal nodes whose last leaf is i. Walk from the root towards leaf i; a node [lo, hi)
// whose last leaf hi-1 is i completes right after leaf i.
HD int canon_tree_merges_after(int i, int n) {
    int lo = 0, hi = n, merges = 0;
    while (hi - lo > 1) {
        int mid = lo + (hi - lo + 1) / 2;
        if (i < mid) {
            hi = mid;
        } else {
            if (i == hi - 1) { merges++; }
            lo = mid;
        }
    }
    return merges;
}

// The partial sums of a streamed R1 (or R3) reduction: each leaf's partial is pushed in
// order, then the pop-and-add steps its tree prescribes (canon_tree_merges_after, or
// canon_pos_merges_after for R3), each adding the top entry into the one below (left + right);
// after the last leaf, entry 0 holds the sum. An entry is a block of rows x cols floats (rows
// ld apart; one partial: 1 x 1), entry i at base + i * size: one stack serves a scalar, a row
// of channels, a register tile stored to memory and a stripe of a matrix alike.
typedef struct {
    float* base;
    long size;        // floats from one entry to the next
    int rows, cols;   // the floats of an entry that take part in the sum
    long ld;          // the row stride within an entry
    int top;          // entries on the stack
} CanonStack;

HD CanonStack canon_stack(float* base, long size, int rows, int cols, long ld) {
    CanonStack s = {base, size, rows, cols, ld, 0};
    return s;
}

// Where the next leaf's partial is written (before canon_stack_push).
HD float* canon_stack_next(const CanonStack* s) { return s->base + (long)s->top * s->size; }

// The partial written at canon_stack_next joins the stack, then `merges` pop-and-add steps.
HD void canon_stack_push(CanonStack* s, int merges) {
    s->top++;
    for (; merges > 0; merges--) {
        float* left = s->base + (long)(s->top - 2) * s->size;
        const float* right = left + s->size;
        for (int r = 0; r < s->rows; r++) {
            for (int c = 0; c < s->cols; c++) { left[r * s->ld + c] = left[r * s->ld + c] + right[r * s->ld + c]; }
        }
        s->top--;
    }
}

// A single partial: v joins the stack, then `merges` pop-and-add steps.
HD void canon_stack_push_value(CanonStack* s, float v, int merges) {
    *canon_stack_next(s) = v;
    canon_stack_push(s, merges);
}

// The R1 tree sum of v[0], v[stride], ..., v[(n-1)*stride]. n may be up to 2^31.
HD float canon_tree_sum(const float* v, long n, long stride) {
    float partials[64];
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    if (n <= 0) { return 0.0f; }
    for (long i = 0; i < n; i++) { canon_stack_push_value(&stack, v[i * stride], canon_tree_merges_after((int)i, (int)n)); }
    return partials[0];
}

// The R1 tree over exactly CANON_R = 8 partials, written out.
HD float canon_tree8(const float p[CANON_R]) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// ------------------------------------------------------------------------------------------
// R2: chunks

// First index of chunk c of a dimension of length n (chunk c is [begin(c), begin(c+1))).
HD long canon_chunk_begin(long n, int c) { return (n * (long)c) / CANON_R; }

// R2 sum of x[0..n) (stride apart).
HD float canon_sum(const float* x, long n, long stride) {
    float partial[CANON_R];
    for (int c = 0; c < CANON_R; c++) {
        float acc = 0.0f;
        for (long i = canon_chunk_begin(n, c); i < canon_chunk_begin(n, c + 1); i++) {
            acc = acc + x[i * stride];
        }
        partial[c] = acc;
    }
    return canon_tree8(partial);
}

// R2 dot product of a[0..n) and b[0..n) (strides sa, sb).
HD float canon_dot(const float* a, long sa, const float* b, long sb, long n) {
    float partial[CANON_R];
    for (int c = 0; c < CANON_R; c++) {
        float acc = 0.0f;
        for (long i = canon_chunk_begin(n, c); i < canon_chunk_begin(n, c + 1); i++) {
            acc = fmaf(a[i * sa], b[i * sb], acc);
        }
        partial[c] = acc;
    }
    return canon_tree8(partial);
}

// ------------------------------------------------------------------------------------------
// R2Z: zig-zag chunks along a sequence

// First index of piece p of a dimension of length n cut into npieces pieces.
HD long canon_piece_begin(long n, int npieces, int p) { return (n * (long)p) / npieces; }

// Stretch `half` (0: the low piece c, 1: the high piece 2*nchunks-1-c) of zig-zag chunk c of a
// sequence of length n reduced in nchunks chunks: [*begin, *end).
HD void canon_zz_half(long n, int nchunks, int c, int half, long* begin, long* end) {
    int p = half == 0 ? c : 2 * nchunks - 1 - c;
    *begin = canon_piece_begin(n, 2 * nchunks, p);
    *end = canon_piece_begin(n, 2 * nchunks, p + 1);
}

// Rank r's D-way zig-zag slice of a sequence of length n (D | 8): R2Z chunks [r*k, (r+1)*k),
// k = 8/D, i.e. global pieces r*k .. r*k+k-1 (its low stretch) and their mirrors 16-(r+1)*k ..
// 15-r*k (its high stretch), stored low stretch first. When 2D | n the stretches are n/2D
// each; for any other n they are R2Z's unequal pieces (a stretch of k pieces is floor or ceil
// of k*n/16, the two stretches of a slice may differ by one, slices by up to two).
// The first global position of the slice's low (half 0) or high (half 1) stretch, and its end.
HD void canon_zz_stretch(long n, int D, int r, int half, long* begin, long* end) {
    int k = CANON_R / D, p = half == 0 ? r * k : 2 * CANON_R - (r + 1) * k;
    *begin = canon_piece_begin(n, 2 * CANON_R, p);
    *end = canon_piece_begin(n, 2 * CANON_R, p + k);
}

// The positions of rank r's D-way slice (n/D when 2D | n).
HD long canon_zz_len(long n, int D, int r) {
    long b0, e0, b1, e1;
    canon_zz_stretch(n, D, r, 0, &b0, &e0);
    canon_zz_stretch(n, D, r, 1, &b1, &e1);
    return (e0 - b0) + (e1 - b1);
}

// Where rank s's slice starts when the D slices are laid end to end in rank order (a row of n
// keys of context parallelism's attention, block s; s*n/D when 2D | n): the slices before it
// hold pieces [0, s*k) and [16 - s*k, 16).
HD long canon_zz_offset(long n, int D, int s) {
    int k = CANON_R / D;
    return canon_piece_begin(n, 2 * CANON_R, s * k) + (n - canon_piece_begin(n, 2 * CANON_R, 2 * CANON_R - s * k));
}

// The global position of local position t of rank r's D-way slice of a sequence of length n.
// D = 1 is the identity.
HD long canon_zz_global(long t, long n, int D, int r) {
    long b0, e0, b1, e1;
    canon_zz_stretch(n, D, r, 0, &b0, &e0);
    canon_zz_stretch(n, D, r, 1, &b1, &e1);
    return t < e0 - b0 ? b0 + t : b1 + (t - (e0 - b0));
}

// Stretch `half` of the slice's local chunk c (of its k = 8/D: global R2Z chunk r*k + c) in
// the slice's local positions: [*begin, *end). D = 1 is canon_zz_half(n, CANON_R, ...); when
// 2D | n it is canon_zz_half(n/D, k, ...), the slice being again a zig-zag sequence.
HD void canon_zz_slice_half(long n, int D, int r, int c, int half, long* begin, long* end) {
    long b0, e0, b1, e1;
    canon_zz_stretch(n, D, r, 0, &b0, &e0);
    canon_zz_stretch(n, D, r, 1, &b1, &e1);
    int k = CANON_R / D, p = half == 0 ? r * k + c : 2 * CANON_R - 1 - r * k - c;
    long shift = half == 0 ? -b0 : (e0 - b0) - b1;   // global -> local
    *begin = canon_piece_begin(n, 2 * CANON_R, p) + shift;
    *end = canon_piece_begin(n, 2 * CANON_R, p + 1) + shift;
}

// How many positions of rank s's D-way zig-zag slice of a sequence of length n lie at global
// positions <= p (its low stretch, then its high one: a prefix of the slice, since the slice's
// positions increase): the keys of rank s that a query at p attends to.
HD int canon_zz_count_le(long p, long n, int D, int s) {
    long b0, e0, b1, e1;
    canon_zz_stretch(n, D, s, 0, &b0, &e0);
    canon_zz_stretch(n, D, s, 1, &b1, &e1);
    long lo = p - b0 + 1, hi = p - b1 + 1;
    lo = lo < 0 ? 0 : lo > e0 - b0 ? e0 - b0 : lo;
    hi = hi < 0 ? 0 : hi > e1 - b1 ? e1 - b1 : hi;
    return (int)(lo + hi);
}

// How many positions of rank r's slice lie at global positions >= p (a suffix of the slice):
// the queries of rank r that attend to a key at p.
HD int canon_zz_count_ge(long p, long n, int D, int r) {
    long b0, e0, b1, e1;
    canon_zz_stretch(n, D, r, 0, &b0, &e0);
    canon_zz_stretch(n, D, r, 1, &b1, &e1);
    long lo = e0 - p, hi = e1 - p;
    lo = lo < 0 ? 0 : lo > e0 - b0 ? e0 - b0 : lo;
    hi = hi < 0 ? 0 : hi > e1 - b1 ? e1 - b1 : hi;
    return (int)(lo + hi);
}

// R3: merges to do after leaf (sequence b of nseq, chunk c of the sequence's nchunks: CANON_R,
// or a zig-zag slice's CANON_R/D) of a position reduction: first the chunk tree of sequence b,
// then, when b's tree is complete, the tree over sequences.
HD int canon_pos_merges_after(int b, int nseq, int c, int nchunks) {
    int m = canon_tree_merges_after(c, nchunks);
    if (c == nchunks - 1) { m += canon_tree_merges_after(b, nseq); }
    return m;
}

// ------------------------------------------------------------------------------------------
// R4: per-element math, our own, identical on every IEEE-754 machine

HD float canon_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
HD uint32_t canon_float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
HD float canon_inf(void) { return canon_bits_to_float(0x7f800000u); }
HD float canon_nan(void) { return canon_bits_to_float(0x7fc00000u); }

// x rounded to bf16, as its 16 bits: to nearest, ties to even (CUDA's __float2bfloat16_rn), a
// NaN to 0x7fff. Fast mode's weights are rounded from their fp32 master parameters by it
// (memory.h's to_bf16).
HD uint16_t canon_bf16_bits(float x) {
    uint32_t u = canon_float_to_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return 0x7fffu; }
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 2^k for -126 <= k <= 127, exactly.
HD float canon_pow2i(int k) { return canon_bits_to_float((uint32_t)(k + 127) << 23); }

// exp(x): x = k*ln2 + r with |r| <= ln2/2 (Cody-Waite, fmaf), exp(r) by its Taylor polynomial
// of degree 7 (truncation error < 6e-9, below half an ulp), then the exact scaling by 2^k in
// two steps so results in the subnormal range are rounded once. Max error about 1 ulp.
HD float canon_expf(float x) {
    // written without early returns (selects at the end), so loops over it vectorise; the
    // special cases: NaN -> NaN, above ln(FLT_MAX) -> inf, below half the smallest subnormal -> 0
    float xc = x > 88.72283935546875f ? 88.72283935546875f : x;
    xc = xc < -103.972084045410156f ? -103.972084045410156f : xc;
    xc = xc == xc ? xc : 0.0f;
    float kf = xc * 1.44269502162933349609f;               // x / ln2
    int k = (int)(kf >= 0.0f ? kf + 0.5f : kf - 0.5f);     // round half away from zero
    kf = (float)k;
    float r = fmaf(-kf, 0.693145751953125f, xc);           // ln2 high part: 16 bits, exact
    r = fmaf(-kf, 1.42860676533018704e-06f, r);            // ln2 low part
    float p = 1.98412698412698413e-04f;                    // 1/5040
    p = fmaf(p, r, 1.38888888888888889e-03f);              // 1/720
    p = fmaf(p, r, 8.33333333333333333e-03f);              // 1/120
    p = fmaf(p, r, 4.16666666666666667e-02f);              // 1/24
    p = fmaf(p, r, 1.66666666666666667e-01f);              // 1/6
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int k1 = k / 2;
    float y = (p * canon_pow2i(k1)) * canon_pow2i(k - k1);
    y = x > 88.72283935546875f ? canon_inf() : y;
    y = x < -103.972084045410156f ? 0.0f : y;
    return x == x ? y : x;
}

// log(x) for x > 0: x = 2^e * m with m in [sqrt(1/2), sqrt(2)), f = m - 1, s = f/(2+f),
// log(1+f) = f - hfsq + s*(hfsq + R(s^2)), R the atanh series (fdlibm's arrangement, with
// Taylor coefficients to s^11; error < 3e-9 relative). Max error about 1 ulp.
HD float canon_logf(float x) {
    if (x != x) { return x; }
    if (x < 0.0f) { return canon_nan(); }
    if (x == 0.0f) { return -canon_inf(); }
    uint32_t u = canon_float_to_bits(x);
    if (u == 0x7f800000u) { return x; }
    int e = 0;
    if (u < 0x00800000u) {                                 // subnormal: scale by 2^25
        x = x * 33554432.0f;
        u = canon_float_to_bits(x);
        e = -25;
    }
    e += (int)(u >> 23) - 127;
    float m = canon_bits_to_float((u & 0x007fffffu) | 0x3f800000u);   // [1, 2)
    if (m > 1.41421353816986083984f) { m = m * 0.5f; e += 1; }
    float f = m - 1.0f;
    float hfsq = 0.5f * f * f;
    float s = f / (2.0f + f);
    float z = s * s;
    float R = 1.81818181818181818e-01f;                    // 2/11
    R = fmaf(R, z, 2.22222222222222222e-01f);              // 2/9
    R = fmaf(R, z, 2.85714285714285714e-01f);              // 2/7
    R = fmaf(R, z, 4.00000000000000000e-01f);              // 2/5
    R = fmaf(R, z, 6.66666666666666667e-01f);              // 2/3
    R = R * z;
    float ef = (float)e;
    float lo = fmaf(ef, 1.42860676533018704e-06f, s * (hfsq + R));
    return fmaf(ef, 0.693145751953125f, (f - (hfsq - lo)));
}

// tanh(x) = sign(x) * (1 - t) / (1 + t), t = exp(-2|x|). Absolute error about 1e-7, which is
// what GELU needs (it adds tanh to 1).
HD float canon_tanhf(float x) {
    float ax = x < 0.0f ? -x : x;
    float t = canon_expf(-2.0f * ax);
    float r = (1.0f - t) / (1.0f + t);
    return x < 0.0f ? -r : r;
}

HD float canon_rsqrtf(float x) { return 1.0f / sqrtf(x); }

// GELU, tanh approximation (GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#define CANON_GELU_SCALE 0.797884560802865355f             // sqrt(2/pi)
HD float canon_gelu(float x) {
    float cube = 0.044715f * x * x * x;
    float u = CANON_GELU_SCALE * (x + cube);
    return 0.5f * x * (1.0f + canon_tanhf(u));
}

// d gelu / dx, with sech^2 = 1 - tanh^2.
HD float canon_gelu_grad(float x) {
    float cube = 0.044715f * x * x * x;
    float u = CANON_GELU_SCALE * (x + cube);
    float th = canon_tanhf(u);
    float sech2 = 1.0f - th * th;
    float du_dx = CANON_GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * sech2 * du_dx;
}

// ------------------------------------------------------------------------------------------
// R6: exact sum of squares.
//
// A float x = m * 2^(e-150) with m < 2^24 an integer (e the biased exponent, e = 1 for
// subnormals), so x^2 = m^2 * 2^(2e-300): an integer below 2^48 at bit position 2(e-1) of a
// fixed-point number whose unit is 2^-298. That number fits in 554 bits; it is kept as 18
// base-2^32 digits, each in a 64-bit word so that carries can wait: a word overflows only
// after 2^32 additions, and canon_sumsq_normalize() propagates carries (every 2^30 elements
// and before anything reads the digits). Integer addition is associative, so partial
// accumulators of any partition of the data (threads, GPU blocks, ranks) add up to the same
// digits; the result is rounded to double once.
#define CANON_SUMSQ_DIGITS 18
typedef struct {
    uint64_t digit[CANON_SUMSQ_DIGITS];
    uint64_t nonfinite;     // count of inf/nan inputs: the norm is then NaN
    uint64_t pending;       // additions since the last normalize
} SumSq;

HD void canon_sumsq_init(SumSq* s) {
    for (int i = 0; i < CANON_SUMSQ_DIGITS; i++) { s->digit[i] = 0; }
    s->nonfinite = 0;
    s->pending = 0;
}

HD void canon_sumsq_normalize(SumSq* s) {
    uint64_t carry = 0;
    for (int i = 0; i < CANON_SUMSQ_DIGITS; i++) {
        uint64_t v = s->digit[i] + carry;     // v < 2^64: digit < 2^63 and carry < 2^32
        s->digit[i] = v & 0xffffffffu;
        carry = v >> 32;
    }
    // carry out of the top digit is impossible: 2^64 elements of at most 2^256 each
    s->pending = 0;
}

// Adds the integer v (< 2^64) times 2^pos (pos in fixed-point units) to the digits.
HD void canon_sumsq_add_scaled(SumSq* s, uint64_t v, uint32_t pos) {
    uint32_t d = pos >> 5, sh = pos & 31;
    uint64_t lo = v << sh;                                  // bits 0..63 of v << sh
    uint64_t hi = sh ? (v >> (64 - sh)) : 0;                // bits 64..95
    s->digit[d] += lo & 0xffffffffu;
    s->digit[d + 1] += lo >> 32;
    if (hi) { s->digit[d + 2] += hi; }
    if (++s->pending >= (1u << 30)) { canon_sumsq_normalize(s); }
}

HD void canon_sumsq_add(SumSq* s, float x) {
    uint32_t u = canon_float_to_bits(x) & 0x7fffffffu;
    uint32_t e = u >> 23;
    if (e == 255) { s->nonfinite++; return; }
    uint64_t m = (u & 0x007fffffu) | (e ? 0x00800000u : 0u);
    canon_sumsq_add_scaled(s, m * m, 2 * ((e ? e : 1) - 1));   // m^2 < 2^48 at bit 2(e-1)
}

// The same exact sum over an array, faster: the squared mantissas m^2 (< 2^48) of elements
// with the same exponent are first summed in a 64-bit bucket per exponent (2^16 of them fit),
// and the buckets are added to the digits at their positions. Integer sums: the same digits as
// adding the elements one by one.
static inline void canon_sumsq_add_array(SumSq* s, const float* x, size_t n) {
    uint64_t bucket[256];
    for (size_t i0 = 0; i0 < n; i0 += 65536) {
        size_t i1 = n - i0 < 65536 ? n : i0 + 65536;
        memset(bucket, 0, sizeof(bucket));
        for (size_t i = i0; i < i1; i++) {
            uint32_t u = canon_float_to_bits(x[i]) & 0x7fffffffu;
            uint32_t e = u >> 23;
            uint64_t m = (u & 0x007fffffu) | (e && e < 255 ? 0x00800000u : 0u);
            bucket[e] += m * m;
            if (e == 255) { s->nonfinite++; }
        }
        for (uint32_t e = 0; e < 255; e++) {
            if (bucket[e]) { canon_sumsq_add_scaled(s, bucket[e], 2 * ((e ? e : 1) - 1)); }
        }
    }
}

// Adds the digits of b into a (both normalized or not; normalize before reading).
HD void canon_sumsq_merge(SumSq* a, const SumSq* b) {
    for (int i = 0; i < CANON_SUMSQ_DIGITS; i++) { a->digit[i] += b->digit[i]; }
    a->nonfinite += b->nonfinite;
    a->pending += b->pending + 1;
    if (a->pending >= (1u << 30)) { canon_sumsq_normalize(a); }
}

// The exact sum rounded once to double (round to nearest even): the top 64 bits with a sticky
// bit for everything below, converted (the sticky bit sits below the 53 kept bits, so it
// breaks ties correctly), then scaled exactly by a power of two.
HD double canon_sumsq_value(SumSq* s) {
    canon_sumsq_normalize(s);
    if (s->nonfinite) { return (double)canon_nan(); }
    int top = CANON_SUMSQ_DIGITS - 1;
    while (top >= 0 && s->digit[top] == 0) { top--; }
    if (top < 0) { return 0.0; }
    uint64_t next = top >= 1 ? s->digit[top - 1] : 0;
    uint64_t below = top >= 2 ? s->digit[top - 2] : 0;
    int lz = 0;                                            // leading zeros of the top digit
    while (!((s->digit[top] << lz) & 0x80000000u)) { lz++; }
    // w = the 64 bits starting at the highest set bit; below = the 32 bits after them
    uint64_t w = (s->digit[top] << 32) | next;
    if (lz) {
        w = (w << lz) | (below >> (32 - lz));
        below = (below << lz) & 0xffffffffu;
    }
    int sticky = below != 0;
    for (int i = top - 3; i >= 0 && !sticky; i--) { sticky = s->digit[i] != 0; }
    if (sticky) { w |= 1; }
    double value = (double)w;                              // rounds to 53 bits, ties even
    // w's unit is bit 32*(top-1) - lz of the fixed-point number, whose unit is 2^-298
    int exp2 = 32 * (top - 1) - lz - 298;
    while (exp2 != 0) {                                    // exact scaling by 2^exp2
        int step = exp2 > 1000 ? 1000 : (exp2 < -1000 ? -1000 : exp2);
        uint64_t bits = (uint64_t)(step + 1023) << 52;
        double f;
        memcpy(&f, &bits, 8);
        value *= f;
        exp2 -= step;
    }
    return value;
}

// ------------------------------------------------------------------------------------------
// Double-precision helpers for host-side numbers that must agree across machines (learning
// rate schedule, weight initialisation): our own, so two machines with different libm
// versions still compute the same bits.

// cos(pi * x): reduced to |pi*y| <= pi/4 and a Taylor polynomial (error < 1e-17).
HD double canon_cospi_d(double x) {
    if (x < 0) { x = -x; }
    x = x - 2.0 * (double)(long long)(x * 0.5);              // now in [0, 2)
    double sign = 1.0;
    if (x > 1.0) { x = 2.0 - x; }                            // cos(pi x) = cos(pi (2 - x))
    if (x > 0.5) { x = 1.0 - x; sign = -1.0; }               // cos(pi x) = -cos(pi (1 - x))
    // now x in [0, 1/2]: cos(pi x) directly for x <= 1/4, else as sin(pi (1/2 - x))
    const double PI = 3.14159265358979323846;
    double r, r2, p;
    if (x <= 0.25) {                                         // cos(r) by Taylor to r^18
        r = PI * x;
        r2 = r * r;
        p = ((((((((1.0 / 6402373705728000.0) * r2 - 1.0 / 20922789888000.0) * r2
              + 1.0 / 87178291200.0) * r2 - 1.0 / 479001600.0) * r2 + 1.0 / 3628800.0) * r2
              - 1.0 / 40320.0) * r2 + 1.0 / 720.0) * r2 - 1.0 / 24.0) * r2 + 0.5;
        p = 1.0 - r2 * p;
    } else {                                                 // sin(r) by Taylor to r^19
        r = PI * (0.5 - x);
        r2 = r * r;
        p = ((((((((-1.0 / 121645100408832000.0) * r2 + 1.0 / 355687428096000.0) * r2
              - 1.0 / 1307674368000.0) * r2 + 1.0 / 6227020800.0) * r2 - 1.0 / 39916800.0) * r2
              + 1.0 / 362880.0) * r2 - 1.0 / 5040.0) * r2 + 1.0 / 120.0) * r2 - 1.0 / 6.0;
        p = r + r * r2 * p;
    }
    return sign * p;
}

// Natural log for x > 0 in double: x = 2^e m, m in [sqrt(1/2), sqrt(2)), the atanh series in
// s = (m-1)/(m+1) to s^21 (error < 1e-17 relative).
HD double canon_log_d(double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    int e = (int)((u >> 52) & 0x7ff) - 1023;
    if (((u >> 52) & 0x7ff) == 0) {                          // subnormal: scale by 2^64
        x = x * 18446744073709551616.0;
        memcpy(&u, &x, 8);
        e = (int)((u >> 52) & 0x7ff) - 1023 - 64;
    }
    uint64_t mb = (u & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
    double m;
    memcpy(&m, &mb, 8);
    if (m > 1.4142135623730951) { m = m * 0.5; e += 1; }
    double f = m - 1.0;
    double s = f / (2.0 + f);
    double z = s * s;
    double R = 2.0 / 21;
    R = R * z + 2.0 / 19;
    R = R * z + 2.0 / 17;
    R = R * z + 2.0 / 15;
    R = R * z + 2.0 / 13;
    R = R * z + 2.0 / 11;
    R = R * z + 2.0 / 9;
    R = R * z + 2.0 / 7;
    R = R * z + 2.0 / 5;
    R = R * z + 2.0 / 3;
    R = R * z;
    double hfsq = 0.5 * f * f;
    double logm = f - (hfsq - s * (hfsq + R));
    return (double)e * 0.6931471805599453 + logm;
}

#endif // LLMC_CANONICAL_H
