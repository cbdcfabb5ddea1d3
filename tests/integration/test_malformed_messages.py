"""Bytes that are not a valid request message get INVALID_ARGUMENT naming the expected type, on every
service and every kind of method, and the server goes on serving: grpcio alone would answer INTERNAL.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import pytest

from strata.v1 import gateway_pb2, tokenizer_pb2
from tests.integration.tiny_stack import tiny_stack

if TYPE_CHECKING:
    from pathlib import Path

# A field 1 (length-delimited) whose length runs past the end, then a truncated varint.
GARBAGE = (b"\x0a\xff\xff\xff\x0f\x01", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")


async def _unary(address: str, method: str, payload: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(method)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(payload, timeout=10)
    return error.value


def test_every_kind_of_method_refuses_garbage_and_keeps_serving(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        async with tiny_stack(tiny_serving_dir) as stack:
            await _check(stack.tokenizer.address, stack.worker.address, stack.gateway.address)

    asyncio.run(main())


async def _check(tokenizer: str, worker: str, gateway: str) -> None:
    """Garbage to every kind of method, then a good call to each service."""
    for payload in GARBAGE:
        for address, method, expected in [
            (gateway, "/strata.v1.Gateway/Generate", "strata.v1.GenerateRequest"),
            (tokenizer, "/strata.v1.TokenizerService/Tokenize", "strata.v1.TokenizeRequest"),
        ]:
            error = await _unary(address, method, payload)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert f"not a valid {expected} message" in (error.details() or "")
        async with grpc.aio.insecure_channel(gateway) as channel:
            stream = channel.unary_stream("/strata.v1.Gateway/GenerateStream")(payload, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await stream.read()
            assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        async with grpc.aio.insecure_channel(worker) as channel:
            connect = channel.stream_stream("/strata.v1.WorkerService/Connect")(timeout=10)
            await connect.write(payload)
            with pytest.raises(grpc.aio.AioRpcError) as connected:
                await connect.read()
            assert connected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "strata.v1.ConnectRequest" in (connected.value.details() or "")
    # Still serving, all three.
    async with grpc.aio.insecure_channel(gateway) as channel:
        reply = await channel.unary_unary(
            "/strata.v1.Gateway/Generate",
            request_serializer=gateway_pb2.GenerateRequest.SerializeToString,
            response_deserializer=gateway_pb2.GenerateResponse.FromString,
        )(gateway_pb2.GenerateRequest(model="tiny", prompt="hello"), timeout=30)
    assert reply.usage.output_tokens > 0
    async with grpc.aio.insecure_channel(tokenizer) as channel:
        info = await channel.unary_unary(
            "/strata.v1.TokenizerService/GetTokenizerInfo",
            request_serializer=tokenizer_pb2.GetTokenizerInfoRequest.SerializeToString,
            response_deserializer=tokenizer_pb2.GetTokenizerInfoResponse.FromString,
        )(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=10)
    assert [model.name for model in info.models] == ["tiny"]
