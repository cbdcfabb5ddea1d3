// Every decoder layer of a decode-only step at a few rows, in one call: the same kernels, no Python.
//
// A decode step at one to eight rows spends a few milliseconds between its kernels: about ten Python
// calls, allocations and ctypes crossings per layer, thirty layers a step. This runs the whole stack
// of layers with the very kernels the per-operator path calls, in the same order on the same
// buffers (rms_norm.cpp, small_linear.cpp, rotary.cpp, paged_attention.cpp, and torch's own silu and
// multiply for SwiGLU, through ATen), so its results equal that path's to the bit. Each projection's
// weight is float32, or int8 with one scale per row (small_int8.py's copies). It must not choose
// when it applies (decode_stack.py does) nor own any tensor: the caller passes every buffer.

#include <ATen/ATen.h>

#include <cstdint>

extern "C" {
void strata_rms_norm(const float* x, const float* residual, const float* weight, float* sum, float* out,
                     int64_t rows, int64_t n, float eps);
void strata_small_linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                         int64_t k);
void strata_small_linear_int8(const float* x, const int8_t* w, const float* scale, const float* bias, float* y,
                              int64_t m, int64_t n, int64_t k);
void strata_rotary(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t heads_total,
                   int64_t rotated, int64_t dim);
void strata_paged_decode_attention(const float* q, float* keys, float* values, const int64_t* tables,
                                   const int32_t* lens, float* out, int64_t batch, int64_t q_stride, int64_t heads,
                                   int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width,
                                   float scale, const float* new_k, const float* new_v, int64_t new_stride,
                                   const int64_t* slots);
}

namespace {

// One projection: y = x . w^T (* scale) (+ bias); scale is null for float32 weights.
struct Projection {
  const void* weight;
  const float* scale;
  const float* bias;
  int64_t out_features;
  int64_t in_features;
};

// One decoder layer's weights and its cache; laid out as decode_stack.py's ctypes Structure.
struct Layer {
  const float* input_norm;
  const float* post_attention_norm;
  Projection qkv, o, gate_up, down;
  float* keys;
  float* values;
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
};

void project(const Projection& p, const float* x, float* y, int64_t rows) {
  if (p.scale != nullptr) {
    strata_small_linear_int8(x, static_cast<const int8_t*>(p.weight), p.scale, p.bias, y, rows, p.out_features,
                             p.in_features);
  } else {
    strata_small_linear(x, static_cast<const float*>(p.weight), p.bias, y, rows, p.out_features, p.in_features);
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
  const int64_t qkv_width = q_width + 2 * s.kv_heads * s.head_dim;
  float* qkv = scratch;
  float* attended = qkv + rows * qkv_width;
  float* gate_up = attended + rows * q_width;
  float* activated = gate_up + rows * 2 * s.intermediate;
  float* normed = activated + rows * s.intermediate;
  float* delta = normed + rows * s.hidden;
  for (int64_t index = 0; index < num_layers; ++index) {
    const Layer& layer = layers[index];
    if (index == 0) {
      strata_rms_norm(residual, nullptr, layer.input_norm, residual, normed, rows, s.hidden, s.eps);
    } else {
      strata_rms_norm(delta, residual, layer.input_norm, residual, normed, rows, s.hidden, s.eps);
    }
    project(layer.qkv, normed, qkv, rows);
    strata_rotary(qkv, s.cos, s.sin, rows, s.heads + 2 * s.kv_heads, s.heads + s.kv_heads, s.head_dim);
    strata_paged_decode_attention(qkv, layer.keys, layer.values, s.block_tables, s.seq_lens, attended, rows,
                                  qkv_width, s.heads, s.kv_heads, s.head_dim, s.block_size, s.table_width,
                                  s.attention_scale, qkv + q_width, qkv + q_width + s.kv_heads * s.head_dim,
                                  qkv_width, s.slots);
    project(layer.o, attended, delta, rows);
    strata_rms_norm(delta, residual, layer.post_attention_norm, residual, normed, rows, s.hidden, s.eps);
    project(layer.gate_up, normed, gate_up, rows);
    swiglu(gate_up, activated, rows, s.intermediate);
    project(layer.down, activated, delta, rows);
  }
  strata_rms_norm(delta, residual, final_norm, residual, hidden_out, rows, s.hidden, s.eps);
}
}
