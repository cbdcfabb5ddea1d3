// Rows of x quantized to 8 bits per block of values, the form gguf_dots.h's integer dot products read:
// blocks of 32 for the types of 32-value blocks, of 256 for the K types (one scale per super-block, as
// ggml's Q8_K gives them, so a super-block's eight sub-block sums add up in integers before one float
// multiply-add).
//
// Each block gets d = max |x| / 127, q = x / d rounded to nearest (ties to even), each 32 values' sum
// of q as an integer, and for blocks of 32 that sum as d * sum, the term a block with an offset (Q4_1's
// + m) needs. The operations are exactly rounded and written once here, outside every instruction
// set's region, so a row quantizes to the same bytes on every build, thread and batch. A block holding
// an infinity or NaN gets d = NaN and q = 0, so the products it enters are NaN, as the float32 product
// would be.

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace strata {

struct Activations {
  int64_t k = 0;               // values per row, a whole number of blocks
  int64_t block = 32;          // values per scale: 32, or 256 for the K types
  std::vector<int8_t> q;       // [m, k]
  std::vector<float> d;        // [m, k / block]: each block's scale
  std::vector<float> sum;      // [m, k / 32]: d * (sum of the 32 values' q), for blocks of 32
  std::vector<int32_t> isum;   // [m, k / 32]: each 32 values' sum of q

  const int8_t* row_q(int64_t row) const { return q.data() + row * k; }
  const float* row_d(int64_t row) const { return d.data() + row * (k / block); }
  const float* row_sum(int64_t row) const { return sum.data() + row * (k / 32); }
  const int32_t* row_isum(int64_t row) const { return isum.data() + row * (k / 32); }
};

// Rounds |v| < 2^22 to the nearest integer, ties to even, with float additions only (this file's
// users compile with contraction off, so the two additions are two roundings): vectorizable, and the
// same as the AVX2 conversion instruction under the default rounding mode.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// n (32 or 256) values of x: their q, their scale, and each 32's integer sum (and d * it into `sum`).
inline void quantize_block(const float* x, int64_t n, int8_t* q, float* d, float* sum, int32_t* isum) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::fabs(x[j]);
    finite = finite && a <= std::numeric_limits<float>::max();
    amax = a > amax ? a : amax;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float scale = finite ? amax / 127.0f : nan;
  const float inverse = finite && scale != 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t s = 0; s < n / 32; ++s) {
    int total = 0;
    for (int64_t j = s * 32; j < s * 32 + 32; ++j) {
      const int v = finite ? static_cast<int>(round_even(x[j] * inverse)) : 0;
      q[j] = static_cast<int8_t>(v);
      total += v;
    }
    isum[s] = total;
    if (n == 32) *sum = scale * static_cast<float>(total);
  }
  *d = scale;
}

// `out`'s buffers grown for m rows of k values in blocks of `block` (32 or 256, dividing k).
inline void size_activations(int64_t m, int64_t k, int64_t block, Activations* out) {
  out->k = k;
  out->block = block;
  out->q.resize(static_cast<size_t>(m * k));
  out->d.resize(static_cast<size_t>(m * (k / block)));
  out->sum.resize(static_cast<size_t>(m * (k / 32)));
  out->isum.resize(static_cast<size_t>(m * (k / 32)));
}

// Row `row` of x (its k values at x) into `out`, sized for it.
inline void quantize_row(const float* x, int64_t row, Activations* out) {
  const int64_t k = out->k;
  const int64_t block = out->block;
  for (int64_t at = 0; at < k; at += block) {
    const int64_t flat = row * k + at;
    quantize_block(x + at, block, out->q.data() + flat, out->d.data() + flat / block, out->sum.data() + flat / 32,
                   out->isum.data() + flat / 32);
  }
}

// x [m, k] float32 into `out` in blocks of `block` (32 or 256, dividing k), its buffers grown as needed.
inline void quantize_activations(const float* x, int64_t m, int64_t k, int64_t block, Activations* out) {
  size_activations(m, k, block, out);
  for (int64_t row = 0; row < m; ++row) quantize_row(x + row * k, row, out);
}

// Calls f(std::integral_constant<int, R>{}) with R = min(count, Max) for count >= 1: the kernels' row
// counts are template arguments, and this turns a run-time count into one. Always inlined, so f's body
// keeps the instructions of the region that calls it (see gguf_linear.cpp).
template <int Max, class F>
[[gnu::always_inline]] inline void with_rows(int64_t count, F&& f) {
  if constexpr (Max > 1) {
    if (count < Max) {
      with_rows<Max - 1>(count, f);
      return;
    }
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace strata
