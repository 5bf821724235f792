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
   items, contiguous runs of them per thread, so a single decode row's heads spread over the
   threads too; a head's arithmetic is the same whichever run it falls in. An AVX2 build sums a
   score over 8 lanes, an AVX-512 build over 16: the two builds agree within fp32 rounding.

   Speed (measured on an AVX512-BF16 EPYC, docs/engine_speed.md): each block is widened front to
   back into an L1 tile of all its heads (the hardware prefetcher follows a straight 8 KiB read,
   not a head's strided rows); the next blocks of the table are prefetched into L2 while the
   current one is scored (blocks sit at random places in the pool); a head's D values are D/LANES
   vectors of the build's widest register (GCC vector extensions), so one source serves AVX-512
   and AVX2. */

#include <math.h>
#include <stdint.h>
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

#define MAX_CHUNKS (256 / LANES)  /* D <= 256 */
#define PREFETCH_AHEAD 2  /* blocks */

static inline vecf loadv(const void *base, int bf16, size_t at) {
    vecf f;
    if (bf16) {  /* a bf16 is the high half of the fp32 with the same value: exact widening */
        vech h;
        memcpy(&h, (const uint16_t *)base + at, sizeof h);
        vecu u = __builtin_convertvector(h, vecu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)base + at, sizeof f);
    }
    return f;
}

static inline float hsum(vecf a) {  /* a fixed pairwise tree: (16 ->) 8 -> 4 -> 1 */
#if LANES == 16
    v8f b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8f b = a;
#endif
    v4f c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* tile [rows * row_elems / LANES] <- the first `rows` rows of block `blk` (row_elems values from each row's
   offset `at0`: the heads of a run), read front to back */
static inline void load_tile(const void *cache, int bf16, int64_t blk, int64_t at0, int64_t row_elems,
                             int64_t block_stride, int64_t row_stride, int64_t rows, vecf *tile) {
    const int64_t n = row_elems / LANES;
    for (int64_t t = 0; t < rows; t++) {
        const size_t at = (size_t)(blk * block_stride + t * row_stride + at0);
        for (int64_t i = 0; i < n; i++) tile[t * n + i] = loadv(cache, bf16, at + LANES * (size_t)i);
    }
}

static inline void prefetch_block(const void *cache, int64_t blk, int64_t at0, int64_t block_stride,
                                  int64_t row_stride, int64_t rows, int64_t row_bytes, int64_t esize) {
    for (int64_t t = 0; t < rows; t++) {
        const char *base = (const char *)cache + (size_t)(blk * block_stride + t * row_stride + at0) * (size_t)esize;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(base + off, 0, 2);
    }
}

/* K/V heads [h0, h1) of one row: out's query heads [h0 * g, h1 * g) */
static inline __attribute__((always_inline)) void one_row_nc(
        const float *q, const void *ck, const void *cv, int bf16, const int64_t *table, int64_t len,
        int64_t bs, int64_t sb, int64_t sr, int64_t h0, int64_t h1, int64_t d, int64_t g, float *scores, vecf *tile,
        float *out, const int64_t nc) {
    const int64_t hk = h1 - h0, nb = (len + bs - 1) / bs, row_elems = hk * d, esize = bf16 ? 2 : 4;
    const int64_t row_bytes = row_elems * esize, at0 = h0 * d;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t b = 0; b < nb; b++) {  /* scores [H_q, len] = q K^T * scale */
        const int64_t rows = len - b * bs < bs ? len - b * bs : bs;
        if (b + PREFETCH_AHEAD < nb) prefetch_block(ck, table[b + PREFETCH_AHEAD], at0, sb, sr, bs, row_bytes, esize);
        load_tile(ck, bf16, table[b], at0, row_elems, sb, sr, rows, tile);
        for (int64_t h = 0; h < hk; h++) {
            for (int64_t gi = 0; gi < g; gi++) {
                const int64_t j = (h0 + h) * g + gi;
                vecf qv[MAX_CHUNKS];
                for (int64_t c = 0; c < nc; c++) memcpy(&qv[c], q + j * d + LANES * c, sizeof(vecf));
                for (int64_t t = 0; t < rows; t++) {
                    const vecf *k = tile + (t * hk + h) * nc;
                    vecf acc = qv[0] * k[0];
                    for (int64_t c = 1; c < nc; c++) acc += qv[c] * k[c];
                    scores[j * len + b * bs + t] = hsum(acc) * scale;
                }
            }
        }
    }
    for (int64_t j = h0 * g; j < h1 * g; j++) {  /* softmax per query head, max-subtracted */
        float *s = scores + j * len, m = s[0], total = 0.0f;
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) s[t] = expf(s[t] - m);
        for (int64_t t = 0; t < len; t++) total += s[t];
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(out + h0 * g * d, 0, (size_t)(hk * g * d) * sizeof(float));
    for (int64_t b = 0; b < nb; b++) {  /* out [H_q, D] += p [H_q, t] V [t, D] */
        const int64_t rows = len - b * bs < bs ? len - b * bs : bs;
        if (b + PREFETCH_AHEAD < nb) prefetch_block(cv, table[b + PREFETCH_AHEAD], at0, sb, sr, bs, row_bytes, esize);
        load_tile(cv, bf16, table[b], at0, row_elems, sb, sr, rows, tile);
        for (int64_t h = 0; h < hk; h++) {
            for (int64_t gi = 0; gi < g; gi++) {
                const int64_t j = (h0 + h) * g + gi;
                const float *p = scores + j * len + b * bs;
                vecf acc[MAX_CHUNKS];
                for (int64_t c = 0; c < nc; c++) memcpy(&acc[c], out + j * d + LANES * c, sizeof(vecf));
                for (int64_t t = 0; t < rows; t++) {
                    const vecf *v = tile + (t * hk + h) * nc;
                    for (int64_t c = 0; c < nc; c++) acc[c] += p[t] * v[c];
                }
                for (int64_t c = 0; c < nc; c++) memcpy(out + j * d + LANES * c, &acc[c], sizeof(vecf));
            }
        }
    }
}

/* D = 64 and 128 get their own copies so a row's D/LANES vectors stay in registers. */
static void one_row(const float *q, const void *ck, const void *cv, int bf16, const int64_t *table, int64_t len,
                    int64_t bs, int64_t sb, int64_t sr, int64_t h0, int64_t h1, int64_t d, int64_t g, float *scores,
                    vecf *tile, float *out) {
    if (d == 64) one_row_nc(q, ck, cv, bf16, table, len, bs, sb, sr, h0, h1, d, g, scores, tile, out, 64 / LANES);
    else if (d == 128) one_row_nc(q, ck, cv, bf16, table, len, bs, sb, sr, h0, h1, d, g, scores, tile, out, 128 / LANES);
    else one_row_nc(q, ck, cv, bf16, table, len, bs, sb, sr, h0, h1, d, g, scores, tile, out, d / LANES);
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
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_len));
        vecf *tile = aligned_alloc(64, sizeof(vecf) * (size_t)(block_size * num_kv_heads * head_dim / LANES));
        float *qrow = malloc(sizeof(float) * (size_t)width), *orow = malloc(sizeof(float) * (size_t)width);
        failed = scores == NULL || tile == NULL || qrow == NULL || orow == NULL;
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
            float *or = (float *)out + r * width;
            if (q_bf16) {
                const uint16_t *qh = (const uint16_t *)q + r * q_stride;
                for (int64_t i = lo; i < hi; i++) {
                    const uint32_t u = (uint32_t)qh[i] << 16;
                    memcpy(qrow + i, &u, sizeof u);
                }
                qr = qrow;
                or = orow;
            }
            one_row(qr, cache_k, cache_v, bf16, tables + r * table_stride, lens[r], block_size, block_stride,
                    row_stride, h0, h1, head_dim, g, scores, tile, or);
            if (q_bf16)
                for (int64_t i = lo; i < hi; i++) ((uint16_t *)out)[r * width + i] = to_bf16(orow[i]);
        }
        free(scores);
        free(tile);
        free(qrow);
        free(orow);
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
