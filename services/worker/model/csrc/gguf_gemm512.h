// Many rows of x (prefill chunks, large decode batches) against a GGUF weight of the signed 32-value
// block types (Q4_0, Q5_0, Q8_0) with AVX-512 VNNI: a tiled integer GEMM that computes what
// gguf_dots512.h's PairDots computes for each row of x alone, bit for bit, so a row's result is the
// same whatever M, and the same as gguf_dots.h's on every instruction set.
//
// The weight is decoded once per panel of kPanelRows rows into an int8 form the inner loop reads as
// is: per row and pair of blocks, 64 signed weights (the even block in the low half), 16 int32 lanes
// of -128 * (the sum of each lane's four weights), and 16 lanes of the two blocks' scales. x rounded
// to 8 bits meets it as unsigned bytes (q + 128, one xor per row and pair), so one dpbusd started from
// those -128 * sum lanes gives exactly the integer sums PairDots gets from |w| and x with w's sign,
// with no sign work per pair of rows. Each product then takes lanes += sums * (d_w * d_x), one multiply
// and one fused multiply-add, the even and odd blocks in the two halves of one register, and a row's
// dot is hsum256(even + odd) + 0, PairDots's operations in its order. Four rows of x meet four rows of
// the panel at a time (16 accumulators): each weight register serves four rows of x, each row of x
// four weight rows. Included by gguf_linear.cpp once, in its AVX-512 VNNI region, after gguf_dots512.h.

#pragma once

namespace gguf_gemm {

namespace avx2 = gguf_avx2;

constexpr int64_t kPanelRows = 16;  // weight rows decoded together; a multiple of kWeightRows
constexpr int kWeightRows = 4;      // weight rows one inner step serves
constexpr int kXRows = 4;           // rows of x one inner step serves

// Whether `type` has this kernel.
inline bool tiled(int64_t type) { return type == kQ4_0 || type == kQ5_0 || type == kQ8_0; }

// A panel's rows in the inner loop's form: 64 bytes, 16 lanes, per [row * pairs + pair]. (Plain
// element vectors: a std::vector of __m512i loses the type's alignment.)
struct Panel {
  int64_t pairs = 0;
  std::vector<int8_t> weights;
  std::vector<int32_t> start;  // -128 * the sum of each lane's four weights
  std::vector<float> scales;   // d_w of the even block in the low half, of the odd one in the high

  __m512i weights_at(int64_t at) const { return _mm512_loadu_si512(weights.data() + at * 64); }
  __m512i start_at(int64_t at) const { return _mm512_loadu_si512(start.data() + at * 16); }
  __m512 scales_at(int64_t at) const { return _mm512_loadu_ps(scales.data() + at * 16); }
};

// Block p's 32 weights as signed bytes.
inline __m256i block_weights(int64_t type, const uint8_t* p) {
  switch (type) {
    case kQ4_0:
      return _mm256_sub_epi8((__m256i)avx2::nibbles(p + 2), _mm256_set1_epi8(8));
    case kQ5_0:
      return _mm256_sub_epi8(gguf_vnni::five_bits(p + 6, p + 2), _mm256_set1_epi8(16));
    default:
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  }
}

inline int64_t block_bytes(int64_t type) { return type == kQ4_0 ? 18 : type == kQ5_0 ? 22 : 34; }

// This file's kernel as run_panels takes it: a panel's decoding and the inner loop.
struct BlockPairs {
  using Panel = gguf_gemm::Panel;

  // Weight rows [row, row + kPanelRows) of `w` into `panel`; rows at or past n are zeros.
  static void decode(int64_t type, const uint8_t* w, int64_t row, int64_t n, int64_t k, Panel* panel) {
    const int64_t blocks = k / 32;
    const int64_t bytes = block_bytes(type);
    const int64_t pairs = (blocks + 1) / 2;
    panel->pairs = pairs;
    panel->weights.resize(static_cast<size_t>(kPanelRows * pairs * 64));
    panel->start.resize(static_cast<size_t>(kPanelRows * pairs * 16));
    panel->scales.resize(panel->start.size());
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t r = 0; r < kPanelRows; ++r) {
      const uint8_t* b = w + (row + r) * blocks * bytes;
      for (int64_t p = 0; p < pairs; ++p) {
        const int64_t at = r * pairs + p;
        int8_t* weights = panel->weights.data() + at * 64;
        int32_t* start = panel->start.data() + at * 16;
        float* scales = panel->scales.data() + at * 16;
        if (row + r >= n) {
          _mm512_storeu_si512(weights, _mm512_setzero_si512());
          _mm512_storeu_si512(start, _mm512_setzero_si512());
          _mm512_storeu_ps(scales, _mm512_setzero_ps());
          continue;
        }
        const uint8_t* even = b + 2 * p * bytes;
        const bool single = 2 * p + 1 == blocks;
        const __m256i low = block_weights(type, even);
        const __m256i high = single ? _mm256_setzero_si256() : block_weights(type, even + bytes);
        const __m512i values = gguf_vnni::pair((avx2::v32u)low, (avx2::v32u)high);
        _mm512_storeu_si512(weights, values);
        _mm512_storeu_si512(start, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, values)));
        const float d1 = single ? 0.0f : avx2::scale_at(even + bytes);
        _mm512_storeu_ps(scales, gguf_vnni::halves(avx2::scale_at(even), d1));
      }
    }
  }

  // Rows [first, first + XR) of x against panel rows [j, j + kWeightRows): out[i * kWeightRows + jj].
  template <int XR>
  static void rows(const Panel& panel, int64_t j, const strata::Activations& a, int64_t first, float* out) {
    const int64_t pairs = panel.pairs;
    const int64_t full = a.k / 64;
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t base = j * pairs;
    __m512 lanes[XR][kWeightRows];
    for (int i = 0; i < XR; ++i)
      for (int jj = 0; jj < kWeightRows; ++jj) lanes[i][jj] = _mm512_setzero_ps();
    const auto step = [&](int64_t p, bool single) {
      __m512i w[kWeightRows];
      for (int jj = 0; jj < kWeightRows; ++jj) w[jj] = panel.weights_at(base + jj * pairs + p);
      for (int i = 0; i < XR; ++i) {
        const int8_t* q = a.row_q(first + i) + p * 64;
        const float* d = a.row_d(first + i) + 2 * p;
        const __m512i x = _mm512_xor_si512(
            single ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, q) : _mm512_loadu_si512(q), offset);
        const __m512 dx = gguf_vnni::halves(d[0], single ? 0.0f : d[1]);
        for (int jj = 0; jj < kWeightRows; ++jj) {
          const __m512i sums = _mm512_dpbusd_epi32(panel.start_at(base + jj * pairs + p), x, w[jj]);
          const __m512 scale = _mm512_mul_ps(panel.scales_at(base + jj * pairs + p), dx);
          lanes[i][jj] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, lanes[i][jj], single ? 0x00FF : 0xFFFF);
        }
      }
    };
    for (int64_t p = 0; p < full; ++p) step(p, false);
    if (full < pairs) step(full, true);
    for (int i = 0; i < XR; ++i) {
      for (int jj = 0; jj < kWeightRows; ++jj) {
        const __m256 even = _mm512_castps512_ps256(lanes[i][jj]);
        const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes[i][jj]), 1));
        out[i * kWeightRows + jj] = strata::hsum256(_mm256_add_ps(even, odd)) + 0.0f;
      }
    }
  }
};

// Panels [first, last) of kPanelRows weight rows: y[:, rows] = x . dequant(w)^T + bias for every row
// of the activations. Kernel: BlockPairs, or gguf_kgemm512.h's KQuants. Each panel is decoded once;
// four rows of x at a time then meet its rows four at a time, so those rows of x stay in cache while
// the panel's rows pass.
template <class Kernel>
void run_panels(int64_t type, const strata::Activations& a, const uint8_t* w, const float* bias, float* y, int64_t m,
                int64_t n, int64_t ldy, int64_t first, int64_t last) {
  thread_local typename Kernel::Panel panel;
  float dots[kXRows * kWeightRows];
  for (int64_t pn = first; pn < last; ++pn) {
    const int64_t row = pn * kPanelRows;
    Kernel::decode(type, w, row, n, a.k, &panel);
    for (int64_t i = 0; i < m; i += kXRows) {
      const int64_t xr = std::min<int64_t>(kXRows, m - i);
      for (int64_t j = 0; j < kPanelRows && row + j < n; j += kWeightRows) {
        strata::with_rows<kXRows>(
            xr, [&](auto rows) { Kernel::template rows<decltype(rows)::value>(panel, j, a, i, dots); });
        const int64_t wr = std::min<int64_t>(kWeightRows, n - row - j);
        for (int64_t r = 0; r < xr; ++r) {
          for (int64_t c = 0; c < wr; ++c) {
            const int64_t col = row + j + c;
            const float dot = dots[r * kWeightRows + c];
            y[(i + r) * ldy + col] = bias != nullptr ? dot + bias[col] : dot;
          }
        }
      }
    }
  }
}

inline int64_t panel_count(int64_t n) { return (n + kPanelRows - 1) / kPanelRows; }

}  // namespace gguf_gemm
