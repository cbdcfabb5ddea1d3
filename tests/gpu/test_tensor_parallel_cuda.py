"""On CUDA: the tensor-parallel path over NCCL. A one-rank group runs on one chip (the plan's
broadcast, the row-parallel all-reduces and the vocabulary's all_gather are all NCCL calls, each the
identity on one rank), so its log probabilities equal the plain engine's; with two GPUs, two ranks
agree with one under the parity rule.

Without a CUDA device (CI has none) these tests are reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs them on a machine with a GPU and records the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.loader import load_model
from services.worker.model.ranks import RankSpec, collective_clock, load_tensor_parallel
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu

CONFIG = EngineConfig(num_blocks=64, max_num_seqs=4)
PROMPTS = [[1, 7, 99, 5, 23] * 4, [3, 3, 200, 17, 5, 9, 11, 40, 2] * 3]
# Teacher-forced: every prompt position's log probability, so no sampled token can make two runs
# diverge.
PARAMS = SamplingParams(max_new_tokens=1, prompt_logprobs=1)


def prompt_logprobs(engine: LLMEngine) -> list[list[float]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"lp-{i}", prompt, PARAMS)
    found: dict[str, list[float]] = {}
    while engine.has_work():
        for step in engine.step():
            found.setdefault(step.request_id, []).extend(lp.logprob for lp in step.prompt_logprobs or ())
    return [found[f"lp-{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("size", [1, 2])
def test_ranks_over_nccl_give_one_ranks_logprobs(tiny_llama_dir: Path, size: int) -> None:
    """The prompts' log probabilities through the engine over `size` NCCL ranks equal the plain
    engine's, and the ranks did exchange."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs, torch sees {torch.cuda.device_count()}")
    plain = prompt_logprobs(LLMEngine(load_model(tiny_llama_dir, device="cuda", dtype=torch.float32), CONFIG))
    spec = RankSpec(tiny_llama_dir, "cuda", torch.float32, "auto", size, 60.0, start_timeout_s=600.0)
    loaded = load_tensor_parallel(spec)
    engine = LLMEngine(loaded, CONFIG)
    try:
        split = prompt_logprobs(engine)
        clock = collective_clock(engine.runner.model)
    finally:
        engine.close()
    assert engine.runner.graphs is None  # a split model's forward is not replayed from graphs
    assert clock is not None and clock.calls > 0
    # One rank: the same kernels, so rounding alone; two: partial sums added in another order.
    tolerance = 1e-5 if size == 1 else 1e-3
    for ours, ref, prompt in zip(split, plain, PROMPTS, strict=True):
        assert len(ours) == len(ref) == len(prompt) - 1
        assert ours == pytest.approx(ref, abs=tolerance)
