"""Routes driven directly (no gateway servicer): discovery by DNS, a frozen worker process noticed by
keepalive, and the queue's exits (a cancelled caller, the last worker going away).

Each test runs one event loop holding a real tokenizer service, a real Router with its worker links,
and real workers: in-process, or a `python -m services.worker` subprocess for SIGSTOP.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gateway.admission import Ticket
from gateway.attempt import Attempt
from gateway.credits import Slot
from gateway.discovery import resolve
from gateway.errors import Unavailable
from gateway.request import Request
from gateway.request_trace import RequestTrace
from gateway.request_values import Incoming
from gateway.router import Router
from gateway.settings import GatewaySettings
from gateway.tenant_settings import DEFAULT_TENANT
from gateway.tokenizer_client import TokenizerClient
from gateway.validation import ValidRequest
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from strata.tracing import Tracing
from strata.v1 import common_pb2, gateway_pb2, worker_pb2
from tests.integration.admission_harness import MODELS, WAIT_S, engine_config, set_step_delay, worker_settings
from tests.integration.worker_harness import worker_process
from tests.polling import seconds_until_async, wait_for_async
from tests.route_defaults import NO_SLO_ROUTE

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.route import Route
    from services.worker.server import WorkerServer

REPO = Path(__file__).resolve().parents[2]


class Scene:
    """A tokenizer service, workers, and one Router over them, on the running loop; the route starts from
    NO_SLO_ROUTE (tests/route_defaults.py: nothing refused for the machine's speed)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.servers: list[Any] = []
        self.tokenizer_address = ""
        self.closers: list[Any] = []

    async def start(self) -> None:
        settings = TokenizerSettings.build(
            {"listen": "127.0.0.1:0", "models": dict.fromkeys(MODELS, self.model_dir)}
        )
        tokenizer = await start_tokenizer(settings)
        self.servers.append(tokenizer)
        self.tokenizer_address = tokenizer.address

    async def worker(self, model: str, max_requests: int = 4) -> WorkerServer:
        settings = worker_settings(self.model_dir, model, max_requests)
        server = await start_worker(settings)
        await asyncio.wait_for(server.wait_ready(), WAIT_S)
        self.servers.append(server)
        return server

    async def router(self, route: dict[str, Any], resolver: Callable[..., Any] = resolve) -> Router:
        settings = GatewaySettings.build(
            {
                "tokenizer_address": self.tokenizer_address,
                "routes": [{**NO_SLO_ROUTE, **route}],
                "reconnect_backoff_max_s": 0.5,
            }
        )
        client = TokenizerClient(settings, lambda: None)
        client.start()
        router = Router(settings, client, lambda: None, resolver)
        router.start()
        self.closers.extend([router.close, client.close])
        return router

    async def close(self) -> None:
        for close in self.closers:
            await close()
        for server in reversed(self.servers):
            await server.stop(0)


def ticket(name: str, deadline: float | None = None) -> Ticket:
    return Ticket(request_id=name, prompt_tokens=3, max_new_tokens=4, deadline=deadline)


def request_of(route: Route, name: str, new_tokens: int) -> Request:
    """A request of three prompt ids for `route`, as the pipeline makes one after tokenizing."""
    incoming = Incoming(gateway_pb2.GenerateRequest(prompt="x", request_id=name))
    sampling = common_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    valid = ValidRequest(incoming.request, route.name, name, sampling)
    arrival = time.perf_counter()
    request = Request(incoming, valid, route, RequestTrace(Tracing.off(), incoming, arrival), arrival)
    request.prompt_ids = [5, 6, 7]
    return request


async def generate(route: Route, name: str, new_tokens: int = 4) -> list[int]:
    """Place, send and collect one request's tokens, as the pipeline's attempt does."""
    request = request_of(route, name, new_tokens)
    with Attempt.place(request, route, None, 0) as attempt:
        request.sent_to(route, None)
        attempt.send(await attempt.granted())
        return await collect(request)


async def collect(request: Request) -> list[int]:
    tokens: list[int] = []
    while True:
        for delta in await asyncio.wait_for(request.sink.next_deltas(), WAIT_S):
            if delta.error is not None:
                raise delta.error
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                return tokens


def test_a_dns_route_resolves_localhost_and_follows_its_changes(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        scene = Scene(tiny_serving_dir)
        await scene.start()
        try:
            first, second = await scene.worker("dns"), await scene.worker("dns")
            port = first.address.rsplit(":", 1)[1]
            # The real resolver: localhost's answers collapse to distinct host:port addresses.
            addresses = await resolve("localhost", int(port))
            assert f"127.0.0.1:{port}" in addresses and len(set(addresses)) == len(addresses)
            real = (
                await scene.router({"model": "dns", "dns": f"localhost:{port}", "dns_refresh_s": 0.1})
            ).route("dns")
            await wait_for_async(real.available, 30, "the worker behind localhost is ready")
            assert len(await generate(real, "via-localhost")) == 4
            # A changing answer: the zone a headless service's DNS would serve.
            zone = [first.address]

            async def zone_resolver(host: str, port: int) -> list[str]:
                assert (host, port) == ("workers.test", 50053)
                return list(zone)

            route = (
                await scene.router(
                    {"model": "dns", "dns": "workers.test:50053", "dns_refresh_s": 0.1}, zone_resolver
                )
            ).route("dns")
            await wait_for_async(route.available, 30, "the first replica is ready")
            assert [link.address for link in route.links] == [first.address]
            zone.append(second.address)
            await wait_for_async(
                lambda: sum(link.ready for link in route.links) == 2, 30, "the added replica is ready"
            )
            results = await asyncio.gather(*(generate(route, f"r{i}") for i in range(16)))
            assert all(len(tokens) == 4 for tokens in results)
            assert all(link.submitted > 0 for link in route.links)
            # The first replica leaves the zone while a request runs on it: it finishes, then the link closes.
            set_step_delay(first, 0.05)
            leaving = next(link for link in route.links if link.address == first.address)
            running = asyncio.ensure_future(generate_on(route, leaving, "last-one", 30))
            await wait_for_async(
                lambda: leaving.open_requests == 1, 10, "a request runs on the leaving replica"
            )
            zone.remove(first.address)
            await wait_for_async(lambda: leaving.leaving, 10, "the vanished replica takes no new requests")
            assert len(await running) == 30
            await wait_for_async(
                lambda: [link.address for link in route.links] == [second.address], 10, "the link closed"
            )
            assert not leaving.ready
        finally:
            await scene.close()

    asyncio.run(main())


async def generate_on(route: Route, link: Any, name: str, new_tokens: int) -> list[int]:
    """A request submitted straight to one link: its slot granted there, bypassing the dispatcher."""
    request = request_of(route, name, new_tokens)
    slot: Slot[Any] = Slot(ticket(name))
    slot.grant(link)
    try:
        sampling = common_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        submission = worker_pb2.Submission(
            request_id=f"{name}#direct", prompt_ids=[5, 6, 7], sampling=sampling
        )
        link.submit(slot, submission, request.sink)
        return await collect(request)
    finally:
        route.release(slot)


def test_a_cancelled_caller_leaves_the_queue_and_a_lost_worker_fails_the_waiting(
    tiny_serving_dir: Path,
) -> None:
    async def main() -> None:
        scene = Scene(tiny_serving_dir)
        await scene.start()
        try:
            worker = await scene.worker("cancel", max_requests=1)
            route = (
                await scene.router({"model": "cancel", "workers": [worker.address], "ttft_slo_ms": 0})
            ).route("cancel")
            await wait_for_async(route.available, 30, "the worker is ready")
            set_step_delay(worker, 0.05)
            running = asyncio.ensure_future(generate(route, "running", 60))
            taken = "the only credit is taken"
            await wait_for_async(lambda: route.free_credits(DEFAULT_TENANT) == 0, 10, taken)
            waiting = asyncio.ensure_future(generate(route, "waiting"))
            cancelled = asyncio.ensure_future(generate(route, "cancelled"))
            await wait_for_async(lambda: route.queued_requests == 2, 10, "two requests wait")
            cancelled.cancel()
            await wait_for_async(
                lambda: route.queued_requests == 1, 10, "the cancelled request left the queue"
            )
            await worker.running.server.stop(0)  # the worker goes away, abruptly
            with pytest.raises(Unavailable, match=worker.address):
                await asyncio.wait_for(waiting, WAIT_S)
            with pytest.raises(Unavailable):
                await asyncio.wait_for(running, WAIT_S)
            assert route.queued_requests == 0
            with pytest.raises(Unavailable, match="no worker is ready"):
                route.enqueue(ticket("late"))
        finally:
            await scene.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_frozen_worker_is_noticed_within_seconds_and_comes_back(
    tiny_serving_dir: Path, tmp_path: Path
) -> None:
    worker = {
        "model_name": "stop",
        "model_path": str(tiny_serving_dir),
        "device": "cpu",
        "threads": 1,
        "engine": engine_config(4),
    }
    process, announce = worker_process(worker, tmp_path)

    async def main() -> tuple[float, float]:
        scene = Scene(tiny_serving_dir)
        await scene.start()
        try:
            await wait_for_async(
                lambda: announce.exists() or process.poll() is not None, WAIT_S, "the worker announced"
            )
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            address = announce.read_text().strip()
            route = (await scene.router({"model": "stop", "workers": [address]})).route("stop")
            await wait_for_async(route.available, WAIT_S, "the worker process is ready")
            assert len(await generate(route, "before")) == 4
            (link,) = route.links
            process.send_signal(signal.SIGSTOP)
            noticed = await seconds_until_async(lambda: not link.ready, 10, "the frozen worker is noticed")
            with pytest.raises(Unavailable, match=address):
                route.enqueue(ticket("while-frozen"))
            process.send_signal(signal.SIGCONT)
            back = await seconds_until_async(route.available, 30, "the worker is back")
            assert len(await generate(route, "after")) == 4
            return noticed, back
        finally:
            await scene.close()

    try:
        noticed, back = asyncio.run(main())
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        process.wait(30)
    print(f"frozen worker noticed after {noticed:.2f} s; back {back:.2f} s after SIGCONT")
    # Expected about 2 s (a ping every second, one second to answer it); the bound is 5x that.
    assert noticed < 10.0
