/* Decode attention read in place from the paged K/V pool; see pdserve/model/paged_decode.py.

   Layout: cache_k, cache_v [N, B, H_kv, D] (fp32, or bf16 as raw uint16 bits); q, out [rows, H_q, D]
   fp32; tables [rows, table_stride] int64 block ids; lens [rows] int64 visible keys (>= 1).
   For one row, each query head is scored against every visible key of the K/V head it shares
   with its G = H_q / H_kv neighbours, softmaxed in fp32 and summed over the values. Every loop runs in an order fixed
   by the row's own length, so a row's bits never depend on the other rows of the call. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline void load_row(const void *cache, int bf16, int64_t index, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)cache + index * n;
        uint32_t *bits = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;  /* exact widening */
    } else {
        memcpy(dst, (const float *)cache + index * n, (size_t)n * sizeof(float));
    }
}

/* Ask for the next block of this row's table while the current one is being read: blocks sit
   at random places in the pool, so the hardware prefetcher loses the stream at every block edge. */
static inline void prefetch_block(const void *cache, int bf16, const int64_t *table, int64_t t, int64_t len,
                                  int64_t bs, int64_t n) {
    if (t % bs != 0 || t + bs >= len) return;
    const size_t bytes = (size_t)(bs * n) * (bf16 ? 2 : 4);
    const char *base = (const char *)cache + (size_t)(table[t / bs + 1] * bs * n) * (bf16 ? 2 : 4);
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(base + off, 0, 3);
}

/* One row: q, out [H_q, D]; scores [H_q, len] and key [H_kv, D] are scratch. Each key's row of
   all K/V heads is read once, contiguously (a block is B such rows back to back). */
static void one_row(const float *q, const void *ck, const void *cv, int bf16, const int64_t *table,
                    int64_t len, int64_t bs, int64_t hk, int64_t d, int64_t g,
                    float *scores, float *key, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t hq = hk * g;
    for (int64_t t = 0; t < len; t++) {  /* scores [H_q, len] */
        prefetch_block(ck, bf16, table, t, len, bs, hk * d);
        load_row(ck, bf16, table[t / bs] * bs + t % bs, hk * d, key);
        for (int64_t j = 0; j < hq; j++) {
            const float *qj = q + j * d, *kj = key + (j / g) * d;
            float acc = 0.0f;
            for (int64_t i = 0; i < d; i++) acc += qj[i] * kj[i];
            scores[j * len + t] = acc * scale;
        }
    }
    for (int64_t j = 0; j < hq; j++) {  /* softmax per query head, max-subtracted */
        float *s = scores + j * len, m = s[0], total = 0.0f;
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) s[t] = expf(s[t] - m);
        for (int64_t t = 0; t < len; t++) total += s[t];
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(out, 0, (size_t)(hq * d) * sizeof(float));
    for (int64_t t = 0; t < len; t++) {  /* out [H_q, D] += p [H_q, t] V [t, H_kv(j), D] */
        prefetch_block(cv, bf16, table, t, len, bs, hk * d);
        load_row(cv, bf16, table[t / bs] * bs + t % bs, hk * d, key);
        for (int64_t j = 0; j < hq; j++) {
            float *o = out + j * d;
            const float p = scores[j * len + t], *vj = key + (j / g) * d;
            for (int64_t i = 0; i < d; i++) o[i] += p * vj[i];
        }
    }
}

/* Rows [start, stop) of the call; returns 0, or -1 when scratch cannot be allocated. */
int paged_decode(const float *q, const void *cache_k, const void *cache_v, int bf16,
                 const int64_t *tables, int64_t table_stride, const int64_t *lens, float *out,
                 int64_t start, int64_t stop, int64_t max_len,
                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t num_q_heads) {
    const int64_t g = num_q_heads / num_kv_heads;
    float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_len + num_kv_heads * head_dim));
    if (scores == NULL) return -1;
    float *key = scores + num_q_heads * max_len;
    for (int64_t r = start; r < stop; r++) {
        one_row(q + r * num_q_heads * head_dim, cache_k, cache_v, bf16, tables + r * table_stride, lens[r],
                block_size, num_kv_heads, head_dim, g, scores, key, out + r * num_q_heads * head_dim);
    }
    free(scores);
    return 0;
}
