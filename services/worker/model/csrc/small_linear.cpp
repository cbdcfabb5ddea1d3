// y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]) for small M, in float32, reading w once.
//
// At a decode step's batch sizes a linear layer is a matrix-vector product: it must stream its
// weight from memory at the machine's bandwidth and do nothing else. Each thread takes a range of
// weight rows; R rows at a time stay in registers' reach while every row of x (a few KiB, in L1)
// meets them, so w is read from memory exactly once whatever M is. The instruction set (AVX-512,
// AVX2 + FMA, or plain C++) is chosen at run time from the CPU this runs on, never from the build
// machine's. Threads come from ATen's pool, the one torch's own kernels use, so no second OpenMP
// team competes for the cores. Called through ctypes (extern "C"): no Python types here.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRows = 4;        // weight rows per tile
constexpr int64_t kXRows = 4;       // rows of x per pass over a tile
constexpr int64_t kGrainBytes = 1 << 16;  // weight bytes per parallel chunk, at least

struct Problem {
  const float* x;
  const float* w;
  const float* bias;  // nullptr when the layer has none
  float* y;
  int64_t m, n, k;
};

template <int R, int MB>
__attribute__((target("avx512f"))) void tile_avx512(const Problem& p, int64_t row, int64_t m0) {
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  const float* w = p.w + row * p.k;
  const float* x = p.x + m0 * p.k;
  int64_t k = 0;
  for (; k + 16 <= p.k; k += 16) {
    __m512 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_ps(x + i * p.k + k);
    for (int r = 0; r < R; ++r) {
      // The next tile's rows, one cache line per load: streaming prefetch alone left ~15% of the
      // bandwidth unused at M=4 (bench/small_linear.py).
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * p.k + k), _MM_HINT_T0);
      const __m512 wv = _mm512_loadu_ps(w + r * p.k + k);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  if (k < p.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.k - k)) - 1u);
    __m512 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * p.k + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + r * p.k + k);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = p.bias != nullptr ? p.bias[row + r] : 0.0f;
    for (int i = 0; i < MB; ++i) p.y[(m0 + i) * p.n + row + r] = _mm512_reduce_add_ps(acc[r][i]) + b;
  }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int MB>
__attribute__((target("avx2,fma"))) void tile_avx2(const Problem& p, int64_t row, int64_t m0) {
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  const float* w = p.w + row * p.k;
  const float* x = p.x + m0 * p.k;
  int64_t k = 0;
  for (; k + 8 <= p.k; k += 8) {
    __m256 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * p.k + k);
    for (int r = 0; r < R; ++r) {
      if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * p.k + k), _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(w + r * p.k + k);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = p.bias != nullptr ? p.bias[row + r] : 0.0f;
    for (int i = 0; i < MB; ++i) {
      float tail = 0.0f;
      for (int64_t j = k; j < p.k; ++j) tail += w[r * p.k + j] * x[i * p.k + j];
      p.y[(m0 + i) * p.n + row + r] = hsum256(acc[r][i]) + tail + b;
    }
  }
}

template <int R, int MB>
void tile_portable(const Problem& p, int64_t row, int64_t m0) {
  for (int r = 0; r < R; ++r) {
    const float* w = p.w + (row + r) * p.k;
    for (int i = 0; i < MB; ++i) {
      const float* x = p.x + (m0 + i) * p.k;
      float sum = 0.0f;
      for (int64_t j = 0; j < p.k; ++j) sum += w[j] * x[j];
      p.y[(m0 + i) * p.n + row + r] = sum + (p.bias != nullptr ? p.bias[row + r] : 0.0f);
    }
  }
}

// One ISA's tiles, indexed by [rows in the tile == kRows][rows of x in the pass - 1].
using Tile = void (*)(const Problem&, int64_t, int64_t);
struct Isa {
  const char* name;
  Tile tiles[2][kXRows];
};

#define STRATA_TILES(fn) \
  {{fn<1, 1>, fn<1, 2>, fn<1, 3>, fn<1, 4>}, {fn<kRows, 1>, fn<kRows, 2>, fn<kRows, 3>, fn<kRows, 4>}}

const Isa kAvx512 = {"avx512", STRATA_TILES(tile_avx512)};
const Isa kAvx2 = {"avx2", STRATA_TILES(tile_avx2)};
const Isa kPortable = {"portable", STRATA_TILES(tile_portable)};

const Isa& chosen_isa() {
  static const Isa& isa = [] () -> const Isa& {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
    return kPortable;
  }();
  return isa;
}

void rows(const Isa& isa, const Problem& p, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end;) {
    const int full = row + kRows <= end ? 1 : 0;
    for (int64_t m0 = 0; m0 < p.m; m0 += kXRows) {
      const int64_t mb = std::min(kXRows, p.m - m0);
      isa.tiles[full][mb - 1](p, row, m0);
    }
    row += full ? kRows : 1;
  }
}

}  // namespace

extern "C" {

// The instruction set the kernels run with on this CPU: "avx512", "avx2" or "portable".
const char* strata_small_linear_isa() { return chosen_isa().name; }

// x [m, k], w [n, k], bias [n] or null, y [m, n]: all contiguous float32, y not aliasing the others.
void strata_small_linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                         int64_t k) {
  const Problem p{x, w, bias, y, m, n, k};
  const Isa& isa = chosen_isa();
  const int64_t tiles = (n + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kRows * k * static_cast<int64_t>(sizeof(float))));
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    rows(isa, p, first * kRows, std::min(n, last * kRows));
  });
}
}
