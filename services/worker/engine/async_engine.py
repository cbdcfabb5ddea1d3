"""The asyncio facade over the engine: submit a request, iterate its tokens, abort it, read stats.

The engine steps on its own thread so that a forward pass never blocks the event loop; torch releases
the GIL inside its kernels. The engine is also *built* on that thread: a second thread running torch
gives the process a second OpenMP team, and with more OpenMP threads than cores libgomp stops
spin-waiting, which cost 13-25% of decode throughput on a 2-core machine. Commands reach the step
thread through a thread-safe inbox and are applied between steps; each step's outputs come back to
the loop in one callback, which feeds the per-request streams and then the step listeners (a server
that multiplexes many requests reads whole steps rather than one stream per request). `call` runs any
other work on the engine (loading an adapter) on that thread between two steps. This module must not
make scheduling decisions: that is the engine's job.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from services.worker.engine.adapters import UnknownAdapterError
from services.worker.engine.request_stream import RequestStream, aborted_output
from strata.sampling import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from services.worker.engine.engine import EngineStats, LLMEngine
    from services.worker.engine.grammar_matcher import GrammarMatcher
    from services.worker.engine.sequence import StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop failed or was stopped; the request cannot complete."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """One engine step as the event loop sees it: every output it produced, and when it ran."""

    outputs: list[StepOutput]
    started: float
    """time.monotonic() just before the step began (the inbox was already applied)."""
    ended: float
    """time.monotonic() just after the step returned its outputs."""
    stats: EngineStats
    """The engine's snapshot after the step: its batch's shape, the queues, the KV cache."""


StepListener = Callable[[StepReport], None]
FailureListener = Callable[[str | None, BaseException], None]
"""(request_id, error): a request the engine could not add, or, with None, the step loop ended (each
request it held first)."""


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str = ""
    grammar: GrammarMatcher | None = None
    itl_slo_s: float | None = None
    adapter: str = ""


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Call:
    work: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]


class AsyncEngine:
    """Runs an LLMEngine on a dedicated thread and serves it to asyncio code."""

    def __init__(self, build: Callable[[], LLMEngine], idle_wait_s: float = 0.05) -> None:
        """`build` makes the engine (loads the model) on the step thread when start() is awaited."""
        self._build = build
        self._engine: LLMEngine | None = None
        self._idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Every request the loop knows of; None for those submitted with add_request (listeners only).
        self._streams: dict[str, RequestStream | None] = {}
        self._step_listeners: list[StepListener] = []
        self._failure_listeners: list[FailureListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: EngineStats | None = None
        self._error: BaseException | None = None

    async def start(self) -> None:
        """Build the engine on the step thread and start stepping; raises what building raised."""
        self._loop = asyncio.get_running_loop()
        built: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="strata-engine", daemon=True)
        self._thread.start()
        await built

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("the engine is not built yet: await start() first")
        return self._engine

    async def stop(self) -> None:
        """Stop the step loop; requests still running end with EngineDeadError."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("the engine was stopped"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def check(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str = ""
    ) -> None:
        """Raise unless this request can be queued now: EngineDeadError when the engine is not running,
        InvalidRequestError for bad input (the engine's validate) or an id already running,
        UnknownAdapterError for an adapter the engine does not serve."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self._error or 'stopped'}")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", request_id, "a request with this id is already running")
        self.engine.validate(prompt_ids, params, adapter)

    async def call(self, work: Callable[[LLMEngine], T]) -> T:
        """Run `work(engine)` on the step thread between two steps; its result, or what it raised."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self._error or 'stopped'}")
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(work, done))
        self._wake.set()
        return await done

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        grammar: GrammarMatcher | None = None,
    ) -> RequestStream:
        """Check and queue a request; raises like `check`, at once."""
        self.check(request_id, prompt_ids, params)
        stream = RequestStream(request_id, self.abort)
        self._enqueue(_Add(request_id, list(prompt_ids), params, priority, grammar=grammar), stream)
        return stream

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        grammar: GrammarMatcher | None = None,
        itl_slo_s: float | None = None,
        adapter: str = "",
    ) -> None:
        """Queue a request that passed `check` (not checked again), whose outputs reach only the step
        listeners and its failure the failure listeners. For servers that read whole steps, not one
        stream per request, and that take their own resources for a request between the two calls.
        cache_salt: who may share its cached KV blocks (the tenant); grammar: its output constraint;
        itl_slo_s: the inter-token latency its route promises; adapter: its LoRA adapter, if any."""
        command = _Add(
            request_id, list(prompt_ids), params, priority, cache_salt, grammar, itl_slo_s, adapter
        )
        self._enqueue(command, None)

    def add_step_listener(
        self, on_step: StepListener, on_failure: FailureListener | None = None
    ) -> Callable[[], None]:
        """Call on_step on the event loop with every step that produced outputs, after the request
        streams got theirs; on_failure when the engine could not add a request, or when the step loop
        ends (each open request, then None).
        Returns a function that removes both."""
        self._step_listeners.append(on_step)
        if on_failure is not None:
            self._failure_listeners.append(on_failure)

        def remove() -> None:
            if on_step in self._step_listeners:
                self._step_listeners.remove(on_step)
            if on_failure is not None and on_failure in self._failure_listeners:
                self._failure_listeners.remove(on_failure)

        return remove

    def _enqueue(self, command: _Add, stream: RequestStream | None) -> None:
        self._streams[command.request_id] = stream
        self._inbox.put(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are free once the step thread reads the inbox."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.push(aborted_output(request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (an immutable object replaced atomically)."""
        if self._stats is None:
            raise EngineDeadError("the engine is not built yet: await start() first")
        return self._stats

    def _run(self, built: asyncio.Future[None]) -> None:
        try:
            self._engine = self._build()
            self._stats = self._engine.stats()
        except BaseException as exc:  # start() re-raises it in the caller
            self._error = exc
            self._post(_settle, (built, None, exc))
            return
        self._post(_settle, (built, None, None))
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_work():
                    self._stats = self.engine.stats()
                    self.engine.idle()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                started = time.monotonic()
                outputs = self.engine.step()
                ended = time.monotonic()
                self._stats = self.engine.stats()
                # Steps without outputs (a chunk of a long prompt) still reach listeners: metrics, spans.
                self._post(self._dispatch, StepReport(outputs, started, ended, self._stats))
        except BaseException as exc:  # the loop must report any death, even KeyboardInterrupt
            log.exception("engine step loop died")
            self._error = exc
            self._post(self._fail_all, EngineDeadError(f"the engine step loop died: {exc!r}"))
            raise
        finally:
            # On this thread, which made every collective a tensor-parallel model's ranks share.
            self.engine.close()
            self._refuse_calls()

    def _refuse_calls(self) -> None:
        """Settle the calls the stopped loop will never run: their callers must not wait forever."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call):
                self._post(_settle, (cmd.done, None, EngineDeadError("the engine stopped")))

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(
                        cmd.request_id,
                        cmd.prompt_ids,
                        cmd.params,
                        cmd.priority,
                        cmd.cache_salt,
                        cmd.grammar,
                        cmd.itl_slo_s,
                        cmd.adapter,
                    )
                except (InvalidRequestError, ValueError, UnknownAdapterError) as exc:
                    # `check` ran on the loop, the scheduler's own state lives here: should they ever
                    # disagree (an adapter unloaded between the two), the one request fails, never the engine.
                    self._post(self._fail_one, (cmd.request_id, exc))
            elif isinstance(cmd, _Call):
                self._run_call(cmd)
            else:
                self.engine.abort(cmd.request_id)

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.work(self.engine)
        except Exception as exc:  # the caller's failure, raised in the caller: the loop goes on
            self._post(_settle, (call.done, None, exc))
            return
        self._post(_settle, (call.done, result, None))

    def _post(self, fn: object, arg: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, arg)  # type: ignore[arg-type]

    def _dispatch(self, report: StepReport) -> None:
        for out in report.outputs:
            if out.request_id not in self._streams:
                continue  # aborted by the client while this step ran
            stream = self._streams.pop(out.request_id) if out.finished else self._streams[out.request_id]
            if stream is not None:
                stream.push(out)
        for listener in list(self._step_listeners):
            try:
                listener(report)
            except Exception:  # one broken listener must not starve the others of this step
                log.exception("step listener %r failed", listener)

    def _fail_one(self, failure: tuple[str, BaseException]) -> None:
        request_id, error = failure
        if request_id not in self._streams:
            return
        stream = self._streams.pop(request_id)
        if stream is not None:
            stream.push(error)
        self._notify_failure(request_id, error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            if stream is not None:
                stream.push(error)
            self._notify_failure(request_id, error)
        self._notify_failure(None, error)

    def _notify_failure(self, request_id: str | None, error: BaseException) -> None:
        for listener in list(self._failure_listeners):
            try:
                listener(request_id, error)
            except Exception:  # as in _dispatch: the other listeners still hear of it
                log.exception("failure listener %r failed", listener)


def _settle(outcome: tuple[asyncio.Future[Any], Any, BaseException | None]) -> None:
    future, result, error = outcome
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
