/* 8-bit matmul for the CPU runner's lm_head (engine/runners/int4_linear.py, built by
 * engine/runners/native.py): out = x @ W^T in fp32, W int8 in memory with one scale per 32
 * inputs of each output column (llama.cpp's Q8_0: SmolLM2's GGUF stores its tied embedding so).
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
 * run time by the CPU's flags. OpenMP splits the tiles over threads.
 *
 * x:   bf16 [rows][k], k a multiple of 32     out: fp32 [rows][out_stride], columns [0, n)
 * w:   int8_bytes(n, k) bytes
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef VW
#error "compile with -DVW=8 (AVX2) or -DVW=16 (AVX-512)"
#endif
#ifndef VNNI
#define VNNI 0
#endif

#define TILE 16
#define HALVES (TILE / VW)
#define XB 32 /* inputs per block (weights and activations alike) */
#define BLOCK_BYTES (64 + TILE * XB)
#define RB_F32 (VW == 16 ? 16 : 8)
#define RB_I8 (VW == 16 ? 8 : 4)

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

#if VW == 16
typedef __m512i ivec;
static inline vf load_bf16(const uint16_t *p) {
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16);
    return (vf)_mm512_castsi512_ps(u);
}
static inline vi load_i16(const int16_t *p) {
    return (vi)_mm512_cvtepi16_epi32(_mm256_loadu_si256((const void *)p));
}
static inline ivec load_words(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec splat32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#if VNNI
static inline ivec dot4(ivec acc, ivec xu, ivec w) { return _mm512_dpbusd_epi32(acc, xu, w); }
#else
static inline ivec dot4_signed(ivec acc, ivec wabs, ivec w, ivec x) {
    const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    const __m512i pairs = _mm512_maddubs_epi16(wabs, xs);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
static inline ivec absolute(ivec w) { return _mm512_abs_epi8(w); }
#endif
static inline vf to_float(ivec v) { return (vf)_mm512_cvtepi32_ps(v); }
static inline ivec izero(void) { return _mm512_setzero_si512(); }
#else
typedef __m256i ivec;
static inline vf load_bf16(const uint16_t *p) {
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16);
    return (vf)_mm256_castsi256_ps(u);
}
static inline vi load_i16(const int16_t *p) {
    return (vi)_mm256_cvtepi16_epi32(_mm_loadu_si128((const void *)p));
}
static inline ivec load_words(const uint8_t *p) { return _mm256_loadu_si256((const void *)p); }
static inline ivec splat32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#if VNNI
static inline ivec dot4(ivec acc, ivec xu, ivec w) { return _mm256_dpbusd_avx_epi32(acc, xu, w); }
#else
static inline ivec dot4_signed(ivec acc, ivec wabs, ivec w, ivec x) {
    const __m256i pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline ivec absolute(ivec w) { return _mm256_abs_epi8(w); }
#endif
static inline vf to_float(ivec v) { return (vf)_mm256_cvtepi32_ps(v); }
static inline ivec izero(void) { return _mm256_setzero_si256(); }
#endif

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

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
            const ivec wabs = absolute(words);
            for (int r = 0; r < R; r++)
                dot[r] = dot4_signed(dot[r], wabs, words, splat32(xq + r * k + b * XB + i * 4));
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
    for (int half = 0; half < HALVES; half++) {
        const int64_t col = col0 + half * VW;
        if (col >= n) break;
        switch (count) {
            F32_CASE(1) F32_CASE(2) F32_CASE(3) F32_CASE(4)
            F32_CASE(5) F32_CASE(6) F32_CASE(7) F32_CASE(8)
#if RB_F32 > 8
            F32_CASE(9) F32_CASE(10) F32_CASE(11) F32_CASE(12)
            F32_CASE(13) F32_CASE(14) F32_CASE(15) F32_CASE(16)
#endif
        default: break;
        }
    }
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
    for (int half = 0; half < HALVES; half++) {
        const int64_t col = col0 + half * VW;
        if (col >= n) break;
        switch (count) {
            I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4)
#if RB_I8 > 4
            I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8)
#endif
        default: break;
        }
    }
}

/* Per calling thread (OpenMP workers only read it): the activations in the kernel's form. */
static __thread void *scratch = 0;
static __thread size_t scratch_size = 0;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch);
        scratch = malloc(bytes);
        scratch_size = scratch ? bytes : 0;
    }
    return scratch;
}

/* x [rows][k] bf16 -> int8 per block of XB (scale dx = max|x| / 127); VNNI: stored + 128. */
static void quantize_rows(const uint16_t *x, int64_t rows, int64_t k, uint8_t *xq, float *dx) {
    const int64_t blocks = k / XB;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            float v[XB], amax = 0.0f;
            for (int i = 0; i < XB; i++) {
                v[i] = from_bf16(x[r * k + b * XB + i]);
                const float a = __builtin_fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
            for (int i = 0; i < XB; i++) {
                const int q = (int)__builtin_roundf(v[i] * inverse);
                xq[r * k + b * XB + i] = (uint8_t)(VNNI ? q + 128 : q);
            }
            dx[r * blocks + b] = d;
        }
    }
}

/* out[rows][0..n) = x[rows][k] @ dequantized(w)^T. int8: 0 for the f32 kernel, 1 for the i8
   one. threads <= 1: the calling thread only. 0; -1: no memory; -2: k not a multiple of 32. */
int int8_matmul(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
                float *out, int64_t out_stride, int64_t threads, int64_t int8) {
    if (k % XB) return -2;
    const int64_t tiles = (n + TILE - 1) / TILE, blocks = k / XB;
    const size_t tbytes = (size_t)blocks * BLOCK_BYTES;
    const int team = threads > 1 ? (int)threads : 1;
    (void)team;
    if (int8) {
        const size_t scales = (size_t)rows * (size_t)blocks;
        char *buffer = scratch_for(scales * sizeof(float) + (size_t)rows * k + 64);
        if (!buffer) return -1;
        float *dx = (float *)buffer;
        uint8_t *xq = (uint8_t *)(dx + scales);
        quantize_rows(x, rows, k, xq, dx);
        const int64_t chunks = (rows + RB_I8 - 1) / RB_I8;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
#endif
        for (int64_t t = 0; t < tiles; t++) {
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t r0 = c * RB_I8, count = rows - r0 < RB_I8 ? rows - r0 : RB_I8;
                i8_block(w + t * tbytes, t * TILE, blocks, xq + r0 * k, dx + r0 * blocks, count,
                         k, n, out + r0 * out_stride, out_stride);
            }
        }
        return 0;
    }
    float *xf = scratch_for((size_t)rows * k * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < rows * k; i++) xf[i] = from_bf16(x[i]);
    const int64_t chunks = (rows + RB_F32 - 1) / RB_F32;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
#endif
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t r0 = c * RB_F32, count = rows - r0 < RB_F32 ? rows - r0 : RB_F32;
            f32_block(w + t * tbytes, t * TILE, blocks, xf + r0 * k, count, k, n,
                      out + r0 * out_stride, out_stride);
        }
    }
    return 0;
}

int int8_vector_width(void) { return VW; }
