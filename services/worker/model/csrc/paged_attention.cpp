// Decode attention over the paged KV cache, read in place: no gather of a sequence's blocks.
//
// Each decode token's query heads attend to their sequence's cached keys and values where they lie,
// block by block through its block table. One task per (sequence, kv head) computes the scores of
// that kv head's query-head group against every cached key, a float32 softmax (max subtracted, as
// torch's SDPA does), and the weighted sum of the values. A cache row (one token's one kv head) is
// float32, or int8 (kv_format.py's rows: dim int8 values, then their float32 scale): an int8 key's
// score is (q . its values) * its scale, a value adds (weight * its scale) * its values, the int8
// values widened to float32 in registers; a decode's own new k/v are quantized here as kv_format.py
// quantizes them, to the bit. The instruction set is chosen at run time (AVX-512, else portable C++
// that the compiler vectorises for the baseline ISA). Threads come from ATen's pool. Called through
// ctypes (extern "C"): no Python types here.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "isa.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// kv_format.py's NATIVE_* ids.
constexpr int64_t kFloat32Rows = 0, kInt8Rows = 1;

struct Decode {
  const float* q;        // [batch, heads, dim], rows q_stride apart
  uint8_t* keys;         // [num_blocks, block_size, kv_heads] rows of row_bytes each
  uint8_t* values;       // same
  const int64_t* tables; // [batch, table_width]
  const int32_t* lens;   // [batch] context lengths
  float* out;            // [batch, heads, dim]
  int64_t q_stride, heads, kv_heads, dim, block_size, table_width;
  float scale;
  const float* new_k;    // [batch, kv_heads, dim] rows new_stride apart, or null when already cached
  const float* new_v;
  int64_t new_stride;
  const int64_t* slots;  // [batch] cache slot of each decode's new k/v
  int64_t format;        // kFloat32Rows or kInt8Rows
  int64_t row_bytes;     // dim floats, or dim int8 values and a float32 scale
};

inline int64_t row_bytes_of(int64_t format, int64_t dim) {
  return format == kInt8Rows ? dim + static_cast<int64_t>(sizeof(float)) : dim * static_cast<int64_t>(sizeof(float));
}

// An int8 row's scale, stored after its dim values.
inline float row_scale(const uint8_t* row, int64_t dim) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof scale);
  return scale;
}

// kv_format.quantize_int8 for one row: scale = max |x| * (float32's 1/127), q = x / scale rounded
// half to even (the default rounding mode's nearbyint).
void quantize_row(const float* x, uint8_t* row, int64_t dim) {
  float amax = 0.0f;
  for (int64_t i = 0; i < dim; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax || a != a ? a : amax;  // a NaN stays, as torch's amax keeps it
  }
  const float scale = amax * (1.0f / 127.0f);
  int8_t* q = reinterpret_cast<int8_t*>(row);
  for (int64_t i = 0; i < dim; ++i) {
    const float v = scale > 0.0f ? x[i] / scale : 0.0f;
    q[i] = v == v ? static_cast<int8_t>(std::nearbyint(v)) : 0;  // NaN (an infinite x): 0, as kv_format
  }
  std::memcpy(row + dim, &scale, sizeof scale);
}

__attribute__((target("avx512f"))) float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f"))) void axpy_avx512(float a, const float* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// a . b for int8 b, widened to float32 16 at a time.
__attribute__((target("avx512f"))) float dot_int8_avx512(const float* a, const int8_t* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), wide, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

__attribute__((target("avx512f"))) void axpy_int8_avx512(float a, const int8_t* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, wide, _mm512_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

float dot_portable(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_portable(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float dot_int8_portable(const float* a, const int8_t* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

void axpy_int8_portable(float a, const int8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

struct Ops {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float, const float*, float*, int64_t);
  float (*dot_int8)(const float*, const int8_t*, int64_t);
  void (*axpy_int8)(float, const int8_t*, float*, int64_t);
};

const Ops& ops() {
  static const Ops chosen = [] {
    if (strata::chosen_isa() == strata::Isa::kAvx512)
      return Ops{dot_avx512, axpy_avx512, dot_int8_avx512, axpy_int8_avx512};
    return Ops{dot_portable, axpy_portable, dot_int8_portable, axpy_int8_portable};
  }();
  return chosen;
}

// q . key row, the key float32 or int8 (then times its scale).
inline float key_dot(const Decode& d, const Ops& f, const float* q, const uint8_t* row) {
  if (d.format == kInt8Rows) return f.dot_int8(q, reinterpret_cast<const int8_t*>(row), d.dim) * row_scale(row, d.dim);
  return f.dot(q, reinterpret_cast<const float*>(row), d.dim);
}

// out += weight * value row, the value float32 or int8 (then its scale folded into the weight).
inline void add_value(const Decode& d, const Ops& f, float weight, const uint8_t* row, float* out) {
  if (d.format == kInt8Rows) {
    f.axpy_int8(weight * row_scale(row, d.dim), reinterpret_cast<const int8_t*>(row), out, d.dim);
  } else {
    f.axpy(weight, reinterpret_cast<const float*>(row), out, d.dim);
  }
}

// A decode's new k or v row into the cache, in its format.
inline void store_row(const Decode& d, const float* src, uint8_t* row) {
  if (d.format == kInt8Rows) {
    quantize_row(src, row, d.dim);
  } else {
    std::memcpy(row, src, static_cast<size_t>(d.dim) * sizeof(float));
  }
}

void one_group(const Decode& d, const Ops& f, int64_t seq, int64_t kv_head, std::vector<float>& scores) {
  const int64_t group = d.heads / d.kv_heads;
  const int64_t len = d.lens[seq];
  const int64_t token_bytes = d.kv_heads * d.row_bytes;
  const int64_t head_offset = kv_head * d.row_bytes;
  const int64_t* table = d.tables + seq * d.table_width;
  if (d.new_k != nullptr) {
    // This decode's own k/v go to the cache first (its last position), then it attends to them too.
    const int64_t at = d.slots[seq] * token_bytes + head_offset;
    store_row(d, d.new_k + seq * d.new_stride + kv_head * d.dim, d.keys + at);
    store_row(d, d.new_v + seq * d.new_stride + kv_head * d.dim, d.values + at);
  }
  scores.resize(static_cast<size_t>(group * len));
  for (int64_t g = 0; g < group; ++g) {
    const float* q = d.q + seq * d.q_stride + (kv_head * group + g) * d.dim;
    float* row = scores.data() + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) {
      const int64_t block = table[t / d.block_size];
      const uint8_t* k = d.keys + (block * d.block_size + t % d.block_size) * token_bytes + head_offset;
      row[t] = key_dot(d, f, q, k) * d.scale;
      top = std::max(top, row[t]);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - top);
      total += row[t];
    }
    float* out = d.out + (seq * d.heads + kv_head * group + g) * d.dim;
    std::fill(out, out + d.dim, 0.0f);
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < len; ++t) {
      const int64_t block = table[t / d.block_size];
      const uint8_t* v = d.values + (block * d.block_size + t % d.block_size) * token_bytes + head_offset;
      add_value(d, f, row[t] * inverse, v, out);
    }
  }
}

void task_range(const Decode& d, int64_t first, int64_t last) {
  const Ops& f = ops();
  std::vector<float> scores;
  for (int64_t task = first; task < last; ++task) one_group(d, f, task / d.kv_heads, task % d.kv_heads, scores);
}

}  // namespace

void strata::paged_decode_attention_part(const float* q, void* keys, void* values, const int64_t* tables,
                                         const int32_t* lens, float* out, int64_t batch, int64_t q_stride,
                                         int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                         int64_t table_width, float scale, const float* new_k, const float* new_v,
                                         int64_t new_stride, const int64_t* slots, int64_t format, int64_t part,
                                         int64_t parts) {
  const Decode d{q,     static_cast<uint8_t*>(keys), static_cast<uint8_t*>(values), tables, lens, out,
                 q_stride, heads, kv_heads, dim, block_size, table_width, scale, new_k, new_v, new_stride, slots,
                 format, row_bytes_of(format, dim)};
  int64_t first = 0;
  int64_t last = 0;
  strata::share(batch * kv_heads, part, parts, &first, &last);
  task_range(d, first, last);
}

extern "C" {

// q [batch, heads, dim] with rows q_stride floats apart, caches [num_blocks, block_size, kv_heads] rows
// of `format` (kFloat32Rows: dim floats; kInt8Rows: dim int8 and a float32 scale), tables [batch,
// table_width] int64, lens [batch] int32, out [batch, heads, dim] contiguous. With new_k and new_v
// (float32 rows new_stride floats apart) each decode's k/v are first written at slots[seq], in the
// format; each (sequence, kv head) task writes only its own head, so no two tasks touch the same bytes.
void strata_paged_decode_attention(const float* q, void* keys, void* values, const int64_t* tables,
                                   const int32_t* lens, float* out, int64_t batch, int64_t q_stride, int64_t heads,
                                   int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width,
                                   float scale, const float* new_k, const float* new_v, int64_t new_stride,
                                   const int64_t* slots, int64_t format) {
  const Decode d{q,     static_cast<uint8_t*>(keys), static_cast<uint8_t*>(values), tables, lens, out,
                 q_stride, heads, kv_heads, dim, block_size, table_width, scale, new_k, new_v, new_stride, slots,
                 format, row_bytes_of(format, dim)};
  // A task is a few microseconds at short contexts: one decode's few kv heads run inline, since
  // waking the pool would cost as much as the work.
  at::parallel_for(0, batch * kv_heads, 8, [&](int64_t first, int64_t last) { task_range(d, first, last); });
}
}
