// Dot products of GGUF weight rows, read from their blocks as stored, with rows of x quantized to 8
// bits per 32 values, or per 256 for the K types (gguf_activations.h): integer products of the stored
// quants, one float multiply-add per 8 products (per super-block for the K types), as ggml computes
// them. Included by gguf_linear.cpp once for AVX2 and once for the portable build, in each one's
// namespace and `#pragma GCC target` region, after gguf_blocks.h. AVX-512 CPUs run the AVX2 build too:
// for every type without VNNI; with it, for the K types, while gguf_dots512.h takes the 32-value ones.
//
// Every block of 32 weights meets its 32 activations as 32 byte products summed in eight int32 lanes
// of four (the AVX2 sequence maddubs then madd, whose int16 pair sums never saturate at these widths:
// |w| <= 128, |q| <= 127), a sub-block scale folded into the integer sums where the type has one. The
// types of 32-value blocks (activations scaled per 32) then add lanes += sums * (d_w * d_x) as one
// fused multiply-add per block, and Q4_1's and Q5_1's offset m times the activations' d * sum in a
// scalar of its own. The K types (activations scaled per 256, as ggml's Q8_K) add a super-block's
// eight sub-block sums in integers first (under 2^24 per lane, so their float conversion is exact),
// then one multiply-add by d_w * d_x per super-block, and the mins as -dmin * d_x times the integer
// sum over sub-blocks of min * (sum of their q). The sums are exact integers and the floating-point
// steps are the same operations in the same order in both builds (the portable one spells each
// instruction out), so a row's result is the same bits on every instruction set, and does not depend
// on which rows of x share its batch or thread.
//
// No include guard: included once per instruction set, on purpose.

namespace STRATA_GGUF_NS {

typedef int8_t v32s __attribute__((vector_size(32)));
typedef uint8_t v32u __attribute__((vector_size(32)));
typedef int16_t v16h __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));

constexpr int kDotRows = 4;  // rows of x one decoding of a weight block serves

#if STRATA_LANES == 8
inline v32u magnitude(v32s w) { return (v32u)_mm256_abs_epi8((__m256i)w); }

// a where w > 0, -a where w < 0, 0 where w == 0: with magnitude(w), the products a * w.
inline v32s signed_like(v32s a, v32s w) { return (v32s)_mm256_sign_epi8((__m256i)a, (__m256i)w); }

// Lane l: sum over the pairs p of 4l..4l+3 of (u * s summed over the pair) * scale[p / 2].
inline v8i products(v32u u, v32s s, v16h scale) {
  return (v8i)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), (__m256i)scale);
}

inline v8f add_scaled(v8f lanes, v8i sums, float scale) {
  return (v8f)_mm256_fmadd_ps(_mm256_cvtepi32_ps((__m256i)sums), _mm256_set1_ps(scale), (__m256)lanes);
}

inline float total(v8f lanes) { return strata::hsum256((__m256)lanes); }

// A float16 scale's exact value, as half_to_float gives it, in one instruction.
inline float scale_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// 16 bytes as 32 values: their low nibbles, then their high ones.
inline v32u nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0xF);
  return (v32u)_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}

// Value j is 16 where bit j of the little-endian uint32 at p is set, else 0.
inline v32u fifth_bit_values(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return (v32u)_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(16));
}
#else
inline v32u magnitude(v32s w) {
  const v32u negative = (v32u)(w >> 7);
  return ((v32u)w ^ negative) - negative;
}

inline v32s signed_like(v32s a, v32s w) {
  const v32u negative = (v32u)(w >> 7);
  return (v32s)((((v32u)a ^ negative) - negative) & (v32u)(w != 0));
}

inline v8i products(v32u u, v32s s, v16h scale) {
  v8i sums;
  for (int l = 0; l < 8; ++l) {
    int32_t sum = 0;
    for (int p = 2 * l; p < 2 * l + 2; ++p) sum += (u[2 * p] * s[2 * p] + u[2 * p + 1] * s[2 * p + 1]) * scale[p];
    sums[l] = sum;
  }
  return sums;
}

inline v8f add_scaled(v8f lanes, v8i sums, float scale) {
  for (int l = 0; l < 8; ++l) lanes[l] = std::fma(static_cast<float>(sums[l]), scale, lanes[l]);
  return lanes;
}

// hsum256's order: the two halves, then lanes two apart, then the last pair.
inline float total(v8f lanes) {
  const float s0 = lanes[0] + lanes[4], s1 = lanes[1] + lanes[5], s2 = lanes[2] + lanes[6], s3 = lanes[3] + lanes[7];
  return (s0 + s2) + (s1 + s3);
}

inline float scale_at(const uint8_t* p) { return half_to_float(p); }

inline v32u nibbles(const uint8_t* p) {
  v32u values;
  for (int j = 0; j < 16; ++j) {
    values[j] = p[j] & 0xF;
    values[16 + j] = p[j] >> 4;
  }
  return values;
}

inline v32u fifth_bit_values(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  v32u values;
  for (int j = 0; j < 32; ++j) values[j] = ((bits >> j) & 1u) << 4;
  return values;
}
#endif

inline v32u load_u8x32(const void* p) {
  v32u v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v32s load_s8x32(const void* p) {
  v32s v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16h scale_pair(int first_half, int second_half) {
  v16h scale;
  for (int i = 0; i < 16; ++i) scale[i] = static_cast<int16_t>(i < 8 ? first_half : second_half);
  return scale;
}

const v16h kOnes = v16h{} + 1;

// How far ahead of the block being read the kernels ask for the weight's bytes. A decode step reads
// each weight once, from memory, and the hardware's prefetcher alone keeps too few lines in flight
// (measured, one row of x against 600 MB of Q5_0 on a 2-core AVX-512 VM: 6.9 GB/s without, 14.5 at 2
// KiB ahead, no better beyond). A weight's rows are consecutive, so this runs on into the next row.
constexpr int64_t kPrefetchAhead = 2048;

// Asks for the cache lines of the `bytes` at p + kPrefetchAhead (past the weight's end, a no-op).
[[gnu::always_inline]] inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + kPrefetchAhead + at, 0, 3);
}

// The running sums of rows [first, first + R) of the activations with one weight row.
// Blocks of even index add into `even`, odd ones into `odd`, and a row's dot is total(even + odd):
// the order gguf_dots512.h's pairs of blocks in one 512-bit register keep too.
template <int R>
struct RowDots {
  const int8_t* q[R];
  const float* d[R];
  const float* sum[R];
  const int32_t* isum[R];
  v8f even[R] = {};
  v8f odd[R] = {};
  v8i super_sums[R] = {};
  float offsets[R] = {};

  RowDots(const strata::Activations& a, int64_t first) {
    for (int r = 0; r < R; ++r) {
      q[r] = a.row_q(first + r);
      d[r] = a.row_d(first + r);
      sum[r] = a.row_sum(first + r);
      isum[r] = a.row_isum(first + r);
    }
  }

  // Sub-block s (32 values) of a K-type super-block, unsigned weights weighted by `scale` in pairs.
  void add_sub_unsigned(int64_t s, v32u w, v16h scale) {
    for (int r = 0; r < R; ++r) super_sums[r] += products(w, load_s8x32(q[r] + s * 32), scale);
  }

  // The same for signed weights.
  void add_sub_signed(int64_t s, v32s w, v16h scale) {
    const v32u magnitudes = magnitude(w);
    for (int r = 0; r < R; ++r)
      super_sums[r] += products(magnitudes, signed_like(load_s8x32(q[r] + s * 32), w), scale);
  }

  // Super-block i's integer sums times d_w and its activations' scale; with `min` (its eight sub-block
  // mins), the offset -dmin * d_x * sum over sub-blocks of min * (sum of their q).
  void end_super(int64_t i, float d_w, float dmin, const uint8_t* min) {
    for (int r = 0; r < R; ++r) {
      even[r] = add_scaled(even[r], super_sums[r], d_w * d[r][i]);
      super_sums[r] = v8i{};
      if (min == nullptr) continue;
      int32_t weighted = 0;
      for (int s = 0; s < 8; ++s) weighted += static_cast<int32_t>(min[s]) * isum[r][i * 8 + s];
      offsets[r] += -(dmin * d[r][i]) * static_cast<float>(weighted);
    }
  }

  // Block b's sums into its parity's lanes. Two assignments, not a reference chosen at run time:
  // the lanes then stay in registers instead of memory.
  void add_block(int64_t b, int r, v8i sums, float scale) {
    if ((b & 1) != 0)
      odd[r] = add_scaled(odd[r], sums, scale);
    else
      even[r] = add_scaled(even[r], sums, scale);
  }

  // Block b: 32 signed weights, their products weighted by `scale` in pairs, times d_w.
  void add_signed(int64_t b, v32s w, v16h scale, float d_w) {
    const v32u magnitudes = magnitude(w);
    for (int r = 0; r < R; ++r) {
      const v8i sums = products(magnitudes, signed_like(load_s8x32(q[r] + b * 32), w), scale);
      add_block(b, r, sums, d_w * d[r][b]);
    }
  }

  // Block b: 32 unsigned weights times `scale`, times d_w, plus `offset` for each of the 32.
  void add_unsigned(int64_t b, v32u w, int scale, float d_w, float offset) {
    const v16h weights = v16h{} + static_cast<int16_t>(scale);
    for (int r = 0; r < R; ++r) {
      const v8i sums = products(w, load_s8x32(q[r] + b * 32), weights);
      add_block(b, r, sums, d_w * d[r][b]);
      offsets[r] += offset * sum[r][b];
    }
  }

  void store(float* dots) const {
    for (int r = 0; r < R; ++r) dots[r] = total(even[r] + odd[r]) + offsets[r];
  }
};

template <int R>
[[gnu::always_inline]] inline void q8_0_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i, b += 34) {
    prefetch(b, 34);
    dots.add_signed(i, load_s8x32(b + 2), kOnes, scale_at(b));
  }
}

template <int R>
[[gnu::always_inline]] inline void q4_0_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i, b += 18) {
    prefetch(b, 18);
    dots.add_signed(i, (v32s)(nibbles(b + 2) - 8), kOnes, scale_at(b));
  }
}

template <int R>
[[gnu::always_inline]] inline void q4_1_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i, b += 20) {
    prefetch(b, 20);
    dots.add_unsigned(i, nibbles(b + 4), 1, scale_at(b), scale_at(b + 2));
  }
}

template <int R>
[[gnu::always_inline]] inline void q5_0_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i, b += 22) {
    prefetch(b, 22);
    dots.add_signed(i, (v32s)((nibbles(b + 6) | fifth_bit_values(b + 2)) - 16), kOnes, scale_at(b));
  }
}

template <int R>
[[gnu::always_inline]] inline void q5_1_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i, b += 24) {
    prefetch(b, 24);
    dots.add_unsigned(i, nibbles(b + 8) | fifth_bit_values(b + 4), 1, scale_at(b), scale_at(b + 2));
  }
}

// Q4_K and Q5_K: sub-block 2c takes the low nibbles of chunk c's 32 bytes, 2c + 1 the high ones; Q5_K
// adds bit i of qh[l] to value l of sub-block i. Each sub-block's 6-bit scale multiplies its integer
// sums; its min enters the super-block's offset.
template <int R, bool kFifthBit>
[[gnu::always_inline]] inline void k_quant_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  constexpr int64_t kBytes = kFifthBit ? 176 : 144;
  uint8_t scale[8];
  uint8_t min[8];
  for (int64_t i = 0; i < blocks; ++i, b += kBytes) {
    prefetch(b, kBytes);
    const float d = scale_at(b);
    const float dmin = scale_at(b + 2);
    k_scale_bytes(b + 4, scale, min);
    const uint8_t* qs = b + (kFifthBit ? 48 : 16);
    v32u high{};
    if constexpr (kFifthBit) high = load_u8x32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const v32u chunk = load_u8x32(qs + c * 32);
      for (int half = 0; half < 2; ++half) {
        const int sub = 2 * c + half;
        v32u w = half == 0 ? chunk & 0xF : chunk >> 4;
        if constexpr (kFifthBit) w |= ((high >> sub) & 1) << 4;
        dots.add_sub_unsigned(i * 8 + sub, w, v16h{} + static_cast<int16_t>(scale[sub]));
      }
    }
    dots.end_super(i, d, dmin, min);
  }
}

// Q6_K: half h's four blocks of 32 take their low 4 bits from ql[h * 64 ..] (the first or second 32
// bytes, low or high nibbles) and their high 2 from qh[h * 32 ..] (shifted by 2 per block), minus 32;
// each 16 values have a signed 8-bit scale.
template <int R>
[[gnu::always_inline]] inline void q6_k_dots(const uint8_t* b, RowDots<R>& dots, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i, b += 210) {
    prefetch(b, 210);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = scale_at(b + 208);
    for (int h = 0; h < 2; ++h) {
      const v32u low[2] = {load_u8x32(b + h * 64), load_u8x32(b + h * 64 + 32)};
      const v32u high = load_u8x32(b + 128 + h * 32);
      for (int j = 0; j < 4; ++j) {
        const v32u nibble = j < 2 ? low[j] & 0xF : low[j - 2] >> 4;
        const v32s w = (v32s)((nibble | (((high >> (2 * j)) & 3) << 4)) - 32);
        const int s = h * 8 + 2 * j;
        dots.add_sub_signed(i * 8 + h * 4 + j, w, scale_pair(scales[s], scales[s + 1]));
      }
    }
    dots.end_super(i, d, 0.0f, nullptr);
  }
}

template <int R>
void row_dots(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, float* out) {
  RowDots<R> dots(a, first);
  switch (type) {
    case kQ4_0:
      q4_0_dots(row, dots, a.k / 32);
      break;
    case kQ4_1:
      q4_1_dots(row, dots, a.k / 32);
      break;
    case kQ5_0:
      q5_0_dots(row, dots, a.k / 32);
      break;
    case kQ5_1:
      q5_1_dots(row, dots, a.k / 32);
      break;
    case kQ8_0:
      q8_0_dots(row, dots, a.k / 32);
      break;
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

// out[i] = row . (rows first + i of the activations) for i < count <= kDotRows.
inline void dot_rows(int64_t type, const uint8_t* row, const strata::Activations& a, int64_t first, int64_t count,
                     float* out) {
  strata::with_rows<kDotRows>(
      count, [&](auto rows) { row_dots<decltype(rows)::value>(type, row, a, first, out); });
}

}  // namespace STRATA_GGUF_NS
