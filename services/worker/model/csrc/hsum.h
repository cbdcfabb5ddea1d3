// The horizontal sum of eight float32 lanes, in one fixed order: small_linear.cpp's AVX2 tiles and
// gguf_dots.h's integer dot products both end with it, so their sums agree bit for bit.

#pragma once

#include <immintrin.h>

namespace strata {

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace strata
