// LoRA deltas of a step's rows, each row through its own adapter slot: y[i] += (x[i] . A[s]^T) . Bt[s].
//
// A batch mixes adapters (and the base model: slot -1) row by row, so the deltas cannot be merged
// into the base weights: they are computed beside the base projection, in two halves. The shrink
// takes each adapter row's x to R values (R dot products of `in` floats against its slot's A); the
// expansion adds to each of its output columns the sum over those R values times Bt's column. A slot's
// A and Bt are a few hundred KiB, read once per row from the cache after their first row. The shrink
// splits rows among threads, the expansion splits output columns, and each element's arithmetic is
// the same whatever the split, so the per-operator call here and decode_stack.cpp's shares give the
// same bits. Called through ctypes (extern "C"): no Python types here.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kColumns = 64;  // output columns summed per pass: a register-sized accumulator

}  // namespace

namespace strata {

void lora_shrink_part(const float* x, const float* a, const int64_t* row_slots, float* t, int64_t rows,
                      int64_t in, int64_t rank, int64_t part, int64_t parts) {
  int64_t begin, end;
  share(rows, part, parts, &begin, &end);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = row_slots[i];
    if (slot < 0) continue;
    const float* xi = x + i * in;
    for (int64_t r = 0; r < rank; ++r) {
      const float* ar = a + (slot * rank + r) * in;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < in; ++k) acc += xi[k] * ar[k];
      t[i * rank + r] = acc;
    }
  }
}

void lora_expand_part(const float* t, const float* bt, const int64_t* row_slots, float* y, int64_t rows,
                      int64_t out, int64_t rank, int64_t part, int64_t parts) {
  const int64_t chunks = (out + kColumns - 1) / kColumns;
  int64_t begin, end;
  share(chunks, part, parts, &begin, &end);
  float acc[kColumns];
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = row_slots[i];
    if (slot < 0) continue;
    const float* ti = t + i * rank;
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t first = chunk * kColumns;
      const int64_t width = std::min(kColumns, out - first);
      std::fill(acc, acc + kColumns, 0.0f);
      for (int64_t r = 0; r < rank; ++r) {
        const float tr = ti[r];
        const float* column = bt + (slot * rank + r) * out + first;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) acc[c] += tr * column[c];
      }
      float* yi = y + i * out + first;
      for (int64_t c = 0; c < width; ++c) yi[c] += acc[c];
    }
  }
}

}  // namespace strata

extern "C" {

// x [rows, in], y [rows, out] (the base projection's output, added to), row_slots [rows] (-1: none),
// a [slots, rank, in], bt [slots, rank, out].
void strata_lora_add(const float* x, float* y, const int64_t* row_slots, const float* a, const float* bt,
                     int64_t rows, int64_t in, int64_t out, int64_t rank) {
  std::vector<float> t(static_cast<size_t>(rows * rank));
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part)
      strata::lora_shrink_part(x, a, row_slots, t.data(), rows, in, rank, part, parts);
  });
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part)
      strata::lora_expand_part(t.data(), bt, row_slots, y, rows, out, rank, part, parts);
  });
}
}
