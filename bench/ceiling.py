"""The matmul ceiling: how long the workload's linear layers alone take, step by step.

For each engine step (num_batched_tokens, num_logits) the ceiling is the time of every decoder
layer's linear projections at M = num_batched_tokens plus the lm_head at M = num_logits, on the
model's own weights (same shapes, dtype, device and thread count). Each distinct M is timed once
(median of a few repetitions) and the steps are summed. Attention, norms, sampling and all Python
are left out on purpose: no engine can beat this time. On CUDA each pass is a replayed CUDA graph,
so launch overhead is left out too. This module must not run the engine or any
contestant; it only replays shapes.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from services.worker.model import small_linear

if TYPE_CHECKING:
    from collections.abc import Callable

_MIN_SAMPLE_S = 0.05
_MAX_SAMPLES = 50


@dataclass(frozen=True, slots=True)
class CeilingResult:
    seconds: float
    steps: int
    layer_seconds_by_m: dict[int, float] = field(default_factory=dict)
    lm_head_seconds_by_m: dict[int, float] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_linears(model: nn.Module) -> tuple[list[nn.Linear], Tensor]:
    """The decoder layers' linear layers (q, k, v, o, gate, up, down, or fused ones) and the lm_head weight.

    Works on our model (layers at the top, fused qkv and gate_up) and on a transformers model
    (layers under get_decoder()); a tied lm_head is the embedding matrix.
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = model.get_decoder().layers  # type: ignore[operator]
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        return linears, head.weight
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if len(embeddings) != 1:
        raise TypeError(f"cannot tell the tied lm_head among {len(embeddings)} embeddings")
    return linears, embeddings[0].weight


def _pass(weights: list[tuple[Tensor, Tensor | None]], inputs: dict[int, Tensor]) -> Callable[[], None]:
    """One pass over every weight; on CUDA a captured graph, so kernel launches do not count."""

    def eager() -> None:
        for weight, bias in weights:
            # The engine's own projection: the small-batch kernel where it applies, else F.linear.
            small_linear.linear(inputs[weight.shape[1]], weight, bias)

    device = weights[0][0].device
    if device.type != "cuda":
        return eager
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        eager()  # capture needs the kernels chosen and the workspaces allocated first
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    return graph.replay


def _time(weights: list[tuple[Tensor, Tensor | None]], m: int, reps: int) -> float:
    device, dtype = weights[0][0].device, weights[0][0].dtype
    widths = {w.shape[1] for w, _ in weights}
    samples: list[float] = []
    with torch.inference_mode():
        run = _pass(weights, {width: torch.randn(m, width, device=device, dtype=dtype) for width in widths})
        # The first pass warms allocator and kernels and is dropped. Cheap shapes get more samples
        # (up to _MIN_SAMPLE_S of them) so one preempted pass cannot move the median.
        while len(samples) <= reps or (sum(samples[1:]) < _MIN_SAMPLE_S and len(samples) <= _MAX_SAMPLES):
            _sync(device)
            started = time.perf_counter()
            run()
            _sync(device)
            samples.append(time.perf_counter() - started)
    return statistics.median(samples[1:])


def linear_ceiling(model: nn.Module, step_log: list[tuple[int, int]], reps: int = 3) -> CeilingResult:
    """Sum over `step_log` of the linear-layer time at each step's token and logit counts."""
    if not step_log:
        raise ValueError("the ceiling needs the engine's step log, and it is empty")
    linears, lm_head = model_linears(model)
    layer_weights: list[tuple[Tensor, Tensor | None]] = [(lin.weight, lin.bias) for lin in linears]
    token_counts = Counter(tokens for tokens, _ in step_log)
    logit_counts = Counter(logits for _, logits in step_log if logits > 0)
    by_tokens = {m: _time(layer_weights, m, reps) for m in sorted(token_counts)}
    by_logits = {m: _time([(lm_head, None)], m, reps) for m in sorted(logit_counts)}
    seconds = sum(by_tokens[m] * n for m, n in token_counts.items())
    seconds += sum(by_logits[m] * n for m, n in logit_counts.items())
    return CeilingResult(seconds, len(step_log), by_tokens, by_logits)


def nominal_step_log(
    num_requests: int, prompt_tokens: int, new_tokens: int, max_batched_tokens: int
) -> list[tuple[int, int]]:
    """The schedule an ideal batcher runs when there is no engine step log to replay.

    Prefill fills steps of `max_batched_tokens` (a request's first token is sampled in the step
    that finishes its prompt), then every later token is one decode step over all requests.
    """
    steps: list[tuple[int, int]] = []
    total = num_requests * prompt_tokens
    done = 0
    while done < total:
        chunk = min(max_batched_tokens, total - done)
        finished = (done + chunk) // prompt_tokens - done // prompt_tokens
        steps.append((chunk, finished))
        done += chunk
    steps.extend((num_requests, num_requests) for _ in range(new_tokens - 1))
    return steps
