/* predictor/engine/runners/native/int4_matmul.c: the 4-bit GPTQ matmul for the CPU runner
 * (int4_linear.py; built and loaded by bindings.py: int4_matmul): out = x @ W^T, the weights 4-bit
 * in memory, dequantized in registers.
 *
 * Layout, made at load by int4_repack: tiles of 16 output columns; per tile and group of GS
 * inputs, the 16 columns' bf16 scales, their bf16 zero offsets (torch's int4pack convention:
 * w = scale * (code - 8) + zero = scale * code + m, m = zero - 8 scale), then GS / 8 chunks of
 * 64 bytes: chunk i holds, for column c, one 32-bit word whose byte b has the code of input
 * 8i + b in its low nibble and of input 8i + 4 + b in its high nibble. A word is what one
 * vector lane needs: 8 inputs of one column.
 *
 * Two kernels over that one layout, each taking up to RB rows of x per pass over the 4-bit bytes
 * (a GEMV at 1 row, a register-tiled GEMM at many; prefill walks the rows RB at a time while a
 * tile, k * 10 bytes, stays in L1):
 *   f32: x in fp32 (from bf16), each weight dequantized to fp32 and FMA'd into RB rows.
 *   i8:  x quantized per 32 inputs to int8 with a scale (llama.cpp's Q8 trick), 4 products
 *        summed per instruction into int32 (AVX-512 VNNI / AVX-VNNI dpbusd, else maddubs +
 *        madd); per 32 inputs: acc += float(dot) * scale * dx + m * dx * sum(q).
 * VW (8: AVX2, 16: AVX-512) and VNNI are -D constants: one build per instruction set, chosen at
 * run time by the CPU's flags; the vector mappings, the int8 rows and the tile driver are
 * native_common.h's. bf16 out. OpenMP splits the tiles over threads (in the runner: the
 * libgomp.so.1 torch already loaded, one pool).
 *
 * x:   bf16 [rows][k]          out: bf16 [rows][out_stride], columns [0, n)
 * w:   uint8, ceil(n / 16) * (k / GS) * (64 + GS * 8) bytes
 */
#include <stdint.h>

#ifndef VW
#error "compile with -DVW=8 (AVX2) or -DVW=16 (AVX-512)"
#endif

#include "native_common.h"

static inline size_t group_bytes(int64_t gs) { return (size_t)(64 + gs * 8); }

/* The packed weights stream from memory once a step (a model's weights are more than the caches
   hold), tile after tile, in order. Left to the hardware prefetcher the kernels waited on memory
   and then computed, one after the other: each group's bytes are requested PREFETCH_AHEAD
   bytes before they are used. Measured, SmolLM2-135M's whole step at one row and a 300-token
   context (Xeon family 6 model 167, 1 thread): 10.2 -> 9.3 ms; a row with 1 draft 12.0 ->
   10.1, with 8 drafts 20.6 -> 18.2 ms (1024 bytes ahead: no better than none; 4096: as 2048). */
#define PREFETCH_AHEAD 2048
static inline void prefetch_ahead(const uint8_t *at, size_t bytes) {
    for (size_t c = 0; c < bytes; c += 64) __builtin_prefetch(at + PREFETCH_AHEAD + c);
}

/* Repack codes [n][k] (uint8 0..15) and scales, zeros [k / gs][n] (bf16) into the layout.
   Columns past n (the last tile's padding) get code 8, scale 0 and zero 0. */
void int4_repack(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int64_t n,
                 int64_t k, int64_t gs, uint8_t *w) {
    const int64_t tiles = (n + TILE - 1) / TILE, groups = k / gs;
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *dst = w + ((size_t)t * groups + g) * group_bytes(gs);
            uint16_t *s = (uint16_t *)dst, *z = (uint16_t *)(dst + 32);
            for (int j = 0; j < TILE; j++) {
                const int64_t c = t * TILE + j;
                s[j] = c < n ? scales[g * n + c] : 0;
                z[j] = c < n ? zeros[g * n + c] : 0;
            }
            for (int64_t i = 0; i < gs / 8; i++) {
                uint8_t *chunk = dst + 64 + i * 64;
                for (int j = 0; j < TILE; j++) {
                    const int64_t c = t * TILE + j, at = g * gs + i * 8;
                    for (int b = 0; b < 4; b++) {
                        const uint8_t lo = c < n ? codes[c * k + at + b] : 8;
                        const uint8_t hi = c < n ? codes[c * k + at + 4 + b] : 8;
                        chunk[j * 4 + b] = (uint8_t)((lo & 15) | (hi << 4));
                    }
                }
            }
        }
    }
}

/* GPTQ's packed weights qweight [k / 8][n] (int32: input 8i + j of column c in bits 4j..4j+3
   of word [i][c]) as codes [n][k] (uint8), input p of each column read from input order[p]
   (act-order's group-by-group order; NULL: the identity). At load: the start-up of a 1-8B model
   reads every weight through here once (torch's shifts and gathers took seconds a layer). */
void gptq_unpack4(const int32_t *qweight, int64_t k, int64_t n, const int64_t *order,
                  uint8_t *codes) {
    for (int64_t c = 0; c < n; c++) {
        uint8_t *row = codes + c * k;
        if (order == NULL) {
            for (int64_t i = 0; i < k / 8; i++) {
                const uint32_t word = (uint32_t)qweight[i * n + c];
                for (int j = 0; j < 8; j++) row[i * 8 + j] = (uint8_t)((word >> (4 * j)) & 15);
            }
        } else {
            for (int64_t p = 0; p < k; p++) {
                const int64_t at = order[p];
                row[p] = (uint8_t)(((uint32_t)qweight[(at >> 3) * n + c] >> (4 * (at & 7))) & 15);
            }
        }
    }
}

/* Codes [n][k] and scales, zeros [k / gs][stride] (bf16, columns [0, n) read) as bf16 weights
   [n][k]: scale * (code - 8) + zero, the product exact in fp32 (an 8-bit mantissa times a 4-bit
   integer), the sum rounded once to nearest even: the numbers torch's int4 op dequantizes to. */
void int4_dequantize(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                     int64_t n, int64_t k, int64_t gs, int64_t stride, uint16_t *out) {
    for (int64_t c = 0; c < n; c++) {
        for (int64_t g = 0; g < k / gs; g++) {
            const float s = from_bf16(scales[g * stride + c]);
            const float z = from_bf16(zeros[g * stride + c]);
            const uint8_t *src = codes + c * k + g * gs;
            uint16_t *dst = out + c * k + g * gs;
            for (int64_t i = 0; i < gs; i++) dst[i] = to_bf16((float)(src[i] - 8) * s + z);
        }
    }
}

static inline __attribute__((always_inline)) void store_rows(const vf *acc, int R, int64_t col,
                                                            int64_t n, uint16_t *out,
                                                            int64_t out_stride) {
    for (int r = 0; r < R; r++) {
        uint16_t *dst = out + r * out_stride + col;
        for (int j = 0; j < VW && col + j < n; j++) dst[j] = to_bf16(acc[r][j]);
    }
}

/* f32: R rows of one tile's VW-column half, over all k. xf: fp32 [R][k]. */
static inline __attribute__((always_inline)) void f32_rows(const uint8_t *tile, int64_t groups,
                                                          int64_t gs, int half, const float *xf,
                                                          int64_t k, int R, vf *acc) {
    for (int r = 0; r < R; r++) acc[r] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *src = tile + g * group_bytes(gs);
        if (!half) prefetch_ahead(src, group_bytes(gs)); /* once a tile */
        const vf s = load_bf16((const uint16_t *)src + half * VW);
        const vf m = load_bf16((const uint16_t *)(src + 32) + half * VW) - 8.0f * s;
        for (int64_t i = 0; i < gs / 8; i++) {
            const vi words = (vi)load_words(src + 64 + i * 64 + half * VW * 4);
            const float *xg = xf + g * gs + i * 8;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int shift = j < 4 ? 8 * j : 8 * (j - 4) + 4;
                const vf w = __builtin_convertvector((words >> shift) & 15, vf) * s + m;
                for (int r = 0; r < R; r++) acc[r] += w * xg[r * k + j];
            }
        }
    }
}

/* i8: the same with int8 activations. xq: int8 [R][k]; dx, xs: float [R][k / XB] (the
   blocks' scales and sums of x). */
static inline __attribute__((always_inline)) void i8_rows(const uint8_t *tile, int64_t groups,
                                                         int64_t gs, int half, const int8_t *xq,
                                                         const float *dx, const float *xs,
                                                         int64_t k, int R, vf *acc) {
    const int64_t blocks = k / XB;
    const ivec nibbles = (ivec)((vi){0} + 0x0F0F0F0F);
    for (int r = 0; r < R; r++) acc[r] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *src = tile + g * group_bytes(gs);
        if (!half) prefetch_ahead(src, group_bytes(gs)); /* once a tile */
        const vf s = load_bf16((const uint16_t *)src + half * VW);
        const vf m = load_bf16((const uint16_t *)(src + 32) + half * VW) - 8.0f * s;
        for (int64_t b0 = 0; b0 < gs / XB; b0++) {
            const int64_t block = g * (gs / XB) + b0;
            ivec dot[R];
            for (int r = 0; r < R; r++) dot[r] = izero();
#pragma GCC unroll 4
            for (int i = 0; i < XB / 8; i++) {
                const ivec words = load_words(src + 64 + (b0 * (XB / 8) + i) * 64 + half * VW * 4);
                const ivec lo = (ivec)((vi)words & (vi)nibbles);
                const ivec hi = (ivec)(((vi)words >> 4) & (vi)nibbles);
                const int64_t at = block * XB + i * 8;
                for (int r = 0; r < R; r++) {
                    dot[r] = dot4(dot[r], lo, splat32(xq + r * k + at));
                    dot[r] = dot4(dot[r], hi, splat32(xq + r * k + at + 4));
                }
            }
            for (int r = 0; r < R; r++) {
                acc[r] += to_float(dot[r]) * (s * dx[r * blocks + block]);
                acc[r] += m * xs[r * blocks + block];
            }
        }
    }
}

#define F32_CASE(R)                                                                           \
    case R: {                                                                                 \
        vf acc[R];                                                                            \
        f32_rows(tile, groups, gs, half, xf, k, R, acc);                                      \
        store_rows(acc, R, col, n, out, out_stride);                                          \
    } break;

static void f32_block(const uint8_t *tile, int64_t col0, int64_t groups, int64_t gs,
                      const float *xf, int64_t count, int64_t k, int64_t n, uint16_t *out,
                      int64_t out_stride) {
    TILE_HALVES(col0, n, count, ROW_CASES_F32(F32_CASE))
}

#define I8_CASE(R)                                                                            \
    case R: {                                                                                 \
        vf acc[R];                                                                            \
        i8_rows(tile, groups, gs, half, xq, dx, xs, k, R, acc);                               \
        store_rows(acc, R, col, n, out, out_stride);                                          \
    } break;

static void i8_block(const uint8_t *tile, int64_t col0, int64_t groups, int64_t gs,
                     const int8_t *xq, const float *dx, const float *xs, int64_t count,
                     int64_t k, int64_t n, uint16_t *out, int64_t out_stride) {
    TILE_HALVES(col0, n, count, ROW_CASES_I8(I8_CASE))
}

/* out[rows][0..n) = x[rows][k] @ dequantized(w)^T. int8: 0 for the f32 kernel, 1 for the i8
   one (needs gs % 32 == 0). threads <= 1: the calling thread only. 0, or -1: no memory. */
int int4_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
                int64_t gs, uint16_t *out, int64_t out_stride, int64_t threads, int64_t int8) {
    const int64_t tiles = (n + TILE - 1) / TILE, groups = k / gs;
    const size_t tbytes = (size_t)groups * group_bytes(gs);
    if (int8) {
        if (gs % XB) return -2;
        const size_t blocks = (size_t)rows * (size_t)(k / XB);
        char *buffer = scratch_for((size_t)rows * k + 2 * blocks * sizeof(float) + 64);
        if (!buffer) return -1;
        float *dx = (float *)buffer, *xs = dx + blocks;
        int8_t *xq = (int8_t *)(xs + blocks);
        quantize_rows(x, rows, k, (uint8_t *)xq, dx, xs, 0);
        const int64_t per = k / XB;
        FOR_EACH_TILE(tiles, rows, RB_I8, threads,
                      i8_block(w + t * tbytes, t * TILE, groups, gs, xq + r0 * k, dx + r0 * per,
                               xs + r0 * per, count, k, n, out + r0 * out_stride, out_stride));
        return 0;
    }
    float *xf = scratch_for((size_t)rows * k * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < rows * k; i++) xf[i] = from_bf16(x[i]);
    FOR_EACH_TILE(tiles, rows, RB_F32, threads,
                  f32_block(w + t * tbytes, t * TILE, groups, gs, xf + r0 * k, count, k, n,
                            out + r0 * out_stride, out_stride));
    return 0;
}

int int4_vector_width(void) { return VW; }

int int4_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
