// y[M, N] = x[M, K] . w[N, K]^T (+ bias) for a weight kept as GGUF blocks, and that weight's
// dequantization.
//
// The weight never exists as float32 in memory, so the bytes crossing the memory bus are the file's.
// Up to kIntegerMaxRows rows of x (decode steps), x is first rounded to 8 bits per 32 values, per 256
// for the K types (gguf_activations.h), and each weight row's dot products with up to four rows of x
// at a time (eight with VNNI) come from the stored quants in integers, as ggml computes them
// (gguf_dots.h; on AVX-512 VNNI gguf_dots512.h for the 32-value types, gguf_kdots512.h for the K
// types), each thread taking tiles of kTileRows weight rows: the same bits whatever M (up to the
// bound), the tile, the thread or the instruction set (AVX-512 VNNI, AVX2, which AVX-512 CPUs without
// VNNI run too, or the portable build), and off the float32 product on the
// dequantized weight by the activations' rounding only. With AVX-512 VNNI every type but Q4_1 and
// Q5_1 stays on that integer path at any M: gguf_gemm512.h's tiled GEMM (Q4_0, Q5_0, Q8_0) and
// gguf_kgemm512.h's (the K types) decode panels of weight rows once and give each row of x the bits
// the dot products give it alone, so prefill computes what decode does, in fewer instructions per
// product than the float32 GEMM (bench.gguf_linear). Otherwise, above
// the bound, a tile is dequantized into a buffer of its own once and small_linear.cpp's float32 tiles
// multiply every row of x by it: each element the float32 kernel's sum over the dequantized row.
// Either way the decode stack (gguf_linear_part) and the layer-by-layer path agree bit for bit.
// Dequantization (embedding rows, the tile path, batches above GgufLinear's row bound, tests) equals
// the gguf package's bit for bit (gguf_blocks.h), with AVX-512, AVX2 or the portable build, chosen at
// run time like every kernel here (isa.h). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K
// (ggml's type ids); strata_gguf_supported says which, strata_gguf_any_rows which take any M.

// The dequantization must round q * d and + m (or - m) separately, as the gguf package does.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_activations.h"
#include "hsum.h"
#include "isa.h"
#include "kernels.h"

namespace {

// ggml's type ids (gguf's GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kTileRows = 4;          // weight rows per tile
// Rows of x up to which the integer dot products run (decode steps: the decode stack's bound). Above,
// with AVX-512 VNNI, the tiled kernels take their types; otherwise a dequantized tile times x in
// float32 makes fewer instructions per product than AVX2's integer sequence does, and every row of x
// reuses the tile. strata_gguf_set_integer_rows sets it to 0 for products equal to the float32 model
// of the dequantized file (parity checks against transformers), the tiled kernels' included.
constexpr int64_t kIntegerMaxRows = 8;
std::atomic<int64_t> integer_max_rows{kIntegerMaxRows};
constexpr int64_t kGrainBytes = 1 << 15;  // stored weight bytes per parallel chunk, at least

// The scalar helpers below are used inside every instruction set's kernels: always inlined, so they
// are compiled with the caller's instructions. Out of line they are baseline SSE code, which an
// AVX-512 caller holding its 512-bit registers calls at a transition penalty on every instruction
// (measured: dequantizing Q5_0 rows five times slower).

// A float16's exact float32 value (normal, subnormal, zero, infinity and NaN alike).
[[gnu::always_inline]] inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign != 0 ? -magnitude : magnitude;
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Q4_K's and Q5_K's eight 6-bit sub-block scales and mins, from the 12 bytes at s.
[[gnu::always_inline]] inline void k_scale_bytes(const uint8_t* s, uint8_t* scale, uint8_t* min) {
  for (int i = 0; i < 8; ++i) {
    scale[i] = static_cast<uint8_t>(i < 4 ? s[i] & 63 : (s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4));
    min[i] = static_cast<uint8_t>(i < 4 ? s[i + 4] & 63 : (s[i + 4] >> 4) | ((s[i] >> 6) << 4));
  }
}

// The same as d * sc and dmin * m, each one float32 product.
[[gnu::always_inline]] inline void k_scales(const uint8_t* b, float* scale, float* min) {
  const float d = half_to_float(b);
  const float dmin = half_to_float(b + 2);
  uint8_t sc[8];
  uint8_t m[8];
  k_scale_bytes(b + 4, sc, m);
  for (int i = 0; i < 8; ++i) {
    scale[i] = d * static_cast<float>(sc[i]);
    min[i] = dmin * static_cast<float>(m[i]);
  }
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#define STRATA_GGUF_NS gguf_avx512
#define STRATA_LANES 16
#include "gguf_blocks.h"
#undef STRATA_GGUF_NS
#undef STRATA_LANES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define STRATA_GGUF_NS gguf_avx2
#define STRATA_LANES 8
#include "gguf_blocks.h"
#include "gguf_dots.h"
#undef STRATA_GGUF_NS
#undef STRATA_LANES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include "gguf_dots512.h"
#include "gguf_kdots512.h"
#include "gguf_gemm512.h"
#include "gguf_kgemm512.h"
#pragma GCC pop_options

#define STRATA_GGUF_NS gguf_portable
#define STRATA_LANES 4
#include "gguf_blocks.h"
#include "gguf_dots.h"
#undef STRATA_GGUF_NS
#undef STRATA_LANES

namespace {

using Dequantize = bool (*)(int64_t, const uint8_t*, float*, int64_t);
using DotRows = void (*)(int64_t, const uint8_t*, const strata::Activations&, int64_t, int64_t, float*);

struct Decoders {
  Dequantize dequantize;
  DotRows dot_rows;
  int64_t dot_rows_max;  // rows of x one dot_rows call takes: its kernel's registers hold that many
};

Decoders decoders() {
  switch (strata::chosen_isa()) {
    case strata::Isa::kAvx512:
      // With VNNI, dpbusd sums four byte products at a time (gguf_dots512.h, gguf_kdots512.h).
      if (strata::has_avx512_vnni()) return {gguf_avx512::dequantize_row, gguf_vnni::dot_rows, gguf_vnni::kDotRows};
      return {gguf_avx512::dequantize_row, gguf_avx2::dot_rows, gguf_avx2::kDotRows};
    case strata::Isa::kAvx2:
      return {gguf_avx2::dequantize_row, gguf_avx2::dot_rows, gguf_avx2::kDotRows};
    case strata::Isa::kPortable:
      break;
  }
  return {gguf_portable::dequantize_row, gguf_portable::dot_rows, gguf_portable::kDotRows};
}

// (values per block, bytes per block) of a supported type; {0, 0} for any other.
std::pair<int64_t, int64_t> block_shape(int64_t type) {
  switch (type) {
    case kQ4_0:
      return {32, 18};
    case kQ4_1:
      return {32, 20};
    case kQ5_0:
      return {32, 22};
    case kQ5_1:
      return {32, 24};
    case kQ8_0:
      return {32, 34};
    case kQ4_K:
      return {256, 144};
    case kQ5_K:
      return {256, 176};
    case kQ6_K:
      return {256, 210};
    default:
      return {0, 0};
  }
}

int64_t row_bytes(int64_t type, int64_t k) {
  const auto [values, bytes] = block_shape(type);
  return k / values * bytes;
}

int64_t grain(int64_t per_item_bytes) { return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, per_item_bytes)); }

int64_t tile_count(int64_t n) { return (n + kTileRows - 1) / kTileRows; }

// Weight-row tiles [first, last) on the calling thread. With `a` (x quantized, up to kIntegerMaxRows
// rows): each weight row meets the rows of x as many at a time as the kernel takes (four, eight with
// VNNI), its blocks decoded once per call.
// Above, each tile is dequantized into a buffer once and the float32 kernel multiplies every row of x
// by it: each element the float32 kernel's sum over the dequantized row.
void linear_tiles(int64_t type, const float* x, const strata::Activations* a, const uint8_t* w, const float* bias,
                  float* y, int64_t m, int64_t n, int64_t k, int64_t ldy, int64_t first, int64_t last) {
  const Decoders decode = decoders();
  const int64_t bytes = row_bytes(type, k);
  const int64_t end = std::min(n, last * kTileRows);
  if (a != nullptr) {
    float dots[kIntegerMaxRows];
    for (int64_t row = first * kTileRows; row < end; ++row) {
      for (int64_t i = 0; i < m; i += decode.dot_rows_max) {
        const int64_t count = std::min<int64_t>(decode.dot_rows_max, m - i);
        decode.dot_rows(type, w + row * bytes, *a, i, count, dots);
        for (int64_t r = 0; r < count; ++r) y[(i + r) * ldy + row] = bias != nullptr ? dots[r] + bias[row] : dots[r];
      }
    }
    return;
  }
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(kTileRows * k));
  for (int64_t row = first * kTileRows; row < end; row += kTileRows) {
    const int64_t rows = std::min(kTileRows, end - row);
    for (int64_t r = 0; r < rows; ++r) decode.dequantize(type, w + (row + r) * bytes, buffer.data() + r * k, k);
    strata::small_linear_rows(x, buffer.data(), bias != nullptr ? bias + row : nullptr, y + row, m, rows, k, ldy);
  }
}

// Whether this CPU runs a tiled kernel (gguf_gemm512.h, gguf_kgemm512.h) on `type`.
bool tiled(int64_t type) {
  return strata::chosen_isa() == strata::Isa::kAvx512 && strata::has_avx512_vnni() &&
         (gguf_gemm::tiled(type) || gguf_kgemm::tiled(type));
}

// Whether m rows of x against `type` take the integer path: up to kIntegerMaxRows rows on every
// instruction set, at any m where a tiled kernel runs (AVX-512 VNNI, their types).
bool integer_rows(int64_t type, int64_t m) {
  const int64_t bound = integer_max_rows.load(std::memory_order_relaxed);
  return m <= bound || (bound != 0 && tiled(type));
}

// x quantized for `type` into this thread's activations where the integer path takes m rows; else
// null. The K types read x scaled per 256 values (their super-block), the others per 32. Many rows
// (the tiled kernel's) are shared out among the threads.
const strata::Activations* quantized(int64_t type, const float* x, int64_t m, int64_t k) {
  if (!integer_rows(type, m)) return nullptr;
  thread_local strata::Activations a;
  strata::size_activations(m, k, block_shape(type).first == 256 ? 256 : 32, &a);
  strata::Activations* out = &a;
  at::parallel_for(0, m, std::max<int64_t>(1, kGrainBytes / (4 * k)), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) strata::quantize_row(x + row * k, row, out);
  });
  return &a;
}

// Whether m rows of x quantized into `a` (or null) take a tiled kernel.
bool tiled_rows(int64_t type, const strata::Activations* a, int64_t m) {
  return a != nullptr && m > kIntegerMaxRows && tiled(type);
}

// Items [first, last): a tiled kernel's panels of the weight, or linear_tiles's row tiles.
void linear_part(int64_t type, const float* x, const strata::Activations* a, const uint8_t* w, const float* bias,
                 float* y, int64_t m, int64_t n, int64_t k, int64_t ldy, int64_t first, int64_t last) {
  if (tiled_rows(type, a, m)) {
    if (gguf_kgemm::tiled(type)) {
      gguf_gemm::run_panels<gguf_kgemm::KQuants>(type, *a, w, bias, y, m, n, ldy, first, last);
    } else {
      gguf_gemm::run_panels<gguf_gemm::BlockPairs>(type, *a, w, bias, y, m, n, ldy, first, last);
    }
  } else {
    linear_tiles(type, x, a, w, bias, y, m, n, k, ldy, first, last);
  }
}

// How many items linear_part shares out for m rows: the tiled kernel's panels, or row tiles.
int64_t part_items(int64_t type, const strata::Activations* a, int64_t m, int64_t n) {
  return tiled_rows(type, a, m) ? gguf_gemm::panel_count(n) : tile_count(n);
}

}  // namespace

void strata::gguf_linear_part(int64_t type, const float* x, const uint8_t* w, const float* bias, float* y,
                              int64_t m, int64_t n, int64_t k, int64_t ldy, int64_t part, int64_t parts) {
  // Each thread of the decode stack quantizes x for itself: the same bytes on every thread, and a
  // few thousand values against its share of the weight's millions.
  const strata::Activations* a = quantized(type, x, m, k);
  int64_t first = 0;
  int64_t last = 0;
  strata::share(part_items(type, a, m, n), part, parts, &first, &last);
  linear_part(type, x, a, w, bias, y, m, n, k, ldy, first, last);
}

extern "C" {

// Whether batches of up to eight rows take the integer path (1, the default) or the float32 kernel on
// dequantized tiles (0); returns the previous setting. A call in flight keeps the path it began on.
int strata_gguf_set_integer_rows(int on) {
  const int64_t previous = integer_max_rows.exchange(on != 0 ? kIntegerMaxRows : 0);
  return previous != 0 ? 1 : 0;
}

// Whether `type` has a kernel and `k` is a whole number of its blocks.
int strata_gguf_supported(int64_t type, int64_t k) {
  const int64_t values = block_shape(type).first;
  return values != 0 && k > 0 && k % values == 0 ? 1 : 0;
}

// w: n rows of k values of `type` as stored; y [n, k] float32. Call strata_gguf_supported first.
void strata_gguf_dequantize(int64_t type, const uint8_t* w, float* y, int64_t n, int64_t k) {
  const Dequantize dequantize = decoders().dequantize;
  const int64_t bytes = row_bytes(type, k);
  at::parallel_for(0, n, grain(bytes), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) dequantize(type, w + row * bytes, y + row * k, k);
  });
}

// x [m, k] float32, w n rows of `type`, bias [n] or null, y [m, ldy] (ldy >= n: the columns of a wider
// output this weight's rows fill): y[:, :n] = x . dequant(w)^T + bias, x rounded to 8 bits per 32
// values (256 for the K types) on the integer path.
void strata_gguf_linear(int64_t type, const float* x, const uint8_t* w, const float* bias, float* y, int64_t m,
                        int64_t n, int64_t k, int64_t ldy) {
  const strata::Activations* a = quantized(type, x, m, k);
  const int64_t items = part_items(type, a, m, n);
  const int64_t per_item = tiled_rows(type, a, m) ? gguf_gemm::kPanelRows : kTileRows;
  at::parallel_for(0, items, grain(per_item * row_bytes(type, k)), [&](int64_t first, int64_t last) {
    linear_part(type, x, a, w, bias, y, m, n, k, ldy, first, last);
  });
}

// Whether batches of any number of rows take the integer path on `type` (this CPU has the tiled
// kernel for it and the integer path is on); else only up to eight rows do.
int strata_gguf_any_rows(int64_t type) {
  return integer_max_rows.load(std::memory_order_relaxed) != 0 && tiled(type) ? 1 : 0;
}
}
