"""The gateway's connection to the tokenizer service: its calls, its health, and its tokenizer fingerprints.

One channel serves every call. A health Watch stream (no polling) tracks whether the service is
reachable and serving; the gateway's own readiness depends on it. Fingerprints come from
GetTokenizerInfo, asked again on every worker connect so a restarted tokenizer with other files is
noticed. This module must not batch (tokenize_batcher.py does) nor keep per-request state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import DeadlineExceeded, GatewayError, TokenizerUnavailable, Unavailable, from_rpc_error
from gateway.stage_clock import Call
from strata.rpc import MIB, SERVING, aio_channel, channel_options
from strata.v1 import tokenizer_pb2, tokenizer_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

TOKENIZER_SERVICE = "strata.v1.TokenizerService"
# Tokenize batches carry prompts of up to the client limit each; ids of a long prompt take more bytes.
INTERNAL_MESSAGE_BYTES = 64 * MIB
INITIAL_BACKOFF_S = 0.05


class TokenizerClient:
    """Calls to the tokenizer service with a per-call timeout, and its readiness."""

    def __init__(self, settings: GatewaySettings, on_change: Callable[[], None]) -> None:
        self._settings = settings
        self._timeout = settings.tokenizer_timeout_s
        self._on_change = on_change
        self._channel = aio_channel(
            settings.tokenizer_address, channel_options(INTERNAL_MESSAGE_BYTES), settings.internal_tls
        )
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._watcher: asyncio.Task[None] | None = None
        self.reachable = False
        self.models: dict[str, tokenizer_pb2.TokenizerModel] = {}
        """The last GetTokenizerInfo answer, by model name."""

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch(), name="tokenizer-health")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self._channel.close()

    async def tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, timeout: float | None = None
    ) -> tokenizer_pb2.TokenizeResponse:
        """Tokenize within min(tokenizer_timeout_s, `timeout`): the callers' remaining time bounds it."""
        bound = self._timeout if timeout is None else min(self._timeout, timeout)
        try:
            response: tokenizer_pb2.TokenizeResponse = await self._stub.Tokenize(request, timeout=bound)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and bound < self._timeout:
                raise DeadlineExceeded(
                    f"the request's deadline passed while tokenizing ({bound:.3f} s were left)"
                ) from exc
            raise from_rpc_error(exc, "tokenizer service (Tokenize)") from exc
        return response

    async def detokenize(
        self, entries: list[tokenizer_pb2.DetokenizeEntry]
    ) -> tuple[list[tokenizer_pb2.DetokenizeResult], Call]:
        """One result per entry, and the times of the call; TokenizerUnavailable when it failed, since
        then no worker retry helps (every worker's tokens pass through this service)."""
        started = time.perf_counter()
        try:
            response: tokenizer_pb2.DetokenizeResponse = await self._stub.Detokenize(
                tokenizer_pb2.DetokenizeRequest(entries=entries), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, "tokenizer service (Detokenize)")
            raise TokenizerUnavailable(
                f"the tokenizer service could not detokenize the request's tokens: {error}"
            ) from exc
        if len(response.results) != len(entries):
            raise TokenizerUnavailable(
                "the tokenizer service could not detokenize the request's tokens: tokenizer service "
                f"answered {len(response.results)} results for {len(entries)} entries"
            )
        return list(response.results), Call(started, time.perf_counter(), response.server_ms)

    async def refresh_info(self) -> dict[str, tokenizer_pb2.TokenizerModel]:
        try:
            info: tokenizer_pb2.GetTokenizerInfoResponse = await self._stub.GetTokenizerInfo(
                tokenizer_pb2.GetTokenizerInfoRequest(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "tokenizer service (GetTokenizerInfo)") from exc
        self.models = {model.name: model for model in info.models}
        return self.models

    async def fingerprint(self, model: str) -> str:
        """The tokenizer service's fingerprint for `model`, asked now."""
        models = await self.refresh_info()
        if model not in models:
            raise Unavailable(
                f"the tokenizer service at {self._settings.tokenizer_address} does not serve model "
                f"{model!r} (it serves {', '.join(sorted(models)) or 'nothing'})"
            )
        return models[model].fingerprint

    def _set_reachable(self, reachable: bool) -> None:
        if reachable != self.reachable:
            self.reachable = reachable
            log.info(
                "tokenizer service %s is %s",
                self._settings.tokenizer_address,
                "serving" if reachable else "not serving",
            )
            self._on_change()

    async def _watch(self) -> None:
        backoff = INITIAL_BACKOFF_S
        request = health_pb2.HealthCheckRequest(service=TOKENIZER_SERVICE)
        while True:
            try:
                async for response in self._health.Watch(request):
                    serving = response.status == SERVING
                    if serving:
                        await self.refresh_info()
                        backoff = INITIAL_BACKOFF_S
                    self._set_reachable(serving)
            except grpc.aio.AioRpcError as exc:
                log.debug("tokenizer health watch ended: %s", exc.details())
            except GatewayError as exc:
                log.warning("%s", exc)
            self._set_reachable(False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._settings.reconnect_backoff_max_s)
