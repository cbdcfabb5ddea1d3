"""The machine's limit for a workload: bytes each step must read over the measured memory bandwidth.

A decode step on a small batch cannot finish faster than it takes to read every decoder weight once,
the vocabulary projection once when any row is sampled, and the K/V of every context token it
attends to (and to write the new tokens' K/V); a large batch cannot finish faster than its matmul
FLOPs at the machine's measured matmul throughput. Per step the floor is the larger of the two, and
the workload's floor is their sum. Bandwidth is measured here by reading a buffer several times larger
than the last-level cache (a sum over float32, which streams the buffer at the cores' pace); matmul
throughput by a float32 square matmul large enough to be compute-bound. This module measures and
does arithmetic only: it must not run the engine or any contestant.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from services.worker.model.config import ModelConfig

# Bigger than any last-level cache these machines report (260 MiB), so the read comes from memory.
_BANDWIDTH_BYTES = 1 << 30
_MATMUL_SIZE = 2048


@dataclass(frozen=True, slots=True)
class MachineLimits:
    read_bandwidth_gb_s: float
    matmul_gflop_s: float
    threads: int


def _best_seconds(run: Any, reps: int) -> float:
    """The fastest of `reps` runs: a capability, which a busy neighbour can only slow down."""
    run()  # page faults, allocator and kernel choice happen once, outside the samples
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return min(samples)


def measure_machine(reps: int = 9) -> MachineLimits:
    """Memory read bandwidth (GB/s) and float32 matmul throughput (GFLOP/s) at torch's thread count."""
    buffer = torch.ones(_BANDWIDTH_BYTES // 4, dtype=torch.float32)
    read_s = _best_seconds(buffer.sum, reps)
    del buffer
    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE)
    b = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE)
    matmul_s = _best_seconds(lambda: a @ b, reps)
    return MachineLimits(
        read_bandwidth_gb_s=_BANDWIDTH_BYTES / read_s / 1e9,
        matmul_gflop_s=2 * _MATMUL_SIZE**3 / matmul_s / 1e9,
        threads=torch.get_num_threads(),
    )


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What a step reads, from the config: decoder weights, vocabulary projection, K/V per token."""

    layer_weight_bytes: int
    lm_head_bytes: int
    kv_bytes_per_token: int  # all layers, keys and values
    layer_params: int
    lm_head_params: int

    @classmethod
    def of(cls, config: ModelConfig, element_bytes: int = 4) -> ModelBytes:
        h, inter = config.hidden_size, config.intermediate_size
        per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * inter
        layer_params = per_layer * config.num_hidden_layers
        lm_head_params = config.vocab_size * h
        return cls(
            layer_weight_bytes=layer_params * element_bytes,
            lm_head_bytes=lm_head_params * element_bytes,
            kv_bytes_per_token=2 * config.kv_size * config.num_hidden_layers * element_bytes,
            layer_params=layer_params,
            lm_head_params=lm_head_params,
        )


def physical_limit(
    model: ModelBytes,
    limits: MachineLimits,
    steps: list[tuple[int, int, int]],
) -> dict[str, Any]:
    """The floor of a schedule of (tokens computed, rows sampled, context tokens attended) steps."""
    bandwidth = limits.read_bandwidth_gb_s * 1e9
    flops_per_s = limits.matmul_gflop_s * 1e9
    memory_s = compute_s = floor_s = 0.0
    for tokens, logits, context in steps:
        read = model.layer_weight_bytes + (model.lm_head_bytes if logits else 0)
        read += (context + tokens) * model.kv_bytes_per_token  # read every context token, write new ones
        flops = 2 * (tokens * model.layer_params + logits * model.lm_head_params)
        step_memory, step_compute = read / bandwidth, flops / flops_per_s
        memory_s += step_memory
        compute_s += step_compute
        floor_s += max(step_memory, step_compute)
    return {
        "seconds": floor_s,
        "memory_bound_seconds": memory_s,
        "compute_bound_seconds": compute_s,
        "steps": len(steps),
        "machine": asdict(limits),
        "model_bytes": asdict(model),
    }
