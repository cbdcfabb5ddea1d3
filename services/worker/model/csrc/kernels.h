// The kernels' entry points that decode_stack.cpp calls from inside its own parallel region: each
// does the share `part` of `parts` of its work on the calling thread, with no parallel region of its
// own, and splits the work exactly as its extern "C" twin does, so both give the same bits.

#pragma once

#include <cstdint>

namespace strata {

// strata_small_linear / strata_small_linear_int8 for output rows of tile share `part` of `parts`.
void small_linear_part(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                       int64_t k, int64_t part, int64_t parts);
void small_linear_int8_part(const float* x, const int8_t* w, const float* scale, const float* bias, float* y,
                            int64_t m, int64_t n, int64_t k, int64_t part, int64_t parts);

// y[i * ldy + r] = x[i] . w[r] (+ bias[r]) for i < m, r < rows, on the calling thread: each element the
// same bits as strata_small_linear gives it (a tile of a dequantized weight, gguf_linear.cpp).
void small_linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t rows,
                       int64_t k, int64_t ldy);

// strata_gguf_linear for the weight-row tiles of share `part` of `parts` (gguf_linear.cpp).
void gguf_linear_part(int64_t type, const float* x, const uint8_t* w, const float* bias, float* y, int64_t m,
                      int64_t n, int64_t k, int64_t ldy, int64_t part, int64_t parts);

// strata_paged_decode_attention's first half for the (sequence, kv head) tasks of share `part` of
// `parts`: their new k/v rows stored at their slots. Every share must be stored before any attends.
void paged_decode_store_part(void* keys, void* values, int64_t batch, int64_t kv_heads, int64_t dim,
                             const float* new_k, const float* new_v, int64_t new_stride, const int64_t* slots,
                             int64_t format, int64_t part, int64_t parts);

// strata_paged_decode_attention's second half (the attention over rows already stored) for share `part`.
void paged_decode_attention_part(const float* q, void* keys, void* values, const int64_t* tables,
                                 const int32_t* lens, float* out, int64_t batch, int64_t q_stride, int64_t heads,
                                 int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width, float scale,
                                 int64_t format, int64_t part, int64_t parts);

// strata_lora_add's halves (lora.cpp): the shrink of the ordered rows of share `part` (t [rows, rank]),
// then the expansion into the output columns of share `part`; every shrink share must be done before any
// expands.
void lora_shrink_part(const float* x, const float* a, const int64_t* row_slots, const int64_t* order, int64_t count,
                      float* t, int64_t in, int64_t rank, int64_t part, int64_t parts);
void lora_expand_part(const float* t, const float* bt, const int64_t* row_slots, const int64_t* order,
                      int64_t count, float* y, int64_t out, int64_t rank, const int64_t* bands, int64_t num_bands,
                      int64_t part, int64_t parts);

// The [begin, end) of share `part` when `count` items are cut into `parts` near-equal shares.
inline void share(int64_t count, int64_t part, int64_t parts, int64_t* begin, int64_t* end) {
  const int64_t each = (count + parts - 1) / parts;
  *begin = part * each < count ? part * each : count;
  *end = *begin + each < count ? *begin + each : count;
}

}  // namespace strata
