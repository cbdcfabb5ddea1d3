"""The writing half of a worker link: the submissions and cancellations queued for one Connect stream,
merged into as few ConnectRequests as the stream allows.

Everything queued in the same event-loop tick (the slots one dispatch granted, the cancellations one
worker message caused) leaves in one ConnectRequest, up to MAX_SUBMISSIONS_PER_MESSAGE submissions or
MAX_MERGED_BYTES, so the gRPC cost grows with engine steps, not with requests. Cancellations keep their
place in the queue, so the worker reads a cancellation before any submission queued after it. This
module must not decide what is sent (worker_link.py queues it) nor read the stream.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.metrics import SUBMISSION_BATCH_SIZE
from strata.rpc import MIB
from strata.v1 import worker_pb2

log = logging.getLogger(__name__)

MAX_SUBMISSIONS_PER_MESSAGE = 1024
# Stop merging once a ConnectRequest is this big, well inside the worker's 16 MiB default bound.
MAX_MERGED_BYTES = 4 * MIB


async def write_merged(
    call: grpc.aio.StreamStreamCall,
    outbound: asyncio.Queue[worker_pb2.Submission | str],
    model: str,
    address: str,
) -> None:
    """Write `outbound` (submissions, and wire ids to cancel) to `call` until the stream breaks."""
    try:
        while True:
            message = worker_pb2.ConnectRequest()
            item = await outbound.get()
            size = 0
            while True:
                if isinstance(item, str):
                    message.cancellations.append(item)
                else:
                    message.submissions.append(item)
                    size += item.ByteSize()
                full = len(message.submissions) >= MAX_SUBMISSIONS_PER_MESSAGE or size >= MAX_MERGED_BYTES
                if full or outbound.empty():
                    break
                item = outbound.get_nowait()
            if message.submissions:
                SUBMISSION_BATCH_SIZE.labels(model).observe(len(message.submissions))
            await call.write(message)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
        # The reader sees the same broken stream and reconnects; make sure it wakes up.
        log.debug("write to worker %s failed: %s", address, exc)
        call.cancel()
