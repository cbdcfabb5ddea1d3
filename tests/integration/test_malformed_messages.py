"""Bytes that are not a valid request message get INVALID_ARGUMENT naming the expected type, on every
service and every kind of method, and the server goes on serving: grpcio alone would answer INTERNAL.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import pytest

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata.v1 import gateway_pb2, tokenizer_pb2

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
        tokenizer = await start_tokenizer(
            TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {"tiny": tiny_serving_dir}})
        )
        worker = await start_worker(
            WorkerSettings.build(
                {
                    "listen": "127.0.0.1:0",
                    "model_name": "tiny",
                    "model_path": tiny_serving_dir,
                    "device": "cpu",
                    "threads": 1,
                }
            )
        )
        await worker.wait_ready()
        gateway = await start_gateway(
            GatewaySettings.build(
                {
                    "listen": "127.0.0.1:0",
                    "tokenizer_address": tokenizer.address,
                    "routes": [{"model": "tiny", "workers": [worker.address]}],
                }
            )
        )
        await gateway.wait_ready(30)
        try:
            for payload in GARBAGE:
                for address, method, expected in [
                    (gateway.address, "/strata.v1.Gateway/Generate", "strata.v1.GenerateRequest"),
                    (tokenizer.address, "/strata.v1.TokenizerService/Tokenize", "strata.v1.TokenizeRequest"),
                ]:
                    error = await _unary(address, method, payload)
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
                    assert f"not a valid {expected} message" in (error.details() or "")
                async with grpc.aio.insecure_channel(gateway.address) as channel:
                    stream = channel.unary_stream("/strata.v1.Gateway/GenerateStream")(payload, timeout=10)
                    with pytest.raises(grpc.aio.AioRpcError) as streamed:
                        await stream.read()
                    assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                async with grpc.aio.insecure_channel(worker.address) as channel:
                    connect = channel.stream_stream("/strata.v1.WorkerService/Connect")(timeout=10)
                    await connect.write(payload)
                    with pytest.raises(grpc.aio.AioRpcError) as connected:
                        await connect.read()
                    assert connected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "strata.v1.ConnectRequest" in (connected.value.details() or "")
            # Still serving, all three.
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                reply = await channel.unary_unary(
                    "/strata.v1.Gateway/Generate",
                    request_serializer=gateway_pb2.GenerateRequest.SerializeToString,
                    response_deserializer=gateway_pb2.GenerateResponse.FromString,
                )(gateway_pb2.GenerateRequest(model="tiny", prompt="hello"), timeout=30)
            assert reply.usage.output_tokens > 0
            async with grpc.aio.insecure_channel(tokenizer.address) as channel:
                info = await channel.unary_unary(
                    "/strata.v1.TokenizerService/GetTokenizerInfo",
                    request_serializer=tokenizer_pb2.GetTokenizerInfoRequest.SerializeToString,
                    response_deserializer=tokenizer_pb2.GetTokenizerInfoResponse.FromString,
                )(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=10)
            assert [model.name for model in info.models] == ["tiny"]
        finally:
            await gateway.stop(0)
            await worker.stop(grace=0)
            await tokenizer.stop(grace=0)

    asyncio.run(main())
