"""The tokenizer service's gRPC server: the servicer, start and stop, and the process entry point.

`start` binds the listen address (health NOT_SERVING), loads every configured tokenizer off the event
loop, then turns health SERVING. Tokenize and Detokenize run their batch in a worker thread, since
they are CPU work (the tokenizers library releases the GIL while it encodes and decodes) and the
event loop must keep answering health checks and other calls. `main` runs the service until SIGTERM
or SIGINT, then stops gracefully. This module must not tokenize itself nor choose status codes
(errors.py maps them); it converts between messages and the pure modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import grpc

from services.tokenizer.detokenize import Detokenized, detokenize_entries
from services.tokenizer.errors import InvalidArgument, NotReady, TokenizerError, abort, entry_error
from services.tokenizer.metrics import record_call
from services.tokenizer.registry import TokenizerRegistry, load_registry
from services.tokenizer.settings import TokenizerSettings
from services.tokenizer.tokenize import Tokenized, tokenize_entries
from strata.rpc import RunningServer, shutdown_event, start_server
from strata.service_main import run_service
from strata.strict_handlers import add_servicer
from strata.tracing import SpanKind, Tracing
from strata.v1 import tokenizer_pb2, tokenizer_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence, Sized
    from pathlib import Path

    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)

SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]
SERVICE_NAME = SERVICE.full_name


# Tokenize's or Detokenize's messages: _batch serves both, and mypy holds each call to its own types.
EntryT = TypeVar("EntryT", tokenizer_pb2.TokenizeEntry, tokenizer_pb2.DetokenizeEntry)
ResultT = TypeVar("ResultT", tokenizer_pb2.TokenizeResult, tokenizer_pb2.DetokenizeResult)
ResponseT = TypeVar("ResponseT", tokenizer_pb2.TokenizeResponse, tokenizer_pb2.DetokenizeResponse)
OutcomeT = TypeVar("OutcomeT")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """strata.v1.TokenizerService over a registry that is set once the tokenizers are loaded."""

    def __init__(self, max_batch_entries: int, tracing: Tracing | None = None) -> None:
        self.max_batch_entries = max_batch_entries
        self.registry: TokenizerRegistry | None = None
        self.tracing = tracing or Tracing.off()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Counts a Tokenize or Detokenize call in flight, for a stop that waits for them."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def idle(self) -> None:
        """Return once no Tokenize or Detokenize call is in flight."""
        await self._idle.wait()

    def _ready(self, entries: Sized) -> TokenizerRegistry:
        if self.registry is None:
            raise NotReady("the tokenizers are still loading; retry once health reports SERVING")
        if len(entries) > self.max_batch_entries:
            raise InvalidArgument(
                f"entries: {len(entries)} entries exceed max_batch_entries={self.max_batch_entries}; "
                "split the batch into smaller calls"
            )
        return self.registry

    async def _batch(
        self,
        method: str,
        context: Context,
        entries: Sequence[EntryT],
        run: Callable[[TokenizerRegistry, Sequence[EntryT]], list[OutcomeT]],
        result: Callable[[OutcomeT], ResultT],
        respond: Callable[[list[ResultT]], ResponseT],
        tokens: Callable[[EntryT, ResultT], int],
    ) -> tuple[ResponseT, float, float]:
        """What Tokenize and Detokenize do: refuse the batch (not ready, too many entries) or `run` it in a
        worker thread, counted in flight; `respond` with each outcome's `result`, server time set; record
        the call's metrics (`tokens` per entry). Returns the response and the perf_counter readings
        around the work."""
        try:
            registry = self._ready(entries)
        except TokenizerError as error:
            await abort(context, error)
        started = time.perf_counter()
        with self._call():
            outcomes = await asyncio.to_thread(run, registry, entries)
        results = [result(outcome) for outcome in outcomes]
        response = respond(results)
        ended = time.perf_counter()
        response.server_ms = (ended - started) * 1000.0
        record_call(
            method,
            ended - started,
            [(e.model, tokens(e, r), _code_name(r.error)) for e, r in zip(entries, results, strict=True)],
        )
        return response, started, ended

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: Context
    ) -> tokenizer_pb2.TokenizeResponse:
        response, started, ended = await self._batch(
            "tokenize",
            context,
            request.entries,
            tokenize_entries,
            _tokenize_result,
            lambda results: tokenizer_pb2.TokenizeResponse(results=results),
            lambda _, result: len(result.token_ids),
        )
        if self.tracing.enabled:
            self._preprocess_spans(request, response, context, started, ended)
        return response

    def _preprocess_spans(
        self,
        request: tokenizer_pb2.TokenizeRequest,
        response: tokenizer_pb2.TokenizeResponse,
        context: Context,
        started: float,
        ended: float,
    ) -> None:
        """One `preprocess` span per entry, in the entry's trace (else the call metadata's)."""
        metadata = context.invocation_metadata() or ()
        call_carrier = {key: value for key, value in metadata if key == "traceparent"}
        for entry, result in zip(request.entries, response.results, strict=True):
            parent = self.tracing.extract(entry.trace_context or call_carrier)
            self.tracing.span(
                "preprocess",
                parent=parent,
                start=started,
                end=ended,
                kind=SpanKind.SERVER,
                attributes={
                    "gen_ai.request.model": entry.model,
                    "gen_ai.usage.input_tokens": len(result.token_ids),
                    "strata.truncated_tokens": result.truncated_tokens,
                    "strata.chat": len(entry.messages) > 0,
                    "strata.batch_entries": len(request.entries),
                    "strata.error": result.error.message,
                },
            )

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: Context
    ) -> tokenizer_pb2.DetokenizeResponse:
        response, _, _ = await self._batch(
            "detokenize",
            context,
            request.entries,
            detokenize_entries,
            _detokenize_result,
            lambda results: tokenizer_pb2.DetokenizeResponse(results=results),
            lambda entry, _: len(entry.new_ids),
        )
        return response

    async def GetTokenizerInfo(
        self, request: tokenizer_pb2.GetTokenizerInfoRequest, context: Context
    ) -> tokenizer_pb2.GetTokenizerInfoResponse:
        try:
            registry = self._ready(())
        except TokenizerError as error:
            await abort(context, error)
        return tokenizer_pb2.GetTokenizerInfoResponse(
            models=[
                tokenizer_pb2.TokenizerModel(
                    name=model.name,
                    fingerprint=model.fingerprint,
                    has_chat_template=model.chat_template is not None,
                    eos_token_ids=model.eos_token_ids,
                    tool_call_tokens=model.tool_call_tokens,
                    think_tokens=model.think_tokens,
                )
                for model in registry.models.values()
            ]
        )


def _code_name(error: tokenizer_pb2.EntryError) -> str:
    """The gRPC code name of an entry's error ("" when it has none)."""
    return grpc.StatusCode(_CODES[error.code]).name.lower() if error.code in _CODES else ""


_CODES = {code.value[0]: code.value for code in grpc.StatusCode if code.value[0] != 0}


def _tokenize_result(outcome: Tokenized | TokenizerError) -> tokenizer_pb2.TokenizeResult:
    if isinstance(outcome, TokenizerError):
        return tokenizer_pb2.TokenizeResult(error=entry_error(outcome))
    return tokenizer_pb2.TokenizeResult(
        token_ids=outcome.token_ids, truncated_tokens=outcome.truncated_tokens
    )


def _detokenize_result(outcome: Detokenized | TokenizerError) -> tokenizer_pb2.DetokenizeResult:
    if isinstance(outcome, TokenizerError):
        return tokenizer_pb2.DetokenizeResult(error=entry_error(outcome))
    return tokenizer_pb2.DetokenizeResult(
        text=outcome.text,
        window=outcome.window,
        read_offset=outcome.read_offset,
        pending_text=outcome.pending_text,
        stopped=outcome.stopped,
        stop_sequence=outcome.stop_sequence,
        pieces=outcome.pieces,
    )


class TokenizerServer:
    """A running tokenizer service."""

    def __init__(self, running: RunningServer, servicer: TokenizerServicer) -> None:
        self.running = running
        self.servicer = servicer
        self.address: str = running.address
        """host:port the server is bound to."""

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, let Tokenize and Detokenize calls in flight finish for up to `grace`
        seconds, then stop. Long-lived health watches are not waited for: they would hold the stop
        for the whole grace."""
        await self.running.set_serving(False)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.idle(), grace)
        await self.running.stop(0)


async def start(
    settings: TokenizerSettings, announce_file: Path | None = None, tracing: Tracing | None = None
) -> TokenizerServer:
    """Bind, load every tokenizer, then report SERVING; a folder that cannot be served is a SettingsError."""
    servicer = TokenizerServicer(settings.max_batch_entries, tracing or Tracing.off())
    running = await start_server(
        settings.listen,
        register=[lambda server: add_servicer(server, servicer, SERVICE)],
        service_names=[SERVICE_NAME],
        max_message_bytes=settings.max_message_bytes,
        limits=settings.rpc_limits,
        announce_file=announce_file,
        health_listen=settings.health_listen,
        tls=settings.tls,
    )
    try:
        servicer.registry = await asyncio.to_thread(load_registry, settings.models)
    except BaseException:
        await running.stop(None)
        raise
    await running.set_serving(True)
    log.info("tokenizer service serving %s on %s", ", ".join(settings.models), running.address)
    return TokenizerServer(running, servicer)


async def serve(settings: TokenizerSettings, announce_file: Path | None, tracing: Tracing) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    stopping = shutdown_event()  # before loading, so a signal during a slow load is not lost
    server = await start(settings, announce_file, tracing)
    await stopping.wait()
    log.info("tokenizer service stopping")
    await server.stop(settings.shutdown_grace_s)


def main(argv: list[str] | None = None) -> int:
    """`python -m services.tokenizer [--config PATH] [--announce-file PATH]`."""
    return run_service(
        TokenizerSettings,
        serve,
        argv,
        prog="python -m services.tokenizer",
        description=__doc__,
        service_name="strata-tokenizer",
    )
