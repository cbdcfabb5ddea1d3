// Decode attention over the paged KV cache, read in place: no gather of a sequence's blocks.
//
// Each decode token's query heads attend to their sequence's cached keys and values where they lie,
// block by block through its block table. One task per (sequence, kv head) computes the scores of
// that kv head's query-head group against every cached key, a float32 softmax (max subtracted, as
// torch's SDPA does), and the weighted sum of the values, reading each cached row once for the whole
// group. A cache row (one token's one kv head) is float32, or int8 (kv_format.py's rows: dim int8
// values, then their float32 scale): an int8 row is widened to float32 once into an L1 buffer, a
// key's score is (q . its values) * its scale, a value adds (weight * its scale) * its values; a
// decode's own new k/v are rotated and quantized here as kv_format.py does it, to the bit. Where dim
// is a power of two, int8 rows hold the Hadamard rotation Hx of each row: the group's queries are
// rotated once (q . k = Hq . Hk) and so are its outputs at the end (H is its own inverse), so no
// cached row is rotated back. The instruction set is chosen at run time (AVX-512, else portable C++
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

// Whether int8 rows of this dim hold Hx (kv_format.rotated).
inline bool rotated(int64_t dim) { return dim > 1 && (dim & (dim - 1)) == 0; }

// x <- H x for the normalized Walsh-Hadamard matrix H of a power-of-two n: kv_format.hadamard's
// butterflies and final product, operation for operation.
void hadamard(float* x, int64_t n) {
  for (int64_t width = 1; width < n; width *= 2) {
    for (int64_t start = 0; start < n; start += 2 * width) {
      for (int64_t j = start; j < start + width; ++j) {
        const float a = x[j];
        const float b = x[j + width];
        x[j] = a + b;
        x[j + width] = a - b;
      }
    }
  }
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= norm;
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

// y = float(x) for int8 x, 16 at a time.
__attribute__((target("avx512f"))) void widen_avx512(const int8_t* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm512_storeu_ps(y + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
  }
  for (; i < n; ++i) y[i] = static_cast<float>(x[i]);
}

float dot_portable(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_portable(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void widen_portable(const int8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
}

struct Ops {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float, const float*, float*, int64_t);
  void (*widen)(const int8_t*, float*, int64_t);
};

const Ops& ops() {
  static const Ops chosen = [] {
    if (strata::chosen_isa() == strata::Isa::kAvx512) return Ops{dot_avx512, axpy_avx512, widen_avx512};
    return Ops{dot_portable, axpy_portable, widen_portable};
  }();
  return chosen;
}

// A cached row's values as float32 (itself, or an int8 row widened into `buffer`) and the factor
// its products take: 1 for float32, the int8 row's scale.
inline const float* row_values(const Decode& d, const Ops& f, const uint8_t* row, float* buffer, float* factor) {
  if (d.format != kInt8Rows) {
    *factor = 1.0f;
    return reinterpret_cast<const float*>(row);
  }
  f.widen(reinterpret_cast<const int8_t*>(row), buffer, d.dim);
  *factor = row_scale(row, d.dim);
  return buffer;
}

// A decode's new k or v row into the cache, in its format; `spare` holds dim floats.
inline void store_row(const Decode& d, const float* src, uint8_t* row, float* spare) {
  if (d.format == kInt8Rows && rotated(d.dim)) {
    std::memcpy(spare, src, static_cast<size_t>(d.dim) * sizeof(float));
    hadamard(spare, d.dim);
    quantize_row(spare, row, d.dim);
  } else if (d.format == kInt8Rows) {
    quantize_row(src, row, d.dim);
  } else {
    std::memcpy(row, src, static_cast<size_t>(d.dim) * sizeof(float));
  }
}

// Position t's token in a sequence's cache rows (keys or values), through its block table.
inline const uint8_t* cached_row(const Decode& d, const uint8_t* rows, const int64_t* table, int64_t t) {
  return rows + (table[t / d.block_size] * d.block_size + t % d.block_size) * d.kv_heads * d.row_bytes;
}

// Task `task`'s (sequence, kv head) new k and v rows into their slot, in the cache's format.
void store_task(const Decode& d, int64_t task, std::vector<float>& spare) {
  const int64_t seq = task / d.kv_heads;
  const int64_t kv_head = task % d.kv_heads;
  const int64_t at = d.slots[seq] * d.kv_heads * d.row_bytes + kv_head * d.row_bytes;
  spare.resize(static_cast<size_t>(d.dim));
  store_row(d, d.new_k + seq * d.new_stride + kv_head * d.dim, d.keys + at, spare.data());
  store_row(d, d.new_v + seq * d.new_stride + kv_head * d.dim, d.values + at, spare.data());
}

void one_group(const Decode& d, const Ops& f, int64_t seq, int64_t kv_head, std::vector<float>& scores,
               std::vector<float>& buffer) {
  const int64_t group = d.heads / d.kv_heads;
  const int64_t len = d.lens[seq];
  const int64_t head_offset = kv_head * d.row_bytes;
  const int64_t* table = d.tables + seq * d.table_width;
  const bool rotate = d.format == kInt8Rows && rotated(d.dim);
  // buffer: one widened row, then (rotated rows only) the group's rotated queries.
  buffer.resize(static_cast<size_t>((rotate ? group + 1 : 1) * d.dim));
  scores.resize(static_cast<size_t>(group * len));
  const float* q = d.q + seq * d.q_stride + kv_head * group * d.dim;
  if (rotate) {
    float* rotated_q = buffer.data() + d.dim;
    std::memcpy(rotated_q, q, static_cast<size_t>(group * d.dim) * sizeof(float));
    for (int64_t g = 0; g < group; ++g) hadamard(rotated_q + g * d.dim, d.dim);
    q = rotated_q;
  }
  // Each cached row is read (and an int8 one widened) once for the group's query heads.
  for (int64_t t = 0; t < len; ++t) {
    float factor = 1.0f;
    const float* key = row_values(d, f, cached_row(d, d.keys, table, t) + head_offset, buffer.data(), &factor);
    for (int64_t g = 0; g < group; ++g) {
      const float dot = f.dot(q + g * d.dim, key, d.dim);
      scores[g * len + t] = (d.format == kInt8Rows ? dot * factor : dot) * d.scale;
    }
  }
  float* out = d.out + (seq * d.heads + kv_head * group) * d.dim;
  std::fill(out, out + group * d.dim, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * len;
    const float top = *std::max_element(row, row + len);
    float total = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - top);
      total += row[t];
    }
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < len; ++t) row[t] *= inverse;
  }
  for (int64_t t = 0; t < len; ++t) {
    float factor = 1.0f;
    const float* value = row_values(d, f, cached_row(d, d.values, table, t) + head_offset, buffer.data(), &factor);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * len + t];
      f.axpy(d.format == kInt8Rows ? weight * factor : weight, value, out + g * d.dim, d.dim);
    }
  }
  if (rotate) {
    for (int64_t g = 0; g < group; ++g) hadamard(out + g * d.dim, d.dim);
  }
}

void store_range(const Decode& d, int64_t first, int64_t last) {
  std::vector<float> spare;
  for (int64_t task = first; task < last; ++task) store_task(d, task, spare);
}

void attend_range(const Decode& d, int64_t first, int64_t last) {
  const Ops& f = ops();
  std::vector<float> scores;
  std::vector<float> buffer;
  for (int64_t task = first; task < last; ++task)
    one_group(d, f, task / d.kv_heads, task % d.kv_heads, scores, buffer);
}

Decode decode_of(const float* q, void* keys, void* values, const int64_t* tables, const int32_t* lens, float* out,
                 int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                 int64_t table_width, float scale, const float* new_k, const float* new_v, int64_t new_stride,
                 const int64_t* slots, int64_t format) {
  return Decode{q,     static_cast<uint8_t*>(keys), static_cast<uint8_t*>(values), tables, lens, out,
                q_stride, heads, kv_heads, dim, block_size, table_width, scale, new_k, new_v, new_stride, slots,
                format, row_bytes_of(format, dim)};
}

}  // namespace

void strata::paged_decode_store_part(void* keys, void* values, int64_t batch, int64_t kv_heads, int64_t dim,
                                     const float* new_k, const float* new_v, int64_t new_stride,
                                     const int64_t* slots, int64_t format, int64_t part, int64_t parts) {
  const Decode d = decode_of(nullptr, keys, values, nullptr, nullptr, nullptr, 0, kv_heads, kv_heads, dim, 1, 0,
                             0.0f, new_k, new_v, new_stride, slots, format);
  int64_t first = 0;
  int64_t last = 0;
  strata::share(batch * kv_heads, part, parts, &first, &last);
  store_range(d, first, last);
}

void strata::paged_decode_attention_part(const float* q, void* keys, void* values, const int64_t* tables,
                                         const int32_t* lens, float* out, int64_t batch, int64_t q_stride,
                                         int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                         int64_t table_width, float scale, int64_t format, int64_t part,
                                         int64_t parts) {
  const Decode d = decode_of(q, keys, values, tables, lens, out, q_stride, heads, kv_heads, dim, block_size,
                             table_width, scale, nullptr, nullptr, 0, nullptr, format);
  int64_t first = 0;
  int64_t last = 0;
  strata::share(batch * kv_heads, part, parts, &first, &last);
  attend_range(d, first, last);
}

extern "C" {

// q [batch, heads, dim] with rows q_stride floats apart, caches [num_blocks, block_size, kv_heads] rows
// of `format` (kFloat32Rows: dim floats; kInt8Rows: dim int8 and a float32 scale), tables [batch,
// table_width] int64, lens [batch] int32, out [batch, heads, dim] contiguous. With new_k and new_v
// (float32 rows new_stride floats apart) every decode's k/v are first written at slots[seq], in the
// format, and only then does any decode attend; each (sequence, kv head) task writes only its own
// head, so no two tasks touch the same bytes.
void strata_paged_decode_attention(const float* q, void* keys, void* values, const int64_t* tables,
                                   const int32_t* lens, float* out, int64_t batch, int64_t q_stride, int64_t heads,
                                   int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width,
                                   float scale, const float* new_k, const float* new_v, int64_t new_stride,
                                   const int64_t* slots, int64_t format) {
  const Decode d = decode_of(q, keys, values, tables, lens, out, q_stride, heads, kv_heads, dim, block_size,
                             table_width, scale, new_k, new_v, new_stride, slots, format);
  // Every new row is stored before any decode attends: a speculative step's rows of one sequence
  // (one per position) each read the rows of the positions before theirs.
  // A task is a few microseconds at short contexts: one decode's few kv heads run inline, since
  // waking the pool would cost as much as the work.
  if (new_k != nullptr) {
    at::parallel_for(0, batch * kv_heads, 8, [&](int64_t first, int64_t last) { store_range(d, first, last); });
  }
  at::parallel_for(0, batch * kv_heads, 8, [&](int64_t first, int64_t last) { attend_range(d, first, last); });
}
}
