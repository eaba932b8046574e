/* predictor/engine/runners/layer_ops.c: a decoder layer's small ops for the CPU runner (built and
 * loaded by native.py: layer_ops; on tensors in layer_kernels.py), bf16 storage, fp32 math.
 *
 * At a few rows a step is mostly dispatch: torch's bf16 rms_norm is ~10 ops (22 us at 1 row of
 * 576, measured), the rotary pass and the cache write 6 more, SwiGLU 3; 30 layers each. Here each
 * is one call of a few microseconds, rounding to bf16 once where torch rounds after each op.
 * DIM (head_dim) is a -D constant so the compiler unrolls and vectorises the head loops.
 * threads > 1 (built with OpenMP): the rows split over that many threads (one row: one thread).
 */
#include <math.h>
#include <stdint.h>

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

/* out [n][inner] = silu(gate) * up, gate_up [n][2 inner]: gate columns first, then up */
void silu_mul(const uint16_t *gate_up, int64_t n, int64_t inner, uint16_t *out,
              int64_t threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? (int)threads : 1) if (threads > 1 && n > 1)
#endif
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *g = gate_up + t * 2 * inner, *u = g + inner;
        uint16_t *o = out + t * inner;
        for (int64_t i = 0; i < inner; i++) {
            const float x = from_bf16(g[i]);
            o[i] = to_bf16(x / (1.0f + exp_approx(-x)) * from_bf16(u[i]));
        }
    }
}

/* LoRA's products for each row with its own adapter: out[t] += B (A x[t]) for every module of
   the projection group that the row's adapter adapts. Rows come in `order`, grouped by their
   adapter's table row (which[t]; -1: the base model, nothing to add); a run of rows of one
   adapter reads its factors once (SGMV), 16 rows at a time. Per table row i and module m
   (i * MODULES + m): bf16 A^T [in][r] at a[], bf16 B^T [r][width] at b[] (the scale folded in),
   rank r (0: not adapted), the module's first column in out and its width. fp32 sums, one
   rounding into the bf16 out. */
#define LORA_ROWS 16
#define LORA_COLUMNS 512
void lora_add(const uint16_t *x, int64_t x_stride, int64_t rows, const int64_t *which,
              const int64_t *order, const int64_t *a, const int64_t *b, const int64_t *ranks,
              const int64_t *columns, const int64_t *widths, int64_t modules, int64_t in,
              uint16_t *out, int64_t out_stride, int64_t threads) {
    (void)threads;
    float h[LORA_ROWS][256], acc[LORA_ROWS][LORA_COLUMNS];
    for (int64_t start = 0; start < rows;) {
        const int64_t adapter = which[order[start]];
        int64_t end = start + 1;
        while (end < rows && end - start < LORA_ROWS && which[order[end]] == adapter) end++;
        const int64_t count = end - start;
        for (int64_t m = 0; adapter >= 0 && m < modules; m++) {
            const int64_t slot = adapter * modules + m, r = ranks[slot];
            if (r <= 0 || r > 256) continue;
            const uint16_t *at = (const uint16_t *)(intptr_t)a[slot];
            const uint16_t *bt = (const uint16_t *)(intptr_t)b[slot];
            for (int64_t q = 0; q < count; q++)
                for (int64_t k = 0; k < r; k++) h[q][k] = 0.0f;
            for (int64_t c = 0; c < in; c++) { /* h = x A^T, each A^T row read once */
                float arow[256];
                for (int64_t k = 0; k < r; k++) arow[k] = from_bf16(at[c * r + k]);
                for (int64_t q = 0; q < count; q++) {
                    const float xc = from_bf16(x[order[start + q] * x_stride + c]);
                    for (int64_t k = 0; k < r; k++) h[q][k] += xc * arow[k];
                }
            }
            const int64_t width = widths[slot], column = columns[slot];
            for (int64_t j0 = 0; j0 < width; j0 += LORA_COLUMNS) { /* out += h B^T */
                const int64_t span = width - j0 < LORA_COLUMNS ? width - j0 : LORA_COLUMNS;
                for (int64_t q = 0; q < count; q++)
                    for (int64_t j = 0; j < span; j++) acc[q][j] = 0.0f;
                for (int64_t k = 0; k < r; k++) {
                    float brow[LORA_COLUMNS];
                    for (int64_t j = 0; j < span; j++) brow[j] = from_bf16(bt[k * width + j0 + j]);
                    for (int64_t q = 0; q < count; q++) {
                        const float hk = h[q][k];
                        for (int64_t j = 0; j < span; j++) acc[q][j] += hk * brow[j];
                    }
                }
                for (int64_t q = 0; q < count; q++) {
                    uint16_t *o = out + order[start + q] * out_stride + column + j0;
                    for (int64_t j = 0; j < span; j++) o[j] = to_bf16(from_bf16(o[j]) + acc[q][j]);
                }
            }
        }
        start = end;
    }
}
