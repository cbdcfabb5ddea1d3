// LoRA deltas of a step's rows, each row through its own adapter slot: y[i] += (x[i] . A[s]^T) . Bt[s].
//
// A batch mixes adapters (and the base model: slot -1) row by row, so the deltas cannot be merged
// into the base weights: they are computed beside the base projection, in two halves. The shrink
// takes each adapter row's x to R values (R dot products of `in` floats against its slot's A); the
// expansion adds to each of its output columns the sum over those R values times Bt's column, band by
// band (a band is one component's rank rows, nonzero in that component's columns only: q, k or v of a
// fused q/k/v). Rows are taken in slot order, so a slot's weights are read once per step from memory
// however its rows are spread over the batch. The shrink splits rows among threads, the expansion
// splits output columns, and each element's arithmetic is the same whatever the split, so the
// per-operator call here and decode_stack.cpp's shares give the same bits. Called through ctypes
// (extern "C"): no Python types here.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kColumns = 64;  // output columns summed per pass: a register-sized accumulator

}  // namespace

namespace strata {

void lora_shrink_part(const float* x, const float* a, const int64_t* row_slots, const int64_t* order, int64_t count,
                      float* t, int64_t in, int64_t rank, int64_t part, int64_t parts) {
  int64_t begin, end;
  share(count, part, parts, &begin, &end);
  // The rows of one slot run together (order is sorted by slot): each row of A is read once per group
  // while the group's x rows stay in L1.
  for (int64_t first = begin; first < end;) {
    const int64_t slot = row_slots[order[first]];
    int64_t last = first;
    while (last < end && row_slots[order[last]] == slot) ++last;
    for (int64_t r = 0; r < rank; ++r) {
      const float* ar = a + (slot * rank + r) * in;
      for (int64_t k = first; k < last; ++k) {
        const int64_t row = order[k];
        const float* xi = x + row * in;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < in; ++c) acc += xi[c] * ar[c];
        t[row * rank + r] = acc;
      }
    }
    first = last;
  }
}

void lora_expand_part(const float* t, const float* bt, const int64_t* row_slots, const int64_t* order,
                      int64_t count, float* y, int64_t out, int64_t rank, const int64_t* bands, int64_t num_bands,
                      int64_t part, int64_t parts) {
  const int64_t chunks = (out + kColumns - 1) / kColumns;
  int64_t begin, end;
  share(chunks, part, parts, &begin, &end);
  float acc[kColumns];
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int64_t first = chunk * kColumns;
    const int64_t width = std::min(kColumns, out - first);
    // In slot order, so a slot's part of Bt for these columns stays in L1 across its rows.
    for (int64_t k = 0; k < count; ++k) {
      const int64_t row = order[k];
      const int64_t slot = row_slots[row];
      const float* ti = t + row * rank;
      std::fill(acc, acc + kColumns, 0.0f);
      for (int64_t b = 0; b < num_bands; ++b) {
        // A band's rank rows hold its component's columns only: the rest of Bt is zero, never read.
        const int64_t* band = bands + 4 * b;
        const int64_t from = std::max(first, band[2]) - first;
        const int64_t to = std::min(first + width, band[3]) - first;
        if (from >= to) continue;
        for (int64_t r = band[0]; r < band[0] + band[1]; ++r) {
          const float tr = ti[r];
          const float* column = bt + (slot * rank + r) * out + first;
#pragma omp simd
          for (int64_t c = from; c < to; ++c) acc[c] += tr * column[c];
        }
      }
      float* yi = y + row * out + first;
      for (int64_t c = 0; c < width; ++c) yi[c] += acc[c];
    }
  }
}

}  // namespace strata

extern "C" {

// x [rows, in], y [rows, out] (the base projection's output, added to), row_slots [rows] (-1: none),
// order: the `count` rows with a slot, sorted by slot; a [slots, rank, in], bt [slots, rank, out];
// bands [num_bands, 4]: each band's first rank row, its rank rows, its first and end output column.
void strata_lora_add(const float* x, float* y, const int64_t* row_slots, const int64_t* order, int64_t count,
                     const float* a, const float* bt, const int64_t* bands, int64_t num_bands, int64_t rows,
                     int64_t in, int64_t out, int64_t rank) {
  std::vector<float> t(static_cast<size_t>(rows * rank));
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part)
      strata::lora_shrink_part(x, a, row_slots, order, count, t.data(), in, rank, part, parts);
  });
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part)
      strata::lora_expand_part(t.data(), bt, row_slots, order, count, y, out, rank, bands, num_bands, part, parts);
  });
}
}
