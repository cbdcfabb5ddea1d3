// y[M, N] = x[M, K] . w[N, K]^T (* scale[N]) (+ bias[N]) for small M, reading w once.
//
// At a decode step's batch sizes a linear layer is a matrix-vector product: it must stream its
// weight from memory at the machine's bandwidth and do nothing else. Each thread takes a range of
// weight rows; R rows at a time stay in registers' reach while every row of x (a few KiB, in L1)
// meets them, so w is read from memory exactly once whatever M is. The weight is float32, or int8
// with one float32 scale per output row (weight-only quantization: x stays float32, each int8 is
// widened to float32 in registers, so a quarter of the bytes cross the memory bus). The instruction
// set (AVX-512, AVX2 + FMA, or plain C++) is chosen at run time from the CPU this runs on, never from
// the build machine's (isa.h). Threads come from ATen's pool, the one torch's own kernels use, so no second
// OpenMP team competes for the cores. Called through ctypes (extern "C"): no Python types here.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "hsum.h"
#include "isa.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kRows = 4;        // weight rows per tile
constexpr int64_t kXRows = 4;       // rows of x per pass over a tile
constexpr int64_t kGrainBytes = 1 << 16;  // weight bytes per parallel chunk, at least

template <typename W>
struct Problem {
  const float* x;
  const W* w;
  const float* scale;  // nullptr for float32 weights
  const float* bias;   // nullptr when the layer has none
  float* y;
  int64_t m, n, k;
  int64_t ldy;  // elements between rows of y: n, or more when the rows are a tile of a wider output

  // Spelled out as one fused multiply-add where there are both: left to the compiler, dot * scale + bias
  // is contracted in some tile instantiations and not in others, and a row's bits would then depend
  // on how many rows shared its pass (the int8-weight-only mode promises they do not).
  float finish(float dot, int64_t row) const {
    if (scale != nullptr && bias != nullptr) return std::fma(dot, scale[row], bias[row]);
    const float scaled = scale != nullptr ? dot * scale[row] : dot;
    return bias != nullptr ? scaled + bias[row] : scaled;
  }
};

// Sixteen (AVX-512) or eight (AVX2) weights widened to float32, whole or the first `count` of them.
__attribute__((target("avx512f"))) inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
__attribute__((target("avx512f"))) inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
__attribute__((target("avx512f"))) inline __m512 load16(const float* w, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, w);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const int8_t* w, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

template <int R, int MB, typename W>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void tile_avx512(const Problem<W>& p, int64_t row,
                                                                     int64_t m0) {
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  const W* w = p.w + row * p.k;
  const float* x = p.x + m0 * p.k;
  // One cache line of the next tile's rows per prefetch: streaming prefetch alone left ~15% of the
  // bandwidth unused at M=4 (bench/small_linear.py).
  constexpr int64_t kLine = 64 / sizeof(W);
  int64_t k = 0;
  for (; k + 16 <= p.k; k += 16) {
    __m512 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_ps(x + i * p.k + k);
    for (int r = 0; r < R; ++r) {
      if (k % kLine == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * p.k + k), _MM_HINT_T0);
      const __m512 wv = load16(w + r * p.k + k);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  if (k < p.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.k - k)) - 1u);
    __m512 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * p.k + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w + r * p.k + k, mask);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) p.y[(m0 + i) * p.ldy + row + r] = p.finish(_mm512_reduce_add_ps(acc[r][i]), row + r);
}

template <int R, int MB, typename W>
__attribute__((target("avx2,fma"))) void tile_avx2(const Problem<W>& p, int64_t row, int64_t m0) {
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  const W* w = p.w + row * p.k;
  const float* x = p.x + m0 * p.k;
  constexpr int64_t kLine = 64 / sizeof(W);
  int64_t k = 0;
  for (; k + 8 <= p.k; k += 8) {
    __m256 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * p.k + k);
    for (int r = 0; r < R; ++r) {
      if (k % kLine == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * p.k + k), _MM_HINT_T0);
      const __m256 wv = load8(w + r * p.k + k);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < MB; ++i) {
      float tail = 0.0f;
      for (int64_t j = k; j < p.k; ++j) tail = std::fma(static_cast<float>(w[r * p.k + j]), x[i * p.k + j], tail);
      p.y[(m0 + i) * p.ldy + row + r] = p.finish(strata::hsum256(acc[r][i]) + tail, row + r);
    }
  }
}

template <int R, int MB, typename W>
void tile_portable(const Problem<W>& p, int64_t row, int64_t m0) {
  for (int r = 0; r < R; ++r) {
    const W* w = p.w + (row + r) * p.k;
    for (int i = 0; i < MB; ++i) {
      const float* x = p.x + (m0 + i) * p.k;
      float sum = 0.0f;
      for (int64_t j = 0; j < p.k; ++j) sum += static_cast<float>(w[j]) * x[j];
      p.y[(m0 + i) * p.ldy + row + r] = p.finish(sum, row + r);
    }
  }
}

// One ISA's tiles for one weight type, indexed by [rows in the tile == kRows][rows of x in the pass - 1].
template <typename W>
struct Tiles {
  using Tile = void (*)(const Problem<W>&, int64_t, int64_t);
  Tile tiles[2][kXRows];
};

#define STRATA_TILES(fn, W)                                                                       \
  Tiles<W> {                                                                                      \
    {{fn<1, 1, W>, fn<1, 2, W>, fn<1, 3, W>, fn<1, 4, W>},                                        \
     {fn<kRows, 1, W>, fn<kRows, 2, W>, fn<kRows, 3, W>, fn<kRows, 4, W>}}                        \
  }

struct Isa {
  const char* name;
  Tiles<float> f32;
  Tiles<int8_t> i8;
};

const Isa kAvx512 = {"avx512", STRATA_TILES(tile_avx512, float), STRATA_TILES(tile_avx512, int8_t)};
const Isa kAvx2 = {"avx2", STRATA_TILES(tile_avx2, float), STRATA_TILES(tile_avx2, int8_t)};
const Isa kPortable = {"portable", STRATA_TILES(tile_portable, float), STRATA_TILES(tile_portable, int8_t)};

const Isa& kernel_isa() {
  switch (strata::chosen_isa()) {
    case strata::Isa::kAvx512:
      return kAvx512;
    case strata::Isa::kAvx2:
      return kAvx2;
    case strata::Isa::kPortable:
      break;
  }
  return kPortable;
}

// Output rows of tiles [first, last): each output element is one tile's sum, whoever computes it.
template <typename W>
void tile_range(const Tiles<W>& tiles, const Problem<W>& p, int64_t first, int64_t last) {
  const int64_t end = std::min(p.n, last * kRows);
  for (int64_t row = first * kRows; row < end;) {
    const int full = row + kRows <= end ? 1 : 0;
    for (int64_t m0 = 0; m0 < p.m; m0 += kXRows) {
      const int64_t mb = std::min(kXRows, p.m - m0);
      tiles.tiles[full][mb - 1](p, row, m0);
    }
    row += full ? kRows : 1;
  }
}

template <typename W>
int64_t tile_count(const Problem<W>& p) {
  return (p.n + kRows - 1) / kRows;
}

template <typename W>
void run(const Tiles<W>& tiles, const Problem<W>& p) {
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kRows * p.k * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, tile_count(p), grain, [&](int64_t first, int64_t last) { tile_range(tiles, p, first, last); });
}

template <typename W>
void run_part(const Tiles<W>& tiles, const Problem<W>& p, int64_t part, int64_t parts) {
  int64_t first = 0;
  int64_t last = 0;
  strata::share(tile_count(p), part, parts, &first, &last);
  tile_range(tiles, p, first, last);
}

}  // namespace

void strata::small_linear_part(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                               int64_t k, int64_t part, int64_t parts) {
  run_part(kernel_isa().f32, Problem<float>{x, w, nullptr, bias, y, m, n, k, n}, part, parts);
}

void strata::small_linear_int8_part(const float* x, const int8_t* w, const float* scale, const float* bias,
                                    float* y, int64_t m, int64_t n, int64_t k, int64_t part, int64_t parts) {
  run_part(kernel_isa().i8, Problem<int8_t>{x, w, scale, bias, y, m, n, k, n}, part, parts);
}

void strata::small_linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t m,
                               int64_t rows, int64_t k, int64_t ldy) {
  const Problem<float> p{x, w, nullptr, bias, y, m, rows, k, ldy};
  tile_range(kernel_isa().f32, p, 0, tile_count(p));
}

extern "C" {

// The instruction set the kernels run with on this CPU: "avx512", "avx2" or "portable".
const char* strata_small_linear_isa() { return kernel_isa().name; }

// x [m, k], w [n, k], bias [n] or null, y [m, n]: all contiguous float32, y not aliasing the others.
void strata_small_linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                         int64_t k) {
  run(kernel_isa().f32, Problem<float>{x, w, nullptr, bias, y, m, n, k, n});
}

// As strata_small_linear with w [n, k] int8 and y = (x . w^T) * scale[n] + bias: scale float32 [n].
void strata_small_linear_int8(const float* x, const int8_t* w, const float* scale, const float* bias, float* y,
                              int64_t m, int64_t n, int64_t k) {
  run(kernel_isa().i8, Problem<int8_t>{x, w, scale, bias, y, m, n, k, n});
}
}
