/* Causal prefill attention over the paged K/V pool; see pdserve/model/paged_prefill.py.

   Layout: q [S, H_q, D] fp32 or bf16 (the chunk's S new rows, at positions ctx - S .. ctx - 1; row r at
   q + r * q_stride, its heads D apart); cache_k,
   cache_v [N, B, H_kv, D] (fp32, or bf16 as raw uint16 bits), a block `block_stride` elements
   after the previous one and a key row `row_stride` after the previous one, each head's D values
   contiguous and adjacent heads D apart; table [ceil(ctx / B)] int64 block ids; out [S, H_q, D]
   fp32. D a multiple of 16, at most 256.

   Scores are D-long sums in a fixed order, the same on every path: the dimensions in pairs (0, 1),
   (2, 3), ..., each pair adding its odd product and then its even one (acc + q1 k1, then + q0 k0),
   which is what AVX512-BF16's vdpbf16ps does per fp32 lane (measured bit for bit against two fmaf
   on an EPYC; a bf16 times a bf16 is exact in fp32, so each step rounds once). With a bf16 query,
   a bf16 pool and a build for a CPU with AVX512-BF16, K tiles are kept as bf16 pairs
   ([H_kv][ctx16 / 16][D / 2][16] dwords) and scored with vdpbf16ps, 32 products per instruction;
   elsewhere the same order runs in fp32 FMAs over widened values, so a bf16 query's result equals
   the fp32 path's over the same (widened) values bit for bit. Built with -fno-associative-math
   (model/ckernel.py) so the compiler keeps every sum in the order written; the softmax's sum runs
   over 16 lanes then a fixed tree.

   Phase 1 widens the ctx visible keys of every K/V head once into fp32 scratch: K transposed in
   tiles of 16 keys ([H_kv][ctx16 / 16][D][16], a tile's 4 KiB contiguous: a [D][ctx16] layout put
   a tile's D rows 4 * ctx16 bytes apart, into the same few L1 sets) and V as rows
   ([H_kv][ctx16][D]), zero past ctx.
   Phase 2 takes work items (K/V head, block of QB query rows): the G query heads of the head and
   QB rows give M = G * QB query vectors, scored 16 keys at a time (8 queries per pass, so a key
   vector is loaded once per 8 queries), softmaxed per row in fp32 over exactly its visible keys
   (positions 0 .. its own), and summed over V rows 16 keys at a time (6 queries per pass at
   D = 64: 24 accumulators, each V vector loaded once per 6 queries; measured, 1 thread, 512
   rows: 4 queries per pass 7.9 ms a layer, 6: 6.6 ms; 32 keys x 6 queries per scoring pass was
   slower than 16 x 8, 7.6 vs 6.2 ms). A row's arithmetic is fixed
   by its position and its own keys: scores are D-long sums in index order, the softmax runs over
   the row's own key count, and the value sum runs over keys in position order, where keys the
   row must not see enter with weight exactly 0 (p = 0 times a finite V adds +-0). So a row's bits
   do not depend on the other rows of its item, how the prompt was chunked, the thread count or
   how items were shared among threads.

   AVX2 builds (no AVX-512: 16 ymm registers where the passes above are sized for 32) run both passes
   through their own intrinsics (AVX2_PASSES): 4 queries x 16 keys per scoring pass, 6 queries x 16 D
   values per value pass over up to 64 keys; each score and each output value gets the same fused
   multiply-adds in the same order as on the other paths, so the blocking changes no bit (the same
   build's output before this blocking, bit for bit over 480 cases of D 16..256, GQA 1..4, fp32/bf16
   pools and queries); they differ from an AVX-512 build's only by libmvec's expf per width. One layer,
   512 rows, GQA 3, D 64, bf16 pool, 1 thread, CPU time: x86-64-v3 19.6 -> 7.1 ms, native 5.5 ms. */

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_PASSES 1  /* passes of their own, sized for AVX2's 16 ymm registers (below) */
#else
#define AVX2_PASSES 0
#endif
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* 16 fp32 lanes (16 keys of a tile, or 16 of a head's D values): one register with AVX-512; on other
   builds (those without AVX2 + FMA: AVX2 builds take the AVX2_PASSES below) two 8-lane halves, each
   operation done half by half, since GCC lowered a scalar times a 64-byte vector through the stack
   where the widest register is 32 bytes (a store-forwarding stall per product: 10x slower). Every
   lane computes the same operations in the same order either way. */
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
static inline v16 v16_zero(void) { return (v16){0}; }
static inline v16 v16_mac(v16 acc, float w, v16 v) { return acc + w * v; }
static inline v16 v16_scale(v16 a, float w) { return a * w; }
#else
typedef float v8f __attribute__((vector_size(32)));
typedef struct { v8f lo, hi; } v16;
static inline v16 v16_zero(void) { return (v16){{0}, {0}}; }
static inline v16 v16_mac(v16 acc, float w, v16 v) { acc.lo += w * v.lo; acc.hi += w * v.hi; return acc; }
static inline v16 v16_scale(v16 a, float w) { a.lo *= w; a.hi *= w; return a; }
#endif

#define QB 16        /* query rows per work item */
#define QK_ROWS 8    /* query vectors scored together */
#define MAX_NC 16    /* D <= 256 */

static inline float widen(const void *base, int bf16, size_t at) {
    if (bf16) {  /* a bf16 is the high half of the fp32 with the same value: exact */
        uint32_t u = (uint32_t)((const uint16_t *)base)[at] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)base)[at];
}

/* vr [ctx16][D] of K/V head h <- keys [t0, t0 + 16), zeros past ctx; and K: kt [ctx16 / 16][D][16] fp32,
   or with kb (bf16 pool, bf16 scoring) kb [ctx16 / 16][D / 2][16] dwords, each the key's bf16 pair */
static void widen_tile(const void *ck, const void *cv, int bf16, const int64_t *table, int64_t ctx, int64_t bs,
                       int64_t sb, int64_t sr, int64_t d, int64_t h, int64_t ctx16, int64_t t0, float *kt, float *vr,
                       uint32_t *kb) {
    for (int64_t t = t0; t < t0 + 16; t++) {
        if (t < ctx) {
            const size_t at = (size_t)(table[t / bs] * sb + (t % bs) * sr + h * d);
            for (int64_t i = 0; i < d; i++) vr[t * d + i] = widen(cv, bf16, at + i);
            if (kb != NULL)
                for (int64_t p = 0; p < d / 2; p++)
                    memcpy(kb + t0 * d / 2 + p * 16 + (t - t0), (const uint16_t *)ck + at + 2 * p, sizeof(uint32_t));
            else
                for (int64_t i = 0; i < d; i++) kt[t0 * d + i * 16 + (t - t0)] = widen(ck, bf16, at + i);
        } else {
            memset(vr + t * d, 0, sizeof(float) * (size_t)d);
            if (kb != NULL)
                for (int64_t p = 0; p < d / 2; p++) kb[t0 * d / 2 + p * 16 + (t - t0)] = 0;
            else
                for (int64_t i = 0; i < d; i++) kt[t0 * d + i * 16 + (t - t0)] = 0.0f;
        }
    }
}

/* s[r][t0 .. t0 + 16) = scale * qm[r] . k[t] for r < R (R a constant after inlining), in pair order */
static inline __attribute__((always_inline)) void score_tile(const float *qm, const float *kt, int64_t d, int64_t ctx16,
                                                             int64_t t0, float scale, float *s, int64_t lds,
                                                             const int R) {
    v16 acc[QK_ROWS];
    for (int r = 0; r < R; r++) acc[r] = v16_zero();
    for (int64_t i = 0; i < d; i += 2) {
        v16 k0, k1;
        memcpy(&k0, kt + t0 * d + i * 16, sizeof k0);
        memcpy(&k1, kt + t0 * d + (i + 1) * 16, sizeof k1);
        for (int r = 0; r < R; r++) acc[r] = v16_mac(acc[r], qm[r * d + i + 1], k1);
        for (int r = 0; r < R; r++) acc[r] = v16_mac(acc[r], qm[r * d + i], k0);
    }
    for (int r = 0; r < R; r++) {
        acc[r] = v16_scale(acc[r], scale);
        memcpy(s + r * lds + t0, &acc[r], sizeof(v16));
    }
}

#if HAVE_DPBF16
/* score_tile over bf16 pairs: qp [R][D / 2] dwords (a query's bf16 pairs), kb as widen_tile writes it */
static inline __attribute__((always_inline)) void score_tile_bf16(const uint32_t *qp, const uint32_t *kb, int64_t d,
                                                                  int64_t t0, float scale, float *s, int64_t lds,
                                                                  const int R) {
    __m512 acc[QK_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; p++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + t0 * d / 2 + p * 16);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], k, (__m512bh)_mm512_set1_epi32((int)qp[r * d / 2 + p]));
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(s + r * lds + t0, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
}
#endif

/* o[r] += sum over t in [t0, t0 + 16) of p[r][t] * v[t], for r < R, D = 16 * NC */
static inline __attribute__((always_inline)) void value_tile(const float *p, int64_t lds, const float *vr, int64_t t0,
                                                             float *o, const int R, const int64_t nc) {
    v16 acc[6][MAX_NC];
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < nc; c++) memcpy(&acc[r][c], o + (r * nc + c) * 16, sizeof(v16));
    for (int64_t t = t0; t < t0 + 16; t++) {
        v16 v[MAX_NC];
        for (int64_t c = 0; c < nc; c++) memcpy(&v[c], vr + t * nc * 16 + c * 16, sizeof(v16));
        for (int r = 0; r < R; r++) {
            const float w = p[r * lds + t];
            for (int64_t c = 0; c < nc; c++) acc[r][c] = v16_mac(acc[r][c], w, v[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < nc; c++) memcpy(o + (r * nc + c) * 16, &acc[r][c], sizeof(v16));
}

static inline __attribute__((always_inline)) void values(const float *p, int64_t lds, const float *vr,
                                                         int64_t tiles, float *o, int64_t m, const int64_t nc) {
    const int R = nc <= 4 ? 6 : nc <= 8 ? 2 : 1;
    memset(o, 0, sizeof(float) * (size_t)(m * nc * 16));
    for (int64_t tile = 0; tile < tiles; tile++) {
        int64_t r = 0;
        for (; r + R <= m; r += R) value_tile(p + r * lds, lds, vr, tile * 16, o + r * nc * 16, R, nc);
        for (; r < m; r++) value_tile(p + r * lds, lds, vr, tile * 16, o + r * nc * 16, 1, nc);
    }
}

#if AVX2_PASSES
/* AVX2 builds (16 ymm registers; the passes above want 32): the same fused multiply-adds in the same
   order per score and per output value, blocked to fit. A 16-key tile is two 8-lane halves; scoring
   takes SCORE_ROWS_Y queries per pass (8 accumulators + 4 key vectors); the value sum takes
   VALUE_ROWS_Y queries x 16 of the D values per pass (12 accumulators + 2 V vectors) over up to
   VALUE_KEYS_Y keys (a 16 KiB V block at D = 64, kept in L1 while the item's row groups pass over it). */
#define SCORE_ROWS_Y 4
#define VALUE_ROWS_Y 6
#define VALUE_KEYS_Y 64

static inline __attribute__((always_inline)) void score_tile_y(const float *qm, const float *kt, int64_t d, int64_t t0,
                                                               float scale, float *s, int64_t lds, const int R) {
    __m256 lo[SCORE_ROWS_Y], hi[SCORE_ROWS_Y];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    const float *k = kt + t0 * d;
    for (int64_t i = 0; i < d; i += 2, k += 32) {
        const __m256 k0l = _mm256_loadu_ps(k), k0h = _mm256_loadu_ps(k + 8);
        const __m256 k1l = _mm256_loadu_ps(k + 16), k1h = _mm256_loadu_ps(k + 24);
        for (int r = 0; r < R; r++) {
            const __m256 w = _mm256_broadcast_ss(qm + r * d + i + 1);
            lo[r] = _mm256_fmadd_ps(w, k1l, lo[r]);
            hi[r] = _mm256_fmadd_ps(w, k1h, hi[r]);
        }
        for (int r = 0; r < R; r++) {
            const __m256 w = _mm256_broadcast_ss(qm + r * d + i);
            lo[r] = _mm256_fmadd_ps(w, k0l, lo[r]);
            hi[r] = _mm256_fmadd_ps(w, k0h, hi[r]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(s + r * lds + t0, _mm256_mul_ps(lo[r], sc));
        _mm256_storeu_ps(s + r * lds + t0 + 8, _mm256_mul_ps(hi[r], sc));
    }
}

/* o[r][c0 .. c0 + 16) += sum over t in [t0, t1) of p[r][t] * v[t][c0 .. c0 + 16), for r < R, t in order */
static inline __attribute__((always_inline)) void value_run_y(const float *p, int64_t lds, const float *vr, int64_t d,
                                                              int64_t t0, int64_t t1, float *o, int64_t c0,
                                                              const int R) {
    __m256 lo[VALUE_ROWS_Y], hi[VALUE_ROWS_Y];
    for (int r = 0; r < R; r++) {
        lo[r] = _mm256_loadu_ps(o + r * d + c0);
        hi[r] = _mm256_loadu_ps(o + r * d + c0 + 8);
    }
    for (int64_t t = t0; t < t1; t++) {
        const __m256 vl = _mm256_loadu_ps(vr + t * d + c0), vh = _mm256_loadu_ps(vr + t * d + c0 + 8);
        for (int r = 0; r < R; r++) {
            const __m256 w = _mm256_broadcast_ss(p + r * lds + t);
            lo[r] = _mm256_fmadd_ps(w, vl, lo[r]);
            hi[r] = _mm256_fmadd_ps(w, vh, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(o + r * d + c0, lo[r]);
        _mm256_storeu_ps(o + r * d + c0 + 8, hi[r]);
    }
}

static void values_y(const float *p, int64_t lds, const float *vr, float *o, int64_t m, int64_t d) {
    memset(o, 0, sizeof(float) * (size_t)(m * d));
    for (int64_t t0 = 0; t0 < lds; t0 += VALUE_KEYS_Y) {
        const int64_t t1 = t0 + VALUE_KEYS_Y < lds ? t0 + VALUE_KEYS_Y : lds;
        int64_t r = 0;
        for (; r + VALUE_ROWS_Y <= m; r += VALUE_ROWS_Y)
            for (int64_t c0 = 0; c0 < d; c0 += 16)
                value_run_y(p + r * lds, lds, vr, d, t0, t1, o + r * d, c0, VALUE_ROWS_Y);
        for (; r < m; r++)
            for (int64_t c0 = 0; c0 < d; c0 += 16) value_run_y(p + r * lds, lds, vr, d, t0, t1, o + r * d, c0, 1);
    }
}
#endif

/* 16 lanes, lane l over t = l, l + 16, ... in order, then a fixed pairwise tree */
static float lane_sum(const float *x, int64_t n) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += x[i + l];
    for (int l = 0; i < n; i++, l++) lane[l] += x[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

static float lane_max(const float *x, int64_t n) {  /* exact in any order */
    float lane[16];
    for (int l = 0; l < 16; l++) lane[l] = x[0];
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] = x[i + l] > lane[l] ? x[i + l] : lane[l];
    for (int l = 0; i < n; i++, l++) lane[l] = x[i] > lane[l] ? x[i] : lane[l];
    float m = lane[0];
    for (int l = 1; l < 16; l++) m = lane[l] > m ? lane[l] : m;
    return m;
}

/* softmax of row r's first `vis` scores in place; weights of later keys (up to lds) set to 0 */
static void softmax_row(float *s, int64_t vis, int64_t lds) {
    const float m = lane_max(s, vis);
    for (int64_t t = 0; t < vis; t++) s[t] = expf(s[t] - m);
    const float inv = 1.0f / lane_sum(s, vis);
    for (int64_t t = 0; t < vis; t++) s[t] *= inv;
    for (int64_t t = vis; t < lds; t++) s[t] = 0.0f;
}

/* scores s [m][lds] of the item's m query vectors (qm fp32 [m][D], or bf16 pairs when kb) */
static void scores(const float *qm, const float *kt, const uint32_t *kb, int64_t m, int64_t tiles, int64_t lds,
                   int64_t d, int64_t ctx16, float scale, float *s) {
    for (int64_t tile = 0; tile < tiles; tile++) {
        int64_t i = 0;
#if HAVE_DPBF16
        if (kb != NULL) {
            const uint32_t *qp = (const uint32_t *)qm;
            for (; i + QK_ROWS <= m; i += QK_ROWS)
                score_tile_bf16(qp + i * d / 2, kb, d, tile * 16, scale, s + i * lds, lds, QK_ROWS);
            for (; i < m; i++) score_tile_bf16(qp + i * d / 2, kb, d, tile * 16, scale, s + i * lds, lds, 1);
            continue;
        }
#endif
#if AVX2_PASSES
        for (; i + SCORE_ROWS_Y <= m; i += SCORE_ROWS_Y)
            score_tile_y(qm + i * d, kt, d, tile * 16, scale, s + i * lds, lds, SCORE_ROWS_Y);
        for (; i < m; i++) score_tile_y(qm + i * d, kt, d, tile * 16, scale, s + i * lds, lds, 1);
#else
        for (; i + QK_ROWS <= m; i += QK_ROWS)
            score_tile(qm + i * d, kt, d, ctx16, tile * 16, scale, s + i * lds, lds, QK_ROWS);
        for (; i < m; i++) score_tile(qm + i * d, kt, d, ctx16, tile * 16, scale, s + i * lds, lds, 1);
#endif
    }
}

/* One work item: K/V head h, query rows [r0, r1) of the chunk. qm: fp32 query vectors, or (kb) their
   raw bf16 values. */
static void item(const void *q, int q_bf16, int64_t qs, const float *kt, const uint32_t *kb, const float *vr,
                 float *out, int64_t r0, int64_t r1, int64_t offset, int64_t h, int64_t g, int64_t hq, int64_t d,
                 int64_t ctx16, float *qm, float *s, float *o) {
    const int64_t m = (r1 - r0) * g, tiles = (offset + r1 + 15) / 16, lds = tiles * 16;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t i = 0; i < m; i++) {  /* query vector i: row r0 + i / g, query head h * g + i % g */
        const size_t at = (size_t)((r0 + i / g) * qs + (h * g + i % g) * d);
        if (kb != NULL) memcpy((uint16_t *)qm + i * d, (const uint16_t *)q + at, sizeof(uint16_t) * (size_t)d);
        else
            for (int64_t j = 0; j < d; j++) qm[i * d + j] = widen(q, q_bf16, at + (size_t)j);
    }
    scores(qm, kt, kb, m, tiles, lds, d, ctx16, scale, s);
    for (int64_t i = 0; i < m; i++) softmax_row(s + i * lds, offset + r0 + i / g + 1, lds);
#if AVX2_PASSES
    values_y(s, lds, vr, o, m, d);
#else
    if (d == 64) values(s, lds, vr, tiles, o, m, 4);
    else if (d == 128) values(s, lds, vr, tiles, o, m, 8);
    else values(s, lds, vr, tiles, o, m, d / 16);
#endif
    for (int64_t i = 0; i < m; i++)
        memcpy(out + ((r0 + i / g) * hq + h * g + i % g) * d, o + i * d, sizeof(float) * (size_t)d);
}

/* Returns 0, -1 when scratch cannot be allocated, -2 for a D that is not a multiple of 16 or above 256. */
int paged_prefill(const void *q, int q_bf16, int64_t q_stride, const void *cache_k, const void *cache_v, int bf16,
                  const int64_t *table, int64_t q_len, int64_t ctx, float *out, int64_t block_size,
                  int64_t block_stride, int64_t row_stride, int64_t num_kv_heads, int64_t head_dim,
                  int64_t num_q_heads, int threads) {
    const int64_t d = head_dim, hk = num_kv_heads, g = num_q_heads / num_kv_heads;
    if (d % 16 != 0 || d > 16 * MAX_NC) return -2;
    const int64_t ctx16 = (ctx + 15) / 16 * 16, tiles = ctx16 / 16, offset = ctx - q_len;
    const int64_t blocks = (q_len + QB - 1) / QB, items = blocks * hk;
    const int pairs = HAVE_DPBF16 && bf16 && q_bf16;  /* score with vdpbf16ps over bf16 pairs */
    float *kt = pairs ? NULL : malloc(sizeof(float) * (size_t)(hk * d * ctx16));
    uint32_t *kb = pairs ? malloc(sizeof(uint32_t) * (size_t)(hk * d / 2 * ctx16)) : NULL;
    float *vr = malloc(sizeof(float) * (size_t)(hk * ctx16 * d));
    if ((kt == NULL && kb == NULL) || vr == NULL) {
        free(kt);
        free(kb);
        free(vr);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < hk * tiles; w++)
            widen_tile(cache_k, cache_v, bf16, table, ctx, block_size, block_stride, row_stride, d, w / tiles, ctx16,
                       (w % tiles) * 16, pairs ? NULL : kt + (w / tiles) * d * ctx16, vr + (w / tiles) * ctx16 * d,
                       pairs ? kb + (w / tiles) * d / 2 * ctx16 : NULL);
        float *qm = malloc(sizeof(float) * (size_t)(QB * g * d));
        float *s = malloc(sizeof(float) * (size_t)(QB * g * ctx16));
        float *o = malloc(sizeof(float) * (size_t)(QB * g * d));
        failed = qm == NULL || s == NULL || o == NULL;
        /* the last row blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (failed) continue;
            const int64_t b = blocks - 1 - w / hk, h = w % hk;
            const int64_t r0 = b * QB, r1 = r0 + QB < q_len ? r0 + QB : q_len;
            item(q, q_bf16, q_stride, pairs ? NULL : kt + h * d * ctx16, pairs ? kb + h * d / 2 * ctx16 : NULL,
                 vr + h * ctx16 * d, out, r0, r1, offset, h, g, num_q_heads, d, ctx16, qm, s, o);
        }
        free(qm);
        free(s);
        free(o);
    }
    free(kt);
    free(kb);
    free(vr);
    return failed ? -1 : 0;
}
