/* bf16 x bf16 -> fp32-accumulated products for CPUs without bf16 dot products; see
   pdserve/model/bf16_gemm.py.

   out [rows, n] = round_bf16(x [rows, k] . w [n, k]^T), x and out bf16 as raw uint16 bits at their
   row strides; w packed once at load into panels of PANEL = 16 output columns, panel p holding
   [k][16] values with columns (0, 8, 1, 9, ..., 7, 15) in that order, so one 32-byte load widens
   into columns 0-7 (each 32-bit pair shifted left 16) and 8-15 (each pair's high half kept), no
   shuffle; n is padded with zero columns to whole panels.

   Summation order (the contract): every output element is one fused multiply-add chain over
   i = 0, 1, ..., k-1, acc = fma(x[r][i], w[c][i], acc) from acc = 0, then rounded once to bf16
   (nearest even, NaN kept). Nothing else touches it: which micro-block computes an element (how
   many rows or panels it shares registers with), which thread runs it, and the instruction set
   (AVX2 and AVX-512 builds run the same 8-lane code; a build without AVX2+FMA runs fmaf in the same
   order) change no bit, so a row's result depends on the row and the weight alone. -ffast-math
   cannot reorder a chain: the fused multiply-adds are intrinsics (or fmaf) whose accumulator is a
   column's own, never a reduction the compiler could split.

   Speed: x is widened to fp32 once per call. Work units are groups of GROUP panels (64 columns),
   split statically over OpenMP threads. Within a unit each panel runs its full 6-row blocks
   (12 accumulators + 2 weight vectors + 1 broadcast + the widening mask: AVX2's 16 ymm, no spill),
   the panel staying in L1/L2 across row blocks; the last rows % 6 rows run across several panels
   at once (1 row x 4 panels, 2 x 2, 3-5 x 1: at most 10 accumulators, since the compiler holds
   each row's broadcast in a register), so a decode step of one row keeps 8 independent chains
   going while it streams each weight byte once. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#else
#include <math.h>
#define VECTOR 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 16  /* output columns per packed panel */
#define ROWS 6    /* rows of a full micro-block */
#define GROUP 4   /* panels per work unit */

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f2bf(float f) {  /* nearest even, as torch's float -> bfloat16 for numbers;
                                           a NaN stays a NaN with its own sign and payload, quieted */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One panel's 16 results of one row, in column order, to out (only the first `cols` when the
   panel runs past n). */
static inline void store16(uint16_t *out, const float *vals, int64_t cols) {
    uint16_t tmp[PANEL];
    for (int j = 0; j < PANEL; j++) tmp[j] = f2bf(vals[j]);
    memcpy(out, tmp, (size_t)(cols < PANEL ? cols : PANEL) * sizeof(uint16_t));
}

#if VECTOR
static inline __attribute__((always_inline)) void widen(const uint16_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));  /* even halves: columns 0-7 */
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));  /* odd: 8-15 */
}

static inline __attribute__((always_inline)) __m256i round8(__m256 v) {  /* bf16 bits in each dword's low half */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i near = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(near, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

static inline __attribute__((always_inline)) void store_panel(uint16_t *out, __m256 lo, __m256 hi, int64_t cols) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round8(lo), round8(hi)), 0xd8);
    if (cols >= PANEL) {
        _mm256_storeu_si256((__m256i *)out, packed);
    } else {
        uint16_t tmp[PANEL];
        _mm256_storeu_si256((__m256i *)tmp, packed);
        memcpy(out, tmp, (size_t)cols * sizeof(uint16_t));
    }
}

/* R rows x P panels: xf [R][k] fp32 (row stride k), w the first panel, panels PANEL * k apart. */
static inline __attribute__((always_inline)) void block(const float *xf, int64_t k, const uint16_t *w, uint16_t *out,
                                                        int64_t out_stride, int64_t cols, const int R, const int P) {
    __m256 acc[ROWS][GROUP][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            __m256 lo, hi;
            widen(w + (size_t)p * PANEL * k + i * PANEL, &lo, &hi);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m256 b = _mm256_broadcast_ss(xf + r * k + i);
                acc[r][p][0] = _mm256_fmadd_ps(b, lo, acc[r][p][0]);
                acc[r][p][1] = _mm256_fmadd_ps(b, hi, acc[r][p][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < P; p++)
            store_panel(out + r * out_stride + p * PANEL, acc[r][p][0], acc[r][p][1], cols - p * PANEL);
}
#else
/* The same chains, each element's over i in order: i outer, the 16 columns inner (a loop the
   compiler may vectorise across columns without reordering any element's sum). */
static void block(const float *xf, int64_t k, const uint16_t *w, uint16_t *out, int64_t out_stride, int64_t cols,
                  const int R, const int P) {
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            const uint16_t *wp = w + (size_t)p * PANEL * k;
            float vals[PANEL] = {0};
            for (int64_t i = 0; i < k; i++)
                for (int j = 0; j < PANEL; j++) {
                    const int lane = j < 8 ? 2 * j : 2 * (j - 8) + 1;  /* the packed position of column j */
                    vals[j] = fmaf(xf[r * k + i], bf2f(wp[i * PANEL + lane]), vals[j]);
                }
            store16(out + r * out_stride + p * PANEL, vals, cols - p * PANEL);
        }
}
#endif

/* Rows [0, rows) of panels [p0, p1) (at most GROUP): full 6-row blocks panel by panel, then the
   remaining rows over as many panels at once as their accumulators allow. */
static void unit(const float *xf, int64_t rows, int64_t k, const uint16_t *packed, int64_t p0, int64_t p1, int64_t n,
                 uint16_t *out, int64_t out_stride) {
    const int64_t full = rows - rows % ROWS;
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *w = packed + (size_t)p * PANEL * k;
        for (int64_t r = 0; r < full; r += ROWS)
            block(xf + r * k, k, w, out + r * out_stride + p * PANEL, out_stride, n - p * PANEL, ROWS, 1);
    }
    const int rest = (int)(rows - full);
    if (rest == 0) return;
    const int wide = rest == 1 ? 4 : rest == 2 ? 2 : 1;  /* panels per block */
    const float *xr = xf + full * k;
    uint16_t *o = out + full * out_stride;
    for (int64_t p = p0; p < p1;) {
        const uint16_t *w = packed + (size_t)p * PANEL * k;
        const int64_t cols = n - p * PANEL;
        if (p + wide <= p1) {
            switch (rest) {
                case 1: block(xr, k, w, o + p * PANEL, out_stride, cols, 1, 4); break;
                case 2: block(xr, k, w, o + p * PANEL, out_stride, cols, 2, 2); break;
                case 3: block(xr, k, w, o + p * PANEL, out_stride, cols, 3, 1); break;
                case 4: block(xr, k, w, o + p * PANEL, out_stride, cols, 4, 1); break;
                default: block(xr, k, w, o + p * PANEL, out_stride, cols, 5, 1); break;
            }
            p += wide;
        } else {
            switch (rest) {
                case 1: block(xr, k, w, o + p * PANEL, out_stride, cols, 1, 1); break;
                default: block(xr, k, w, o + p * PANEL, out_stride, cols, 2, 1); break;
            }
            p += 1;
        }
    }
}

/* x [rows, k] bf16 (row stride x_stride), packed [ceil(n / 16), k, 16] bf16 (see the layout above),
   out [rows, n] bf16 (row stride out_stride). Work units of GROUP panels over `threads` OpenMP threads.
   Returns 0, or -1 when the fp32 copy of x cannot be allocated. */
int bf16_gemm(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, const uint16_t *packed, int64_t n,
              uint16_t *out, int64_t out_stride, int threads) {
    float *xf = malloc((size_t)(rows * k > 0 ? rows * k : 1) * sizeof(float));
    if (xf == NULL) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf2f(x[r * x_stride + i]);
    const int64_t panels = (n + PANEL - 1) / PANEL, units = (panels + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t p0 = u * GROUP, p1 = p0 + GROUP < panels ? p0 + GROUP : panels;
        unit(xf, rows, k, packed, p0, p1, n, out, out_stride);
    }
    free(xf);
    return 0;
}

/* 1 when built with OpenMP (calls split their work units over threads), else 0. */
int bf16_gemm_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build runs the AVX2 + FMA vector code, 0 for the scalar fmaf loop (same bits, slower). */
int bf16_gemm_vector(void) { return VECTOR; }
