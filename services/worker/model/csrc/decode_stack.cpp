// Every decoder layer of a decode-only step at a few rows, in one call and one parallel region.
//
// A decode step at one to eight rows spends a few milliseconds between its kernels: about ten Python
// calls, allocations and ctypes crossings per layer, thirty layers a step. This runs the whole stack
// of layers with the very kernels the per-operator path calls, in the same order on the same
// buffers (rms_norm.cpp, small_linear.cpp, rotary.cpp, paged_attention.cpp, and torch's own silu and
// multiply for SwiGLU, through ATen), each kernel's work split among the threads exactly as its own
// parallel loop would split it, so the results equal that path's to the bit. It opens one OpenMP
// region per step instead of one per kernel: with OMP_WAIT_POLICY=PASSIVE (the workers' default, so
// that idle threads leave the cores to a co-located worker) every region's end puts the threads to
// sleep and the next region must wake them, a few hundred times a step. Between its kernels the team
// waits on its own barrier, which spins and then yields the core. Each projection's weight is
// float32, int8 with one scale per row (small_int8.py's copies), or GGUF blocks of up to three types
// (gguf_linear.py's modules); rows served through a LoRA adapter get its deltas (lora.cpp) after each
// projection. It must not choose when it applies (decode_stack.py does) nor own any tensor: the
// caller passes every buffer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "kernels.h"

extern "C" {
void strata_rms_norm(const float* x, const float* residual, const float* weight, float* sum, float* out,
                     int64_t rows, int64_t n, float eps);
void strata_rotary(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t heads_total,
                   int64_t rotated, int64_t dim);
}

namespace {

constexpr int64_t kMaxGgufParts = 3;  // a fused q/k/v of three types

// One projection: y = x . w^T (* scale) (+ bias); scale is null for float32 weights. A GGUF weight has
// gguf_parts > 0 and no `weight`: row ranges of ggml types, stored as blocks (gguf_linear.cpp).
struct Projection {
  const void* weight;
  const float* scale;
  const float* bias;
  int64_t out_features;
  int64_t in_features;
  int64_t gguf_parts;
  int64_t gguf_types[kMaxGgufParts];
  const uint8_t* gguf_blocks[kMaxGgufParts];
  int64_t gguf_rows[kMaxGgufParts];
  const float* lora_a;   // the adapter slots' A [slots, lora_rank, in] and Bt [slots, lora_rank, out],
  const float* lora_bt;  // or null where the model serves no adapters (lora.cpp)
  int64_t lora_rank;
  const int64_t* lora_bands;  // [lora_num_bands, 4] (lora.cpp)
  int64_t lora_num_bands;
};

// One decoder layer's weights and its cache; laid out as decode_stack.py's ctypes Structure.
struct Layer {
  const float* input_norm;
  const float* post_attention_norm;
  Projection qkv, o, gate_up, down;
  void* keys;    // cache rows in the step's kv_format
  void* values;
};

// The step's shape and its attention metadata, shared by every layer.
struct Step {
  int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
  float eps, attention_scale;
  const float* cos;
  const float* sin;
  const int64_t* block_tables;
  const int32_t* seq_lens;
  const int64_t* slots;
  int64_t table_width, block_size;
  int64_t kv_format;  // paged_attention.cpp's row format: float32 or int8
  const int64_t* lora_rows;   // each row's adapter slot (-1: none), or null when no row has one
  const int64_t* lora_order;  // the lora_count rows with a slot, sorted by slot
  int64_t lora_count;
  float* lora_scratch;        // rows * the widest lora_rank floats: a projection's shrunk rows
};

// The team's barrier between two kernels: spin (the wait is microseconds, less than a futex wake
// costs), then yield the core, so a thread whose partner was preempted hands its core to whatever is
// runnable (the gateway, the tokenizer, another worker) instead of burning it.
class SpinBarrier {
 public:
  void set_parties(int parties) { parties_ = parties; }

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == parties_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 2048;  // about 0.1 ms of pause instructions
  int parties_ = 1;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

// One thread's share of a projection.
void project(const Projection& p, const float* x, float* y, int64_t rows, int64_t part, int64_t parts) {
  if (p.gguf_parts > 0) {
    int64_t row = 0;
    for (int64_t i = 0; i < p.gguf_parts; ++i) {
      strata::gguf_linear_part(p.gguf_types[i], x, p.gguf_blocks[i], p.bias != nullptr ? p.bias + row : nullptr,
                               y + row, rows, p.gguf_rows[i], p.in_features, p.out_features, part, parts);
      row += p.gguf_rows[i];
    }
  } else if (p.scale != nullptr) {
    strata::small_linear_int8_part(x, static_cast<const int8_t*>(p.weight), p.scale, p.bias, y, rows,
                                   p.out_features, p.in_features, part, parts);
  } else {
    strata::small_linear_part(x, static_cast<const float*>(p.weight), p.bias, y, rows, p.out_features,
                              p.in_features, part, parts);
  }
}

bool has_lora(const Projection& p, const Step& s) { return s.lora_rows != nullptr && p.lora_a != nullptr; }

// A projection with its LoRA deltas: the shrink reads only x, so it shares the projection's phase;
// the expansion adds to y, so it waits for every share of the projection and is waited for in turn.
void project_with_lora(const Projection& p, const Step& s, const float* x, float* y, int64_t part, int64_t parts,
                       SpinBarrier& barrier) {
  const bool lora = has_lora(p, s);
  if (lora)
    strata::lora_shrink_part(x, p.lora_a, s.lora_rows, s.lora_order, s.lora_count, s.lora_scratch, p.in_features,
                             p.lora_rank, part, parts);
  project(p, x, y, s.rows, part, parts);
  barrier.wait();
  if (lora) {
    strata::lora_expand_part(s.lora_scratch, p.lora_bt, s.lora_rows, s.lora_order, s.lora_count, y, p.out_features,
                             p.lora_rank, p.lora_bands, p.lora_num_bands, part, parts);
    barrier.wait();
  }
}

// down's input: silu(gate) * up, with torch's own operators so the result is theirs to the bit.
void swiglu(float* gate_up, float* out, int64_t rows, int64_t intermediate) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor both = at::from_blob(gate_up, {rows, 2 * intermediate}, options);
  at::Tensor result = at::from_blob(out, {rows, intermediate}, options);
  at::silu_out(result, both.narrow(1, 0, intermediate));
  result.mul_(both.narrow(1, intermediate, intermediate));
}

}  // namespace

extern "C" {

// residual [rows, hidden]: the embeddings in, the last residual sum out; hidden_out [rows, hidden]:
// the final norm's output. scratch: rows * (qkv + q + gate_up + intermediate + 2 * hidden) floats.
void strata_decode_stack(const Layer* layers, int64_t num_layers, const Step* step, const float* final_norm,
                         float* residual, float* hidden_out, float* scratch) {
  const Step& s = *step;
  const int64_t rows = s.rows;
  const int64_t q_width = s.heads * s.head_dim;
  const int64_t kv_width = s.kv_heads * s.head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  float* qkv = scratch;
  float* attended = qkv + rows * qkv_width;
  float* gate_up = attended + rows * q_width;
  float* activated = gate_up + rows * 2 * s.intermediate;
  float* normed = activated + rows * s.intermediate;
  float* delta = normed + rows * s.hidden;
  SpinBarrier barrier;
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp single
    barrier.set_parties(omp_get_num_threads());
    // The single's implied barrier: every thread sees the team size before the first wait.
    const int64_t part = omp_get_thread_num();
    const int64_t parts = omp_get_num_threads();
    const bool lead = part == 0;
    for (int64_t index = 0; index < num_layers; ++index) {
      const Layer& layer = layers[index];
      // Norms, rotary and SwiGLU are a few rows of a few thousand floats: one thread does each.
      if (lead) {
        const float* x = index == 0 ? residual : delta;
        const float* add = index == 0 ? nullptr : residual;
        strata_rms_norm(x, add, layer.input_norm, residual, normed, rows, s.hidden, s.eps);
      }
      barrier.wait();
      project_with_lora(layer.qkv, s, normed, qkv, part, parts, barrier);
      if (lead) strata_rotary(qkv, s.cos, s.sin, rows, s.heads + 2 * s.kv_heads, s.heads + s.kv_heads, s.head_dim);
      barrier.wait();
      strata::paged_decode_store_part(layer.keys, layer.values, rows, s.kv_heads, s.head_dim, qkv + q_width,
                                      qkv + q_width + kv_width, qkv_width, s.slots, s.kv_format, part, parts);
      // Every row's k/v are stored before any row attends: a speculative step's rows of one sequence
      // read the rows of the positions before theirs.
      barrier.wait();
      strata::paged_decode_attention_part(qkv, layer.keys, layer.values, s.block_tables, s.seq_lens, attended, rows,
                                          qkv_width, s.heads, s.kv_heads, s.head_dim, s.block_size, s.table_width,
                                          s.attention_scale, s.kv_format, part, parts);
      barrier.wait();
      project_with_lora(layer.o, s, attended, delta, part, parts, barrier);
      if (lead) strata_rms_norm(delta, residual, layer.post_attention_norm, residual, normed, rows, s.hidden, s.eps);
      barrier.wait();
      project_with_lora(layer.gate_up, s, normed, gate_up, part, parts, barrier);
      if (lead) swiglu(gate_up, activated, rows, s.intermediate);
      barrier.wait();
      project_with_lora(layer.down, s, activated, delta, part, parts, barrier);
    }
  }
  strata_rms_norm(delta, residual, final_norm, residual, hidden_out, rows, s.hidden, s.eps);
}
}
