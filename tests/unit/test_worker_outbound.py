"""The worker's outbound queue alone: merging while a write is in flight, ordering, closing."""

from __future__ import annotations

import asyncio

from services.worker.outbound import OutboundQueue
from strata.v1 import common_pb2, worker_pb2
from tests.polling import wait_for_async


def _update(request_id: str, tokens: list[int], **fields: object) -> worker_pb2.TokenUpdate:
    return worker_pb2.TokenUpdate(request_id=request_id, token_ids=tokens, **fields)  # type: ignore[arg-type]


def _credits(requests: int) -> worker_pb2.Credits:
    return worker_pb2.Credits(requests=requests, kv_tokens=requests * 16)


def test_updates_of_one_request_merge_into_one_entry_in_first_seen_order() -> None:
    queue = OutboundQueue()
    queue.put(updates=[_update("a", [1], output_tokens=1, queue_ms=2.5, forward_ms=1.0)], credits=_credits(5))
    queue.put(updates=[_update("b", [7], output_tokens=1, queue_ms=4.0, forward_ms=1.0)])
    queue.put(
        updates=[
            _update("a", [2, 3], output_tokens=3, forward_ms=3.0),
            _update("b", [8], output_tokens=2, forward_ms=3.0),
        ],
        credits=_credits(4),
    )
    message = queue.take()
    assert message is not None
    assert [(u.request_id, list(u.token_ids)) for u in message.updates] == [("a", [1, 2, 3]), ("b", [7, 8])]
    first = message.updates[0]
    # The first update's queue_ms survives; counters and forward time are the newest.
    assert (first.queue_ms, first.forward_ms, first.output_tokens) == (2.5, 3.0, 3)
    assert message.updates[1].queue_ms == 4.0
    assert message.credits.requests == 4  # the newest credits win
    assert queue.take() is None
    assert not queue.pending


def test_a_merged_update_reports_both_steps_drafts_and_the_last_ones_memory() -> None:
    """Draft counts are per step, so merging adds them (a write in flight must not lose a step's
    drafts); the prefix cache's count and the device memory are the newest update's."""
    queue = OutboundQueue()
    queue.put(
        updates=[_update("a", [1, 2], draft_tokens=3, accepted_draft_tokens=1, cached_prompt_tokens=16)]
    )
    queue.put(
        updates=[
            _update(
                "a",
                [3, 4, 5],
                draft_tokens=4,
                accepted_draft_tokens=2,
                cached_prompt_tokens=16,
                finished=True,
                device_memory_bytes=1 << 20,
            )
        ]
    )
    message = queue.take()
    assert message is not None
    (merged,) = message.updates
    assert (merged.draft_tokens, merged.accepted_draft_tokens) == (7, 3)
    assert (merged.cached_prompt_tokens, merged.device_memory_bytes) == (16, 1 << 20)


def test_a_finished_update_keeps_its_final_state_and_seals_the_entry() -> None:
    queue = OutboundQueue()
    queue.put(updates=[_update("a", [1], output_tokens=1, prompt_tokens=3)])
    queue.put(
        updates=[
            _update(
                "a",
                [2],
                finished=True,
                finish_reason=common_pb2.FINISH_REASON_STOP,
                output_tokens=2,
                prompt_tokens=3,
            )
        ]
    )
    # The gateway reused the id for a new request before the old one's end was written.
    queue.put(updates=[_update("a", [9], output_tokens=1, prompt_tokens=5)])
    message = queue.take()
    assert message is not None
    assert len(message.updates) == 2
    ended, fresh = message.updates
    assert (list(ended.token_ids), ended.finished, ended.finish_reason) == (
        [1, 2],
        True,
        common_pb2.FINISH_REASON_STOP,
    )
    assert (list(fresh.token_ids), fresh.finished, fresh.prompt_tokens) == ([9], False, 5)


def test_hello_rejections_and_credits_travel_together_and_nothing_is_lost() -> None:
    queue = OutboundQueue()
    info = worker_pb2.GetWorkerInfoResponse(model="tiny")
    queue.put(hello=worker_pb2.WorkerHello(info=info), credits=_credits(8))
    queue.put(rejections=[worker_pb2.Rejection(request_id="x", code=8, message="full")])
    queue.put(rejections=[worker_pb2.Rejection(request_id="y", code=3, message="bad")], credits=_credits(7))
    message = queue.take()
    assert message is not None
    assert message.HasField("hello") and message.hello.info.model == "tiny"
    assert [(r.request_id, r.code) for r in message.rejections] == [("x", 8), ("y", 3)]
    assert message.credits.requests == 7
    queue.put(credits=_credits(6))
    second = queue.take()
    assert second is not None
    assert not second.HasField("hello") and not second.updates and second.credits.requests == 6


def test_get_waits_for_output_and_a_closed_queue_drains_then_ends() -> None:
    async def main() -> list[worker_pb2.ConnectResponse | None]:
        queue = OutboundQueue()
        got: list[worker_pb2.ConnectResponse | None] = []
        written = asyncio.Event()

        async def writer() -> None:
            while True:
                message = await queue.get()
                got.append(message)
                if message is None:
                    return
                # A slow write, which lasts until the test lets it end: everything put meanwhile
                # must arrive merged in the next message.
                await written.wait()

        task = asyncio.create_task(writer())
        await asyncio.sleep(0)  # one turn of the loop: the writer runs until it waits in get()
        assert got == [] and not task.done()  # nothing pending: the writer waits
        queue.put(updates=[_update("a", [1])])
        await wait_for_async(lambda: got, 5.0, "the writer took the first message")
        for token in range(2, 6):
            queue.put(updates=[_update("a", [token])])
        queue.close()
        queue.put(updates=[_update("a", [99])])  # ignored once closed
        written.set()
        await asyncio.wait_for(task, 5.0)
        return got

    got = asyncio.run(main())
    assert [None if m is None else [list(u.token_ids) for u in m.updates] for m in got] == [
        [[1]],
        [[2, 3, 4, 5]],
        None,
    ]
