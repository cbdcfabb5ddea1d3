"""Several samples of one prompt (GenerateRequest.n): one request per sample, merged into one answer.

Sample i is the request itself with n cleared and, when it has a seed, the seed mix(seed, i)
(`sample_seed`: sample 0 keeps the seed, so it equals the request with n = 1; the others are a
SplitMix64 hash of (seed, i), so each is reproducible alone). Sample 0 starts first; the others start
when it has produced its first chunk, that is once its worker has prefilled the prompt and offered
its full blocks to the prefix cache, so the other samples (routed to that worker by prefix-aware
routing) take the prompt's blocks by reference count and compute only its last, partial block: the
prompt is prefilled once. Each sample then runs the whole pipeline on its own (admission, failover
from its own prior tokens); their chunks are merged as they come, each with its index and each
sample's last chunk with its own final; a last chunk carries the whole request's final (sample 0's
fields and every sample as a Choice). Closing the merged generator closes every sample's, which
cancels them on the workers; the first sample to fail fails the request and cancels the rest.

This module must not know a front door's objects nor run any stage itself (the pipeline does).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING

from gateway import tool_calls
from gateway.errors import GatewayError, InvalidArgument
from gateway.request_ids import or_new
from gateway.request_values import Chunk
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from gateway.request_values import Incoming

MAX_SAMPLES = 16
_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """mix(seed, index), below 2**63: the seed itself for sample 0, SplitMix64 of (seed, index) else."""
    if index == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * index) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def check_samples(request: gateway_pb2.GenerateRequest) -> int:
    """The number of samples the request asks for (0 reads as 1); InvalidArgument past MAX_SAMPLES."""
    if request.n > MAX_SAMPLES:
        raise InvalidArgument(f"n: {request.n} must be in [1, {MAX_SAMPLES}] (0 is 1)")
    if request.n > 1 and tool_calls.calls_tools(request):
        # An answer's tool calls are parsed from one text: samples would each need their own.
        raise InvalidArgument(f"n: {request.n} with tools; a request that may call a tool takes one sample")
    return max(1, request.n)


def sample_incoming(incoming: Incoming, index: int, request_id: str) -> Incoming:
    """Sample `index`'s request: n cleared, the seed mixed, the request id shared by all samples."""
    request = gateway_pb2.GenerateRequest()
    request.CopyFrom(incoming.request)
    request.ClearField("n")
    request.request_id = request_id
    if request.sampling.HasField("seed"):
        request.sampling.seed = sample_seed(request.sampling.seed, index)
    return replace(incoming, request=request)


async def run_samples(
    run: Callable[[Incoming], AsyncGenerator[Chunk, None]], incoming: Incoming, n: int
) -> AsyncGenerator[Chunk, None]:
    """The merged chunks of `n` samples of `incoming`, each sample run by `run`."""
    request_id = or_new(incoming.request.request_id)
    queue: asyncio.Queue[tuple[int, Chunk | GatewayError | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async with contextlib.aclosing(run(sample_incoming(incoming, index, request_id))) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((index, chunk))
        except GatewayError as error:
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(0))]
    finals: dict[int, gateway_pb2.GenerateResponse] = {}
    running = 1
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, GatewayError):
                raise item
            if len(tasks) == 1:
                # The first sample's first chunk (or its end): its prompt's blocks are cached now.
                tasks += [asyncio.create_task(pump(i)) for i in range(1, n)]
                running += n - 1
            if item is None:
                running -= 1
            else:
                if item.final is not None:
                    finals[index] = item.final
                yield replace(item, index=index, final=None, sample_final=item.final)
        yield _whole(finals, n)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _whole(finals: dict[int, gateway_pb2.GenerateResponse], n: int) -> Chunk:
    first = finals[0]
    whole = gateway_pb2.GenerateResponse()
    whole.CopyFrom(first)
    whole.usage.output_tokens = sum(finals[i].usage.output_tokens for i in range(n))
    whole.usage.draft_tokens = sum(finals[i].usage.draft_tokens for i in range(n))
    whole.usage.accepted_draft_tokens = sum(finals[i].usage.accepted_draft_tokens for i in range(n))
    for i in range(n):
        final = finals[i]
        whole.choices.append(
            gateway_pb2.Choice(
                index=i,
                text=final.text,
                token_ids=final.token_ids,
                finish_reason=final.finish_reason,
                usage=final.usage,
                logprobs=final.logprobs,
                stop_sequence=final.stop_sequence,
            )
        )
    return Chunk("", [], final=whole, model=first.model)
