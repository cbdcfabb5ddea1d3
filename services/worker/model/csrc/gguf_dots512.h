// Dot products of GGUF weight rows of the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with
// AVX-512 VNNI: two blocks a step in one 512-bit register, the even block in its low half and the odd
// one in its high half, each block's 32 byte products summed by one dpbusd into eight int32 lanes of
// four, the same integers as gguf_dots.h's maddubs + madd sequence (which never saturates here). Each
// half then takes lanes += sums * (d_w * d_x) as one fused multiply-add, the offsets of Q4_1 and Q5_1
// add in block order, and a row's dot is hsum256(low + high): gguf_dots.h's even and odd
// accumulators, operation for operation, so a row's result is the same bits as on AVX2 and the
// portable build. The K types keep gguf_dots.h's AVX2 build, and so does one row of x against the
// 4- and 5-bit types. Included by gguf_linear.cpp once, in its AVX-512 VNNI region, after
// gguf_dots.h's AVX2 build, whose helpers it uses.

#pragma once

namespace gguf_vnni {

namespace avx2 = gguf_avx2;
using avx2::v32u;

inline __m512i pair(v32u low, v32u high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)low), (__m256i)high, 1);
}

// The rows [first, first + R) of the activations against one weight row, two blocks at a time.
template <int R>
struct PairDots {
  const int8_t* q[R];
  const float* d[R];
  const float* sum[R];
  __m512 lanes[R];  // low half: the even blocks' lanes, high half: the odd blocks'
  float offsets[R] = {};

  PairDots(const strata::Activations& a, int64_t first) {
    for (int r = 0; r < R; ++r) {
      q[r] = a.row_q(first + r);
      d[r] = a.row_d(first + r);
      sum[r] = a.row_sum(first + r);
      lanes[r] = _mm512_setzero_ps();
    }
  }

  // Blocks b and b + 1 (b alone when `single`), their weights in w and their blocks at p0 and p1 (d
  // first, then Q4_1's and Q5_1's m): signed weights meet x as |w| times x with w's sign.
  template <bool kSigned>
  void add(int64_t b, __m512i w, const uint8_t* p0, const uint8_t* p1, bool single) {
    const __mmask64 negative = kSigned ? _mm512_movepi8_mask(w) : 0;
    const __m512i weights = kSigned ? _mm512_abs_epi8(w) : w;
    const float d0 = avx2::scale_at(p0);
    const float d1 = single ? 0.0f : avx2::scale_at(p1);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = q[r] + b * 32;
      __m512i values = single ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, x) : _mm512_loadu_si512(x);
      if constexpr (kSigned) values = _mm512_mask_sub_epi8(values, negative, _mm512_setzero_si512(), values);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights, values);
      const float s0 = d0 * d[r][b];
      const float s1 = single ? 0.0f : d1 * d[r][b + 1];
      const __m512 scale = _mm512_castpd_ps(_mm512_insertf64x4(
          _mm512_castps_pd(_mm512_set1_ps(s0)), _mm256_castps_pd(_mm256_set1_ps(s1)), 1));
      lanes[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, lanes[r], single ? 0x00FF : 0xFFFF);
      if constexpr (!kSigned) {
        offsets[r] += avx2::scale_at(p0 + 2) * sum[r][b];
        if (!single) offsets[r] += avx2::scale_at(p1 + 2) * sum[r][b + 1];
      }
    }
  }

  void store(float* dots) const {
    for (int r = 0; r < R; ++r) {
      const __m256 even = _mm512_castps512_ps256(lanes[r]);
      const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes[r]), 1));
      dots[r] = strata::hsum256(_mm256_add_ps(even, odd)) + offsets[r];
    }
  }
};

// A row's blocks of kBytes each, two a step; weights(p) gives block p's 32 weights as bytes.
template <int R, bool kSigned, int64_t kBytes, typename Weights>
void pairs(const uint8_t* b, PairDots<R>& dots, int64_t blocks, Weights weights) {
  int64_t i = 0;
  for (; i + 1 < blocks; i += 2, b += 2 * kBytes)
    dots.template add<kSigned>(i, pair(weights(b), weights(b + kBytes)), b, b + kBytes, false);
  if (i < blocks) dots.template add<kSigned>(i, pair(weights(b), v32u{}), b, b, true);
}

template <int R>
void row_dots(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, float* out) {
  PairDots<R> dots(a, first);
  const int64_t blocks = a.k / 32;
  switch (type) {
    case kQ4_0:
      pairs<R, true, 18>(row, dots, blocks, [](const uint8_t* p) { return avx2::nibbles(p + 2) - 8; });
      break;
    case kQ4_1:
      pairs<R, false, 20>(row, dots, blocks, [](const uint8_t* p) { return avx2::nibbles(p + 4); });
      break;
    case kQ5_0:
      pairs<R, true, 22>(row, dots, blocks, [](const uint8_t* p) {
        return (avx2::nibbles(p + 6) | avx2::fifth_bit_values(p + 2)) - 16;
      });
      break;
    case kQ5_1:
      pairs<R, false, 24>(row, dots, blocks, [](const uint8_t* p) {
        return avx2::nibbles(p + 8) | avx2::fifth_bit_values(p + 4);
      });
      break;
    case kQ8_0:
      pairs<R, true, 34>(row, dots, blocks, [](const uint8_t* p) { return avx2::load_u8x32(p + 2); });
      break;
    default:
      return;
  }
  dots.store(out);
}

// gguf_avx2::dot_rows's contract: out[i] = row . (rows first + i of the activations), count <= kDotRows.
inline void dot_rows(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, int64_t count,
                     float* out) {
  // One row of x against 4- or 5-bit weights is faster with AVX2's one block a step (measured: the
  // weights' decoding, in 256-bit halves, then costs more than the pair saves); the bits are the same.
  if (a.block != 32 || (count == 1 && type != kQ8_0)) {
    avx2::dot_rows(type, row, a, first, count, out);
    return;
  }
  switch (count) {
    case 1:
      row_dots<1>(type, row, a, first, out);
      break;
    case 2:
      row_dots<2>(type, row, a, first, out);
      break;
    case 3:
      row_dots<3>(type, row, a, first, out);
      break;
    default:
      row_dots<avx2::kDotRows>(type, row, a, first, out);
      break;
  }
}

}  // namespace gguf_vnni
