/* predictor/model/block_update.c (built and loaded by block_update.py): GPTQ's column loop over
 * one block of 128 columns, on the CPU: what gptqmodel's eager loop in GPTQ.quantize computes
 * column by column, and what its CUDA block update (gptqmodel_ext/gptq_block) computes on a GPU,
 * for asymmetric grouped quantization.
 *
 * For each pivot column p of the block, in order, and each row r:
 *   q       = scale * (clamp(round(w / scale) + zero, 0, maxq) - zero)   (Quantizer.quantize)
 *   err     = w - q;  loss = err * err / (d * d);  err = err / d         (d = hinv[p][p])
 *   w[c]   -= err * hinv[p][c]  for every column c >= p of the block
 * Each operation is one IEEE single-precision operation rounded to nearest, as torch's
 * elementwise kernels compute it: built with -ffp-contract=off (no fused multiply-add) and
 * without -ffast-math; round() is nearbyintf (half to even, torch.round); a NaN passes the
 * clamp as torch.clamp lets it. So the results equal the eager loop's bit for bit
 * (tests/model/test_block_update.py). Rows are independent; the caller releases the GIL. */
#include <math.h>
#include <stdint.h>

#define WIDTH 128

void block_update(float *work, int64_t work_stride, const float *hinv, int64_t hinv_stride,
                  const float *scale, const float *zero, int64_t scale_stride,
                  const int32_t *column_group, float *quantized, int64_t quant_stride,
                  float *errors, int64_t error_stride, float *losses, int64_t loss_stride,
                  int64_t rows, float maxq) {
    for (int64_t row = 0; row < rows; ++row) {
        float *w = work + row * work_stride;
        for (int pivot = 0; pivot < WIDTH; ++pivot) {
            const int64_t group = column_group[pivot];
            const float row_scale = scale[group * scale_stride + row];
            const float row_zero = zero[group * scale_stride + row];
            const float diagonal = hinv[pivot * hinv_stride + pivot];
            const float value = w[pivot];
            const float shifted = nearbyintf(value / row_scale) + row_zero;
            const float code = isnan(shifted) ? shifted : fminf(fmaxf(shifted, 0.0f), maxq);
            const float q = row_scale * (code - row_zero);
            const float residual = value - q;
            losses[row * loss_stride + pivot] = (residual * residual) / (diagonal * diagonal);
            const float error = residual / diagonal;
            errors[row * error_stride + pivot] = error;
            quantized[row * quant_stride + pivot] = q;
            const float *h = hinv + pivot * hinv_stride;
            for (int column = pivot; column < WIDTH; ++column) {
                const float step = error * h[column];
                w[column] = w[column] - step;
            }
        }
    }
}
