"""The worker's engine host: loads the one model, warms it up, and shares it between Connect streams.

It resolves device and dtype from the settings, builds the engine on its step thread (which sizes its
KV cache from the memory budget: the host logs the budget and publishes it in metrics and
GetWorkerInfo), proves it with a one-token generation before declaring itself ready, and owns what
every stream shares: the credits (a request takes one in `accept`, after the one check of its
parameters and id, and gives it back in `finished`), the map from engine request ids to the stream
that owns each, the drain on shutdown, and the grammar compiler of the model's tokenizer (built at
load from the same folder, its fingerprint checked against the one gateways must match). Streams
reach it only through the StreamHost protocol (connection.py).
Each engine step it hands every stream its outputs, then every stream its credits, so no stream
reads credits that another stream's finished requests are about to free. This module must not
speak gRPC (server.py does), build stream messages (connection.py does) nor read the engine into
info, stats and step messages (reports.py does).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from typing import TYPE_CHECKING

import torch

from services.worker.connection import Connection
from services.worker.credits import CreditPool
from services.worker.device_memory import device_memory_bytes
from services.worker.engine.async_engine import AsyncEngine, EngineDeadError
from services.worker.engine.engine import LLMEngine
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.errors import DrainingError, HelloMismatchError, NotReadyError, ProtocolError
from services.worker.metrics import EngineMetrics
from services.worker.model.ranks import RankSpec, load_tensor_parallel
from services.worker.reports import add_engine_info, native_kernels_state, step_info, worker_stats
from services.worker.request_spans import WorkerSpans
from strata.fingerprint import tokenizer_fingerprint
from strata.sampling import InvalidRequestError, SamplingParams
from strata.tracing import Tracing
from strata.v1 import worker_pb2

if TYPE_CHECKING:
    from services.worker.engine.async_engine import StepReport
    from services.worker.engine.engine import EngineStats
    from services.worker.engine.grammar_matcher import GrammarMatcher
    from services.worker.engine.sequence import StepOutput
    from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_ID = "worker-warmup"


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


def resolve_device(setting: str) -> str:
    """auto: the first CUDA device when torch sees one, else the CPU."""
    if setting == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if setting == "cuda" else setting


def resolve_dtype(setting: str, device: str) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on the CPU (CPU bf16 matmuls are slow)."""
    if setting == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[setting]


def rank_spec(settings: WorkerSettings) -> RankSpec:
    """What each of the worker's tensor-parallel ranks loads, from the worker's settings."""
    device = resolve_device(settings.device)
    return RankSpec(
        model_path=settings.model_path,
        device=device,
        dtype=resolve_dtype(settings.dtype, device),
        kv_cache_dtype=settings.engine.kv_cache_dtype,
        size=settings.tensor_parallel_size,
        timeout_s=settings.tensor_parallel_timeout_s,
        start_timeout_s=settings.tensor_parallel_start_timeout_s,
        threads=settings.threads,
    )


class WorkerHost:
    """One engine and everything its streams share. Used from the event loop only."""

    def __init__(self, settings: WorkerSettings, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.credits = CreditPool(settings.credit_limit)
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.spans = WorkerSpans(tracing or Tracing.off(), settings.model_name)
        self.metrics = EngineMetrics(settings.model_name, self.device, self._snapshot)
        self.engine = AsyncEngine(self._build)
        self.fingerprint = ""
        self.grammars: GrammarCompiler | None = None
        """None until loaded, or when the model folder has no tokenizer.json (constraints refused)."""
        self.state = State.LOADING
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        self.failed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._streams = itertools.count(1)
        self._connections: set[Connection] = set()
        self._owners: dict[str, Connection] = {}
        """The stream that owns each accepted request, by engine id."""
        self.last_step: worker_pb2.StepInfo | None = None
        """The engine's latest step as streams report it; a new stream's hello carries it."""
        self.native_kernels = ""
        """The native CPU kernels' state once loaded: "on (avx512)", "off (why)", "not used (...)"."""

    def _build(self) -> LLMEngine:
        # On the step thread, which runs every forward pass, so its OpenMP team gets the setting.
        if self.settings.threads is not None:
            torch.set_num_threads(self.settings.threads)
        quantization = None if self.settings.quantization == "none" else self.settings.quantization
        if self.settings.tensor_parallel_size > 1:
            return self._build_tensor_parallel()
        engine = LLMEngine.from_model_dir(
            self.settings.model_path,
            self.settings.engine,
            device=self.device,
            dtype=self.dtype,
            quantization=quantization,
        )
        for name, path in self.settings.adapters.items():
            engine.load_adapter(name, path)
        return engine

    def _build_tensor_parallel(self) -> LLMEngine:
        loaded = load_tensor_parallel(rank_spec(self.settings))
        try:
            return LLMEngine(loaded, self.settings.engine)
        except BaseException:
            loaded.model.close()
            raise

    async def load(self) -> None:
        """Fingerprint the tokenizer, load the model, warm it up; raise what failed (and stay FAILED)."""
        try:
            self.fingerprint = await asyncio.to_thread(tokenizer_fingerprint, self.settings.model_path)
            await self.engine.start()
            budget = self.engine.engine.memory
            log.info("%s", budget.describe())
            self.metrics.set_memory(budget)
            self.grammars = await asyncio.to_thread(self._build_grammars)
            self.engine.add_step_listener(self._on_step, self._on_failure)
            await self._warm_up()
            self.native_kernels = native_kernels_state(self.device, self.engine.engine)
            self.metrics.set_native_kernels(self.native_kernels)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)
            raise
        if self.state is State.LOADING:
            self.state = State.READY
            self.ready.set()

    def _build_grammars(self) -> GrammarCompiler | None:
        path = self.settings.model_path
        if not (path / "tokenizer.json").is_file():
            log.warning("%s has no tokenizer.json: requests with an output constraint are refused", path)
            return None
        config = self.engine.engine.model_config
        compiler = GrammarCompiler.from_model_dir(
            path,
            config.eos_token_ids,
            config.vocab_size,
            timeout_s=self.settings.grammar_compile_timeout_s,
            cache_size=self.settings.grammar_cache_size,
        )
        if compiler.fingerprint != self.fingerprint:
            raise RuntimeError(
                f"the grammar tokenizer read from {path} has fingerprint {compiler.fingerprint}, the "
                f"worker advertises {self.fingerprint}: the folder changed while loading; restart"
            )
        return compiler

    def grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            raise InvalidRequestError(
                "sampling.constraint",
                "<set>",
                f"this worker's model folder {self.settings.model_path} has no tokenizer.json, which "
                "structured output needs; send the request without a constraint",
            )
        return self.grammars

    async def _warm_up(self) -> None:
        """One real one-token generation: the first forward pass allocates and compiles what it needs."""
        engine = self.engine.engine
        length = max(1, min(4, engine.max_model_len - 1))
        prompt = [min(i + 1, engine.model_config.vocab_size - 1) for i in range(length)]
        tokens: list[int] = []
        async for out in self.engine.submit(WARMUP_ID, prompt, SamplingParams(max_new_tokens=1)):
            tokens.extend(out.new_token_ids)
        if len(tokens) != 1:
            raise EngineDeadError(f"the warm-up generation returned {len(tokens)} tokens instead of 1")

    def _fail(self, error: BaseException) -> None:
        if self.state is State.FAILED:
            return
        self.state = State.FAILED
        self.error = error
        self.failed.set()

    async def close(self) -> None:
        """Stop the engine's step loop (after drain)."""
        await self.engine.stop()
        if self.grammars is not None:
            self.grammars.close()

    def check_accepting(self) -> None:
        """Raise unless new streams and submissions can be served now."""
        if self.state is State.LOADING:
            raise NotReadyError("the worker is still loading its model; retry once its health is SERVING")
        if self.state is State.DRAINING:
            raise DrainingError("the worker is shutting down; send new requests to another worker")
        if self.state is State.FAILED:
            raise EngineDeadError(f"the worker's engine failed: {self.error!r}")

    def connect(self, first: worker_pb2.ConnectRequest) -> Connection:
        """A new stream after checking its hello, or raise why it is refused."""
        self.check_accepting()
        if not first.HasField("hello"):
            raise ProtocolError("the first ConnectRequest must carry hello (model and tokenizer fingerprint)")
        hello = first.hello
        if hello.model != self.settings.model_name:
            raise HelloMismatchError(
                f"this worker serves model '{self.settings.model_name}' but the gateway connected for "
                f"model '{hello.model}': route '{hello.model}' to a worker that serves it, or fix the "
                "gateway's or the worker's model_name"
            )
        if hello.tokenizer_fingerprint != self.fingerprint:
            raise HelloMismatchError(
                f"tokenizer fingerprint mismatch for model '{hello.model}': the gateway tokenizes with "
                f"{hello.tokenizer_fingerprint or '<empty>'}, this worker's folder "
                f"{self.settings.model_path} has {self.fingerprint}; point the tokenizer service and the "
                "worker at the same model folder"
            )
        connection = Connection(
            self,
            next(self._streams),
            hello.client_name,
            model=self.settings.model_name,
            max_submissions=self.settings.max_submissions_per_message,
        )
        self._connections.add(connection)
        return connection

    def disconnect(self, connection: Connection) -> None:
        self._connections.discard(connection)

    def accept(
        self,
        engine_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        owner: Connection,
        cache_salt: str = "",
        grammar: GrammarMatcher | None = None,
        itl_slo_s: float | None = None,
        adapter: str = "",
    ) -> None:
        """Check the request once, take a credit for `owner`, queue it on the engine.

        Raises NotReadyError, DrainingError or EngineDeadError when nothing runs now, InvalidRequestError
        for bad input or an id already running (before any credit is taken: a bad request is
        INVALID_ARGUMENT even on a full worker), UnknownAdapterError for an adapter not served here,
        NoCreditError when no credit is left.
        """
        self.check_accepting()
        self.engine.check(engine_id, prompt, params, adapter)
        self.credits.acquire()
        self._owners[engine_id] = owner
        self._idle.clear()
        self.engine.add_request(engine_id, prompt, params, priority, cache_salt, grammar, itl_slo_s, adapter)

    def abort(self, engine_id: str) -> None:
        """Abort an accepted request in the engine (its KV blocks are free before the next step)."""
        self.engine.abort(engine_id)

    def finished(self, engine_id: str) -> None:
        """An accepted request ended: give its credit back."""
        if self._owners.pop(engine_id, None) is None:
            return
        self.credits.release()
        if self.credits.open == 0:
            self._idle.set()

    def credits_message(self) -> worker_pb2.Credits:
        with contextlib.suppress(EngineDeadError):
            return worker_pb2.Credits(
                requests=self.credits.available, kv_tokens=self.engine.stats().free_kv_tokens
            )
        return worker_pb2.Credits(requests=self.credits.available)

    def _snapshot(self) -> EngineStats | None:
        try:
            return self.engine.stats()
        except EngineDeadError:  # not built yet
            return None

    def device_memory_bytes(self) -> int:
        return device_memory_bytes(self.device)

    def _on_step(self, report: StepReport) -> None:
        self.metrics.on_step(report)
        self.spans.step(report)
        owned: dict[Connection, list[StepOutput]] = {}
        for out in report.outputs:
            connection = self._owners.get(out.request_id)
            if connection is not None:
                owned.setdefault(connection, []).append(out)
        updates = {conn: conn.collect(outs, report) for conn, outs in owned.items()}
        step = self.last_step = step_info(report)
        for connection in list(self._connections):
            connection.send(updates.get(connection, []), step)

    def _on_failure(self, request_id: str | None, error: BaseException) -> None:
        if request_id is None:
            if self.state in (State.LOADING, State.READY):  # not a stop we asked for
                log.error("the engine's step loop ended: %r", error)
                self._fail(error)
            return
        connection = self._owners.get(request_id)
        if connection is not None:
            connection.fail(request_id, error)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let open requests finish for up to timeout_s, abort the rest, end streams."""
        if self.state is not State.FAILED:
            self.state = State.DRAINING
        if self.credits.open:
            log.info("draining %d open requests (up to %.1f s)", self.credits.open, timeout_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
        if self.credits.open:
            log.warning("drain timed out: aborting %d open requests", self.credits.open)
        for connection in list(self._connections):
            connection.abort_all()
        for connection in list(self._connections):
            connection.end()

    def info(self) -> worker_pb2.GetWorkerInfoResponse:
        """What this worker serves; limits from the engine once it is built."""
        info = worker_pb2.GetWorkerInfoResponse(
            model=self.settings.model_name,
            tokenizer_fingerprint=self.fingerprint,
            max_requests=self.credits.limit,
            device=self.device,
            dtype=str(self.dtype).removeprefix("torch."),
            native_kernels=self.native_kernels,
        )
        add_engine_info(info, self.engine)
        return info

    def stats(self) -> worker_pb2.GetWorkerStatsResponse:
        """The engine's snapshot after its last step, plus the streams' open requests."""
        return worker_stats(self.credits.open, self.engine)
