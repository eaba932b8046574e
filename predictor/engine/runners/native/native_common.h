/* predictor/engine/runners/native/native_common.h: what the runner's C kernels share, as llama.cpp's
 * ggml-cpu/simd-mappings.h serves its kernels. Included by decode_attention.c, layer_ops.c,
 * int4_matmul.c and int8_matmul.c; bindings.py compiles them with this folder on the include path
 * and keys its library cache on this file's text too, so an edit here rebuilds them all.
 *
 * Every kernel:
 *   from_bf16, to_bf16   bf16 <-> fp32 (round to nearest even, as torch does)
 *   exp_approx           exp(x) in fp32, relative error ~2e-7 (softmax, SiLU)
 * The matmuls (built with -DVW=8, AVX2, or -DVW=16, AVX-512; -DVNNI=1 where the CPU has it):
 *   TILE, HALVES, XB, RB_F32, RB_I8   the packed layout's tile and block, rows a pass serves
 *   vf, vi, ivec and the ISA mappings   load_bf16, load_i16, load_words, splat32, dot4,
 *                                        sign8, abs8, to_float, izero
 *   scratch_for          the calling thread's buffer for the activations in a kernel's form
 *   quantize_rows        bf16 rows to int8 per XB inputs with a scale (llama.cpp's Q8)
 *   FOR_EACH_TILE, TILE_HALVES, ROW_CASES_F32, ROW_CASES_I8   the tile driver: tiles over
 *                        OpenMP threads, rows RB at a time, a case per row count
 */
#ifndef NATIVE_COMMON_H
#define NATIVE_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp_approx's reduction and polynomial, for a float or a vector of floats (GCC's vector
   extensions take the same expressions): x clamped, n = x / ln 2 rounded to an integer; sets
   p, where exp(x) = p * 2^n. One text for exp_approx here and decode_attention.c's vectors. */
#define EXP_POLYNOMIAL(x, n, p)                                                               \
    do {                                                                                     \
        const __typeof__(x) r_ = (x) - (n) * 0.693145751953125f                              \
                                 - (n) * 1.428606765330187045e-06f;                          \
        (p) = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                      \
        (p) = (p) * r_ + 8.3334519073e-3f;                                                   \
        (p) = (p) * r_ + 4.1665795894e-2f;                                                   \
        (p) = (p) * r_ + 1.6666665459e-1f;                                                   \
        (p) = (p) * r_ + 5.0000001201e-1f;                                                   \
        (p) = (p) * r_ * r_ + r_ + 1.0f;                                                     \
    } while (0)

/* exp(x), relative error ~2e-7 on [-87, 88] (clamped outside). For x <= 0 (a softmax's
   numerators after subtracting the maximum) only the lower clamp acts. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_roundf(x * 1.44269504088896341f);
    float p;
    EXP_POLYNOMIAL(x, n, p);
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

#ifdef VW /* the matmuls: one build per instruction set */
#include <immintrin.h>

#ifndef VNNI
#define VNNI 0
#endif

#define TILE 16            /* output columns per tile of the packed weights */
#define HALVES (TILE / VW) /* vectors per tile */
#define XB 32              /* inputs per int8 block (activations; int8 weights too) */

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
static inline ivec splat32(const void *p) { /* 4 bytes into every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
/* acc + the sums of 4 products of unsigned u8 and signed s8 bytes, per 32-bit lane (without
   VNNI, pairs summed in int16 first: saturating, so |u8 * s8| * 2 must fit, as in both uses) */
static inline ivec dot4(ivec acc, ivec u8, ivec s8) {
#if VNNI
    return _mm512_dpbusd_epi32(acc, u8, s8);
#else
    const __m512i pairs = _mm512_maddubs_epi16(u8, s8); /* 15 * 127 * 2 fits int16 */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
/* x negated where w is negative, byte by byte (where w is 0 its product with |w| is 0 anyway) */
static inline ivec sign8(ivec x, ivec w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
static inline ivec abs8(ivec w) { return _mm512_abs_epi8(w); }
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
static inline ivec splat32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline ivec dot4(ivec acc, ivec u8, ivec s8) {
#if VNNI
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#else
    const __m256i pairs = _mm256_maddubs_epi16(u8, s8);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline ivec sign8(ivec x, ivec w) { return _mm256_sign_epi8(x, w); }
static inline ivec abs8(ivec w) { return _mm256_abs_epi8(w); }
static inline vf to_float(ivec v) { return (vf)_mm256_cvtepi32_ps(v); }
static inline ivec izero(void) { return _mm256_setzero_si256(); }
#endif

/* The calling thread's buffer of at least `bytes` (kept for its next call; OpenMP workers only
   read it): the activations in a kernel's form. NULL: no memory. */
static inline void *scratch_for(size_t bytes) {
    static __thread void *buffer = 0;
    static __thread size_t size = 0;
    if (bytes > size) {
        free(buffer);
        buffer = malloc(bytes);
        size = buffer ? bytes : 0;
    }
    return buffer;
}

/* x [rows][k] bf16 -> int8 per block of XB inputs: q = round(x / d), d = max|x| / 127 into
   dx [rows][k / XB], stored as the byte q + offset (0, or 128: VNNI's unsigned side) into
   xq [rows][k]; where xs is not NULL, each block's sum of the quantized x, d * sum(q), into
   xs [rows][k / XB]. Of the quantized x, not of x: a 4-bit weight is s * code + m with codes
   0..15, and its kernel adds m * xs to s * d * sum(code * q); with the sum of x itself, the
   rounding errors of x are weighed by the codes (7.5 on average) instead of by the weights
   (near 0), 2x the error: SmolLM2-135M's served perplexity 3% over fp32 activations'. */
static inline void quantize_rows(const uint16_t *x, int64_t rows, int64_t k, uint8_t *xq,
                                 float *dx, float *xs, int offset) {
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
            int sum = 0;
            for (int i = 0; i < XB; i++) {
                const int q = (int)__builtin_roundf(v[i] * inverse);
                xq[r * k + b * XB + i] = (uint8_t)(q + offset);
                sum += q;
            }
            dx[r * blocks + b] = d;
            if (xs) xs[r * blocks + b] = d * (float)sum;
        }
    }
}

/* The tile driver. out = x @ w^T in tiles of TILE output columns, the tiles split over
   `threads` (OpenMP, where built with it; else the calling thread), each tile taking x's rows
   `rb` at a time (the rows one pass over the tile's bytes serves, as registers allow): BLOCK
   (a statement) runs for tile `t` and rows [r0, r0 + count). */
#ifdef _OPENMP
#define OMP_TILES _Pragma("omp parallel for schedule(static) num_threads(team_) if (team_ > 1)")
#else
#define OMP_TILES
#endif
#define FOR_EACH_TILE(tiles, rows, rb, threads, BLOCK)                                        \
    do {                                                                                      \
        const int64_t tiles_ = (tiles), rows_ = (rows), chunks_ = (rows_ + (rb) - 1) / (rb);  \
        const int team_ = (threads) > 1 ? (int)(threads) : 1;                                 \
        (void)team_;                                                                          \
        OMP_TILES                                                                        \
        for (int64_t t = 0; t < tiles_; t++) {                                                \
            for (int64_t c_ = 0; c_ < chunks_; c_++) {                                        \
                const int64_t r0 = c_ * (rb), count = rows_ - r0 < (rb) ? rows_ - r0 : (rb);  \
                BLOCK;                                                                        \
            }                                                                                 \
        }                                                                                     \
    } while (0)

/* A block's body: each VW-column half of the tile at column col0 (one at VW 16, two at VW 8)
   that starts below column n, through the case for `count` rows; CASES is ROW_CASES_F32(CASE)
   or ROW_CASES_I8(CASE), CASE(R) a `case R:` that sees `half` and `col`. */
#define TILE_HALVES(col0, n, count, CASES)                                                    \
    for (int half = 0; half < HALVES; half++) {                                               \
        const int64_t col = (col0) + half * VW;                                               \
        if (col >= (n)) break;                                                                \
        switch (count) {                                                                      \
            CASES                                                                             \
        default: break;                                                                       \
        }                                                                                     \
    }

/* Rows sharing one pass over the weights: what the registers hold (fp32: RB accumulators and
   the dequantized vector; int8: RB int32 dot products beside them). AVX-512's 32 registers
   hold 12 int8 rows: a step's row and 8 drafts verified in one pass, not 8 + 1 (a second pass
   over the weights for one row). Measured, Xeon family 6 model 167, 1 thread, 9 rows: a
   1536x576 int4 matmul from memory 84.5 -> 71.6 us, lm_head 49152x576 int8 1852 -> 1655 us;
   8 rows and fewer unchanged, 16 rows (12 + 4) 127 -> 121 us. */
#define CASES_1_4(CASE) CASE(1) CASE(2) CASE(3) CASE(4)
#define CASES_5_8(CASE) CASE(5) CASE(6) CASE(7) CASE(8)
#define CASES_9_12(CASE) CASE(9) CASE(10) CASE(11) CASE(12)
#define CASES_9_16(CASE) CASES_9_12(CASE) CASE(13) CASE(14) CASE(15) CASE(16)
#if VW == 16
#define RB_F32 16
#define RB_I8 12
#define ROW_CASES_F32(CASE) CASES_1_4(CASE) CASES_5_8(CASE) CASES_9_16(CASE)
#define ROW_CASES_I8(CASE) CASES_1_4(CASE) CASES_5_8(CASE) CASES_9_12(CASE)
#else
#define RB_F32 8
#define RB_I8 4
#define ROW_CASES_F32(CASE) CASES_1_4(CASE) CASES_5_8(CASE)
#define ROW_CASES_I8(CASE) CASES_1_4(CASE)
#endif

#endif /* VW */
#endif /* NATIVE_COMMON_H */
