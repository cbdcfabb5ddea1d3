// Rotary position embedding applied in place to the q and k heads of a fused qkv projection's output.
//
// Half-split layout (as Hugging Face checkpoints store q/k): for i < dim/2, x[i] and x[i + dim/2]
// rotate by the token's angle: (x1 * cos - x2 * sin, x2 * cos + x1 * sin), the same products and
// sums as transformers' apply_rotary_pos_emb. torch spends eight operators per layer on this; here it
// is one pass. Plain C++ (the compiler vectorises it for the baseline instruction set); tokens run in
// parallel on ATen's pool when there are enough. Called through ctypes.

#include <ATen/Parallel.h>

#include <cstdint>

extern "C" {

// qkv [tokens, heads_total, dim] contiguous: the first `rotated` heads of each token are rotated
// in place by cos/sin [tokens, dim / 2].
void strata_rotary(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t heads_total,
                   int64_t rotated, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 32, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < rotated; ++h) {
        float* x = qkv + (t * heads_total + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i];
          const float x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}
}
