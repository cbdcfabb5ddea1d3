"""On a CUDA device: the sampler's counter-based noise and its tokens equal the CPU's.

Without a CUDA device (CI has none) it is reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs it on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.noise import row_keys, uniform
from services.worker.engine.sampler import Sampler, SampleRow
from tests.sampling_cases import CPU, TARGETS

pytestmark = pytest.mark.gpu


def test_cuda_gives_the_cpu_noise_and_tokens() -> None:
    cuda = torch.device("cuda")
    keys = row_keys([3, 2**62], [0, 9], CPU)
    columns = torch.arange(50_000)[None, :]
    assert torch.equal(uniform(keys.to(cuda), columns.to(cuda)).cpu(), uniform(keys, columns))
    logits = torch.randn(len(TARGETS), 3000, generator=torch.Generator().manual_seed(15)) * 2
    history = list(range(0, 3000, 7))
    rows = [SampleRow(p, seed=i, position=4, history=history) for i, p in enumerate(TARGETS)]
    assert Sampler()(logits.to(cuda), rows) == Sampler()(logits, rows)
    assert torch.equal(Sampler().allowed(logits.to(cuda), rows).cpu(), Sampler().allowed(logits, rows))
