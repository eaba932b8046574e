/* predictor/model/scale_search.c (built and loaded by scale_search.py): gptqmodel's MSE scale
   search for one group of columns, in one pass over the weights.

   For each row r of x (rows x cols, row stride `stride` floats) and each shrink candidate p of
   `shrink` (in order), the range [p * xmin[r], p * xmax[r]] gives
       scale = (p * xmax - p * xmin) / maxq,  zero = round(-p * xmin / scale)   (asymmetric)
       zero  = sym_zero                                                          (symmetric)
   and the error sum_j (clamp(round(x / scale) + zero, 0, maxq) - zero) * scale - x)^2; the first
   candidate with the least error (a strictly smaller one replaces it; NaN never wins) is
   written to best_scale[r] and best_zero[r]; where none is finite they are left as they came.

   Every step is torch's, so the choice is gptqmodel's bit for bit (its loop and
   predictor/model/scale_search.py `_search` compute the same tensors): each element in float32
   with the same operations and rounding (division, not a reciprocal; round half to even; no
   fused multiply-add: built with -ffp-contract=off), and each row's sum in the order of ATen's
   sum over a contiguous last dimension (ReduceOps' vectorized_inner_sum / row_sum, measured the
   same on torch 2.13's AVX-512, AVX2 and default kernels): the columns as vectors of 8, those
   vectors summed in 4 interleaved chains, the chains added in order, then the columns left over
   and the 8 lanes added one by one. `row_sums` exposes that order alone, so scale_search.py
   checks it against torch.sum before it trusts the kernel.

   The candidates are the innermost loop (a vector lane each), so nothing is reduced across
   lanes while the columns stream by. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>

#define LANES 8         /* ATen's float vector in its sum, whatever the instruction set */
#define CHAINS 4        /* row_sum's ilp_factor */
#define MAX_VECTORS 64  /* below CHAINS * 16 vectors multi_row_sum does not cascade */
#define MAX_STEPS 256
#define MAX_THREADS 64

/* The lanes of torch's sum over `cols` columns: vectors of 8, or single columns below 8
   (scalar_inner_sum: the same chains, of scalars). */
static inline int64_t lanes_for(int64_t cols) { return cols >= LANES ? LANES : 1; }

/* Where column j's term goes: a chain's lane (0..CHAINS*lanes-1) or the left-over sum (-1). */
static inline int64_t slot(int64_t j, int64_t cols, int64_t lanes) {
    const int64_t vectors = cols / lanes, chained = vectors / CHAINS * CHAINS;
    const int64_t v = j / lanes, lane = j % lanes;
    if (v >= vectors) return -1;                       /* a column past the last whole vector */
    if (v >= chained) return lane;                      /* a vector past the chains: chain 0 */
    return (v % CHAINS) * lanes + lane;
}

/* The chains' lanes and the left-over columns, added as row_sum and vectorized_inner_sum do. */
static inline float finish(float chain[CHAINS * LANES], float rest, int64_t lanes) {
    for (int64_t k = 1; k < CHAINS; k++)
        for (int64_t l = 0; l < lanes; l++) chain[l] += chain[k * lanes + l];
    for (int64_t l = 0; l < lanes; l++) rest += chain[l];
    return rest;
}

int64_t max_columns(void) { return MAX_VECTORS * LANES - 1; }

void row_sums(const float *x, int64_t rows, int64_t cols, float *out) {
    const int64_t lanes = lanes_for(cols);
    for (int64_t r = 0; r < rows; r++) {
        float chain[CHAINS * LANES] = {0}, rest = 0.0f;
        for (int64_t j = 0; j < cols; j++) {
            const int64_t s = slot(j, cols, lanes);
            if (s < 0) rest += x[r * cols + j];
            else chain[s] += x[r * cols + j];
        }
        out[r] = finish(chain, rest, lanes);
    }
}

/* The search of one row: `*best_scale` and `*best_zero` hold the starting range's on entry. */
static void search_row(const float *row, int64_t cols, float xmin, float xmax,
                       const float *shrink, int64_t steps, float maxq, int32_t sym,
                       float sym_zero, float *best_scale, float *best_zero) {
    float scale[MAX_STEPS], zero[MAX_STEPS], rest[MAX_STEPS];
    float chain[CHAINS * LANES][MAX_STEPS];
    const int64_t lanes = lanes_for(cols);
    for (int64_t c = 0; c < steps; c++) {
        const float lo = shrink[c] * xmin, hi = shrink[c] * xmax;
        scale[c] = (hi - lo) / maxq;
        zero[c] = sym ? sym_zero : nearbyintf(-lo / scale[c]);
        rest[c] = 0.0f;
    }
    for (int s = 0; s < CHAINS * LANES; s++)
        for (int64_t c = 0; c < steps; c++) chain[s][c] = 0.0f;
    for (int64_t j = 0; j < cols; j++) {
        const float v = row[j];
        const int64_t s = slot(j, cols, lanes);
        float *sum = s < 0 ? rest : chain[s];
        for (int64_t c = 0; c < steps; c++) {
            float q = nearbyintf(v / scale[c]) + zero[c];
            q = q < 0.0f ? 0.0f : q;  /* NaN stays NaN, as in torch.clamp */
            q = q > maxq ? maxq : q;
            const float d = (q - zero[c]) * scale[c] - v;
            sum[c] += d * d;
        }
    }
    float best = INFINITY;
    for (int64_t c = 0; c < steps; c++) {
        float terms[CHAINS * LANES];
        for (int s = 0; s < CHAINS * LANES; s++) terms[s] = chain[s][c];
        const float err = finish(terms, rest[c], lanes);
        if (err < best) {  /* the first least error wins; NaN never does */
            best = err;
            *best_scale = scale[c];
            *best_zero = zero[c];
        }
    }
}

/* A run of a group's rows and where their results go. */
struct rows {
    const float *x;
    int64_t rows, cols, stride;
    float maxq;
    int32_t sym;
    float sym_zero;
    const float *shrink;
    int64_t steps;
    float *scale, *zero;
};

/* gptqmodel's Quantizer.find_params for a group, per row r: the range [xmin, xmax] of the row
   and 0 (NaN where the row holds one, as torch.min and torch.minimum give), for `sym` the
   range made symmetric, an all-zero range widened to [-1, 1]; its scale and zero; then, where
   `steps` > 0, the search above from there. Written to scale[r] and zero[r]. */
static void find_rows(const struct rows *p) {
    for (int64_t r = 0; r < p->rows; r++) {
        const float *row = p->x + r * p->stride;
        float lo = 0.0f, hi = 0.0f;
        int nan = 0;
        for (int64_t j = 0; j < p->cols; j++) {
            const float v = row[j];
            nan |= v != v;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        if (nan) lo = hi = NAN;
        if (p->sym) {
            const float magnitude = fabsf(lo);
            hi = magnitude > hi ? magnitude : hi;
            if (lo < 0.0f) lo = -hi;
        }
        if (lo == 0.0f && hi == 0.0f) {
            lo = -1.0f;
            hi = 1.0f;
        }
        p->scale[r] = (hi - lo) / p->maxq;
        p->zero[r] = p->sym ? p->sym_zero : nearbyintf(-lo / p->scale[r]);
        if (p->steps > 0)
            search_row(row, p->cols, lo, hi, p->shrink, p->steps, p->maxq, p->sym, p->sym_zero,
                       &p->scale[r], &p->zero[r]);
    }
}

static void *find_rows_thread(void *part) {
    find_rows(part);
    return NULL;
}

/* Rows are independent: with `threads` > 1 each of that many threads takes a run of them (the
   same numbers as one thread); a thread that cannot be started leaves its run to this one. */
void find_params(const float *x, int64_t rows, int64_t cols, int64_t stride, float maxq,
                 int32_t sym, float sym_zero, const float *shrink, int64_t steps, float *scale,
                 float *zero, int64_t threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows) threads = rows;
    if (threads < 1) threads = 1;
    struct rows parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < threads; t++) {
        const int64_t first = rows * t / threads, last = rows * (t + 1) / threads;
        parts[t] = (struct rows){x + first * stride, last - first, cols, stride, maxq, sym,
                                 sym_zero, shrink, steps, scale + first, zero + first};
    }
    for (int64_t t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, find_rows_thread, &parts[t]) == 0;
    find_rows(&parts[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else find_rows(&parts[t]);
    }
}
