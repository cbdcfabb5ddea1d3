"""How much device memory a worker holds: CUDA allocations on a GPU, resident memory on the CPU.

Read for the /metrics gauge and for each finished request's last update. This module must not
allocate nor hold state.
"""

from __future__ import annotations

import functools

import psutil
import torch


def device_memory_bytes(device: str) -> int:
    """Bytes in use on `device` ("cpu" counts this process's resident set: weights, KV cache, rest)."""
    if device.startswith("cuda"):
        return int(torch.cuda.memory_allocated(torch.device(device)))
    return int(_this_process().memory_info().rss)


@functools.cache
def _this_process() -> psutil.Process:
    """This process's handle, made once: it is read for every finished request."""
    return psutil.Process()
