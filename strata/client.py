"""The Strata client SDK: sync `StrataClient` and asyncio `AsyncStrataClient` of strata.v1.Gateway.

Both build the same GenerateRequest (`build_request`, from strata.generate_request) and decide their
retries the same way (strata.retry.CallAttempts), so they differ only in how they call and wait. A
call the gateway refuses with RESOURCE_EXHAUSTED or UNAVAILABLE is tried again after the server's
hint (RetryInfo or pushback) or an exponential backoff, up to `RetryPolicy.max_attempts` and never
past the call's overall `timeout`. A stream is retried only before its first message: once text reached the
caller, a failure is raised rather than replayed. Failures reach the caller as grpc.RpcError (sync:
a grpc.Call, so `.code()` and `.details()` work; asyncio: grpc.aio.AioRpcError); bad arguments raise
ValueError before any call. This module must not hold serving logic nor validate what the gateway
validates (prompt vs. messages, limits): the gateway answers INVALID_ARGUMENT with the field's name.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any, Self, TypeVar

import grpc

from strata.generate_request import build_request
from strata.retry import CallAttempts, RetryPolicy
from strata.rpc import MIB, aio_channel, channel_options, sync_channel
from strata.sampling import SamplingOptions
from strata.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
    from types import TracebackType

    from typing_extensions import Unpack

    from strata.tls import ClientTlsSettings

# build_request is listed because it is imported: it has been part of this module's API all along.
__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AsyncStrataClient",
    "GenerateOptions",
    "StrataClient",
    "auth_metadata",
    "build_request",
]

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 16 * MIB

ResponseT = TypeVar("ResponseT")


class GenerateOptions(SamplingOptions, total=False):
    """The keyword arguments of generate and generate_stream besides prompt and timeout: the scalar
    sampling parameters (strata.sampling.SamplingOptions) and these."""

    messages: Sequence[tuple[str, str] | Mapping[str, str]] | None
    model: str
    stop: Sequence[str]
    request_id: str
    allow_fallback: bool
    truncation: int | str | None
    logit_bias: Mapping[int, float] | None
    stop_token_ids: Sequence[int]
    logprobs: int | None
    n: int
    json_schema: str | Mapping[str, Any] | None
    json_object: bool
    regex: str | None
    grammar: str | None
    speculate: bool


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries an API key (none without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class _GatewayClient:
    """What both clients share: the gateway's address, the retry policy, the API key's metadata, and
    how each attempt of a call is made and whether it is retried (strata.retry.CallAttempts).

    A subclass holds the channel, and only runs the attempts and waits, each in its own way.
    """

    def __init__(self, address: str, retry: RetryPolicy | None, api_key: str | None) -> None:
        self.address = address
        self.retry = retry or RetryPolicy()
        self._rng = random.Random()
        self._metadata = auth_metadata(api_key)

    def _attempts(self, timeout: float | None) -> CallAttempts:
        return CallAttempts(self.retry, timeout, self._rng)

    def _attempt(self, method: Callable[..., Any], request: Any, attempts: CallAttempts) -> Any:
        """Start one attempt: `method` of the stub with what is left of the timeout and the API key.

        It returns what the stub returns (a response, an awaitable or a stream), for the caller to
        consume in its own way.
        """
        return method(request, timeout=attempts.time_left_s(), metadata=self._metadata)


class StrataClient(_GatewayClient):
    """A blocking client of one gateway. Thread-safe; close it (or use `with`) to free the channel."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        api_key: str | None = None,
        tls: ClientTlsSettings | None = None,
    ) -> None:
        """`api_key` is sent as `authorization: Bearer <key>`; `tls` makes the channel TLS."""
        super().__init__(address, retry, api_key)
        self._channel = sync_channel(address, channel_options(max_message_bytes), tls)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> gateway_pb2.GenerateResponse:
        """The whole completion; `options` are build_request's keywords. Raises grpc.RpcError."""
        return self.send(build_request(prompt, **options), timeout=timeout)

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[gateway_pb2.GenerateStreamResponse]:
        """Text deltas as decoded, the last message carrying `final`; the call starts on the first next()."""
        return self.send_stream(build_request(prompt, **options), timeout=timeout)

    def list_models(self, *, timeout: float | None = None) -> gateway_pb2.ListModelsResponse:
        return self._unary(
            self._stub.ListModels, gateway_pb2.ListModelsRequest(), gateway_pb2.ListModelsResponse, timeout
        )

    def send(
        self, request: gateway_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> gateway_pb2.GenerateResponse:
        """Generate for a request built beforehand (build_request), with retries."""
        return self._unary(self._stub.Generate, request, gateway_pb2.GenerateResponse, timeout)

    def send_stream(
        self, request: gateway_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> Iterator[gateway_pb2.GenerateStreamResponse]:
        """GenerateStream for a request built beforehand; retried only until its first message."""
        attempts = self._attempts(timeout)
        while True:
            call = self._attempt(self._stub.GenerateStream, request, attempts)
            received = False
            try:
                for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                delay = attempts.delay_after(error, delivered=received)
                if delay is None:
                    raise
            finally:
                # Ends the RPC when the caller stops iterating early; a no-op once it completed.
                call.cancel()
            time.sleep(delay)

    def _unary(
        self, method: Callable[..., Any], request: Any, response_type: type[ResponseT], timeout: float | None
    ) -> ResponseT:
        # response_type only pins ResponseT: the generated stubs' callables are untyped.
        attempts = self._attempts(timeout)
        while True:
            try:
                response: ResponseT = self._attempt(method, request, attempts)
                return response
            except grpc.RpcError as error:
                delay = attempts.delay_after(error)
                if delay is None:
                    raise
            time.sleep(delay)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncStrataClient(_GatewayClient):
    """An asyncio client of one gateway; create it inside the event loop that uses it."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        api_key: str | None = None,
        tls: ClientTlsSettings | None = None,
    ) -> None:
        """`api_key` is sent as `authorization: Bearer <key>`; `tls` makes the channel TLS."""
        super().__init__(address, retry, api_key)
        self._channel = aio_channel(address, channel_options(max_message_bytes), tls)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> gateway_pb2.GenerateResponse:
        """The whole completion; `options` are build_request's keywords. Raises grpc.aio.AioRpcError."""
        return await self.send(build_request(prompt, **options), timeout=timeout)

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """Text deltas as decoded, the last message carrying `final`; retried only until the first one."""
        return self.send_stream(build_request(prompt, **options), timeout=timeout)

    async def list_models(self, *, timeout: float | None = None) -> gateway_pb2.ListModelsResponse:
        return await self._unary(
            self._stub.ListModels, gateway_pb2.ListModelsRequest(), gateway_pb2.ListModelsResponse, timeout
        )

    async def send(
        self, request: gateway_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> gateway_pb2.GenerateResponse:
        """Generate for a request built beforehand (build_request), with retries."""
        return await self._unary(self._stub.Generate, request, gateway_pb2.GenerateResponse, timeout)

    async def send_stream(
        self, request: gateway_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """GenerateStream for a request built beforehand; retried only until its first message."""
        attempts = self._attempts(timeout)
        while True:
            call = self._attempt(self._stub.GenerateStream, request, attempts)
            received = False
            try:
                async for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                delay = attempts.delay_after(error, delivered=received)
                if delay is None:
                    raise
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def _unary(
        self, method: Callable[..., Any], request: Any, response_type: type[ResponseT], timeout: float | None
    ) -> ResponseT:
        # response_type only pins ResponseT: the generated stubs' callables are untyped.
        attempts = self._attempts(timeout)
        while True:
            try:
                response: ResponseT = await self._attempt(method, request, attempts)
                return response
            except grpc.RpcError as error:
                delay = attempts.delay_after(error)
                if delay is None:
                    raise
            await asyncio.sleep(delay)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
