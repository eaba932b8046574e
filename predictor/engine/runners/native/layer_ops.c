/* predictor/engine/runners/native/layer_ops.c: a decoder layer's small ops for the CPU runner (built and
 * loaded by bindings.py: layer_ops; on tensors in layer_kernels.py), bf16 storage, fp32 math.
 *
 * At a few rows a step is mostly dispatch: torch's bf16 rms_norm is ~10 ops (22 us at 1 row of
 * 576, measured), the rotary pass and the cache write 6 more, SwiGLU 3; 30 layers each. Here each
 * is one call of a few microseconds, rounding to bf16 once where torch rounds after each op.
 * DIM (head_dim) is a -D constant so the compiler unrolls and vectorises the head loops.
 * threads > 1 (built with OpenMP): the rows split over that many threads (one row: one thread).
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "native_common.h"

#ifndef DIM
#error "compile with -DDIM=<head_dim>"
#endif

/* hidden [rows][dim] += delta (when not NULL), rounded to bf16 in place; then
   out = hidden * rsqrt(mean(hidden^2) + eps) * weight. */
void add_rms_norm(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight, float eps,
                  uint16_t *out, int64_t rows, int64_t dim, int64_t threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? (int)threads : 1) if (threads > 1 && rows > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        float row[dim];
        uint16_t *h = hidden + r * dim;
        float sum = 0.0f;
        if (delta) {
            const uint16_t *d = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                h[i] = to_bf16(from_bf16(h[i]) + from_bf16(d[i]));
                row[i] = from_bf16(h[i]);
            }
        } else {
            for (int64_t i = 0; i < dim; i++) row[i] = from_bf16(h[i]);
        }
        for (int64_t i = 0; i < dim; i++) sum += row[i] * row[i];
        const float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
        uint16_t *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = to_bf16(row[i] * inverse * from_bf16(weight[i]));
    }
}

/* qkv [n][heads + 2 kv_heads][DIM]: q and k rotated in place (x * cos + rotate_half(x) * sin,
   cos and sin [n][DIM], as transformers' Llama), then token t's keys and values written to
   slot slots_of[t] of pool [2 kv_heads][slots][DIM] (keys of every kv head, then values). */
void rope_write(uint16_t *qkv, int64_t n, int64_t heads, int64_t kv_heads, const uint16_t *cos,
                const uint16_t *sin, uint16_t *pool, int64_t slots, const int64_t *slots_of,
                int64_t threads) {
    const int64_t width = heads + 2 * kv_heads, half = DIM / 2;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? (int)threads : 1) if (threads > 1 && n > 1)
#endif
    for (int64_t t = 0; t < n; t++) {
        float c[DIM], s[DIM];
        for (int i = 0; i < DIM; i++) {
            c[i] = from_bf16(cos[t * DIM + i]);
            s[i] = from_bf16(sin[t * DIM + i]);
        }
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            uint16_t *x = qkv + (t * width + h) * DIM;
            float y[DIM];
            for (int i = 0; i < half; i++) {
                const float x1 = from_bf16(x[i]), x2 = from_bf16(x[i + half]);
                y[i] = x1 * c[i] - x2 * s[i];
                y[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
            for (int i = 0; i < DIM; i++) x[i] = to_bf16(y[i]);
        }
        for (int64_t h = 0; h < 2 * kv_heads; h++) {
            const uint16_t *src = qkv + (t * width + heads + h) * DIM;
            uint16_t *dst = pool + (h * slots + slots_of[t]) * DIM;
            for (int i = 0; i < DIM; i++) dst[i] = src[i];
        }
    }
}

/* One row of silu_mul. Not inlined, its pointers restrict: inlined into the row loop, gcc 12
   vectorises it behind a run-time aliasing check that sends every call down the scalar loop
   (measured: 7.7 us a row of 1536 against 1.0 us, AVX-512 Xeon; 30 layers, each row of a
   step, each draft of a verifying row: 0.2 ms a row a step). */
__attribute__((noinline)) static void silu_row(const uint16_t *restrict gate,
                                                const uint16_t *restrict up,
                                                uint16_t *restrict out, int64_t inner) {
    for (int64_t i = 0; i < inner; i++) {
        const float x = from_bf16(gate[i]);
        out[i] = to_bf16(x / (1.0f + exp_approx(-x)) * from_bf16(up[i]));
    }
}

/* out [n][inner] = silu(gate) * up, gate_up [n][2 inner]: gate columns first, then up */
void silu_mul(const uint16_t *gate_up, int64_t n, int64_t inner, uint16_t *out,
              int64_t threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? (int)threads : 1) if (threads > 1 && n > 1)
#endif
    for (int64_t t = 0; t < n; t++)
        silu_row(gate_up + t * 2 * inner, gate_up + t * 2 * inner + inner, out + t * inner, inner);
}

/* LoRA's products for each row with its own adapter: out[t] += B (A x[t]) for every module of
   the projection group that the row's adapter adapts. Rows come in `order`, grouped by their
   adapter's table row (which[t]; -1: the base model, nothing to add); a run of rows of one
   adapter reads its factors once per LORA_ROWS rows (SGMV; BGMV at one row). Per table row i
   and module m (i * MODULES + m): bf16 B^T [r][width] at b[] (the scale folded in), the rank r
   (a multiple of 16 up to LORA_RANK, zero-padded; 0: not adapted), the module's first column in
   out and its width; at a[i * MODULES] the group's bf16 A^T [in][sum of its modules' r], the
   modules' columns side by side in module order (the rows' inputs are read once for them all).
   fp32 sums, one rounding into the bf16 out. That is mode 0; mode 1 (int8 factors and
   activations, AVX-512 VNNI builds only: LORA_INT8) has the same tables over its own layouts.

   Each row's sums run in one fixed order (over the inputs, then over the rank) in vectors of
   16 lanes held in registers, and a row's int8 scales are its own, whatever the rows beside it:
   a row alone and in any company gets the same bits (--batch-invariant relies on it; tested). */
#define LORA_ROWS 4  /* rows sharing a read of the factors */
#define LORA_RANK 256 /* the most rank (vLLM's --max-lora-rank choices up to 256) */
#define LORA_MODULES 3 /* the most modules a group stacks (q, k, v) */
#define LORA_SUMS (LORA_MODULES * LORA_RANK) /* a row's x A^T: its group's ranks together */
#define LORA_DOWN_VECTORS 4 /* the most rank vectors an A pass holds per row */
#if defined(__AVX512F__) /* registers: 32 vectors of 16 lanes (AVX2: 16 of 8) */
#define LORA_COLUMN_VECTORS 4 /* output vectors a pass over B^T keeps per row */
#define LORA_SPLIT 4          /* partial sums per lane in the A pass */
#define LORA_DOWN_SUMS 4      /* rows x rank vectors an A pass holds (x LORA_SPLIT sums) */
#else
#define LORA_COLUMN_VECTORS 1
#define LORA_SPLIT 2
#define LORA_DOWN_SUMS 2
#endif

typedef float lf16 __attribute__((vector_size(64)));
typedef uint16_t lh16 __attribute__((vector_size(32)));
typedef uint32_t lu16 __attribute__((vector_size(64)));

static inline lf16 lora_load(const uint16_t *p) { /* 16 bf16 as fp32 */
#if defined(__AVX512BW__) /* one widening load (GCC splits __builtin_convertvector's in two) */
    return (lf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16);
#else
    lh16 h;
    memcpy(&h, p, sizeof h);
    lu16 u = __builtin_convertvector(h, lu16) << 16;
    lf16 f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

static inline lf16 lora_splat(float v) { return (lf16){0} + v; }

/* h[q][k0..k0 + 16 vectors) = x[q] A^T's columns there, for `rows` rows (the A pass). Each
   lane sums its inputs in LORA_SPLIT independent partial sums (input c into c % LORA_SPLIT, the
   inputs past the last whole LORA_SPLIT into the first), added pairwise at the end: one chain of
   adds would wait on the add before it at every input (its latency, 4 cycles), whatever the
   rows; the order is fixed by the inputs alone. A^T's rows are r long. */
static inline __attribute__((always_inline)) void lora_down(
        const uint16_t *const *x, int64_t in, const uint16_t *at, int64_t r, int64_t k0,
        int rows, int vectors, float h[LORA_ROWS][LORA_SUMS]) {
    lf16 acc[LORA_ROWS][LORA_DOWN_VECTORS][LORA_SPLIT];
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++)
            for (int u = 0; u < LORA_SPLIT; u++) acc[q][v][u] = (lf16){0};
    int64_t c = 0;
    for (; c + LORA_SPLIT <= in; c += LORA_SPLIT) {
        __builtin_prefetch(at + (c + 16) * r + k0);
        for (int u = 0; u < LORA_SPLIT; u++) {
            lf16 a[LORA_DOWN_VECTORS];
            for (int v = 0; v < vectors; v++) a[v] = lora_load(at + (c + u) * r + k0 + v * 16);
            for (int q = 0; q < rows; q++) {
                const lf16 xc = lora_splat(from_bf16(x[q][c + u]));
                for (int v = 0; v < vectors; v++) acc[q][v][u] += xc * a[v];
            }
        }
    }
    for (; c < in; c++)
        for (int v = 0; v < vectors; v++) {
            const lf16 a = lora_load(at + c * r + k0 + v * 16);
            for (int q = 0; q < rows; q++) acc[q][v][0] += lora_splat(from_bf16(x[q][c])) * a;
        }
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) {
            lf16 sum = acc[q][v][0];
#if LORA_SPLIT == 4
            sum = (sum + acc[q][v][1]) + (acc[q][v][2] + acc[q][v][3]);
#elif LORA_SPLIT == 2
            sum += acc[q][v][1];
#endif
            memcpy(h[q] + k0 + v * 16, &sum, sizeof sum);
        }
}

/* o[0..16) = bf16(f), rounded to nearest even as to_bf16 does, NaN kept a NaN */
static inline void lora_write(uint16_t *o, lf16 f) {
    lu16 u;
    memcpy(&u, &f, sizeof u);
    const lu16 nan = (lu16)((u & 0x7fffffffu) > 0x7f800000u);
    u = ((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | (((u >> 16) | 0x40u) << 16 & nan);
#if defined(__AVX512BW__)
    _mm256_storeu_si256((void *)o, _mm512_cvtepi32_epi16((__m512i)(u >> 16)));
#else
    const lh16 h = __builtin_convertvector(u >> 16, lh16);
    memcpy(o, &h, sizeof h);
#endif
}

/* o[0..16) = bf16(o + sums) */
static inline void lora_store(uint16_t *o, lf16 sums) { lora_write(o, lora_load(o) + sums); }

/* out[q][j0 + 16 vectors) += sum_k h[q][k] B^T[k][...] for `rows` rows, each sum in rank order */
static inline __attribute__((always_inline)) void lora_up_block(
        const float h[LORA_ROWS][LORA_SUMS], int64_t first, int rows, int64_t r,
        const uint16_t *bt, int64_t width, int64_t j0, int vectors, uint16_t *const *out) {
    lf16 acc[LORA_ROWS][LORA_COLUMN_VECTORS];
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) acc[q][v] = (lf16){0};
    for (int64_t k = 0; k < r; k++) {
        lf16 b[LORA_COLUMN_VECTORS];
        for (int v = 0; v < vectors; v++) b[v] = lora_load(bt + k * width + j0 + v * 16);
        __builtin_prefetch(bt + k * width + j0 + 16 * LORA_COLUMN_VECTORS * 2);
        for (int q = 0; q < rows; q++) {
            const lf16 hk = lora_splat(h[q][first + k]);
            for (int v = 0; v < vectors; v++) acc[q][v] += hk * b[v];
        }
    }
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) lora_store(out[q] + j0 + v * 16, acc[q][v]);
}

/* out[q][0..width) += h[q][first..first + r) B^T for `rows` rows (the B pass) */
static inline __attribute__((always_inline)) void lora_up(
        const float h[LORA_ROWS][LORA_SUMS], int64_t first, int rows, int64_t r,
        const uint16_t *bt, int64_t width, uint16_t *const *out) {
    const int64_t span = 16 * LORA_COLUMN_VECTORS, whole = width - width % 16;
    int64_t j0 = 0;
    for (; j0 + span <= whole; j0 += span)
        lora_up_block(h, first, rows, r, bt, width, j0, LORA_COLUMN_VECTORS, out);
    for (; j0 < whole; j0 += 16) lora_up_block(h, first, rows, r, bt, width, j0, 1, out);
    for (int q = 0; q < rows; q++) /* the columns past the last whole vector */
        for (int64_t j = whole; j < width; j++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < r; k++) sum += h[q][first + k] * from_bf16(bt[k * width + j]);
            out[q][j] = to_bf16(from_bf16(out[q][j]) + sum);
        }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The int8 mode (LORA_INT8): a row's inputs and its x A^T are quantized to int8 (one scale a
   row, and a module's h[q] one of its own), the factors are int8 (A^T one scale per rank column,
   B^T one per output column: int8_layouts in lora.py) laid out for VNNI's dpbusd, 4
   consecutive inputs (or ranks) per 32-bit lane: A^T [in4 / 4][r][4] then int32 colsum[r] and
   fp32 scale[r]; B^T [r / 4][width][4] then int32 colsum[width] and fp32 scale[width]. dpbusd
   multiplies unsigned by signed bytes: the activations go in as q + 128 and 128 * colsum comes
   off each sum. Half the bytes of the bf16 factors, a quarter of the instructions. */
#define LORA_INT8 1
#define LORA_AHEAD 32 /* A^T rows (of 4 inputs) prefetched ahead */

/* v as u8: round(v / s) + 128 (within 1..255), rounded to nearest even as cvtps does */
static inline uint8_t lora_u8(float v, float inverse) {
    return (uint8_t)(_mm_cvtss_si32(_mm_set_ss(v * inverse)) + 128);
}

/* 16 of x as u8 at q (round(x / s) + 128) */
static inline void lora_u8_16(__m512 x, __m512 inverse, uint8_t *q) {
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x, inverse)),
                                       _mm512_set1_epi32(128));
    _mm_storeu_si128((void *)q, _mm512_cvtepi32_epi8(v));
}

static inline float lora_scale(float most) { return most > 0.0f ? most / 127.0f : 1.0f; }

/* a row of bf16 inputs x[0..in) as u8 in q (zero, i.e. 128, past `in` up to in4), returning
   its scale s = max|x| / 127 */
static float lora_quantize_x(const uint16_t *x, int64_t in, int64_t in4, uint8_t *q) {
    __m512 most16 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= in; c += 16) most16 = _mm512_max_ps(most16, _mm512_abs_ps((__m512)lora_load(x + c)));
    float most = _mm512_reduce_max_ps(most16);
    for (; c < in; c++) {
        const float a = fabsf(from_bf16(x[c]));
        most = a > most ? a : most;
    }
    const float s = lora_scale(most), inverse = 1.0f / s;
    for (c = 0; c + 16 <= in; c += 16) lora_u8_16((__m512)lora_load(x + c), _mm512_set1_ps(inverse), q + c);
    for (; c < in; c++) q[c] = lora_u8(from_bf16(x[c]), inverse);
    for (; c < in4; c++) q[c] = 128;
    return s;
}

/* a module's x A^T, h[0..r) (r a multiple of 16), as u8 in q, returning its scale */
static float lora_quantize_h(const float *h, int64_t r, uint8_t *q) {
    __m512 most16 = _mm512_setzero_ps();
    for (int64_t k = 0; k < r; k += 16) most16 = _mm512_max_ps(most16, _mm512_abs_ps(_mm512_loadu_ps(h + k)));
    const float s = lora_scale(_mm512_reduce_max_ps(most16));
    for (int64_t k = 0; k < r; k += 16) lora_u8_16(_mm512_loadu_ps(h + k), _mm512_set1_ps(1.0f / s), q + k);
    return s;
}

/* h[q][k0..k0 + 16 vectors) = x[q] A^T's columns there (the A pass, int8) */
static inline __attribute__((always_inline)) void lora_down8(
        const uint8_t *xq, const float *sx, int64_t in4, const int8_t *at, int64_t r,
        int64_t k0, int rows, int vectors, float h[LORA_ROWS][LORA_SUMS]) {
    __m512i acc[LORA_ROWS][LORA_DOWN_VECTORS][2];
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) acc[q][v][0] = acc[q][v][1] = _mm512_setzero_si512();
    for (int64_t c4 = 0; c4 < in4 / 4; c4++) { /* two sums a lane: dpbusd's latency */
        __m512i a[LORA_DOWN_VECTORS];
        for (int v = 0; v < vectors; v++) {
            __builtin_prefetch(at + ((c4 + LORA_AHEAD) * r + k0 + v * 16) * 4);
            a[v] = _mm512_loadu_si512((const void *)(at + (c4 * r + k0 + v * 16) * 4));
        }
        for (int q = 0; q < rows; q++) {
            int32_t four;
            memcpy(&four, xq + q * in4 + c4 * 4, sizeof four);
            const __m512i xs = _mm512_set1_epi32(four);
            for (int v = 0; v < vectors; v++)
                acc[q][v][c4 & 1] = _mm512_dpbusd_epi32(acc[q][v][c4 & 1], xs, a[v]);
        }
    }
    const int32_t *colsum = (const int32_t *)(at + in4 * r);
    const float *scale = (const float *)(colsum + r);
    for (int v = 0; v < vectors; v++) {
        const __m512i offset = _mm512_slli_epi32(
            _mm512_loadu_si512((const void *)(colsum + k0 + v * 16)), 7);
        const __m512 sa = _mm512_loadu_ps(scale + k0 + v * 16);
        for (int q = 0; q < rows; q++) {
            const __m512i sum = _mm512_sub_epi32(
                _mm512_add_epi32(acc[q][v][0], acc[q][v][1]), offset);
            _mm512_storeu_ps(h[q] + k0 + v * 16,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(sum),
                                           _mm512_mul_ps(sa, _mm512_set1_ps(sx[q]))));
        }
    }
}

/* out[q][j0 + 16 vectors) += h[q] B^T there (the B pass, int8: hq as u8, sh its scales) */
static inline __attribute__((always_inline)) void lora_up8_block(
        uint8_t (*hq)[LORA_RANK], const float *sh, int rows, int64_t r, const int8_t *bt,
        int64_t width, int64_t j0, int vectors, uint16_t *const *out) {
    __m512i acc[LORA_ROWS][LORA_COLUMN_VECTORS];
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) acc[q][v] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < r / 4; k4++) {
        __m512i b[LORA_COLUMN_VECTORS];
        for (int v = 0; v < vectors; v++) { /* and the next block's, at this k4 */
            __builtin_prefetch(bt + (k4 * width + j0 + (v + vectors) * 16) * 4);
            b[v] = _mm512_loadu_si512((const void *)(bt + (k4 * width + j0 + v * 16) * 4));
        }
        for (int q = 0; q < rows; q++) {
            int32_t four;
            memcpy(&four, hq[q] + k4 * 4, sizeof four);
            const __m512i hs = _mm512_set1_epi32(four);
            for (int v = 0; v < vectors; v++) acc[q][v] = _mm512_dpbusd_epi32(acc[q][v], hs, b[v]);
        }
    }
    const int32_t *colsum = (const int32_t *)(bt + r * width);
    const float *scale = (const float *)(colsum + width);
    for (int v = 0; v < vectors; v++) {
        const __m512i offset = _mm512_slli_epi32(
            _mm512_loadu_si512((const void *)(colsum + j0 + v * 16)), 7);
        const __m512 sb = _mm512_loadu_ps(scale + j0 + v * 16);
        for (int q = 0; q < rows; q++) { /* out + sum * scale as one fused op, written out:
            left to the compiler, the instances for some row counts fused it and others did not
            (a row's bits then depended on how many rows shared its call) */
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[q][v], offset));
            const __m512 scale = _mm512_mul_ps(sb, _mm512_set1_ps(sh[q]));
            uint16_t *o = out[q] + j0 + v * 16;
            lora_write(o, (lf16)_mm512_fmadd_ps(sum, scale, (__m512)lora_load(o)));
        }
    }
}

static inline __attribute__((always_inline)) void lora_up8(
        uint8_t (*hq)[LORA_RANK], const float *sh, int rows, int64_t r, const int8_t *bt,
        int64_t width, uint16_t *const *out) {
    const int64_t span = 16 * LORA_COLUMN_VECTORS, whole = width - width % 16;
    int64_t j0 = 0;
    for (; j0 + span <= whole; j0 += span)
        lora_up8_block(hq, sh, rows, r, bt, width, j0, LORA_COLUMN_VECTORS, out);
    for (; j0 < whole; j0 += 16) lora_up8_block(hq, sh, rows, r, bt, width, j0, 1, out);
    const int32_t *colsum = (const int32_t *)(bt + r * width);
    const float *scale = (const float *)(colsum + width);
    for (int q = 0; q < rows; q++) /* the columns past the last whole vector */
        for (int64_t j = whole; j < width; j++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < r; k++) sum += (int32_t)hq[q][k] * bt[((k / 4) * width + j) * 4 + k % 4];
            const float scaled = scale[j] * sh[q]; /* fused as the vectors' are */
            out[q][j] = to_bf16(__builtin_fmaf((float)(sum - 128 * colsum[j]), scaled,
                                               from_bf16(out[q][j])));
        }
}

#define LORA_DOWN8_CASE(R, V) \
    case (R) * 8 + (V): lora_down8(xq, sx, in4, at, r, k0, R, V, h); break;

/* a run of `count` rows of one adapter, int8 */
static void lora_rows8(const uint16_t *const *xs, int count, int64_t in, const int8_t *at,
                       int64_t r, const int64_t *bs, const int64_t *ranks,
                       const int64_t *columns, const int64_t *widths, int64_t modules,
                       uint16_t *const *outs, float h[LORA_ROWS][LORA_SUMS]) {
    const int64_t in4 = (in + 3) / 4 * 4;
    uint8_t xq[count * in4]; /* the rows' inputs, u8 */
    float sx[LORA_ROWS];
    for (int q = 0; q < count; q++) sx[q] = lora_quantize_x(xs[q], in, in4, xq + q * in4);
    for (int64_t k0 = 0; k0 < r;) {
        const int64_t left = (r - k0) / 16;
        const int vectors = (int)(left < LORA_DOWN_VECTORS ? left : LORA_DOWN_VECTORS);
        switch (count * 8 + vectors) {
            LORA_DOWN8_CASE(1, 1) LORA_DOWN8_CASE(1, 2) LORA_DOWN8_CASE(1, 3) LORA_DOWN8_CASE(1, 4)
            LORA_DOWN8_CASE(2, 1) LORA_DOWN8_CASE(2, 2) LORA_DOWN8_CASE(2, 3) LORA_DOWN8_CASE(2, 4)
            LORA_DOWN8_CASE(3, 1) LORA_DOWN8_CASE(3, 2) LORA_DOWN8_CASE(3, 3) LORA_DOWN8_CASE(3, 4)
            LORA_DOWN8_CASE(4, 1) LORA_DOWN8_CASE(4, 2) LORA_DOWN8_CASE(4, 3) LORA_DOWN8_CASE(4, 4)
        }
        k0 += 16 * vectors;
    }
    for (int64_t m = 0, first = 0; m < modules; m++) {
        const int64_t rank = ranks[m];
        if (rank == 0) continue;
        uint8_t hq[LORA_ROWS][LORA_RANK];
        float sh[LORA_ROWS];
        uint16_t *o[LORA_ROWS];
        for (int q = 0; q < count; q++) {
            sh[q] = lora_quantize_h(h[q] + first, rank, hq[q]);
            o[q] = outs[q] + columns[m];
        }
        const int8_t *bt = (const int8_t *)(intptr_t)bs[m];
        switch (count) {
            case 1: lora_up8(hq, sh, 1, rank, bt, widths[m], o); break;
            case 2: lora_up8(hq, sh, 2, rank, bt, widths[m], o); break;
            case 3: lora_up8(hq, sh, 3, rank, bt, widths[m], o); break;
            default: lora_up8(hq, sh, 4, rank, bt, widths[m], o); break;
        }
        first += rank;
    }
}
#else
#define LORA_INT8 0
#endif

/* 1 where this build has the int8 mode (AVX-512 VNNI), else 0 */
int64_t lora_int8(void) { return LORA_INT8; }

/* lora_down with its row and vector counts constants (registers, loops unrolled) */
#define LORA_DOWN_CASE(R, V) \
    case (R) * 8 + (V): lora_down(xs, in, at, r, k0, R, V, h); break;

/* a run of `count` rows of one adapter, bf16 factors and fp32 sums */
static void lora_rows(const uint16_t *const *xs, int count, int64_t in, const uint16_t *at,
                      int64_t r, const int64_t *bs, const int64_t *ranks,
                      const int64_t *columns, const int64_t *widths, int64_t modules,
                      uint16_t *const *outs, float h[LORA_ROWS][LORA_SUMS]) {
    /* a pass's rank vectors: as many as the registers hold for these rows (each lane's
       sums are its own: how many run together never changes them) */
    const int most = count >= LORA_DOWN_SUMS ? 1 : LORA_DOWN_SUMS / count;
    for (int64_t k0 = 0; k0 < r;) {
        const int64_t left = (r - k0) / 16;
        const int vectors = (int)(left < most ? left : most);
        switch (count * 8 + vectors) {
            LORA_DOWN_CASE(1, 1) LORA_DOWN_CASE(1, 2) LORA_DOWN_CASE(1, 3) LORA_DOWN_CASE(1, 4)
            LORA_DOWN_CASE(2, 1) LORA_DOWN_CASE(2, 2)
            LORA_DOWN_CASE(3, 1) LORA_DOWN_CASE(4, 1)
        }
        k0 += 16 * vectors;
    }
    for (int64_t m = 0, first = 0; m < modules; m++) {
        const int64_t rank = ranks[m];
        if (rank == 0) continue;
        uint16_t *o[LORA_ROWS];
        for (int q = 0; q < count; q++) o[q] = outs[q] + columns[m];
        const uint16_t *bt = (const uint16_t *)(intptr_t)bs[m];
        switch (count) {
            case 1: lora_up(h, first, 1, rank, bt, widths[m], o); break;
            case 2: lora_up(h, first, 2, rank, bt, widths[m], o); break;
            case 3: lora_up(h, first, 3, rank, bt, widths[m], o); break;
            default: lora_up(h, first, 4, rank, bt, widths[m], o); break;
        }
        first += rank;
    }
}

/* step: [rows, which's address, order's address]; group (a layer's projection group, per
   mode): [mode (0: bf16 factors, 1: int8), the tables' addresses: A^T, B^T, ranks, columns,
   widths; modules, in]. One call a projection: its arguments packed once (a ctypes call of 15
   arguments costs ~3 us, of 6 ~1; a step makes 120 of them at 1 row). */
void lora_add(const int64_t *step, const int64_t *group, const uint16_t *x, int64_t x_stride,
              uint16_t *out, int64_t out_stride) {
    const int64_t rows = step[0], *which = (const int64_t *)step[1], *order = (const int64_t *)step[2];
    const int64_t mode = group[0], *a = (const int64_t *)group[1], *b = (const int64_t *)group[2];
    const int64_t *ranks = (const int64_t *)group[3], *columns = (const int64_t *)group[4];
    const int64_t *widths = (const int64_t *)group[5], modules = group[6], in = group[7];
    if (modules > LORA_MODULES || (mode == 1 && !LORA_INT8)) return;
    float h[LORA_ROWS][LORA_SUMS];
    for (int64_t start = 0; start < rows;) {
        const int64_t adapter = which[order[start]];
        int64_t end = start + 1;
        while (end < rows && end - start < LORA_ROWS && which[order[end]] == adapter) end++;
        const int count = (int)(end - start);
        int64_t r = 0; /* the group's ranks together: h's length, A^T's row */
        for (int64_t m = 0; adapter >= 0 && m < modules; m++) {
            const int64_t rank = ranks[adapter * modules + m];
            r = rank < 0 || rank > LORA_RANK || rank % 16 || r < 0 ? -1 : r + rank;
        }
        if (adapter >= 0 && r > 0) {
            const uint16_t *xs[LORA_ROWS];
            uint16_t *outs[LORA_ROWS];
            for (int q = 0; q < count; q++) {
                xs[q] = x + order[start + q] * x_stride;
                outs[q] = out + order[start + q] * out_stride;
            }
            const int64_t first = adapter * modules;
#if LORA_INT8
            if (mode == 1)
                lora_rows8(xs, count, in, (const int8_t *)(intptr_t)a[first], r, b + first,
                           ranks + first, columns + first, widths + first, modules, outs, h);
            else
#endif
                lora_rows(xs, count, in, (const uint16_t *)(intptr_t)a[first], r, b + first,
                          ranks + first, columns + first, widths + first, modules, outs, h);
        }
        start = end;
    }
}
