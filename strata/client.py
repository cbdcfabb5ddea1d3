"""The Strata client SDK: sync `StrataClient` and asyncio `AsyncStrataClient` of strata.v1.Gateway.

Both build the same GenerateRequest (`build_request`) and retry the same way (strata.retry): a call
the gateway refuses with RESOURCE_EXHAUSTED or UNAVAILABLE is tried again after the server's hint
(RetryInfo or pushback) or an exponential backoff, up to `RetryPolicy.max_attempts` and never past the
call's overall `timeout`. A stream is retried only before its first message: once text reached the
caller, a failure is raised rather than replayed. Failures reach the caller as grpc.RpcError (sync:
a grpc.Call, so `.code()` and `.details()` work; asyncio: grpc.aio.AioRpcError); bad arguments raise
ValueError before any call. This module must not hold serving logic nor validate what the gateway
validates (prompt vs. messages, limits): the gateway answers INVALID_ARGUMENT with the field's name.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any, Self, TypedDict, TypeVar

import grpc

from strata.retry import CallAttempts, RetryPolicy
from strata.rpc import MIB, aio_channel, channel_options, sync_channel
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
    from types import TracebackType

    from typing_extensions import Unpack

    from strata.tls import ClientTlsSettings

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 16 * MIB

ResponseT = TypeVar("ResponseT")


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of generate and generate_stream besides prompt and timeout."""

    messages: Sequence[tuple[str, str] | Mapping[str, str]] | None
    model: str
    max_new_tokens: int
    temperature: float
    top_p: float | None
    top_k: int
    repetition_penalty: float | None
    no_repeat_ngram_size: int
    stop: Sequence[str]
    seed: int | None
    ignore_eos: bool
    request_id: str
    allow_fallback: bool
    truncation: int | str | None


def _chat_message(message: tuple[str, str] | Mapping[str, str]) -> common_pb2.ChatMessage:
    if isinstance(message, tuple) and len(message) == 2:
        return common_pb2.ChatMessage(role=message[0], content=message[1])
    if not isinstance(message, tuple) and "role" in message and "content" in message:
        return common_pb2.ChatMessage(role=message["role"], content=message["content"])
    raise ValueError(
        f"a chat message is a (role, content) tuple or a {{'role', 'content'}} dict, not {message!r}"
    )


def _truncation(value: int | str | None) -> gateway_pb2.Truncation.ValueType:
    if value is None:
        return gateway_pb2.TRUNCATION_UNSPECIFIED
    for name, number in gateway_pb2.Truncation.items():
        short = name.removeprefix("TRUNCATION_")
        if value == number or (isinstance(value, str) and value.upper() in (name, short)):
            return number
    choices = ", ".join(
        name.removeprefix("TRUNCATION_").lower() for name, _ in gateway_pb2.Truncation.items()
    )
    raise ValueError(f"truncation={value!r} is not one of {choices}")


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[tuple[str, str] | Mapping[str, str]] | None = None,
    model: str = "",
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int = 0,
    stop: Sequence[str] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
    allow_fallback: bool = False,
    truncation: int | str | None = None,
) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; None leaves an optional field unset (the server's default).

    `messages` are (role, content) tuples or {"role", "content"} dicts; `truncation` is a
    gateway_pb2.Truncation value or its name ("left", "refuse").
    """
    sampling = common_pb2.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        no_repeat_ngram_size=no_repeat_ngram_size,
        stop=list(stop),
        ignore_eos=ignore_eos,
    )
    if top_p is not None:
        sampling.top_p = top_p
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if seed is not None:
        sampling.seed = seed
    return gateway_pb2.GenerateRequest(
        prompt=prompt or "",
        messages=[_chat_message(message) for message in messages or ()],
        model=model,
        sampling=sampling,
        request_id=request_id,
        allow_fallback=allow_fallback,
        truncation=_truncation(truncation),
    )


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
