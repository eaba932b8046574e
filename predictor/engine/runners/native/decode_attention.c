/* predictor/engine/runners/native/decode_attention.c: decode attention straight from the paged KV
 * cache, for the CPU runner (built and loaded by bindings.py: decode_attention).
 *
 * A row's queries (one for a decode row; a row's last token and its drafts, or a prompt chunk
 * attending token by token: several, each seeing one key more) against its keys, read once for
 * all of them where they lie, through the row's block table: no gather into a padded copy, no
 * mask, no work past a row's end. fp32 arithmetic on bf16 storage; compiled per model shape
 * (DIM, GROUP, BLOCK, QUERIES are -D constants) so the compiler unrolls and vectorises the
 * head_dim loops. With AVX-512 (AVX2), keys and values go 16 (8) at a time through fp32 rows:
 * the scores of 16 (8) keys are summed together, the softmax numerators taken 16 (8) at a time
 * and the weighted values stay in registers for 16 (8) keys. A query's arithmetic depends on its
 * keys alone, so a prompt chunk's tokens attend here exactly as they would decoded one by one
 * (the runner's determinism: cpu.py, `batch_invariant`). Measured, a 1280-token prompt in
 * chunks of 256, SmolLM2's 30 layers (9 heads, 3 kv heads, head_dim 64), Xeon family 6 model
 * 106 (AVX-512 VNNI, no BF16), 1 thread, CPU time: AVX-512 1.21-1.42 -> 1.07-1.12 s, AVX2
 * (-march=znver1, as emulate.avx2_only builds it) 2.37-3.36 -> 1.19-1.39 s (key by key before),
 * where torch's SDPA takes 1.22 s (1.63 s held to AVX2).
 *
 * q:       bf16 [queries][q_stride]: a query's heads first, heads * DIM values
 * pool:    bf16 [2 * kv_heads][slots][DIM]: keys of every slot for each kv head, then values
 * tables:  int64 [rows][table_width]: each row's cache blocks; lengths, counts: int64 [rows]
 * out:     bf16 [queries][heads * DIM]
 * scratch: float, QUERIES * GROUP * (longest length) values
 */
#include <stdint.h>
#include <stdlib.h>

#include "native_common.h"

#ifndef DIM
#error "compile with -DDIM=<head_dim> -DGROUP=<heads per kv head> -DBLOCK=<block size> -DQUERIES=n"
#endif

/* A row's blocks lie anywhere in the pool (rows take blocks as they grow, interleaved), where
   the hardware prefetcher cannot follow: the next block is requested while this one is used.
   Measured, 16 rows of 150 tokens, 30 layers: blocks interleaved row by row 8.7 -> 7.7 ms,
   in random places 17.1 -> 13.4 ms, each row's blocks adjacent 6.0 -> 5.8 ms. */
static inline void prefetch_block(const uint16_t *block) {
    const char *bytes = (const char *)block;
    for (int c = 0; c < BLOCK * DIM * 2; c += 64) __builtin_prefetch(bytes + c);
}

#if (defined(__clang__) || __GNUC__ >= 12) &&                                                  \
    ((DIM % 16 == 0 && defined(__AVX512F__)) || (DIM % 8 == 0 && defined(__AVX2__) && defined(__FMA__)))
/* Vectors of W lanes (16: AVX-512; 8: AVX2): the scores W keys at a time, each key's W-lane
   partial products with a query head, then the W keys' partials summed together (a transpose
   as it adds: W - 1 adds and 2 (W - 1) shuffles for W sums, where summing each across its lanes
   takes log2 W shuffles and adds); the softmax numerators and their sum W at a time (the sum's
   lanes added in one fixed tree); the values weighed W keys at a time. A query's arithmetic is
   fixed by its keys alone: the same in a decode step, a row's drafts or any prompt chunk. */
#include <immintrin.h>
#if DIM % 16 == 0 && defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
typedef float vfw __attribute__((vector_size(W * 4)));
typedef int32_t viw __attribute__((vector_size(W * 4)));

static inline vfw loadw(const float *p) {
    vfw v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vfw splatw(float x) { return (vfw){} + x; }

#if W == 16
static inline vfw maxw(vfw a, vfw b) { return (vfw)_mm512_max_ps((__m512)a, (__m512)b); }
static inline vfw roundw(vfw x) { /* to nearest, ties to even */
    return (vfw)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
static inline vfw maxw(vfw a, vfw b) { return (vfw)_mm256_max_ps((__m256)a, (__m256)b); }
static inline vfw roundw(vfw x) {
    return (vfw)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

/* exp_approx (native_common.h) lane by lane, x <= 0: the same polynomial, the exponent's
   integer rounded to even */
static inline vfw expw(vfw x) {
    x = maxw(x, splatw(-87.0f));
    const vfw n = roundw(x * 1.44269504088896341f);
    vfw p;
    EXP_POLYNOMIAL(x, n, p);
    const viw e = (__builtin_convertvector(n, viw) + 127) << 23;
    return p * (vfw)e;
}

/* lane j: the sum of p[j]'s lanes */
#if W == 16
static inline vfw sum_lanes(const vfw p[16]) {
    vfw x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: key 2i's partials, halved; 8-15: key 2i + 1's */
        x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* 4 lanes a key, keys 4i..4i+3 */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* 2 lanes a key, keys 8i..8i+7 */
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
}
#else
static inline vfw sum_lanes(const vfw p[8]) {
    vfw x[4], y[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: key 2i's partials, halved; 4-7: key 2i + 1's */
        x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* 2 lanes a key, keys 4i..4i+3 */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* the sum of v's lanes, in one fixed tree */
static inline float sum_all(vfw v) {
    float lanes[W], sum;
    memcpy(lanes, &v, sizeof v);
    for (int width = W / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    sum = lanes[0];
    return sum;
}

/* rows[j]: slot l0 + j's key (or value) in fp32, for j < n; 0 past them */
static inline void load_rows(float rows[W][DIM], const uint16_t *pool, const int64_t *table,
                             int64_t l0, int n, int64_t longest) {
    for (int j = 0; j < W; j++) {
        const int64_t l = l0 + j;
        if (j < n && l % BLOCK == 0 && l + BLOCK < longest)
            prefetch_block(pool + table[l / BLOCK + 1] * BLOCK * DIM);
        const uint16_t *src = pool + (table[(j < n ? l : l0) / BLOCK] * BLOCK + l % BLOCK) * DIM;
        for (int i = 0; i < DIM; i++) rows[j][i] = j < n ? from_bf16(src[i]) : 0.0f;
    }
}

static void scores(float query[QUERIES][GROUP][DIM], const uint16_t *keys, const int64_t *table,
                   int64_t length, int64_t count, int64_t longest, float *scratch,
                   float best[QUERIES][GROUP]) {
    float rows[W][DIM] __attribute__((aligned(64)));
    vfw top[QUERIES][GROUP]; /* the maximum of the full chunks' scores, lane by lane */
    for (int64_t t = 0; t < count; t++)
        for (int g = 0; g < GROUP; g++) top[t][g] = splatw(-3.0e38f);
    for (int64_t l0 = 0; l0 < longest; l0 += W) {
        const int n = longest - l0 < W ? (int)(longest - l0) : W;
        load_rows(rows, keys, table, l0, n, longest);
        for (int64_t t = l0 < length ? 0 : l0 - length + 1; t < count; t++) {
            const int valid = length + t - l0 < n ? (int)(length + t - l0) : n; /* its keys */
            for (int g = 0; g < GROUP; g++) {
                vfw partial[W];
                for (int j = 0; j < W; j++) {
                    vfw sum = loadw(query[t][g]) * loadw(rows[j]);
                    for (int c = W; c < DIM; c += W)
                        sum += loadw(query[t][g] + c) * loadw(rows[j] + c);
                    partial[j] = sum;
                }
                const vfw s = sum_lanes(partial);
                float *dst = scratch + (t * GROUP + g) * longest + l0;
                if (valid == W) { /* the usual case: all W at once, their maximum below */
                    memcpy(dst, &s, sizeof s);
                    top[t][g] = maxw(s, top[t][g]);
                    continue;
                }
                for (int j = 0; j < valid; j++) {
                    dst[j] = s[j];
                    if (s[j] > best[t][g]) best[t][g] = s[j];
                }
            }
        }
    }
    for (int64_t t = 0; t < count; t++)
        for (int g = 0; g < GROUP; g++)
            for (int j = 0; j < W; j++)
                best[t][g] = top[t][g][j] > best[t][g] ? top[t][g][j] : best[t][g];
}

/* p[0 .. keys) = exp(p - best), W at a time; their sum */
static float numerators(float *p, int64_t keys, float best) {
    vfw sum = splatw(0.0f);
    int64_t l = 0;
    for (; l + W <= keys; l += W) {
        const vfw e = expw(loadw(p + l) - best);
        memcpy(p + l, &e, sizeof e);
        sum += e;
    }
    if (l < keys) { /* the last few, the lanes past them 0 */
        float tail[W] = {0};
        memcpy(tail, p + l, sizeof(float) * (size_t)(keys - l));
        vfw e = expw(loadw(tail) - best);
        for (int j = (int)(keys - l); j < W; j++) e[j] = 0.0f;
        memcpy(p + l, &e, sizeof(float) * (size_t)(keys - l));
        sum += e;
    }
    return sum_all(sum);
}

/* acc[t][g] += each key's softmax numerator times its value, W keys at a time (the sums
   stay in registers for the W) */
static void weigh_values(float acc[QUERIES][GROUP][DIM], const uint16_t *values,
                         const int64_t *table, int64_t length, int64_t count, int64_t longest,
                         const float *scratch) {
    float rows[W][DIM] __attribute__((aligned(64)));
    for (int64_t l0 = 0; l0 < longest; l0 += W) {
        const int n = longest - l0 < W ? (int)(longest - l0) : W;
        load_rows(rows, values, table, l0, n, longest);
        for (int64_t t = l0 < length ? 0 : l0 - length + 1; t < count; t++) {
            const int valid = length + t - l0 < n ? (int)(length + t - l0) : n;
            for (int g = 0; g < GROUP; g++) {
                const float *p = scratch + (t * GROUP + g) * longest + l0;
                float w[W]; /* 0 past its keys: the rows there are 0 too, never stale */
                for (int j = 0; j < W; j++) w[j] = j < valid ? p[j] : 0.0f;
                for (int c = 0; c < DIM; c += W) {
                    vfw sum = loadw(acc[t][g] + c);
                    for (int j = 0; j < W; j++) sum += w[j] * loadw(rows[j] + c);
                    memcpy(acc[t][g] + c, &sum, sizeof sum);
                }
            }
        }
    }
}
#else
/* The scores key by key (a head_dim that is not a multiple of 16, or an older compiler). */
static void scores(float query[QUERIES][GROUP][DIM], const uint16_t *keys, const int64_t *table,
                   int64_t length, int64_t count, int64_t longest, float *scratch,
                   float best[QUERIES][GROUP]) {
    float row[DIM];
    for (int64_t b = 0, l = 0; l < longest; b++) {
        const uint16_t *block = keys + table[b] * BLOCK * DIM;
        if (l + BLOCK < longest) prefetch_block(keys + table[b + 1] * BLOCK * DIM);
        for (int j = 0; j < BLOCK && l < longest; j++, l++) {
            for (int i = 0; i < DIM; i++) row[i] = from_bf16(block[j * DIM + i]);
            for (int64_t t = l < length ? 0 : l - length + 1; t < count; t++)
                for (int g = 0; g < GROUP; g++) {
                    float s = 0.0f;
                    for (int i = 0; i < DIM; i++) s += query[t][g][i] * row[i];
                    scratch[(t * GROUP + g) * longest + l] = s;
                    if (s > best[t][g]) best[t][g] = s;
                }
        }
    }
}
static float numerators(float *p, int64_t keys, float best) {
    float sum = 0.0f;
    for (int64_t l = 0; l < keys; l++) {
        p[l] = exp_approx(p[l] - best); /* x <= 0 */
        sum += p[l];
    }
    return sum;
}
static void weigh_values(float acc[QUERIES][GROUP][DIM], const uint16_t *values,
                         const int64_t *table, int64_t length, int64_t count, int64_t longest,
                         const float *scratch) {
    float row[DIM];
    for (int64_t b = 0, l = 0; l < longest; b++) {
        const uint16_t *block = values + table[b] * BLOCK * DIM;
        if (l + BLOCK < longest) prefetch_block(values + table[b + 1] * BLOCK * DIM);
        for (int j = 0; j < BLOCK && l < longest; j++, l++) {
            for (int i = 0; i < DIM; i++) row[i] = from_bf16(block[j * DIM + i]);
            for (int64_t t = l < length ? 0 : l - length + 1; t < count; t++)
                for (int g = 0; g < GROUP; g++) {
                    const float p = scratch[(t * GROUP + g) * longest + l];
                    for (int i = 0; i < DIM; i++) acc[t][g][i] += p * row[i];
                }
        }
    }
}
#endif

/* One kv head h of one row: its `count` (<= QUERIES) consecutive query tokens, GROUP query
   heads each, against the row's keys and values; query t sees the first length + t keys (a
   decode row: one query; a row verifying drafts, or a prompt chunk attending token by token:
   several). Each key is read once for all of them. A query's arithmetic (the order of every sum)
   is the same whatever `count` is: a token's attention is the same decoded alone or with its
   drafts (tests/engine/runners/native/test_bindings.py). */
static void attend(const uint16_t *q, int64_t q_stride, const uint16_t *pool, int64_t slots,
                   const int64_t *table, int64_t length, int64_t count, int64_t h,
                   int64_t kv_heads, float scale, uint16_t *out, int64_t out_stride,
                   float *scratch) {
    float query[QUERIES][GROUP][DIM] __attribute__((aligned(64))), acc[QUERIES][GROUP][DIM];
    float best[QUERIES][GROUP], total[QUERIES][GROUP];
    const int64_t longest = length + count - 1; /* the last query's keys */
    const uint16_t *keys = pool + h * slots * DIM;
    const uint16_t *values = pool + (kv_heads + h) * slots * DIM;
    for (int64_t t = 0; t < count; t++)
        for (int g = 0; g < GROUP; g++) {
            const uint16_t *src = q + t * q_stride + (h * GROUP + g) * DIM;
            for (int i = 0; i < DIM; i++) query[t][g][i] = from_bf16(src[i]) * scale;
            best[t][g] = -3.0e38f;
        }
    scores(query, keys, table, length, count, longest, scratch, best);
    for (int64_t t = 0; t < count; t++) /* softmax numerators and their sums */
        for (int g = 0; g < GROUP; g++) {
            total[t][g] = numerators(scratch + (t * GROUP + g) * longest, length + t, best[t][g]);
            for (int i = 0; i < DIM; i++) acc[t][g][i] = 0.0f;
        }
    weigh_values(acc, values, table, length, count, longest, scratch);
    for (int64_t t = 0; t < count; t++)
        for (int g = 0; g < GROUP; g++) {
            uint16_t *dst = out + t * out_stride + (h * GROUP + g) * DIM;
            const float inverse = 1.0f / total[t][g];
            for (int i = 0; i < DIM; i++) dst[i] = to_bf16(acc[t][g][i] * inverse);
        }
}

/* Work item i of a call: row i / kv_heads' kv head i % kv_heads, QUERIES of its queries at a
   time (firsts: each row's first query in q and out). */
static void attend_row(const uint16_t *q, int64_t q_stride, const uint16_t *pool, int64_t slots,
                       const int64_t *tables, int64_t table_width, const int64_t *lengths,
                       const int64_t *counts, const int64_t *firsts, int64_t i,
                       int64_t kv_heads, float scale, uint16_t *out, float *scratch) {
    const int64_t r = i / kv_heads, h = i % kv_heads, heads = kv_heads * GROUP;
    for (int64_t c = 0; c < counts[r]; c += QUERIES) {
        const int64_t first = firsts[r] + c, left = counts[r] - c;
        attend(q + first * q_stride, q_stride, pool, slots, tables + r * table_width,
               lengths[r] + c, left < QUERIES ? left : QUERIES, h, kv_heads, scale,
               out + first * heads * DIM, heads * DIM, scratch);
    }
}

/* rows: block tables (tables, lengths: row r's first query sees lengths[r] keys); counts[r]
   consecutive queries each (1 for a decode row), in q and out row after row. scratch: floats
   for QUERIES * GROUP * (the longest query's keys). threads > 1 and several rows (built with
   OpenMP): the (row, kv head) pairs split over that many threads, each with scratch of its
   own; else the calling thread with `scratch`. */
void decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *pool,
                           int64_t slots, const int64_t *tables, int64_t table_width,
                           const int64_t *lengths, const int64_t *counts, int64_t rows,
                           int64_t kv_heads, float scale, uint16_t *out, float *scratch,
                           int64_t threads) {
    const int64_t pairs = rows * kv_heads;
    int64_t firsts[rows > 0 ? rows : 1], longest = 1;
    for (int64_t r = 0, first = 0; r < rows; first += counts[r], r++) {
        firsts[r] = first;
        const int64_t keys = lengths[r] + counts[r] - 1;
        longest = keys > longest ? keys : longest;
    }
#ifdef _OPENMP
    if (threads > 1 && rows > 1) { /* one row: its few heads are not worth a team's wake-up */
#pragma omp parallel num_threads((int)threads)
        {
            float *mine = malloc(sizeof(float) * QUERIES * GROUP * longest);
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < pairs; i++)
                attend_row(q, q_stride, pool, slots, tables, table_width, lengths, counts, firsts,
                           i, kv_heads, scale, out, mine);
            free(mine);
        }
        return;
    }
#endif
    (void)threads;
    (void)longest;
    for (int64_t i = 0; i < pairs; i++)
        attend_row(q, q_stride, pool, slots, tables, table_width, lengths, counts, firsts, i,
                   kv_heads, scale, out, scratch);
}
