// Rows of x quantized to 8 bits per 32 values, the form gguf_dots.h's integer dot products read.
//
// Each block of 32 values gets d = max |x| / 127, q = x / d rounded to nearest (ties to even) and the
// sum of its q as d * sum, the term a block with an offset (Q4_1's + m, Q4_K's - dmin * m) needs. The
// operations are exactly rounded and written once here, outside every instruction set's region, so a
// row quantizes to the same bytes on every build, thread and batch. A block holding an infinity or
// NaN gets d = NaN and q = 0, so the products it enters are NaN, as the float32 product would be.

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace strata {

struct Activations {
  int64_t k = 0;            // values per row, a whole number of blocks of 32
  std::vector<int8_t> q;    // [m, k]
  std::vector<float> d;     // [m, k / 32]: each block's scale
  std::vector<float> sum;   // [m, k / 32]: each block's d * (sum of its q)

  const int8_t* row_q(int64_t row) const { return q.data() + row * k; }
  const float* row_d(int64_t row) const { return d.data() + row * (k / 32); }
  const float* row_sum(int64_t row) const { return sum.data() + row * (k / 32); }
};

// Rounds |v| < 2^22 to the nearest integer, ties to even, with float additions only (this file's
// users compile with contraction off, so the two additions are two roundings): vectorizable, and the
// same as the AVX2 conversion instruction under the default rounding mode.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

inline void quantize_block(const float* x, int8_t* q, float* d, float* sum) {
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < 32; ++j) {
    const float a = std::fabs(x[j]);
    finite = finite && a <= std::numeric_limits<float>::max();
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    for (int j = 0; j < 32; ++j) q[j] = 0;
    *d = std::numeric_limits<float>::quiet_NaN();
    *sum = *d;
    return;
  }
  const float scale = amax / 127.0f;
  const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
  int total = 0;
  for (int j = 0; j < 32; ++j) {
    const int v = static_cast<int>(round_even(x[j] * inverse));
    q[j] = static_cast<int8_t>(v);
    total += v;
  }
  *d = scale;
  *sum = scale * static_cast<float>(total);
}

// x [m, k] float32 into `out`, its buffers grown as needed; k must be a multiple of 32.
inline void quantize_activations(const float* x, int64_t m, int64_t k, Activations* out) {
  const int64_t blocks = k / 32;
  out->k = k;
  out->q.resize(static_cast<size_t>(m * k));
  out->d.resize(static_cast<size_t>(m * blocks));
  out->sum.resize(static_cast<size_t>(m * blocks));
  for (int64_t i = 0; i < m * blocks; ++i) {
    quantize_block(x + i * 32, out->q.data() + i * 32, out->d.data() + i, out->sum.data() + i);
  }
}

}  // namespace strata
