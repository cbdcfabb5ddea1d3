"""Registers a servicer so that bytes which are not a valid request message get INVALID_ARGUMENT.

grpcio answers a request its generated deserializer cannot parse with INTERNAL ("Exception
deserializing request"), which tells the caller the server is broken. `add_servicer` builds the
service's handlers from its protobuf descriptor instead, with a deserializer that turns a
DecodeError into a Malformed value; the handler answers that with INVALID_ARGUMENT and a message
naming the expected type, before the servicer sees anything. Streaming requests are checked message
by message. This module must not know any service: it works from descriptors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
    from google.protobuf.message import Message


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request whose bytes did not parse as the method's input type."""

    error: str


def _parser(message_class: type[Message]) -> Callable[[bytes], Message | Malformed]:
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | Malformed:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Malformed(f"the request is not a valid {name} message ({len(data)} bytes): {exc}")

    return parse


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], malformed: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed.error)


def _handler(method: MethodDescriptor, behavior: Any) -> grpc.RpcMethodHandler:
    parse = _parser(message_factory.GetMessageClass(method.input_type))
    serialize = message_factory.GetMessageClass(method.output_type).SerializeToString

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async for request in requests:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            yield request

    if not method.client_streaming and not method.server_streaming:

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
    if not method.client_streaming and inspect.isasyncgenfunction(behavior):

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, serialize)
    if not method.client_streaming:  # a coroutine that writes through context.write

        async def unary_stream_writer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            await behavior(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_stream_writer, parse, serialize)
    if method.server_streaming:

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async for response in behavior(checked(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, parse, serialize)

    async def stream_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behavior(checked(requests, context), context)

    return grpc.stream_unary_rpc_method_handler(stream_unary, parse, serialize)


def add_servicer(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Serve every method of `service` from `servicer`'s method of the same name, parsed strictly."""
    handlers = {method.name: _handler(method, getattr(servicer, method.name)) for method in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
