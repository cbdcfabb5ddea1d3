// RMSNorm in float32, optionally fused with the residual add before it: h = x + residual (stored),
// out = (h * rsqrt(mean(h^2) + eps)) * weight, in transformers' order of operations.
//
// torch's CPU rms_norm composes about ten operators per call (tens of microseconds on one decode
// row, twice per layer); this is one pass over the row. Rows run in parallel on ATen's pool when
// there are enough of them. The instruction set is chosen at run time. Called through ctypes.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "isa.h"

#include <cmath>
#include <cstdint>

namespace {

__attribute__((target("avx512f"))) float add_square_sum_avx512(const float* x, const float* residual, float* sum,
                                                               int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 h = _mm512_loadu_ps(x + i);
    if (residual != nullptr) {
      h = _mm512_add_ps(h, _mm512_loadu_ps(residual + i));
      _mm512_storeu_ps(sum + i, h);
    }
    acc = _mm512_fmadd_ps(h, h, acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) {
    float h = x[i];
    if (residual != nullptr) {
      h += residual[i];
      sum[i] = h;
    }
    total += h * h;
  }
  return total;
}

float add_square_sum_portable(const float* x, const float* residual, float* sum, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float h = x[i];
    if (residual != nullptr) {
      h += residual[i];
      sum[i] = h;
    }
    total += h * h;
  }
  return total;
}

using SquareSum = float (*)(const float*, const float*, float*, int64_t);

SquareSum square_sum() {
  static const SquareSum chosen = [] {
    return strata::chosen_isa() == strata::Isa::kAvx512 ? add_square_sum_avx512 : add_square_sum_portable;
  }();
  return chosen;
}

}  // namespace

extern "C" {

// x, residual (or null), sum (written when residual is given; may be residual itself), out: [rows, n].
void strata_rms_norm(const float* x, const float* residual, const float* weight, float* sum, float* out, int64_t rows,
                     int64_t n, float eps) {
  const SquareSum f = square_sum();
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xr = x + r * n;
      const float* rr = residual != nullptr ? residual + r * n : nullptr;
      float* sr = sum + r * n;
      const float total = f(xr, rr, sr, n);
      const float scale = 1.0f / std::sqrt(total / static_cast<float>(n) + eps);
      const float* h = rr != nullptr ? sr : xr;
      float* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = (h[i] * scale) * weight[i];
    }
  });
}
}
