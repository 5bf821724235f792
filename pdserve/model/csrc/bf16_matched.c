/* Few-row bf16 products that reproduce oneDNN's bf16 matrix kernel bit for bit; see
   pdserve/model/matched_gemv.py.

   out [rows, n] = round_bf16(x [rows, k] . w [n, k]^T) for 1 <= rows <= ROWS_MAX, x and out bf16 as raw
   uint16 bits at their row strides; w packed once at load into groups of GROUP_COLS = 64 output
   columns, group g holding [k / 2][64][2] values (for each pair of inner indices, every column's
   two values side by side: the operand layout of vdpbf16ps), the last group padded with zero
   columns. k is even.

   Summation order (the contract): the inner dimension is cut into blocks of `kb` values from 0;
   within a block an element's sum is one vdpbf16ps chain from +0 over the block's pairs in order
   (the instruction adds the odd product, then the even one, each rounded to fp32); the block sums
   are added to the element's total in block order; the total is rounded once to bf16 (nearest
   even). That is the order oneDNN's AVX512-BF16 matrix kernel was measured to use (its K blocking
   `kb` depends on the shape; matched_gemv.py finds it at start-up and checks the bits), so a row
   sent here gives the bits it would get among four or more rows there.

   Speed: a decode step's product of one row is a stream of the weight's bytes; each thread takes
   whole groups (one contiguous stream each) and keeps 4 x rows independent chains; rows go 4 at a time
   (16 accumulators), a group's later passes reading it from L2. Built without
   -ffast-math's reassociation (ckernel.SOURCE_FLAGS): the block sums must be added as written. */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define VECTOR 1
#else
#define VECTOR 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP_COLS 64
#define ROWS_PASS 4   /* rows whose 4 x 4 accumulators one pass over a group holds */
#define ROWS_MAX 8    /* rows one call takes (measured faster than oneDNN up to 8, level at 12-16) */

int bf16_matched_vector(void) { return VECTOR; }

int bf16_matched_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#if VECTOR
/* one group of 64 columns for `rows` rows: out[r][c0 .. c0 + cols) */
static void group_product(const uint16_t *x, int64_t x_stride, int rows, int64_t k, const uint16_t *wg,
                          int64_t kb, uint16_t *out, int64_t out_stride, int64_t cols) {
    __m512 total[ROWS_PASS][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) total[r][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
        int64_t k1 = k0 + kb < k ? k0 + kb : k;
        __m512 acc[ROWS_PASS][4];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t i = k0; i < k1; i += 2) {
            const uint16_t *wp = wg + i * GROUP_COLS;  /* pair i/2: [64][2] */
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
            __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
            for (int r = 0; r < rows; r++) {
                uint32_t pair;
                memcpy(&pair, x + r * x_stride + i, 4);
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) total[r][j] = k0 == 0 ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
    }
    for (int r = 0; r < rows; r++) {
        uint16_t buf[GROUP_COLS];
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(buf + 16 * j), (__m256i)_mm512_cvtneps_pbh(total[r][j]));
        memcpy(out + r * out_stride, buf, (size_t)cols * 2);
    }
}
#endif

/* 0: done; 1: not built for this CPU (no AVX512-BF16); 2: bad shape */
int bf16_matched(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, const uint16_t *w, int64_t n,
                 uint16_t *out, int64_t out_stride, int64_t kb, int threads) {
#if VECTOR
    if (rows < 1 || rows > ROWS_MAX || k <= 0 || k % 2 || kb <= 0 || kb % 2) return 2;
    int64_t groups = (n + GROUP_COLS - 1) / GROUP_COLS;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t g = 0; g < groups; g++) {
        int64_t c0 = g * GROUP_COLS, cols = n - c0 < GROUP_COLS ? n - c0 : GROUP_COLS;
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_PASS)  /* later passes read the group from L2 */
            group_product(x + r0 * x_stride, x_stride, rows - r0 < ROWS_PASS ? (int)(rows - r0) : ROWS_PASS, k,
                          w + g * k * GROUP_COLS, kb, out + c0 + r0 * out_stride, out_stride, cols);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)rows; (void)k; (void)w; (void)n; (void)out; (void)out_stride; (void)kb; (void)threads;
    return 1;
#endif
}
