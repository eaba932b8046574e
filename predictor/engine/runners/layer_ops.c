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
   adapter reads its factors once per LORA_ROWS rows (SGMV; BGMV at one row). Per table row i
   and module m (i * MODULES + m): bf16 B^T [r][width] at b[] (the scale folded in), the rank r
   (a multiple of 16 up to LORA_RANK, zero-padded; 0: not adapted), the module's first column in
   out and its width; at a[i * MODULES] the group's bf16 A^T [in][sum of its modules' r], the
   modules' columns side by side in module order (the rows' inputs are read once for them all).
   fp32 sums, one rounding into the bf16 out.

   Each row's sums run in one fixed order (over the inputs, then over the rank) in vectors of
   16 lanes held in registers, whatever the rows beside it: a row alone and in any company gets
   the same bits (--batch-invariant relies on it; tested). */
#define LORA_ROWS 4  /* rows sharing a read of the factors */
#define LORA_RANK 256 /* the most rank (vLLM's --max-lora-rank choices up to 256) */
#define LORA_MODULES 3 /* the most modules a group stacks (q, k, v) */
#define LORA_SUMS (LORA_MODULES * LORA_RANK) /* a row's x A^T: its group's ranks together */
#define LORA_DOWN_VECTORS 4 /* rank vectors an A pass holds per row (registers) */
#if defined(__AVX512F__) /* registers: output vectors a pass over B^T keeps per row */
#define LORA_COLUMN_VECTORS 4
#else
#define LORA_COLUMN_VECTORS 1
#endif

typedef float lf16 __attribute__((vector_size(64)));
typedef uint16_t lh16 __attribute__((vector_size(32)));
typedef uint32_t lu16 __attribute__((vector_size(64)));

static inline lf16 lora_load(const uint16_t *p) { /* 16 bf16 as fp32 */
    lh16 h;
    memcpy(&h, p, sizeof h);
    lu16 u = __builtin_convertvector(h, lu16) << 16;
    lf16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline lf16 lora_splat(float v) { return (lf16){0} + v; }

/* h[q][k0..k0 + 16 vectors) = x[q] A^T's columns there, for `rows` rows (the A pass), each
   row's sums in input order; A^T's rows are r long */
static inline __attribute__((always_inline)) void lora_down(
        const uint16_t *const *x, int64_t in, const uint16_t *at, int64_t r, int64_t k0,
        int rows, int vectors, float h[LORA_ROWS][LORA_SUMS]) {
    lf16 acc[LORA_ROWS][LORA_DOWN_VECTORS];
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) acc[q][v] = (lf16){0};
    for (int64_t c = 0; c < in; c++) {
        lf16 a[LORA_DOWN_VECTORS];
        for (int v = 0; v < vectors; v++) a[v] = lora_load(at + c * r + k0 + v * 16);
        __builtin_prefetch(at + (c + 16) * r + k0);
        for (int q = 0; q < rows; q++) {
            const lf16 xc = lora_splat(from_bf16(x[q][c]));
            for (int v = 0; v < vectors; v++) acc[q][v] += xc * a[v];
        }
    }
    for (int q = 0; q < rows; q++)
        for (int v = 0; v < vectors; v++) memcpy(h[q] + k0 + v * 16, &acc[q][v], sizeof acc[q][v]);
}

/* o[0..16) = bf16(o + sums), rounded to nearest even as to_bf16 does, NaN kept a NaN */
static inline void lora_store(uint16_t *o, lf16 sums) {
    lf16 f = lora_load(o) + sums;
    lu16 u;
    memcpy(&u, &f, sizeof u);
    const lu16 nan = (lu16)((u & 0x7fffffffu) > 0x7f800000u);
    u = ((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | (((u >> 16) | 0x40u) << 16 & nan);
    const lh16 h = __builtin_convertvector(u >> 16, lh16);
    memcpy(o, &h, sizeof h);
}

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

/* lora_down with its row and vector counts constants (registers, loops unrolled) */
#define LORA_DOWN_CASE(R, V) \
    case (R) * 8 + (V): lora_down(xs, in, at, r, k0, R, V, h); break;

void lora_add(const uint16_t *x, int64_t x_stride, int64_t rows, const int64_t *which,
              const int64_t *order, const int64_t *a, const int64_t *b, const int64_t *ranks,
              const int64_t *columns, const int64_t *widths, int64_t modules, int64_t in,
              uint16_t *out, int64_t out_stride, int64_t threads) {
    (void)threads;
    float h[LORA_ROWS][LORA_SUMS];
    for (int64_t start = 0; start < rows;) {
        const int64_t adapter = which[order[start]];
        int64_t end = start + 1;
        while (end < rows && end - start < LORA_ROWS && which[order[end]] == adapter) end++;
        const int count = (int)(end - start);
        int64_t r = 0; /* the group's ranks together: h's length, A^T's row */
        for (int64_t m = 0; adapter >= 0 && m < modules && m < LORA_MODULES; m++) {
            const int64_t rank = ranks[adapter * modules + m];
            r = rank < 0 || rank > LORA_RANK || rank % 16 || r < 0 ? -1 : r + rank;
        }
        if (adapter < 0 || r <= 0 || modules > LORA_MODULES) {
            start = end;
            continue;
        }
        const uint16_t *xs[LORA_ROWS];
        for (int q = 0; q < count; q++) xs[q] = x + order[start + q] * x_stride;
        const uint16_t *at = (const uint16_t *)(intptr_t)a[adapter * modules];
        for (int64_t k0 = 0; k0 < r; k0 += 16 * LORA_DOWN_VECTORS) {
            const int64_t left = (r - k0) / 16;
            switch (count * 8 + (int)(left < LORA_DOWN_VECTORS ? left : LORA_DOWN_VECTORS)) {
                LORA_DOWN_CASE(1, 1) LORA_DOWN_CASE(1, 2) LORA_DOWN_CASE(1, 3) LORA_DOWN_CASE(1, 4)
                LORA_DOWN_CASE(2, 1) LORA_DOWN_CASE(2, 2) LORA_DOWN_CASE(2, 3) LORA_DOWN_CASE(2, 4)
                LORA_DOWN_CASE(3, 1) LORA_DOWN_CASE(3, 2) LORA_DOWN_CASE(3, 3) LORA_DOWN_CASE(3, 4)
                LORA_DOWN_CASE(4, 1) LORA_DOWN_CASE(4, 2) LORA_DOWN_CASE(4, 3) LORA_DOWN_CASE(4, 4)
            }
        }
        for (int64_t m = 0, first = 0; m < modules; m++) {
            const int64_t slot = adapter * modules + m, rank = ranks[slot];
            if (rank == 0) continue;
            uint16_t *outs[LORA_ROWS];
            for (int q = 0; q < count; q++)
                outs[q] = out + order[start + q] * out_stride + columns[slot];
            const uint16_t *bt = (const uint16_t *)(intptr_t)b[slot];
            switch (count) {
                case 1: lora_up(h, first, 1, rank, bt, widths[slot], outs); break;
                case 2: lora_up(h, first, 2, rank, bt, widths[slot], outs); break;
                case 3: lora_up(h, first, 3, rank, bt, widths[slot], outs); break;
                default: lora_up(h, first, 4, rank, bt, widths[slot], outs); break;
            }
            first += rank;
        }
        start = end;
    }
}
