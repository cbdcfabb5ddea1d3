// What gguf_blocks.h's decoders hand their values to, and the two row functions built on them:
// dequantize_row stores a row's values; dot_rows multiplies them by up to kDotRows rows of x in
// registers, so the dequantized weight never lands in memory. Included by gguf_linear.cpp once per
// instruction set right after gguf_blocks.h, in the same namespace and `#pragma GCC target` region.
//
// Dot adds each value to its row's sum with the float32 kernel's own operations and order
// (small_linear.cpp: one fused multiply-add per lane-wide chunk in increasing k, then the same
// horizontal sum; one scalar multiply-add per value, in order, for the portable build), so a dot
// product equals that kernel's on the dequantized row bit for bit, on every instruction set.
//
// No include guard: included once per instruction set, on purpose.

namespace STRATA_GGUF_NS {

constexpr int kDotRows = 4;  // rows of x one decoding of a weight row serves

struct Store {
  float* y;
  void operator()(int64_t offset, vf v) const { std::memcpy(y + offset, &v, sizeof v); }
};

#if STRATA_LANES == 16
using Sum = vf;
inline Sum add_products(Sum sum, vf w, const float* x) {
  return (vf)_mm512_fmadd_ps((__m512)w, _mm512_loadu_ps(x), (__m512)sum);
}
inline float total(Sum sum) { return _mm512_reduce_add_ps((__m512)sum); }
#elif STRATA_LANES == 8
using Sum = vf;
inline Sum add_products(Sum sum, vf w, const float* x) {
  return (vf)_mm256_fmadd_ps((__m256)w, _mm256_loadu_ps(x), (__m256)sum);
}
// small_linear.cpp adds its scalar tail, 0.0f for a row of whole blocks, to the horizontal sum.
inline float total(Sum sum) { return strata::hsum256((__m256)sum) + 0.0f; }
#else
using Sum = float;
inline Sum add_products(Sum sum, vf w, const float* x) {
  for (int l = 0; l < kLanes; ++l) sum += w[l] * x[l];
  return sum;
}
inline float total(Sum sum) { return sum; }
#endif

// The sums of rows [0, R) of x (k apart) with one weight row, built as its values arrive.
template <int R>
struct Dot {
  const float* x;
  int64_t k;
  Sum sums[R] = {};
  void operator()(int64_t offset, vf w) {
    for (int i = 0; i < R; ++i) sums[i] = add_products(sums[i], w, x + i * k + offset);
  }
};

inline bool dequantize_row(int64_t type, const uint8_t* row, float* y, int64_t k) {
  Store sink{y};
  return decode_row(type, row, sink, k);
}

template <int R>
inline void dot_group(int64_t type, const uint8_t* row, const float* x, int64_t k, float* dots) {
  Dot<R> sink{x, k};
  decode_row(type, row, sink, k);
  for (int i = 0; i < R; ++i) dots[i] = total(sink.sums[i]);
}

// dots[i] = x[i] . dequant(row) for i < m, decoding the row once per kDotRows rows of x.
inline void dot_rows(int64_t type, const uint8_t* row, const float* x, int64_t m, int64_t k, float* dots) {
  for (int64_t i = 0; i < m; i += kDotRows) {
    switch (std::min<int64_t>(kDotRows, m - i)) {
      case 1:
        dot_group<1>(type, row, x + i * k, k, dots + i);
        break;
      case 2:
        dot_group<2>(type, row, x + i * k, k, dots + i);
        break;
      case 3:
        dot_group<3>(type, row, x + i * k, k, dots + i);
        break;
      default:
        dot_group<kDotRows>(type, row, x + i * k, k, dots + i);
        break;
    }
  }
}

}  // namespace STRATA_GGUF_NS
