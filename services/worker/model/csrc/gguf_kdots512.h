// Dot products of GGUF weight rows of the K types (Q4_K, Q5_K, Q6_K) with up to eight rows of x, with
// AVX-512 VNNI: the decode path's kernel for those types where the CPU has it (gguf_dots.h's AVX2
// build runs them elsewhere), and the one a speculative step's few rows take.
//
// A super-block's sub-blocks are read two at a time into one 512-bit register, sub-block 2p in the
// low half and 2p + 1 in the high one, decoded once for all the rows of x. For each row one dpbusd
// sums the 64 byte products into 16 int32 lanes of four values each (Q4_K's and Q5_K's quants are
// unsigned and meet x as it is; Q6_K's are signed, so x is read as unsigned bytes, x + 128, and each
// lane starts from -128 times its four weights' sum, computed once per pair for all rows). Every lane
// then fits in 16 bits (at most 4 * 32 * 127 in magnitude), so one dpwssd against the lanes' sub-block
// scales (in the low 16 bits, zero above) multiplies and adds them into the row's sums. At a
// super-block's end the two halves add into the eight lanes gguf_dots.h's RowDots holds (values
// 4l..4l+3 of every sub-block: the same exact integers, under 2^24), and the float steps are RowDots's
// operations in its order: even += sums * (d_w * d_x), the mins' offset -(dmin * d_x) * (the integer sum
// of min * the sub-block's sum of q), and a row's dot hsum256(even + 0) + offset. So a row's result is
// the same bits as on AVX2, the portable build and the tiled GEMM (gguf_kgemm512.h). This file's
// dot_rows is the VNNI build's for every type. Included by gguf_linear.cpp once, in its AVX-512 VNNI
// region, after gguf_dots512.h, whose helpers and 32-value kernels it uses.

#pragma once

namespace gguf_vnni {

// Rows [first, first + R) of the activations against one weight row of a K type.
template <int R>
struct SuperDots {
  // Rows of x are consecutive: one pointer and the stride, where eight pointers would hold eight
  // general registers.
  const int8_t* q;
  int64_t k;
  const float* d[R];
  const int32_t* isum[R];
  __m512i sums[R];  // this super-block's integer sums, 16 lanes
  __m256 even[R];
  float offsets[R] = {};

  SuperDots(const strata::Activations& a, int64_t first) : q(a.row_q(first)), k(a.k) {
    for (int r = 0; r < R; ++r) {
      d[r] = a.row_d(first + r);
      isum[r] = a.row_isum(first + r);
      sums[r] = _mm512_setzero_si512();
      even[r] = _mm256_setzero_ps();
    }
  }

  // Sub-blocks s and s + 1 (of the whole row) in w, each lane's scale in `scales` (low 16 bits).
  template <bool kSigned>
  void add_pair(int64_t s, __m512i w, __m512i scales) {
    // Signed weights meet x + 128: each lane starts at -128 times the sum of its four weights.
    const __m512i start =
        kSigned ? _mm512_sub_epi32(_mm512_setzero_si512(),
                                   _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), w))
                : _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(q + r * k + s * 32);
      const __m512i lanes =
          kSigned ? _mm512_dpbusd_epi32(start, _mm512_xor_si512(x, _mm512_set1_epi8(-128)), w)
                  : _mm512_dpbusd_epi32(start, w, x);
      sums[r] = _mm512_dpwssd_epi32(sums[r], lanes, scales);
    }
  }

  // Super-block i ends: RowDots::end_super's float steps on the same integers.
  void end_super(int64_t i, float d_w, float dmin, const uint8_t* min) {
    for (int r = 0; r < R; ++r) {
      const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(sums[r]), _mm512_extracti64x4_epi64(sums[r], 1));
      even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), _mm256_set1_ps(d_w * d[r][i]), even[r]);
      sums[r] = _mm512_setzero_si512();
    }
    if (min == nullptr) return;
    // The mins' integer sums in eight lanes, then across them (exact, so their order is free).
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(min)));
    for (int r = 0; r < R; ++r) {
      const __m256i products =
          _mm256_mullo_epi32(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(isum[r] + i * 8)));
      __m128i folded = _mm_add_epi32(_mm256_castsi256_si128(products), _mm256_extracti128_si256(products, 1));
      folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, 0x4E));
      folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, 0xB1));
      const int32_t weighted = _mm_cvtsi128_si32(folded);
      offsets[r] += -(dmin * d[r][i]) * static_cast<float>(weighted);
    }
  }

  void store(float* dots) const {
    for (int r = 0; r < R; ++r) dots[r] = strata::hsum256(_mm256_add_ps(even[r], _mm256_setzero_ps())) + offsets[r];
  }
};

// 16 signed bytes, each int32 lane's scale, as the lanes' low 16 bits (sign-extended to 16, zero
// above: dpwssd multiplies the lanes' high halves by them too).
inline __m512i lane_scales(__m128i bytes) { return _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(bytes)); }

// The 32 bytes at p in both halves of a register.
inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Q4_K and Q5_K: sub-blocks 2c and 2c + 1 are chunk c's low and high nibbles (plus Q5_K's fifth bits,
// bit s of qh[l] for value l of sub-block s); one 6-bit scale per sub-block, its min in the offset.
template <int R, bool kFifthBit>
[[gnu::always_inline]] inline void k_quant_dots(const uint8_t* b, SuperDots<R>& dots, int64_t blocks) {
  constexpr int64_t kBytes = kFifthBit ? 176 : 144;
  // The low half keeps a chunk's low nibbles, the high half its high ones.
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  uint8_t scale[8];
  uint8_t min[8];
  for (int64_t i = 0; i < blocks; ++i, b += kBytes) {
    avx2::prefetch(b, kBytes);
    k_scale_bytes(b + 4, scale, min);
    const uint8_t* qs = b + (kFifthBit ? 48 : 16);
    __m512i high{};
    if constexpr (kFifthBit) high = both_halves(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m512i chunk = both_halves(qs + c * 32);
      __m512i w = _mm512_and_si512(_mm512_srlv_epi16(chunk, shifts), _mm512_set1_epi8(0xF));
      if constexpr (kFifthBit) {
        const __m512i bit = pair(avx2::v32u{} + static_cast<uint8_t>(1u << (2 * c)),
                                 avx2::v32u{} + static_cast<uint8_t>(1u << (2 * c + 1)));
        w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(high, bit), w, _mm512_set1_epi8(16));
      }
      // Lanes 0-7 take the pair's first scale, 8-15 its second.
      const __m512i scales = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(scale[2 * c]),
                                                     _mm512_set1_epi32(scale[2 * c + 1]));
      dots.template add_pair<false>(i * 8 + 2 * c, w, scales);
    }
    dots.end_super(i, avx2::scale_at(b), avx2::scale_at(b + 2), min);
  }
}

// Q6_K: half h's four sub-blocks of 32 take their low 4 bits from ql[h * 64 ..] (the first or second
// 32 bytes, low or high nibbles) and their high 2 from qh[h * 32 ..] (shifted by 2 per sub-block),
// minus 32; each 16 values have a signed 8-bit scale.
template <int R>
[[gnu::always_inline]] inline void q6_k_dots(const uint8_t* b, SuperDots<R>& dots, int64_t blocks) {
  // Lanes 4j..4j+3 take the j-th of the pair's four scales.
  const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t i = 0; i < blocks; ++i, b += 210) {
    avx2::prefetch(b, 210);
    for (int h = 0; h < 2; ++h) {
      const avx2::v32u low[2] = {avx2::load_u8x32(b + h * 64), avx2::load_u8x32(b + h * 64 + 32)};
      const avx2::v32u high = avx2::load_u8x32(b + 128 + h * 32);
      for (int j = 0; j < 4; j += 2) {
        const avx2::v32u nibble0 = j == 0 ? low[0] & 0xF : low[0] >> 4;
        const avx2::v32u nibble1 = j == 0 ? low[1] & 0xF : low[1] >> 4;
        const avx2::v32u w0 = (nibble0 | (((high >> (2 * j)) & 3) << 4)) - 32;
        const avx2::v32u w1 = (nibble1 | (((high >> (2 * j + 2)) & 3) << 4)) - 32;
        int32_t four;
        std::memcpy(&four, b + 192 + h * 8 + 2 * j, 4);
        const __m512i scales = lane_scales(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread));
        dots.template add_pair<true>(i * 8 + h * 4 + j, pair(w0, w1), scales);
      }
    }
    dots.end_super(i, avx2::scale_at(b + 208), 0.0f, nullptr);
  }
}

template <int R>
void k_row_dots(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, float* out) {
  SuperDots<R> dots(a, first);
  switch (type) {
    case kQ4_K:
      k_quant_dots<R, false>(row, dots, a.k / 256);
      break;
    case kQ5_K:
      k_quant_dots<R, true>(row, dots, a.k / 256);
      break;
    case kQ6_K:
      q6_k_dots(row, dots, a.k / 256);
      break;
    default:
      return;
  }
  dots.store(out);
}

// Rows of x against one weight row: the K types' (x scaled per 256) here, the 32-value types' in
// gguf_dots512.h.
template <int R>
void any_row_dots(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, float* out) {
  if (a.block == 256) {
    k_row_dots<R>(type, row, a, first, out);
  } else {
    row_dots<R>(type, row, a, first, out);
  }
}

// Rows of x one decoding of a weight block serves: twice AVX2's, as 32 registers of 512 bits hold
// eight rows' sums where 16 of 256 hold four.
constexpr int kDotRows = 8;

// out[i] = row . (rows first + i of the activations) for i < count <= kDotRows.
inline void dot_rows(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, int64_t count,
                     float* out) {
  // One row of a 32-value type takes one block a step, but Q8_0 keeps the pairs: its weights need no
  // decoding, and one block a step measured slower.
  if (count == 1 && a.block == 32 && type != kQ8_0) {
    one_row_dots(type, row, a, first, out);
    return;
  }
  strata::with_rows<kDotRows>(
      count, [&](auto rows) { any_row_dots<decltype(rows)::value>(type, row, a, first, out); });
}

}  // namespace gguf_vnni
