/* predictor/engine/runners/decode_attention.c: decode attention straight from the paged KV
 * cache, for the CPU runner (built and loaded by native.py: decode_attention).
 *
 * One query token per row. Each row's keys and values are read where they lie, block by block
 * through the row's block table: no gather into a padded copy, no mask, no work past a row's
 * end. fp32 arithmetic on bf16 storage; compiled per model shape (DIM, GROUP, BLOCK are
 * -D constants) so the compiler unrolls and vectorises the head_dim loops.
 *
 * q:       bf16 [rows][q_stride]: a row's query heads first, heads * DIM values
 * pool:    bf16 [2 * kv_heads][slots][DIM]: keys of every slot for each kv head, then values
 * tables:  int64 [rows][table_width]: each row's cache blocks; lengths: int64 [rows]
 * out:     bf16 [rows][heads * DIM]
 * scratch: float, GROUP * (longest length) values
 */
#include <stdint.h>

#include "native_common.h"

#ifndef DIM
#error "compile with -DDIM=<head_dim> -DGROUP=<heads per kv head> -DBLOCK=<block size>"
#endif

/* A row's blocks lie anywhere in the pool (rows take blocks as they grow, interleaved), where
   the hardware prefetcher cannot follow: the next block is requested while this one is used.
   Measured, 16 rows of 150 tokens, 30 layers: blocks interleaved row by row 8.7 -> 7.7 ms,
   in random places 17.1 -> 13.4 ms, each row's blocks adjacent 6.0 -> 5.8 ms. */
static inline void prefetch_block(const uint16_t *block) {
    const char *bytes = (const char *)block;
    for (int c = 0; c < BLOCK * DIM * 2; c += 64) __builtin_prefetch(bytes + c);
}

/* Row r's kv head h: its GROUP query heads against the row's keys and values. */
static void attend(const uint16_t *q, int64_t q_stride, const uint16_t *pool, int64_t slots,
                   const int64_t *tables, int64_t table_width, const int64_t *lengths,
                   int64_t r, int64_t h, int64_t kv_heads, float scale, uint16_t *out,
                   float *scratch) {
    const int64_t heads = kv_heads * GROUP;
    float query[GROUP][DIM], acc[GROUP][DIM], row[DIM];
    const int64_t length = lengths[r];
    const int64_t *table = tables + r * table_width;
    const uint16_t *keys = pool + h * slots * DIM;
    const uint16_t *values = pool + (kv_heads + h) * slots * DIM;
    float best[GROUP], total[GROUP];
    for (int g = 0; g < GROUP; g++) {
        const uint16_t *src = q + r * q_stride + (h * GROUP + g) * DIM;
        for (int i = 0; i < DIM; i++) query[g][i] = from_bf16(src[i]) * scale;
        best[g] = -3.0e38f;
    }
    for (int64_t b = 0, l = 0; l < length; b++) { /* scores, block by block */
        const uint16_t *block = keys + table[b] * BLOCK * DIM;
        if (l + BLOCK < length) prefetch_block(keys + table[b + 1] * BLOCK * DIM);
        for (int j = 0; j < BLOCK && l < length; j++, l++) {
            for (int i = 0; i < DIM; i++) row[i] = from_bf16(block[j * DIM + i]);
            for (int g = 0; g < GROUP; g++) {
                float s = 0.0f;
                for (int i = 0; i < DIM; i++) s += query[g][i] * row[i];
                scratch[g * length + l] = s;
                if (s > best[g]) best[g] = s;
            }
        }
    }
    for (int g = 0; g < GROUP; g++) { /* softmax numerators and their sums */
        float *p = scratch + g * length, sum = 0.0f;
        for (int64_t l = 0; l < length; l++) {
            p[l] = exp_approx(p[l] - best[g]); /* x <= 0 */
            sum += p[l];
        }
        total[g] = sum;
        for (int i = 0; i < DIM; i++) acc[g][i] = 0.0f;
    }
    for (int64_t b = 0, l = 0; l < length; b++) { /* the values, weighted */
        const uint16_t *block = values + table[b] * BLOCK * DIM;
        if (l + BLOCK < length) prefetch_block(values + table[b + 1] * BLOCK * DIM);
        for (int j = 0; j < BLOCK && l < length; j++, l++) {
            for (int i = 0; i < DIM; i++) row[i] = from_bf16(block[j * DIM + i]);
            for (int g = 0; g < GROUP; g++) {
                const float p = scratch[g * length + l];
                for (int i = 0; i < DIM; i++) acc[g][i] += p * row[i];
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        uint16_t *dst = out + r * heads * DIM + (h * GROUP + g) * DIM;
        const float inverse = 1.0f / total[g];
        for (int i = 0; i < DIM; i++) dst[i] = to_bf16(acc[g][i] * inverse);
    }
}

/* threads > 1 and several rows (built with OpenMP): the (row, kv head) pairs split over that
   many threads, each with its own scores on its stack; else the calling thread with `scratch`. */
void decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *pool,
                           int64_t slots, const int64_t *tables, int64_t table_width,
                           const int64_t *lengths, int64_t rows, int64_t kv_heads, float scale,
                           uint16_t *out, float *scratch, int64_t threads) {
    const int64_t pairs = rows * kv_heads;
#ifdef _OPENMP
    if (threads > 1 && rows > 1) { /* one row: its few heads are not worth a team's wake-up */
        int64_t longest = 1;
        for (int64_t r = 0; r < rows; r++) longest = lengths[r] > longest ? lengths[r] : longest;
#pragma omp parallel num_threads((int)threads)
        {
            float mine[GROUP * longest];
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < pairs; i++)
                attend(q, q_stride, pool, slots, tables, table_width, lengths, i / kv_heads,
                       i % kv_heads, kv_heads, scale, out, mine);
        }
        return;
    }
#endif
    (void)threads;
    for (int64_t i = 0; i < pairs; i++)
        attend(q, q_stride, pool, slots, tables, table_width, lengths, i / kv_heads, i % kv_heads,
               kv_heads, scale, out, scratch);
}
