/* A decoder layer's elementwise glue in one pass per step: residual add + RMSNorm, and RoPE over the
   query and key heads in place; see pdserve/model/glue.py.

   Built without -ffast-math and with -ffp-contract=off (model/ckernel.py: SOURCE_FLAGS), so every
   product and sum below rounds as written, as torch's eager operators do: in bf16 each operator's
   fp32 result is rounded to nearest even (a bf16 times a bf16 is exact in fp32, so the rounding is
   the only one), in fp32 each operator rounds once. The residual add and RoPE are therefore bit
   for bit the eager formulas; RMSNorm differs from eager torch only in the order of its sum of
   squares (fixed here: 16 lanes, each summed in index order, then a fixed pairwise tree), so its
   result depends on the row alone. Rows are split over OpenMP threads (each row one thread's). */

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f2bf(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* value i of a row in the compute dtype, widened; and the store that rounds back */
static inline float ld(const void *p, int bf16, int64_t i) {
    return bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float f, int bf16) {  /* an eager operator's result in the compute dtype */
    return bf16 ? bf2f(f2bf(f)) : f;
}

static inline void st(void *p, int bf16, int64_t i, float f) {
    if (bf16) ((uint16_t *)p)[i] = f2bf(f);
    else ((float *)p)[i] = f;
}

static float sum_squares(const float *x, int64_t d) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += x[i + l] * x[i + l];
    for (int l = 0; i < d; i++, l++) lane[l] += x[i] * x[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

static inline __attribute__((always_inline)) void norm_row(char *xr, const char *dr, const void *w, char *hr,
                                                           int64_t d, float eps, float *xf, const int bf16) {
    for (int64_t i = 0; i < d; i++) xf[i] = ld(xr, bf16, i);
    if (dr != NULL) {
        for (int64_t i = 0; i < d; i++) xf[i] = rnd(xf[i] + ld(dr, bf16, i), bf16);
        for (int64_t i = 0; i < d; i++) st(xr, bf16, i, xf[i]);
    }
    const float mean = sum_squares(xf, d) / (float)d;
    const float inv = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < d; i++) st(hr, bf16, i, ld(w, bf16, i) * rnd(xf[i] * inv, bf16));
}

/* x [rows, d] (+= delta [rows, d] when delta is not NULL, rounded), then
   h [rows, d] = w * round(x * 1 / sqrt(mean(x^2) + eps)), the reduction in fp32. */
void glue_add_rms_norm(void *x, const void *delta, const void *w, void *h, int64_t rows, int64_t d, float eps,
                       int bf16, int threads) {
    const size_t row_bytes = (size_t)d * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float xf[d];
        char *xr = (char *)x + (size_t)r * row_bytes, *hr = (char *)h + (size_t)r * row_bytes;
        const char *dr = delta == NULL ? NULL : (const char *)delta + (size_t)r * row_bytes;
        if (bf16) norm_row(xr, dr, w, hr, d, eps, xf, 1);
        else norm_row(xr, dr, w, hr, d, eps, xf, 0);
    }
}

/* In place over the first `heads` heads of each row of qkv (row r at qkv + r * row_stride):
   x = round(round(x * cos) + round(roll(x, D/2) * sin_rot)), cos and sin_rot rows [P, D] picked by
   positions [rows]; the same as `x * cos + x.roll(D/2, -1) * sin_rot` in eager torch. */
static inline __attribute__((always_inline)) void rope_head(void *qkv, int64_t at, int64_t d, int64_t p,
                                                            const void *cos_table, const void *sin_table, float *x,
                                                            const int bf16) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) x[i] = ld(qkv, bf16, at + i);
    for (int64_t i = 0; i < half; i++) {
        const float a = rnd(x[i] * ld(cos_table, bf16, p + i), bf16);
        const float b = rnd(x[i + half] * ld(sin_table, bf16, p + i), bf16);
        st(qkv, bf16, at + i, a + b);
    }
    for (int64_t i = half; i < d; i++) {
        const float a = rnd(x[i] * ld(cos_table, bf16, p + i), bf16);
        const float b = rnd(x[i - half] * ld(sin_table, bf16, p + i), bf16);
        st(qkv, bf16, at + i, a + b);
    }
}

void glue_rope(void *qkv, int64_t row_stride, int64_t rows, int64_t heads, int64_t d, const int64_t *positions,
               const void *cos_table, const void *sin_table, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float x[d];
        for (int64_t hd = 0; hd < heads; hd++) {
            if (bf16) rope_head(qkv, r * row_stride + hd * d, d, positions[r] * d, cos_table, sin_table, x, 1);
            else rope_head(qkv, r * row_stride + hd * d, d, positions[r] * d, cos_table, sin_table, x, 0);
        }
    }
}

/* e^x in fp32 to about 1 ulp, in plain arithmetic (no libm call) so the loop vectorises and rounds
   alike on every instruction set: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor
   polynomial, times 2^n built in the exponent bits; x clamped to [-87, 89]. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x > 89.0f ? 89.0f : x;  /* above ~88.4, 2^n overflows to inf, as e^x does */
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln 2 = 0.693359375 - 2.12194440e-4 */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline __attribute__((always_inline)) void silu_mul_row(const void *gu, void *out, int64_t f, int64_t r,
                                                               const int bf16) {
    for (int64_t i = 0; i < f; i++) {
        const float g = ld(gu, bf16, r * 2 * f + i), u = ld(gu, bf16, r * 2 * f + f + i);
        const float s = rnd(g / (1.0f + exp_f32(-g)), bf16);
        st(out, bf16, r * f + i, s * u);
    }
}

/* out [rows, f] = round(round(silu(gate)) * up), gate|up [rows, 2f] side by side: eager torch's
   `F.silu(gate) * up` except that e^-x is exp_f32's (so a silu may differ from torch's in its last
   fp32 bit, which bf16 rounding almost always hides). */
void glue_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t f, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) silu_mul_row(gate_up, out, f, r, 1);
        else silu_mul_row(gate_up, out, f, r, 0);
    }
}
