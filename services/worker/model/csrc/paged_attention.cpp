// Decode attention over the paged KV cache, read in place: no gather of a sequence's blocks.
//
// Each decode token's query heads attend to their sequence's cached keys and values where they lie,
// block by block through its block table. One task per (sequence, kv head) computes the scores of
// that kv head's query-head group against every cached key, a float32 softmax (max subtracted, as
// torch's SDPA does), and the weighted sum of the values. The instruction set is chosen at run time
// (AVX-512, else portable C++ that the compiler vectorises for the baseline ISA). Threads come from
// ATen's pool. Called through ctypes (extern "C"): no Python types here.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "isa.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

struct Decode {
  const float* q;        // [batch, heads, dim], rows q_stride apart
  const float* keys;     // [num_blocks, block_size, kv_heads, dim]
  const float* values;   // same
  const int64_t* tables; // [batch, table_width]
  const int32_t* lens;   // [batch] context lengths
  float* out;            // [batch, heads, dim]
  int64_t q_stride, heads, kv_heads, dim, block_size, table_width;
  float scale;
  const float* new_k;    // [batch, kv_heads, dim] rows new_stride apart, or null when already cached
  const float* new_v;
  int64_t new_stride;
  const int64_t* slots;  // [batch] cache slot of each decode's new k/v
};

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

float dot_portable(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_portable(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

using Dot = float (*)(const float*, const float*, int64_t);
using Axpy = void (*)(float, const float*, float*, int64_t);

struct Ops {
  Dot dot;
  Axpy axpy;
};

const Ops& ops() {
  static const Ops chosen = [] {
    if (strata::chosen_isa() == strata::Isa::kAvx512) return Ops{dot_avx512, axpy_avx512};
    return Ops{dot_portable, axpy_portable};
  }();
  return chosen;
}

void one_group(const Decode& d, const Ops& f, int64_t seq, int64_t kv_head, std::vector<float>& scores) {
  const int64_t group = d.heads / d.kv_heads;
  const int64_t len = d.lens[seq];
  const int64_t token_stride = d.kv_heads * d.dim;
  const int64_t* table = d.tables + seq * d.table_width;
  if (d.new_k != nullptr) {
    // This decode's own k/v go to the cache first (its last position), then it attends to them too.
    const int64_t slot = d.slots[seq];
    float* k_dst = const_cast<float*>(d.keys) + slot * token_stride + kv_head * d.dim;
    float* v_dst = const_cast<float*>(d.values) + slot * token_stride + kv_head * d.dim;
    const float* k_src = d.new_k + seq * d.new_stride + kv_head * d.dim;
    const float* v_src = d.new_v + seq * d.new_stride + kv_head * d.dim;
    std::copy(k_src, k_src + d.dim, k_dst);
    std::copy(v_src, v_src + d.dim, v_dst);
  }
  scores.resize(static_cast<size_t>(group * len));
  for (int64_t g = 0; g < group; ++g) {
    const float* q = d.q + seq * d.q_stride + (kv_head * group + g) * d.dim;
    float* row = scores.data() + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) {
      const int64_t block = table[t / d.block_size];
      const float* k = d.keys + (block * d.block_size + t % d.block_size) * token_stride + kv_head * d.dim;
      row[t] = f.dot(q, k, d.dim) * d.scale;
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
      const float* v = d.values + (block * d.block_size + t % d.block_size) * token_stride + kv_head * d.dim;
      f.axpy(row[t] * inverse, v, out, d.dim);
    }
  }
}

void task_range(const Decode& d, int64_t first, int64_t last) {
  const Ops& f = ops();
  std::vector<float> scores;
  for (int64_t task = first; task < last; ++task) one_group(d, f, task / d.kv_heads, task % d.kv_heads, scores);
}

}  // namespace

void strata::paged_decode_attention_part(const float* q, float* keys, float* values, const int64_t* tables,
                                         const int32_t* lens, float* out, int64_t batch, int64_t q_stride,
                                         int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                         int64_t table_width, float scale, const float* new_k, const float* new_v,
                                         int64_t new_stride, const int64_t* slots, int64_t part, int64_t parts) {
  const Decode d{q,     keys,        values, tables, lens,  out,   q_stride, heads,     kv_heads,
                 dim,   block_size,  table_width,    scale, new_k, new_v,    new_stride, slots};
  int64_t first = 0;
  int64_t last = 0;
  strata::share(batch * kv_heads, part, parts, &first, &last);
  task_range(d, first, last);
}

extern "C" {

// q [batch, heads, dim] with rows q_stride floats apart, caches [num_blocks, block_size, kv_heads, dim],
// tables [batch, table_width] int64, lens [batch] int32, out [batch, heads, dim] contiguous. With new_k
// and new_v (rows new_stride floats apart) each decode's k/v are first written at slots[seq]; each
// (sequence, kv head) task writes only its own head, so no two tasks touch the same bytes.
void strata_paged_decode_attention(const float* q, float* keys, float* values, const int64_t* tables,
                                   const int32_t* lens, float* out, int64_t batch, int64_t q_stride, int64_t heads,
                                   int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width,
                                   float scale, const float* new_k, const float* new_v, int64_t new_stride,
                                   const int64_t* slots) {
  const Decode d{q,     keys,        values, tables, lens,  out,   q_stride, heads,     kv_heads,
                 dim,   block_size,  table_width,    scale, new_k, new_v,    new_stride, slots};
  // A task is a few microseconds at short contexts: one decode's few kv heads run inline, since
  // waking the pool would cost as much as the work.
  at::parallel_for(0, batch * kv_heads, 8, [&](int64_t first, int64_t last) { task_range(d, first, last); });
}
}
