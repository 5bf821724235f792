/* Decode attention read in place from the paged K/V pool; see pdserve/model/paged_decode.py.

   Layout: cache_k, cache_v [N, B, H_kv, D] (fp32, or bf16 as raw uint16 bits), a block `block_stride`
   elements after the previous one and a key row `row_stride` after the previous one (H_kv * D
   for a whole pool; a tensor-parallel rank's strided view of its heads has the whole pool's
   strides), each head's D values contiguous and adjacent heads D apart; q, out [rows, H_q, D]
   fp32; tables [rows, table_stride] int64 block ids; lens [rows] int64 visible keys (>= 1);
   D a multiple of 16 (at most 256). For one row, each query head is scored against every visible
   key of the K/V head it shares with its G = H_q / H_kv neighbours, softmaxed in fp32 and summed
   over the values. Every loop runs in an order fixed by the row's own length, so a row's bits
   never depend on the other rows of the call. Work is split over threads in (row, K/V head)
   items, contiguous runs of them per thread; a head's arithmetic is the same whichever run it
   falls in. A score sums the dimensions in pairs, odd product then even, pair p into lane
   p % LANES, then the lanes in a fixed tree (see score4): the order of vdpbf16ps, which a bf16
   query over a bf16 pool uses on an AVX512-BF16 build, so its result is the fp32 path's bit for
   bit. An AVX2 build has 8 lanes, an AVX-512 build 16: the two agree within fp32 rounding.

   Speed (measured on an AVX512-BF16 EPYC, docs/engine_speed.md §10): keys are scored 4 at a time
   straight from the pool (bf16 pairs into vdpbf16ps, or widened as odd and even halves of their
   dwords: one AND and one shift per 32 values), the 4 sums reduced together (hsum4); values are
   read the same way and summed into pair-vector accumulators held in registers for up to 4 query
   heads at a time (value_rows), interleaved back into [D] order once per row; the next blocks of
   the table are prefetched into L2 while the current one is used (blocks sit at random places in
   the pool); vectors are the build's widest register (GCC vector extensions), so one source serves
   AVX-512 and AVX2. */

#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* One vector is the widest register the build targets: 16 fp32 lanes with AVX-512, 8 without
   (an AVX2-only build given 16-lane vectors splits each into spilled halves: 6-7x slower). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vecf __attribute__((vector_size(4 * LANES)));
typedef uint32_t vecu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vech __attribute__((vector_size(2 * LANES)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Blocks ahead that the loops prefetch, a few lines at a time as they go (4 key rows per scoring step,
   one head's rows per value step): a whole block at once (128 lines) filled the miss queue and stalled
   on the prefetches themselves. 12 layers x 32 rows x 513 keys, bf16, 1 thread: 25.2 -> 15.1 ms (min),
   2 threads 17.7 -> 12.0 ms; bits unchanged. */
#define PREFETCH_AHEAD 1

static inline void prefetch_block(const void *cache, int64_t blk, int64_t at0, int64_t block_stride,
                                  int64_t row_stride, int64_t rows, int64_t row_bytes, int64_t esize) {
    for (int64_t t = 0; t < rows; t++) {
        const char *base = (const char *)cache + (size_t)(blk * block_stride + t * row_stride + at0) * (size_t)esize;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(base + off, 0, 2);
    }
}

/* Scores are D-long sums in one order on every path: the dimensions in pairs (0, 1), (2, 3), ...,
   pair p feeding lane p % LANES, each pair adding its odd product and then its even one (acc + q1
   k1, then + q0 k0: what AVX512-BF16's vdpbf16ps does per fp32 lane, as paged_prefill.c measured),
   then the LANES lanes summed in a fixed tree (hsum4). A bf16 query over a bf16 pool on an
   AVX512-BF16 build scores with vdpbf16ps straight from the pool's bf16 pairs; elsewhere the same
   order runs on widened odd and even values, so a bf16 query's result equals the fp32 path's over
   the same (widened) values bit for bit (a bf16 times a bf16 is exact in fp32). */
#define PAIRS_MAX (256 / (2 * LANES))  /* pair vectors of a head, D <= 256 */

/* the LANES dwords of pair vector c of a bf16 row of d values, zero past its end */
static inline vecu pairs_bf16(const uint16_t *row, int64_t c, int64_t d) {
    vecu u = {0};
    const int64_t left = d / 2 - c * LANES;
    if (left >= LANES) memcpy(&u, row + 2 * LANES * c, sizeof u);
    else if (left > 0) memcpy(&u, row + 2 * LANES * c, (size_t)(left & (LANES - 1)) * 4);
    return u;
}

/* odd and even values of pair vector c of a row of d values (fp32, or bf16 bits when bf16), zero past its end */
static inline void pairs_f32(const void *row, int bf16, int64_t c, int64_t d, vecf *odd, vecf *even) {
    if (bf16) {
        const vecu u = pairs_bf16(row, c, d);
        const vecu hi = u & 0xffff0000u, lo = u << 16;  /* a bf16 is the high half of the fp32 with its value */
        memcpy(odd, &hi, sizeof *odd);
        memcpy(even, &lo, sizeof *even);
        return;
    }
    vecf lo = {0}, hi = {0};  /* values [2 LANES c, 2 LANES c + LANES) and the LANES after them */
    const int64_t left = d - 2 * LANES * c;
    const float *v = (const float *)row + 2 * LANES * c;
    if (left >= 2 * LANES) {
        memcpy(&lo, v, sizeof lo);
        memcpy(&hi, v + LANES, sizeof hi);
    } else {
        memcpy(&lo, v, (size_t)(left < LANES ? left : LANES) * 4);
        if (left > LANES) memcpy(&hi, v + LANES, (size_t)(left - LANES) * 4);
    }
#if LANES == 16
    *odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
#else
    *odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
    *even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
#endif
}

/* the four sums of a, b, c, e, each over its lanes in hsum's tree: (16 ->) 8 -> 4 -> (0 + 2) + (1 + 3) */
static inline v4f hsum4(vecf a, vecf b, vecf c, vecf e) {
#if LANES == 16
    const vecf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                  + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vecf ce = __builtin_shufflevector(c, e, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                  + __builtin_shufflevector(c, e, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vecf x = __builtin_shufflevector(ab, ce, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
                 + __builtin_shufflevector(ab, ce, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vecf y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const vecf z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return __builtin_shufflevector(z, z, 0, 4, 8, 12);
#else
    const vecf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    const vecf ce = __builtin_shufflevector(c, e, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(c, e, 4, 5, 6, 7, 12, 13, 14, 15);
    const vecf y1 = ab + __builtin_shufflevector(ab, ab, 2, 3, 0, 1, 6, 7, 4, 5);
    const vecf z1 = y1 + __builtin_shufflevector(y1, y1, 1, 0, 3, 2, 5, 4, 7, 6);
    const vecf y2 = ce + __builtin_shufflevector(ce, ce, 2, 3, 0, 1, 6, 7, 4, 5);
    const vecf z2 = y2 + __builtin_shufflevector(y2, y2, 1, 0, 3, 2, 5, 4, 7, 6);
    return __builtin_shufflevector(z1, z2, 0, 4, 8, 12);
#endif
}

/* s[0 .. n) = scale * (q . key k) for the keys at kp[0 .. 4) (n < 4: the last 4 - n are repeats, not stored); query j
   as pair vectors: its bf16 dwords qh (dot-product path) or odd / even fp32 values qo, qe */
static inline __attribute__((always_inline)) void score4(
        const void *const *kp, int n, int bf16, int dp, const uint16_t *qh, const vecf *qo, const vecf *qe,
        int64_t d, int64_t np, float scale, float *s) {
    vecf acc[4] = {{0}, {0}, {0}, {0}};
#if HAVE_DPBF16
    if (dp) {
#pragma GCC unroll 8
        for (int64_t c = 0; c < np; c++) {
            const vecu qu = pairs_bf16(qh, c, d);
            __m512bh qv;
            memcpy(&qv, &qu, sizeof qv);
            for (int k = 0; k < 4; k++) {
                const vecu ku = pairs_bf16(kp[k], c, d);
                __m512bh kv;
                memcpy(&kv, &ku, sizeof kv);
                acc[k] = (vecf)_mm512_dpbf16_ps((__m512)acc[k], kv, qv);
            }
        }
    } else
#endif
    {
        (void)dp, (void)qh;
#pragma GCC unroll 8
        for (int64_t c = 0; c < np; c++)
            for (int k = 0; k < 4; k++) {
                vecf ko, ke;
                pairs_f32(kp[k], bf16, c, d, &ko, &ke);
                acc[k] = acc[k] + qo[c] * ko;
                acc[k] = acc[k] + qe[c] * ke;
            }
    }
    const v4f sum = hsum4(acc[0], acc[1], acc[2], acc[3]) * scale;
    if (n == 4) memcpy(s, &sum, sizeof sum);
    else for (int k = 0; k < n; k++) s[k] = sum[k];
}

/* acc[gi] (query gi's output as pair vectors: odd values [0, np), even [np, 2 np)) += p[gi][t] * V row t, for the
   block's `rows` value rows of one head from vr (a row sr elements after the previous), t in order; one copy per
   bound on np (NPMAX), so the accumulators of D = 64 stay in registers */
#define VALUE_ROWS(name, NPMAX)                                                                                   \
    static inline __attribute__((always_inline)) void name(                                                    \
            const void *vr, int64_t sr, int bf16, int64_t rows, const float *const *p, vecf *const *acc_out,     \
            int64_t d, int64_t np, const int G) {                                                               \
        vecf acc[4][2 * NPMAX];                                                                                 \
        for (int gi = 0; gi < G; gi++)                                                                          \
            _Pragma("GCC unroll 16") for (int64_t c = 0; c < 2 * np; c++) acc[gi][c] = acc_out[gi][c];          \
        const int64_t esize = bf16 ? 2 : 4;                                                                     \
        for (int64_t t = 0; t < rows; t++) {                                                                    \
            const char *row = (const char *)vr + (size_t)(t * sr * esize);                                      \
            _Pragma("GCC unroll 8") for (int64_t c = 0; c < np; c++) {                                          \
                vecf vo, ve;                                                                                    \
                pairs_f32(row, bf16, c, d, &vo, &ve);                                                           \
                for (int gi = 0; gi < G; gi++) {                                                                \
                    acc[gi][c] += p[gi][t] * vo;                                                                \
                    acc[gi][np + c] += p[gi][t] * ve;                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int gi = 0; gi < G; gi++)                                                                          \
            _Pragma("GCC unroll 16") for (int64_t c = 0; c < 2 * np; c++) acc_out[gi][c] = acc[gi][c];          \
    }
VALUE_ROWS(value_rows_2, 2)
VALUE_ROWS(value_rows_4, 4)
VALUE_ROWS(value_rows_n, PAIRS_MAX)

static inline __attribute__((always_inline)) void value_rows(
        const void *vr, int64_t sr, int bf16, int64_t rows, const float *const *p, vecf *const *acc_out, int64_t d,
        int64_t np, const int G) {
    if (np == 2 && bf16) value_rows_2(vr, sr, 1, rows, p, acc_out, d, 2, G);
    else if (np == 2) value_rows_2(vr, sr, 0, rows, p, acc_out, d, 2, G);
    else if (np == 4 && bf16) value_rows_4(vr, sr, 1, rows, p, acc_out, d, 4, G);
    else if (np == 4) value_rows_4(vr, sr, 0, rows, p, acc_out, d, 4, G);
    else value_rows_n(vr, sr, bf16, rows, p, acc_out, d, np, G);
}

/* K/V heads [h0, h1) of one row: out's query heads [h0 * g, h1 * g); q the fp32 query, qh its bf16 bits (dp: scores
   by vdpbf16ps), qpe scratch for its pair vectors */
static inline __attribute__((always_inline)) void one_row_nc(
        const float *q, const uint16_t *qh, int dp, const void *ck, const void *cv, int bf16, const int64_t *table,
        int64_t len, int64_t bs, int64_t sb, int64_t sr, int64_t h0, int64_t h1, int64_t d, int64_t g, float *scores,
        vecf *qpe, vecf *oacc, float *out, const int64_t np) {
    const int64_t hk = h1 - h0, nb = (len + bs - 1) / bs, row_elems = hk * d, esize = bf16 ? 2 : 4;
    const int64_t row_bytes = row_elems * esize, at0 = h0 * d;
    const float scale = 1.0f / sqrtf((float)d);
    if (!dp)
        for (int64_t j = h0 * g; j < h1 * g; j++)
            for (int64_t c = 0; c < np; c++) pairs_f32(q + j * d, 0, c, d, &qpe[2 * j * np + c], &qpe[(2 * j + 1) * np + c]);
    for (int64_t b = 0; b < nb; b++) {  /* scores [H_q, len] = q K^T * scale, 4 keys at a time */
        const int64_t rows = len - b * bs < bs ? len - b * bs : bs;
        const size_t base = (size_t)(table[b] * sb + at0);
        for (int64_t t = 0; t < rows; t += 4) {
            if (b + PREFETCH_AHEAD < nb)  /* the same 4 rows of a later block: the prefetches spread over the loop */
                prefetch_block(ck, table[b + PREFETCH_AHEAD], at0 + t * sr, sb, sr, 4, row_bytes, esize);
            const int n = rows - t < 4 ? (int)(rows - t) : 4;
            for (int64_t h = 0; h < hk; h++) {
                const void *kp[4];
                for (int k = 0; k < 4; k++)
                    kp[k] = (const char *)ck + (base + (size_t)((t + (k < n ? k : 0)) * sr + h * d)) * (size_t)esize;
                for (int64_t gi = 0; gi < g; gi++) {
                    const int64_t j = (h0 + h) * g + gi;
                    score4(kp, n, bf16, dp, qh + j * d, qpe + 2 * j * np, qpe + (2 * j + 1) * np, d, np, scale,
                           scores + j * len + b * bs + t);
                }
            }
        }
    }
    for (int64_t j = h0 * g; j < h1 * g; j++) {  /* softmax per query head, max-subtracted */
        float *s = scores + j * len, m = s[0];
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) s[t] = expf(s[t] - m);
        vecf lanes = {0};  /* the sum over LANES lanes, then hsum's tree */
        int64_t t = 0;
        for (; t + LANES <= len; t += LANES) {
            vecf v;
            memcpy(&v, s + t, sizeof v);
            lanes += v;
        }
        for (int64_t l = 0; t < len; t++, l++) lanes[l] += s[t];
        const float inv = 1.0f / hsum4(lanes, lanes, lanes, lanes)[0];
        for (t = 0; t < len; t++) s[t] *= inv;
    }
    /* out [H_q, D] = p [H_q, t] V [t, D]: each value summed over the keys in order, into pair vectors oacc [H_q][2 np] */
    memset(oacc + 2 * h0 * g * np, 0, sizeof(vecf) * (size_t)(2 * hk * g * np));
    const int qc = LANES == 16 ? (np <= 2 ? 4 : np <= 4 ? 2 : 1) : (np <= 2 ? 2 : 1);  /* queries per pass */
    for (int64_t b = 0; b < nb; b++) {
        const int64_t rows = len - b * bs < bs ? len - b * bs : bs;
        for (int64_t h = 0; h < hk; h++) {
            if (b + PREFETCH_AHEAD < nb)  /* head h's rows of the next block */
                prefetch_block(cv, table[b + PREFETCH_AHEAD], at0 + h * d, sb, sr, bs, d * esize, esize);
            const void *vr = (const char *)cv + (size_t)(table[b] * sb + at0 + h * d) * (size_t)esize;
            for (int64_t g0 = 0; g0 < g; g0 += qc) {
                const float *p[4];
                vecf *acc[4];
                const int n = g - g0 < qc ? (int)(g - g0) : qc;
                for (int k = 0; k < n; k++) {
                    const int64_t j = (h0 + h) * g + g0 + k;
                    p[k] = scores + j * len + b * bs;
                    acc[k] = oacc + 2 * j * np;
                }
                if (n == 4) value_rows(vr, sr, bf16, rows, p, acc, d, np, 4);
                else if (n == 3) value_rows(vr, sr, bf16, rows, p, acc, d, np, 3);
                else if (n == 2) value_rows(vr, sr, bf16, rows, p, acc, d, np, 2);
                else value_rows(vr, sr, bf16, rows, p, acc, d, np, 1);
            }
        }
    }
    for (int64_t j = h0 * g; j < h1 * g; j++)
        for (int64_t c = 0; c < np; c++)
            for (int l = 0; l < LANES && 2 * (LANES * c + l) < d; l++) {
                out[j * d + 2 * (LANES * c + l) + 1] = oacc[2 * j * np + c][l];
                out[j * d + 2 * (LANES * c + l)] = oacc[2 * j * np + np + c][l];
            }
}

/* D = 64 and 128 get their own copies so a row's vectors stay in registers. */
static void one_row(const float *q, const uint16_t *qh, int dp, const void *ck, const void *cv, int bf16,
                    const int64_t *table, int64_t len, int64_t bs, int64_t sb, int64_t sr, int64_t h0, int64_t h1,
                    int64_t d, int64_t g, float *scores, vecf *qpe, vecf *oacc, float *out) {
    if (d == 64)
        one_row_nc(q, qh, dp, ck, cv, bf16, table, len, bs, sb, sr, h0, h1, 64, g, scores, qpe, oacc, out, 64 / (2 * LANES));
    else if (d == 128)
        one_row_nc(q, qh, dp, ck, cv, bf16, table, len, bs, sb, sr, h0, h1, 128, g, scores, qpe, oacc, out,
                   128 / (2 * LANES));
    else
        one_row_nc(q, qh, dp, ck, cv, bf16, table, len, bs, sb, sr, h0, h1, d, g, scores, qpe, oacc, out,
                   (d + 2 * LANES - 1) / (2 * LANES));
}

/* fp32 -> bf16 bits, round to nearest even, NaN to 0x7fc0: torch's conversion (integer arithmetic,
   so -ffast-math cannot change it) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows [start, stop) of the call, split over `threads` OpenMP threads when built with -fopenmp
   (each row is one thread's alone, so a row's bits do not depend on the split); q and out are
   fp32, or bf16 bits when q_bf16, query row r at q + r * q_stride (widened exactly on the way in, rounded to nearest even on the
   way out: the fp32 query's result rounded). Returns 0, -1 when scratch cannot be allocated, -2
   for a D that is not a multiple of 16 or above 256. */
int paged_decode(const void *q, int64_t q_stride, int q_bf16, const void *cache_k, const void *cache_v, int bf16,
                 const int64_t *tables, int64_t table_stride, const int64_t *lens, void *out,
                 int64_t start, int64_t stop, int64_t max_len,
                 int64_t block_size, int64_t block_stride, int64_t row_stride,
                 int64_t num_kv_heads, int64_t head_dim, int64_t num_q_heads, int threads) {
    if (head_dim % 16 != 0 || head_dim > 256) return -2;
    const int64_t g = num_q_heads / num_kv_heads, width = num_q_heads * head_dim;
    const int dp = HAVE_DPBF16 && q_bf16 && bf16;  /* scores by vdpbf16ps from the bf16 query and pool */
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_len));
        const size_t pair_vecs = (size_t)(2 * num_q_heads * ((head_dim + 2 * LANES - 1) / (2 * LANES)));
        float *qrow = malloc(sizeof(float) * (size_t)width), *orow = malloc(sizeof(float) * (size_t)width);
        vecf *qpe = aligned_alloc(64, sizeof(vecf) * pair_vecs), *oacc = aligned_alloc(64, sizeof(vecf) * pair_vecs);
        failed = scores == NULL || qrow == NULL || orow == NULL || qpe == NULL || oacc == NULL;
        int nt = 1, id = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        id = omp_get_thread_num();
#endif
        /* contiguous cuts of the (row, K/V head) items, without depending on the runtime's schedule */
        const int64_t hk = num_kv_heads, items = (stop - start) * hk;
        const int64_t first = items * id / nt, last = items * (id + 1) / nt;
        for (int64_t it = first; it < last && !failed;) {
            const int64_t r = start + it / hk, h0 = it % hk, h1 = last - (it - h0) < hk ? last - (it - h0) : hk;
            const int64_t lo = h0 * g * head_dim, hi = h1 * g * head_dim;  /* this run's query values */
            it += h1 - h0;
            const float *qr = (const float *)q + r * q_stride;
            const uint16_t *qh = (const uint16_t *)q + r * q_stride;
            float *or = (float *)out + r * width;
            if (q_bf16) {
                if (!dp)
                    for (int64_t i = lo; i < hi; i++) {
                        const uint32_t u = (uint32_t)qh[i] << 16;
                        memcpy(qrow + i, &u, sizeof u);
                    }
                qr = qrow;
                or = orow;
            }
            one_row(qr, qh, dp, cache_k, cache_v, bf16, tables + r * table_stride, lens[r], block_size, block_stride,
                    row_stride, h0, h1, head_dim, g, scores, qpe, oacc, or);
            if (q_bf16)
                for (int64_t i = lo; i < hi; i++) ((uint16_t *)out)[r * width + i] = to_bf16(orow[i]);
        }
        free(scores);
        free(oacc);
        free(qrow);
        free(orow);
        free(qpe);
    }
    return failed ? -1 : 0;
}

/* 1 when rows are split over OpenMP threads inside the call (built with -fopenmp), else 0. */
int paged_decode_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
