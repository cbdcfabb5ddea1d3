"""The in-process engine baseline of `strata bench`: what the stack's worker could do without the stack.

The engine is built exactly as the worker builds it (the config file's first worker: model folder,
device, dtype, quantization, engine settings, threads) in the benchmark's own process and fed the
very token ids the stack's requests tokenized to. It measures the two figures the stack is judged
against: output tokens/s with the stack level's own number of requests in flight (`engine.generate`
on each wave of them; every request of a level has the same prompt and output length, so waves are
the stack's closed loop), and time to first token of a request alone (add_request until the
first step output carrying a token). It must run only while the stack is idle: on a small machine
the two would share the cores. This module must not talk to the stack.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.worker.engine.engine import LLMEngine
    from services.worker.settings import WorkerSettings


@dataclass(frozen=True, slots=True)
class ThroughputRun:
    """One all-at-once run: its output tokens/s, wall seconds and every request's new token ids."""

    tok_s: float
    seconds: float
    outputs: list[list[int]]


def resolve_device(settings: WorkerSettings) -> tuple[str, Any]:
    """The worker's device and dtype, "auto" resolved the way the worker resolves it."""
    import torch

    from services.worker.model.loader import default_dtype

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = (
        default_dtype(torch.device(device)) if settings.dtype == "auto" else getattr(torch, settings.dtype)
    )
    return device, dtype


class EngineBaseline:
    """One engine, loaded once, timed on demand between the stack's sweeps."""

    def __init__(self, settings: WorkerSettings, threads: int | None) -> None:
        """`threads` None leaves torch's default, as the worker does when its settings leave it unset.

        The worker's OpenMP wait policy is applied too (strata up gives the worker process the same
        variable), but only if torch has not loaded yet in this process: OpenMP reads it once.
        """
        if settings.omp_wait_policy is not None and "torch" not in sys.modules:
            os.environ["OMP_WAIT_POLICY"] = settings.omp_wait_policy
        self.omp_wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset")
        import torch

        from services.worker.engine.engine import LLMEngine

        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.device, dtype = resolve_device(settings)
        self.dtype = str(dtype).removeprefix("torch.")
        quantization = None if settings.quantization == "none" else settings.quantization
        self.engine: LLMEngine = LLMEngine.from_model_dir(
            settings.model_path, settings.engine, device=self.device, dtype=dtype, quantization=quantization
        )

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "omp_wait_policy": self.omp_wait_policy,
            "engine_config": self.engine.config.model_dump(),
            "max_model_len": self.engine.max_model_len,
        }

    def throughput(self, prompts: list[list[int]], new_tokens: int, concurrency: int) -> ThroughputRun:
        """`concurrency` prompts at a time, each wave run to completion: generated tokens over wall time."""
        from strata.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        outputs: list[list[int]] = []
        started = time.perf_counter()
        for first in range(0, len(prompts), concurrency):
            outputs += self.engine.generate(prompts[first : first + concurrency], params)
        seconds = time.perf_counter() - started
        return ThroughputRun(sum(map(len, outputs)) / seconds, seconds, outputs)

    def time_to_first_token(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Each prompt alone on the idle engine: seconds from add_request to its first token.

        The request is aborted once its first token is out: the rest of it would not change the next
        request's wait, which starts on an idle engine either way.
        """
        from strata.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        waits: list[float] = []
        for index, prompt in enumerate(prompts):
            request_id = f"ttft-{index}-{time.monotonic_ns()}"
            started = time.perf_counter()
            self.engine.add_request(request_id, prompt, params)
            while not any(out.request_id == request_id and out.new_token_ids for out in self.engine.step()):
                if not self.engine.has_work():
                    raise RuntimeError(f"engine finished request {request_id} without a token")
            waits.append(time.perf_counter() - started)
            self.engine.abort(request_id)
            while self.engine.has_work():
                self.engine.step()
        return waits
