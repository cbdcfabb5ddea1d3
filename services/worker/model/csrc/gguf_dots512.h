// Dot products of GGUF weight rows of the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with
// AVX-512 VNNI. Two to four rows of x, and one row against Q8_0, take two blocks a step in one 512-bit
// register, the even block in its low half and the odd one in its high half; one row of x against the
// 4- and 5-bit types takes one block a step in 256 bits (there decoding the weights, in 256-bit halves
// either way, is the cost, and pairs of it measured slower). Each block's 32 byte products are summed
// by one dpbusd into eight int32 lanes of four, the same integers as gguf_dots.h's maddubs + madd
// sequence (which never saturates here); Q5's fifth bits enter as a byte mask (one masked add)
// instead of AVX2's shuffle and compare. Each block then takes lanes += sums * (d_w * d_x) as one
// fused multiply-add into the even or odd blocks' lanes, the offsets of Q4_1 and Q5_1 add in block
// order, and a row's dot is hsum256(even + odd): gguf_dots.h's accumulators, operation for operation,
// so a row's result is the same bits as on AVX2 and the portable build. The K types have their own
// kernel (gguf_kdots512.h, whose dot_rows takes every type). Included by gguf_linear.cpp once, in its
// AVX-512 VNNI region, after gguf_dots.h's AVX2
// build, whose helpers (the weights' prefetch among them) it uses.

#pragma once

namespace gguf_vnni {

namespace avx2 = gguf_avx2;
using avx2::v32u;

inline __m512i pair(v32u low, v32u high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)low), (__m256i)high, 1);
}

// 16 float lanes: `low` in the low eight, `high` in the high eight (an even and an odd block's scale).
inline __m512 halves(float low, float high) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(low)), _mm256_castps_pd(_mm256_set1_ps(high)), 1));
}

inline uint32_t fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return bits;
}

// 32 values: Q5's nibbles at p plus 16 where their fifth bit (the uint32 at `bits`) is set.
inline __m256i five_bits(const uint8_t* p, const uint8_t* bits) {
  const __m256i low = (__m256i)avx2::nibbles(p);
  return _mm256_mask_add_epi8(low, _cvtu32_mask32(fifth_bits(bits)), low, _mm256_set1_epi8(16));
}

// Two blocks' five_bits, the block at p0 in the low half.
inline __m512i five_bits_pair(const uint8_t* p0, const uint8_t* p1, const uint8_t* bits0, const uint8_t* bits1) {
  const __m512i low = pair(avx2::nibbles(p0), avx2::nibbles(p1));
  const uint64_t bits = fifth_bits(bits0) | static_cast<uint64_t>(fifth_bits(bits1)) << 32;
  return _mm512_mask_add_epi8(low, _cvtu64_mask64(bits), low, _mm512_set1_epi8(16));
}

// One row of x against a row of kBytes blocks, one block a step; weights(p) gives block p's 32 weights.
template <bool kSigned, int64_t kBytes, typename Weights>
[[gnu::always_inline]] inline float one_row(const uint8_t* b, const strata::Activations& a, int64_t first,
                                            Weights weights) {
  const int8_t* q = a.row_q(first);
  const float* d = a.row_d(first);
  const float* sum = a.row_sum(first);
  __m256 even = _mm256_setzero_ps();
  __m256 odd = _mm256_setzero_ps();
  float offset = 0.0f;
  const auto block = [&](int64_t i, const uint8_t* p, __m256 lanes) {
    __m256i w = weights(p);
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * 32));
    if constexpr (kSigned) {
      x = _mm256_sign_epi8(x, w);
      w = _mm256_abs_epi8(w);
    }
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
    if constexpr (!kSigned) offset += avx2::scale_at(p + 2) * sum[i];
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(avx2::scale_at(p) * d[i]), lanes);
  };
  const int64_t blocks = a.k / 32;
  int64_t i = 0;
  for (; i + 1 < blocks; i += 2, b += 2 * kBytes) {
    avx2::prefetch(b, 2 * kBytes);
    even = block(i, b, even);
    odd = block(i + 1, b + kBytes, odd);
  }
  if (i < blocks) even = block(i, b, even);
  return strata::hsum256(_mm256_add_ps(even, odd)) + offset;
}

inline void one_row_dots(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first,
                         float* out) {
  switch (type) {
    case kQ4_0:
      *out = one_row<true, 18>(row, a, first, [](const uint8_t* p) {
        return _mm256_sub_epi8((__m256i)avx2::nibbles(p + 2), _mm256_set1_epi8(8));
      });
      break;
    case kQ4_1:
      *out = one_row<false, 20>(row, a, first, [](const uint8_t* p) { return (__m256i)avx2::nibbles(p + 4); });
      break;
    case kQ5_0:
      *out = one_row<true, 22>(row, a, first, [](const uint8_t* p) {
        return _mm256_sub_epi8(five_bits(p + 6, p + 2), _mm256_set1_epi8(16));
      });
      break;
    case kQ5_1:
      *out = one_row<false, 24>(row, a, first, [](const uint8_t* p) { return five_bits(p + 8, p + 4); });
      break;
    default:
      break;
  }
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
      const __m512 scale = halves(s0, s1);
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

// A row's blocks of kBytes each, two a step; weights(p0, p1) gives blocks p0's and p1's 64 weights.
template <int R, bool kSigned, int64_t kBytes, typename Weights>
[[gnu::always_inline]] inline void pairs(const uint8_t* b, PairDots<R>& dots, int64_t blocks, Weights weights) {
  int64_t i = 0;
  for (; i + 1 < blocks; i += 2, b += 2 * kBytes) {
    avx2::prefetch(b, 2 * kBytes);
    dots.template add<kSigned>(i, weights(b, b + kBytes), b, b + kBytes, false);
  }
  if (i < blocks) dots.template add<kSigned>(i, _mm512_maskz_mov_epi8(0xFFFFFFFFull, weights(b, b)), b, b, true);
}

// One block's 32 weights in both halves, for the types whose decoding is per 256 bits.
template <typename Block>
auto both(Block block) {
  return [block](const uint8_t* p0, const uint8_t* p1) { return pair(block(p0), block(p1)); };
}

template <int R>
void row_dots(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, float* out) {
  PairDots<R> dots(a, first);
  const int64_t blocks = a.k / 32;
  switch (type) {
    case kQ4_0:
      pairs<R, true, 18>(row, dots, blocks, both([](const uint8_t* p) { return avx2::nibbles(p + 2) - 8; }));
      break;
    case kQ4_1:
      pairs<R, false, 20>(row, dots, blocks, both([](const uint8_t* p) { return avx2::nibbles(p + 4); }));
      break;
    case kQ5_0:
      pairs<R, true, 22>(row, dots, blocks, [](const uint8_t* p0, const uint8_t* p1) {
        return _mm512_sub_epi8(five_bits_pair(p0 + 6, p1 + 6, p0 + 2, p1 + 2), _mm512_set1_epi8(16));
      });
      break;
    case kQ5_1:
      pairs<R, false, 24>(row, dots, blocks, [](const uint8_t* p0, const uint8_t* p1) {
        return five_bits_pair(p0 + 8, p1 + 8, p0 + 4, p1 + 4);
      });
      break;
    case kQ8_0:
      pairs<R, true, 34>(row, dots, blocks, both([](const uint8_t* p) { return avx2::load_u8x32(p + 2); }));
      break;
    default:
      return;
  }
  dots.store(out);
}

}  // namespace gguf_vnni
