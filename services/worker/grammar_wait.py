"""Submissions of one Connect stream that wait for their output constraint to compile.

The compile itself runs on the grammar compiler's threads; here a task per submission awaits it, for
at most the compiler's time bound, and then hands the submission back to its connection with the
matcher, or with the InvalidRequestError that a bad or slow constraint earned.
Nothing is taken for a waiting submission (no credit, no engine slot), so cancelling one is only
cancelling its task. This module must not accept requests itself nor choose status codes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from strata.sampling import InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.worker.engine.grammar_compiler import GrammarCompiler
    from services.worker.engine.grammar_matcher import GrammarMatcher
    from services.worker.engine.grammar_spec import GrammarSpec
    from strata.v1 import worker_pb2


class PendingCompiles:
    """The waiting submissions of one stream, by request id. Used from the event loop only."""

    def __init__(self, done: Callable[[worker_pb2.Submission, GrammarMatcher | Exception], None]) -> None:
        self._done = done
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, submission: worker_pb2.Submission, spec: GrammarSpec, compiler: GrammarCompiler) -> None:
        """Compile the submission's constraint and hand it on when done."""
        task = asyncio.create_task(self._wait(submission, spec, compiler))
        self._tasks[submission.request_id] = task

    def cancel(self, request_id: str) -> None:
        self._tasks.pop(request_id).cancel()

    def cancel_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def _wait(
        self, submission: worker_pb2.Submission, spec: GrammarSpec, compiler: GrammarCompiler
    ) -> None:
        request_id = submission.request_id
        future = compiler.submit(spec)
        try:
            # shield: other requests may wait on the same compile; a cancelled wait must not end it.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), compiler.timeout_s)
        except TimeoutError:
            outcome: GrammarMatcher | Exception = compiler.timeout_error(spec, compiler.timeout_s)
        except InvalidRequestError as exc:
            outcome = exc
        else:
            outcome = compiler.result(spec, future)
        self._tasks.pop(request_id, None)
        self._done(submission, outcome)
