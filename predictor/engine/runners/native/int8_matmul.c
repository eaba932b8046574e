/* predictor/engine/runners/native/int8_matmul.c: the 8-bit matmul for the CPU runner's lm_head
 * (int4_linear.py; built and loaded by bindings.py: int8_matmul): out = x @ W^T in fp32, W int8
 * in memory with one scale per 32 inputs of each output column (llama.cpp's Q8_0: SmolLM2's GGUF
 * stores its tied embedding so).
 *
 * Layout, made at load by int8_quantize from the bf16 weights: tiles of 16 output columns; per
 * tile and block of 32 inputs, the 16 columns' bf16 scales d (32 bytes), the 16 columns' sums of
 * their 32 codes as int16 (32 bytes: the VNNI kernel's offset correction), then 8 chunks of 64
 * bytes: chunk i holds, for column c, one 32-bit word with the codes of inputs 4i .. 4i + 3. A
 * word is what one vector lane needs. d is rounded to bf16 before the codes are taken, so
 * w ~ d * q with |w - d q| <= d / 2, q in [-127, 127].
 *
 * Two kernels over that one layout, each taking up to RB rows of x per pass over the bytes:
 *   f32: x in fp32 (from bf16); each code turned to fp32, times its scale, FMA'd into RB rows.
 *   i8:  x quantized per 32 inputs to int8 with a scale (as int4_matmul.c's), 4 products summed
 *        per instruction into int32. VNNI (dpbusd: unsigned x signed) takes x + 128 as the
 *        unsigned side and subtracts 128 * sum(q) per block; without VNNI, maddubs over |q| and
 *        x with q's sign (llama.cpp's trick: no int16 overflow).
 * VW (8: AVX2, 16: AVX-512) and VNNI are -D constants: one build per instruction set, chosen at
 * run time by the CPU's flags; the vector mappings, the int8 rows and the tile driver are
 * native_common.h's. OpenMP splits the tiles over threads.
 *
 * x:   bf16 [rows][k], k a multiple of 32     out: fp32 [rows][out_stride], columns [0, n)
 * w:   int8_bytes(n, k) bytes
 */
#include <stdint.h>
#include <string.h>

#ifndef VW
#error "compile with -DVW=8 (AVX2) or -DVW=16 (AVX-512)"
#endif

#include "native_common.h"

#define BLOCK_BYTES (64 + TILE * XB)

size_t int8_bytes(int64_t n, int64_t k) {
    return (size_t)((n + TILE - 1) / TILE) * (size_t)(k / XB) * BLOCK_BYTES;
}

/* weights bf16 [n][k] -> the layout. Columns past n (the last tile's padding): scale 0, code 0. */
void int8_quantize(const uint16_t *weights, int64_t n, int64_t k, uint8_t *w) {
    const int64_t tiles = (n + TILE - 1) / TILE, blocks = k / XB;
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = w + ((size_t)t * blocks + b) * BLOCK_BYTES;
            uint16_t *scales = (uint16_t *)dst;
            int16_t *sums = (int16_t *)(dst + 32);
            for (int j = 0; j < TILE; j++) {
                const int64_t c = t * TILE + j;
                int8_t q[XB] = {0};
                float d = 0.0f;
                if (c < n) {
                    const uint16_t *src = weights + c * k + b * XB;
                    float amax = 0.0f;
                    for (int i = 0; i < XB; i++) {
                        const float a = __builtin_fabsf(from_bf16(src[i]));
                        amax = a > amax ? a : amax;
                    }
                    scales[j] = to_bf16(amax / 127.0f);
                    d = from_bf16(scales[j]);
                    const float inverse = d > 0 ? 1.0f / d : 0.0f;
                    for (int i = 0; i < XB; i++) {
                        float v = __builtin_roundf(from_bf16(src[i]) * inverse);
                        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                        q[i] = (int8_t)v;
                    }
                } else {
                    scales[j] = 0;
                }
                int sum = 0;
                for (int i = 0; i < XB; i++) sum += q[i];
                sums[j] = (int16_t)sum;
                for (int i = 0; i < XB; i++) dst[64 + (i / 4) * 64 + j * 4 + i % 4] = (uint8_t)q[i];
            }
        }
    }
}

/* rows ids[0 .. count) of the weights, dequantized, into out bf16 [count][k] (an embedding
   table read from the same bytes); ids outside [0, n) give -1 and write nothing more. */
int int8_rows(const uint8_t *w, int64_t n, int64_t k, const int64_t *ids, int64_t count,
              uint16_t *out) {
    const int64_t blocks = k / XB;
    for (int64_t r = 0; r < count; r++) {
        const int64_t c = ids[r];
        if (c < 0 || c >= n) return -1;
        const int64_t t = c / TILE, j = c % TILE;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *src = w + ((size_t)t * blocks + b) * BLOCK_BYTES;
            const float d = from_bf16(((const uint16_t *)src)[j]);
            for (int i = 0; i < XB; i++) {
                const int8_t q = (int8_t)src[64 + (i / 4) * 64 + j * 4 + i % 4];
                out[r * k + b * XB + i] = to_bf16(d * (float)q);
            }
        }
    }
    return 0;
}

static inline __attribute__((always_inline)) void store_rows(const vf *acc, int R, int64_t col,
                                                            int64_t n, float *out,
                                                            int64_t out_stride) {
    for (int r = 0; r < R; r++) {
        float *dst = out + r * out_stride + col;
        if (col + VW <= n) {
            memcpy(dst, &acc[r], sizeof(vf));
        } else {
            for (int j = 0; j < VW && col + j < n; j++) dst[j] = acc[r][j];
        }
    }
}

/* f32: R rows of one tile's VW-column half. xf: fp32 [R][k]. */
static inline __attribute__((always_inline)) void f32_rows(const uint8_t *tile, int64_t blocks,
                                                          int half, const float *xf, int64_t k,
                                                          int R, vf *acc) {
    for (int r = 0; r < R; r++) acc[r] = (vf){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *src = tile + b * BLOCK_BYTES;
        const vf s = load_bf16((const uint16_t *)src + half * VW);
        for (int i = 0; i < XB / 4; i++) {
            const vi words = (vi)load_words(src + 64 + i * 64 + half * VW * 4);
            const float *xg = xf + b * XB + i * 4;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const vf w = __builtin_convertvector((words << (24 - 8 * j)) >> 24, vf) * s;
                for (int r = 0; r < R; r++) acc[r] += w * xg[r * k + j];
            }
        }
    }
}

/* i8: xq [R][k] (VNNI: x + 128 as uint8; else int8), dx [R][blocks]. */
static inline __attribute__((always_inline)) void i8_rows(const uint8_t *tile, int64_t blocks,
                                                         int half, const uint8_t *xq,
                                                         const float *dx, int64_t k, int R,
                                                         vf *acc) {
    for (int r = 0; r < R; r++) acc[r] = (vf){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *src = tile + b * BLOCK_BYTES;
        const vf s = load_bf16((const uint16_t *)src + half * VW);
        ivec dot[R];
        for (int r = 0; r < R; r++) dot[r] = izero();
#pragma GCC unroll 8
        for (int i = 0; i < XB / 4; i++) {
            const ivec words = load_words(src + 64 + i * 64 + half * VW * 4);
#if VNNI
            for (int r = 0; r < R; r++) dot[r] = dot4(dot[r], splat32(xq + r * k + b * XB + i * 4), words);
#else
            const ivec wabs = abs8(words); /* |w| x (x with w's sign) */
            for (int r = 0; r < R; r++)
                dot[r] = dot4(dot[r], wabs, sign8(splat32(xq + r * k + b * XB + i * 4), words));
#endif
        }
#if VNNI
        const vf correction = __builtin_convertvector(load_i16((const int16_t *)(src + 32) + half * VW), vf) * 128.0f;
        for (int r = 0; r < R; r++) acc[r] += (to_float(dot[r]) - correction) * (s * dx[r * blocks + b]);
#else
        for (int r = 0; r < R; r++) acc[r] += to_float(dot[r]) * (s * dx[r * blocks + b]);
#endif
    }
}

#define F32_CASE(R)                                                                           \
    case R: {                                                                                 \
        vf acc[R];                                                                            \
        f32_rows(tile, blocks, half, xf, k, R, acc);                                          \
        store_rows(acc, R, col, n, out, out_stride);                                          \
    } break;

static void f32_block(const uint8_t *tile, int64_t col0, int64_t blocks, const float *xf,
                      int64_t count, int64_t k, int64_t n, float *out, int64_t out_stride) {
    TILE_HALVES(col0, n, count, ROW_CASES_F32(F32_CASE))
}

#define I8_CASE(R)                                                                            \
    case R: {                                                                                 \
        vf acc[R];                                                                            \
        i8_rows(tile, blocks, half, xq, dx, k, R, acc);                                       \
        store_rows(acc, R, col, n, out, out_stride);                                          \
    } break;

static void i8_block(const uint8_t *tile, int64_t col0, int64_t blocks, const uint8_t *xq,
                     const float *dx, int64_t count, int64_t k, int64_t n, float *out,
                     int64_t out_stride) {
    TILE_HALVES(col0, n, count, ROW_CASES_I8(I8_CASE))
}

/* out[rows][0..n) = x[rows][k] @ dequantized(w)^T. int8: 0 for the f32 kernel, 1 for the i8
   one. threads <= 1: the calling thread only. 0; -1: no memory; -2: k not a multiple of 32. */
int int8_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
                float *out, int64_t out_stride, int64_t threads, int64_t int8) {
    if (k % XB) return -2;
    const int64_t tiles = (n + TILE - 1) / TILE, blocks = k / XB;
    const size_t tbytes = (size_t)blocks * BLOCK_BYTES;
    if (int8) {
        const size_t scales = (size_t)rows * (size_t)blocks;
        char *buffer = scratch_for(scales * sizeof(float) + (size_t)rows * k + 64);
        if (!buffer) return -1;
        float *dx = (float *)buffer;
        uint8_t *xq = (uint8_t *)(dx + scales);
        quantize_rows(x, rows, k, xq, dx, NULL, VNNI ? 128 : 0); /* VNNI: x + 128, unsigned */
        FOR_EACH_TILE(tiles, rows, RB_I8, threads,
                      i8_block(w + t * tbytes, t * TILE, blocks, xq + r0 * k, dx + r0 * blocks,
                               count, k, n, out + r0 * out_stride, out_stride));
        return 0;
    }
    float *xf = scratch_for((size_t)rows * k * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < rows * k; i++) xf[i] = from_bf16(x[i]);
    FOR_EACH_TILE(tiles, rows, RB_F32, threads,
                  f32_block(w + t * tbytes, t * TILE, blocks, xf + r0 * k, count, k, n,
                            out + r0 * out_stride, out_stride));
    return 0;
}

int int8_vector_width(void) { return VW; }
