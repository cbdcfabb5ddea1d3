// Many rows of x against a GGUF weight of the K types (Q4_K, Q5_K, Q6_K) with AVX-512 VNNI: a tiled
// integer GEMM that computes what gguf_dots.h's RowDots computes for each row of x alone (the K
// types' kernel on every instruction set), bit for bit, so a row's result is the same whatever M.
//
// The weight is decoded once per panel of kPanelRows rows into what the inner loop reads: per row and
// super-block, its 256 quants each times its sub-block's scale as int16 (at most 32 * 128 in
// magnitude), d_w, dmin and the eight sub-block mins. x rounded to 8 bits per 256 values is widened to
// int16 as it is read, and one dpwssd per 32 values adds pairs of products into 16 int32 lanes; at a
// super-block's end each two neighbouring lanes add into one of eight, the lanes RowDots sums (values
// 4l..4l+3 of every sub-block; the integer sums are exact, so their grouping does not change them),
// and even += sums * (d_w * d_x) as one fused multiply-add; the mins add -(dmin * d_x) * (the integer
// sum of min * the sub-block's sum of q) into a scalar of their own, and a row's dot is
// hsum256(even + 0) + offsets: RowDots's operations in its order. Included by gguf_linear.cpp once,
// in its AVX-512 VNNI region, after gguf_gemm512.h, whose panel driver it shares.

#pragma once

namespace gguf_kgemm {

namespace avx2 = gguf_avx2;
using gguf_gemm::kPanelRows;
using gguf_gemm::kWeightRows;

inline bool tiled(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// A panel's rows in the inner loop's form: per [row * supers + super-block] its scaled quants and d_w;
// per [(row / kWeightRows) * supers + super-block] the mins and dmin of kWeightRows rows side by side,
// so one dpwssd weighs a row of x's sub-block sums by four rows' mins at once.
struct Panel {
  int64_t supers = 0;
  std::vector<int16_t> weights;  // 256 scaled quants
  std::vector<float> d;          // d_w
  std::vector<int16_t> mins;     // 8 per row, kWeightRows rows
  std::vector<float> dmin;       // 1 per row, kWeightRows rows
  bool has_mins = false;         // Q4_K and Q5_K; Q6_K has none

  __m512i weights_at(int64_t at, int sub) const {
    return _mm512_loadu_si512(weights.data() + at * 256 + sub * 32);
  }
};

// 32 unsigned quants times `scale`, as int16.
inline __m512i scaled(avx2::v32u w, int scale) {
  return _mm512_mullo_epi16(_mm512_cvtepu8_epi16((__m256i)w), _mm512_set1_epi16(static_cast<int16_t>(scale)));
}

// Super-block b of `type` into 256 scaled quants, d, dmin and mins (left alone where the type has none).
inline void decode_super(int64_t type, const uint8_t* b, int16_t* out, float* d, float* dmin, int16_t* mins) {
  if (type == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h) {
      const avx2::v32u low[2] = {avx2::load_u8x32(b + h * 64), avx2::load_u8x32(b + h * 64 + 32)};
      const avx2::v32u high = avx2::load_u8x32(b + 128 + h * 32);
      for (int j = 0; j < 4; ++j) {
        const avx2::v32u nibble = j < 2 ? low[j] & 0xF : low[j - 2] >> 4;
        const avx2::v32s w = (avx2::v32s)((nibble | (((high >> (2 * j)) & 3) << 4)) - 32);
        const int s = h * 8 + 2 * j;
        const __m512i scale = _mm512_inserti64x4(_mm512_set1_epi16(scales[s]), _mm256_set1_epi16(scales[s + 1]), 1);
        const __m512i values = _mm512_mullo_epi16(_mm512_cvtepi8_epi16((__m256i)w), scale);
        _mm512_storeu_si512(out + (h * 4 + j) * 32, values);
      }
    }
    *d = avx2::scale_at(b + 208);
    return;
  }
  const bool fifth = type == kQ5_K;
  uint8_t scale[8];
  uint8_t min[8];
  k_scale_bytes(b + 4, scale, min);
  const uint8_t* qs = b + (fifth ? 48 : 16);
  const avx2::v32u high = fifth ? avx2::load_u8x32(b + 16) : avx2::v32u{};
  for (int c = 0; c < 4; ++c) {
    const avx2::v32u chunk = avx2::load_u8x32(qs + c * 32);
    for (int half = 0; half < 2; ++half) {
      const int sub = 2 * c + half;
      avx2::v32u w = half == 0 ? chunk & 0xF : chunk >> 4;
      if (fifth) w |= ((high >> sub) & 1) << 4;
      _mm512_storeu_si512(out + sub * 32, scaled(w, scale[sub]));
    }
  }
  *d = avx2::scale_at(b);
  *dmin = avx2::scale_at(b + 2);
  for (int s = 0; s < 8; ++s) mins[s] = min[s];
}

inline int64_t super_bytes(int64_t type) { return type == kQ4_K ? 144 : type == kQ5_K ? 176 : 210; }

// This file's kernel as run_panels takes it: a panel's decoding and the inner loop.
struct KQuants {
  using Panel = gguf_kgemm::Panel;

  // Weight rows [row, row + kPanelRows) of `w` into `panel`; rows at or past n are zeros.
  static void decode(int64_t type, const uint8_t* w, int64_t row, int64_t n, int64_t k, Panel* panel) {
    const int64_t supers = k / 256;
    const int64_t bytes = super_bytes(type);
    panel->supers = supers;
    panel->has_mins = type != kQ6_K;
    panel->weights.assign(static_cast<size_t>(kPanelRows * supers * 256), 0);
    panel->d.assign(static_cast<size_t>(kPanelRows * supers), 0.0f);
    panel->mins.assign(static_cast<size_t>(kPanelRows * supers * 8), 0);
    panel->dmin.assign(static_cast<size_t>(kPanelRows * supers), 0.0f);
    for (int64_t r = 0; r < kPanelRows && row + r < n; ++r) {
      for (int64_t i = 0; i < supers; ++i) {
        const int64_t at = r * supers + i;
        const int64_t group = (r / kWeightRows) * supers + i;
        decode_super(type, w + ((row + r) * supers + i) * bytes, panel->weights.data() + at * 256,
                     panel->d.data() + at, panel->dmin.data() + group * kWeightRows + r % kWeightRows,
                     panel->mins.data() + (group * kWeightRows + r % kWeightRows) * 8);
      }
    }
  }

  // Lane jj: -(dmin * d_x) * (the sum over sub-blocks of min * their sum of q) for weight row j + jj of
  // super-block s against a row of x (its eight sums of q at isum, its scale dx). The mins (at most 63)
  // and the sums of q (at most 32 * 127) are exact as int16; four lanes of the dpwssd hold each row's
  // eight products in pairs and add up to its integer sum.
  [[gnu::always_inline]] static __m128 min_terms(const Panel& panel, int64_t j, int64_t s, const int32_t* isum,
                                                 float dx) {
    const int64_t group = (j / kWeightRows) * panel.supers + s;
    const __m512i mins = _mm512_loadu_si512(panel.mins.data() + group * kWeightRows * 8);
    const __m128i sums = _mm_packs_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(isum)),
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(isum + 4)));
    const __m512i products = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_broadcast_i32x4(sums), mins);
    const __m256i pairs = _mm512_cvtepi64_epi32(_mm512_add_epi32(products, _mm512_srli_epi64(products, 32)));
    const __m128i weighted = _mm256_cvtepi64_epi32(_mm256_add_epi32(pairs, _mm256_srli_epi64(pairs, 32)));
    const __m128 dmin = _mm_loadu_ps(panel.dmin.data() + group * kWeightRows);
    const __m128 scale = _mm_xor_ps(_mm_mul_ps(dmin, _mm_set1_ps(dx)), _mm_set1_ps(-0.0f));
    return _mm_mul_ps(scale, _mm_cvtepi32_ps(weighted));
  }

  // Rows [first, first + XR) of x against panel rows [j, j + kWeightRows): out[i * kWeightRows + jj].
  template <int XR>
  static void rows(const Panel& panel, int64_t j, const strata::Activations& a, int64_t first, float* out) {
    const int64_t supers = panel.supers;
    __m256 even[XR][kWeightRows];
    __m128 offsets[XR];  // lane jj: weight row j + jj
    for (int i = 0; i < XR; ++i) {
      offsets[i] = _mm_setzero_ps();
      for (int jj = 0; jj < kWeightRows; ++jj) even[i][jj] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < supers; ++s) {
      __m512i sums[XR][kWeightRows];
      for (int i = 0; i < XR; ++i)
        for (int jj = 0; jj < kWeightRows; ++jj) sums[i][jj] = _mm512_setzero_si512();
      for (int sub = 0; sub < 8; ++sub) {
        __m512i w[kWeightRows];
        for (int jj = 0; jj < kWeightRows; ++jj) w[jj] = panel.weights_at((j + jj) * supers + s, sub);
        for (int i = 0; i < XR; ++i) {
          const int8_t* q = a.row_q(first + i) + s * 256 + sub * 32;
          const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
          for (int jj = 0; jj < kWeightRows; ++jj) sums[i][jj] = _mm512_dpwssd_epi32(sums[i][jj], x, w[jj]);
        }
      }
      for (int i = 0; i < XR; ++i) {
        const float dx = a.row_d(first + i)[s];
        const int32_t* isum = a.row_isum(first + i) + s * 8;
        for (int jj = 0; jj < kWeightRows; ++jj) {
          const int64_t at = (j + jj) * supers + s;
          const __m512i pairs = _mm512_add_epi32(sums[i][jj], _mm512_srli_epi64(sums[i][jj], 32));
          const __m256i lanes = _mm512_cvtepi64_epi32(pairs);
          even[i][jj] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(panel.d[at] * dx), even[i][jj]);
        }
        if (panel.has_mins) offsets[i] = _mm_add_ps(offsets[i], min_terms(panel, j, s, isum, dx));
      }
    }
    for (int i = 0; i < XR; ++i)
      for (int jj = 0; jj < kWeightRows; ++jj)
        out[i * kWeightRows + jj] = strata::hsum256(_mm256_add_ps(even[i][jj], _mm256_setzero_ps())) + offsets[i][jj];
  }
};


}  // namespace gguf_kgemm
