// The dequantization of GGUF's block types, written once over GCC vector extensions and included by
// gguf_linear.cpp once per instruction set, inside that set's `#pragma GCC target` region and
// namespace, with STRATA_LANES (16 for AVX-512, 8 for AVX2, 4 for the portable build) lanes per vector.
//
// Every value is computed with the operations, in the order, of the gguf package's own numpy
// dequantization (gguf/quants.py): float16 scales widened exactly, the sub-block scale d * sc as one
// float32 product, then q * D, then - M or + M as a separate rounding (the file is compiled with
// floating-point contraction off, so no fused multiply-add merges them). A dequantized weight equals
// the gguf package's bit for bit, on every instruction set. Projections of up to eight rows do not
// read these values (gguf_dots.h works from the blocks in integers); embeddings, larger batches and
// tests do.
//
// No include guard: included once per instruction set, on purpose.

namespace STRATA_GGUF_NS {

constexpr int kLanes = STRATA_LANES;
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef float vf __attribute__((vector_size(kLanes * 4)));

// kLanes bytes widened to int32 lanes. GCC spells __builtin_convertvector of a byte vector as one
// insert per lane (a dequantization ran at about 1 ns a value), so the SIMD builds say which
// instruction widens them.
#if STRATA_LANES == 16
inline vi load_u8(const uint8_t* p) {
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline vi load_i8(const uint8_t* p) {
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif STRATA_LANES == 8
inline vi load_u8(const uint8_t* p) {
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline vi load_i8(const uint8_t* p) {
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#else
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));
typedef int8_t vs8 __attribute__((vector_size(kLanes)));

inline vi load_u8(const uint8_t* p) {
  vu8 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, vi);
}

inline vi load_i8(const uint8_t* p) {
  vs8 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, vi);
}
#endif

inline vf to_float(vi q) { return __builtin_convertvector(q, vf); }

// 0, 1, ..., kLanes - 1, plus `first`.
inline vi lane_index(int first) {
  vi index;
  for (int i = 0; i < kLanes; ++i) index[i] = first + i;
  return index;
}

// Each decoder hands its blocks' values to sink(offset, values): kLanes values starting at `offset`
// in the row, in increasing offsets.

template <class Sink>
inline void q8_0(const uint8_t* b, Sink& sink, int64_t blocks) {
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 34, base += 32) {
    const float d = half_to_float(b);
    for (int j = 0; j < 32; j += kLanes) sink(base + j, to_float(load_i8(b + 2 + j)) * d);
  }
}

// Q4_0 and Q4_1: 32 nibbles, the low ones first; Q4_0 is d * (q - 8), Q4_1 is d * q + m.
template <class Sink>
inline void q4_0(const uint8_t* b, Sink& sink, int64_t blocks) {
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 18, base += 32) {
    const float d = half_to_float(b);
    for (int j = 0; j < 16; j += kLanes) sink(base + j, to_float((load_u8(b + 2 + j) & 0xF) - 8) * d);
    for (int j = 0; j < 16; j += kLanes) sink(base + 16 + j, to_float((load_u8(b + 2 + j) >> 4) - 8) * d);
  }
}

template <class Sink>
inline void q4_1(const uint8_t* b, Sink& sink, int64_t blocks) {
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 20, base += 32) {
    const float d = half_to_float(b);
    const float m = half_to_float(b + 2);
    for (int j = 0; j < 16; j += kLanes) sink(base + j, to_float(load_u8(b + 4 + j) & 0xF) * d + m);
    for (int j = 0; j < 16; j += kLanes) sink(base + 16 + j, to_float(load_u8(b + 4 + j) >> 4) * d + m);
  }
}

// Q5_0 and Q5_1: Q4's nibbles with a fifth bit each from a little-endian uint32 (bit j for value j).
inline vi fifth_bits(const uint8_t* p) {
  uint32_t high;
  std::memcpy(&high, p, 4);
  return vi{} + static_cast<int32_t>(high);
}

inline vi q5_low(const uint8_t* qs, vi bits, int j) {
  return (load_u8(qs + j) & 0xF) | (((bits >> lane_index(j)) & 1) << 4);
}

inline vi q5_high(const uint8_t* qs, vi bits, int j) {
  return (load_u8(qs + j) >> 4) | (((bits >> lane_index(16 + j)) & 1) << 4);
}

template <class Sink>
inline void q5_0(const uint8_t* b, Sink& sink, int64_t blocks) {
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 22, base += 32) {
    const float d = half_to_float(b);
    const vi bits = fifth_bits(b + 2);
    for (int j = 0; j < 16; j += kLanes) sink(base + j, to_float(q5_low(b + 6, bits, j) - 16) * d);
    for (int j = 0; j < 16; j += kLanes) sink(base + 16 + j, to_float(q5_high(b + 6, bits, j) - 16) * d);
  }
}

template <class Sink>
inline void q5_1(const uint8_t* b, Sink& sink, int64_t blocks) {
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 24, base += 32) {
    const float d = half_to_float(b);
    const float m = half_to_float(b + 2);
    const vi bits = fifth_bits(b + 4);
    for (int j = 0; j < 16; j += kLanes) sink(base + j, to_float(q5_low(b + 8, bits, j)) * d + m);
    for (int j = 0; j < 16; j += kLanes) sink(base + 16 + j, to_float(q5_high(b + 8, bits, j)) * d + m);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins; sub-blocks 2c and 2c + 1 share the
// 32 bytes of chunk c (low nibbles, then high); Q5_K adds bit i of qh[l] to value l of sub-block i.
template <class Sink>
inline void q4_k(const uint8_t* b, Sink& sink, int64_t blocks) {
  float scale[8];
  float min[8];
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 144, base += 256) {
    k_scales(b, scale, min);
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c) {
      const int lo = 2 * c;
      const int hi = 2 * c + 1;
      for (int j = 0; j < 32; j += kLanes)
        sink(base + lo * 32 + j, to_float(load_u8(qs + c * 32 + j) & 0xF) * scale[lo] - min[lo]);
      for (int j = 0; j < 32; j += kLanes)
        sink(base + hi * 32 + j, to_float(load_u8(qs + c * 32 + j) >> 4) * scale[hi] - min[hi]);
    }
  }
}

template <class Sink>
inline void q5_k(const uint8_t* b, Sink& sink, int64_t blocks) {
  float scale[8];
  float min[8];
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 176, base += 256) {
    k_scales(b, scale, min);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int c = 0; c < 4; ++c) {
      const int lo = 2 * c;
      const int hi = 2 * c + 1;
      for (int j = 0; j < 32; j += kLanes) {
        const vi q = (load_u8(qs + c * 32 + j) & 0xF) | (((load_u8(qh + j) >> lo) & 1) << 4);
        sink(base + lo * 32 + j, to_float(q) * scale[lo] - min[lo]);
      }
      for (int j = 0; j < 32; j += kLanes) {
        const vi q = (load_u8(qs + c * 32 + j) >> 4) | (((load_u8(qh + j) >> hi) & 1) << 4);
        sink(base + hi * 32 + j, to_float(q) * scale[hi] - min[hi]);
      }
    }
  }
}

// Q6_K: 256 values in two halves of 128; value s * 64 + l of half h takes its low 4 bits from
// ql[h * 64 + l] (shifted by 4 s) and its high 2 from qh[h * 32 + l % 32] (shifted by 2 (2 s + l / 32)),
// minus 32, times d * scales[value / 16].
template <class Sink>
inline void q6_k(const uint8_t* b, Sink& sink, int64_t blocks) {
  for (int64_t i = 0, base = 0; i < blocks; ++i, b += 210, base += 256) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 2; ++s) {
        for (int l = 0; l < 64; l += kLanes) {
          const int e = h * 128 + s * 64 + l;
          const vi lo = (load_u8(ql + h * 64 + l) >> (4 * s)) & 0xF;
          const vi hi = (load_u8(qh + h * 32 + l % 32) >> (2 * (2 * s + l / 32))) & 3;
          const float scale = d * static_cast<float>(scales[e / 16]);
          sink(base + e, to_float((lo | (hi << 4)) - 32) * scale);
        }
      }
    }
  }
}

// One row of `k` values of type `type` (a ggml type id) into `sink`; false for a type without a kernel.
template <class Sink>
inline bool decode_row(int64_t type, const uint8_t* row, Sink& sink, int64_t k) {
  switch (type) {
    case kQ4_0:
      q4_0(row, sink, k / 32);
      return true;
    case kQ4_1:
      q4_1(row, sink, k / 32);
      return true;
    case kQ5_0:
      q5_0(row, sink, k / 32);
      return true;
    case kQ5_1:
      q5_1(row, sink, k / 32);
      return true;
    case kQ8_0:
      q8_0(row, sink, k / 32);
      return true;
    case kQ4_K:
      q4_k(row, sink, k / 256);
      return true;
    case kQ5_K:
      q5_k(row, sink, k / 256);
      return true;
    case kQ6_K:
      q6_k(row, sink, k / 256);
      return true;
    default:
      return false;
  }
}

struct Store {
  float* y;
  void operator()(int64_t offset, vf v) const { std::memcpy(y + offset, &v, sizeof v); }
};

inline bool dequantize_row(int64_t type, const uint8_t* row, float* y, int64_t k) {
  Store sink{y};
  return decode_row(type, row, sink, k);
}

}  // namespace STRATA_GGUF_NS
