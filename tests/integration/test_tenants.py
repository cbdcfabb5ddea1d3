"""Tenants end to end: the real tokenizer service, a real worker and the gateway, in-process, clients
naming their tenant by API key.

A burst from one tenant does not hold another's trickle behind it (and does, first come first served,
with fair queuing off), neither in the gateway's queue nor in the worker's, which prefills a tenant
below its share first; quota refusals carry a QuotaFailure, and unused tokens come back when a
request ends; a tenant's priority ceiling; random keys never reach a metric label; the gateway salts
the worker's prefix cache with the tenant, so one tenant's repeat of a prompt is served from cache
and another tenant's same prompt is not. Requests that must stay running slow each engine step with
the worker's test-only step delay.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import REGISTRY

from services.worker.engine.config import EngineConfig
from strata.status import STATUS_DETAILS_KEY
from strata.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.admission_harness import WAIT_S, Stack, request
from tests.polling import wait_for, wait_for_async

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

TENANTS: list[dict[str, Any]] = [
    {"name": "noisy", "api_keys": ["k-noisy"]},
    {"name": "quiet", "api_keys": ["k-quiet"]},
    {"name": "metered", "api_keys": ["k-metered"], "tokens_per_minute": 120},
    {"name": "batchy", "api_keys": ["k-batchy"], "max_priority": "batch"},
]


def key(name: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer k-{name}"),)


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path) -> Iterator[Stack]:
    with Stack(tiny_serving_dir) as built:
        yield built


def finish_order(stack: Stack, model: str, fair: bool, *, inside_worker: bool = False) -> list[str]:
    """A burst of noisy requests, then quiet ones while the burst waits: the finish order. The burst
    waits in the gateway's queue (12 noisy on 2 credits, then 3 quiet), or with `inside_worker`, in
    the worker's own waiting line (8 noisy on a worker holding 16 and running 2, then 1 quiet)."""
    if inside_worker:
        worker = stack.start_worker(model, max_requests=16, max_running=2, step_delay_s=0.05)
    else:
        worker = stack.start_worker(model, max_requests=2, step_delay_s=0.05)
    gateway = stack.start_gateway(
        {"model": model, "workers": [worker.address], "ttft_slo_ms": 0}, tenants=TENANTS, fair_queuing=fair
    )
    route = gateway.router.route(model)
    order: list[str] = []

    def burst_waits() -> bool:
        return worker.host.stats().waiting >= 6 if inside_worker else route.queued_requests >= 10

    async def main() -> None:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def one(tenant: str, name: str) -> None:
                await stub.Generate(request(model, name, 8), metadata=key(tenant), timeout=120)
                order.append(name)

            noisy = [
                asyncio.create_task(one("noisy", f"noisy {i}")) for i in range(8 if inside_worker else 12)
            ]
            await wait_for_async(burst_waits, WAIT_S, "the noisy burst waiting")
            quiet = []
            for i in range(1 if inside_worker else 3):
                quiet.append(asyncio.create_task(one("quiet", f"quiet {i}")))
                # The trickle's shape, not a wait for anything: quiet requests arrive one at a time.
                await asyncio.sleep(0.05)
            await asyncio.gather(*noisy, *quiet)

    asyncio.run(main())
    return order


@pytest.mark.slow
def test_a_burst_from_one_tenant_does_not_hold_anothers_trickle_behind_it(stack: Stack) -> None:
    fair = finish_order(stack, "fair", fair=True)
    # Each quiet request waits at most behind one noisy request's turn, never behind the burst.
    assert max(fair.index(f"quiet {i}") for i in range(3)) < 8, fair
    fifo = finish_order(stack, "fifo", fair=False)
    assert min(fifo.index(f"quiet {i}") for i in range(3)) >= 12, fifo  # all behind the burst


@pytest.mark.slow
def test_the_worker_prefills_a_tenant_below_its_share_before_a_flood_already_waiting_there(
    stack: Stack,
) -> None:
    """The quiet request is sent favoured (worker priority 1) and takes the first running slot that
    frees; first come, first served, it waits behind every noisy request already on the worker."""
    fair = finish_order(stack, "worker-fair", fair=True, inside_worker=True)
    assert fair.index("quiet 0") <= 3, fair
    fifo = finish_order(stack, "worker-fifo", fair=False, inside_worker=True)
    assert fifo.index("quiet 0") == 8, fifo


def flood_then_one(
    stack: Stack, model: str, reserve_share: float, quiet_prompt: str = "quiet"
) -> tuple[list[str], int]:
    """A noisy flood of long requests that holds every running slot of the worker and every credit
    the gateway lets it take, then one quiet request of 4 tokens: the finish order, and how many
    sequences the worker preempted by then."""
    worker = stack.start_worker(model, max_requests=16, max_running=4, step_delay_s=0.02)
    gateway = stack.start_gateway(
        {"model": model, "workers": [worker.address], "ttft_slo_ms": 0, "fair_reserve_share": reserve_share},
        tenants=TENANTS,
    )
    route = gateway.router.route(model)
    order: list[str] = []
    preempted: list[int] = []

    async def main() -> None:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def one(tenant: str, name: str, tokens: int) -> None:
                await stub.Generate(request(model, name, tokens), metadata=key(tenant), timeout=300)
                name = "quiet" if tenant == "quiet" else name
                order.append(name)
                if name == "quiet":
                    preempted.append(worker.host.stats().preemptions)

            noisy = [asyncio.create_task(one("noisy", f"noisy {i}", 150)) for i in range(20)]
            await wait_for_async(
                lambda: route.queued_requests >= 4 and worker.host.stats().running == 4,
                WAIT_S,
                "the flood running in every slot and filling the credits",
            )
            await one("quiet", quiet_prompt, 4)
            await asyncio.gather(*noisy)

    asyncio.run(main())
    return order, preempted[0]


@pytest.mark.slow
def test_a_flood_holding_every_running_slot_leaves_room_for_another_tenants_request(stack: Stack) -> None:
    """With a quarter of the worker's credits reserved for tenants below their share, the quiet
    request reaches the worker while the flood waits in the gateway's queue, and the worker preempts a
    flooding sequence for it: it ends first. With no reserve it waits for a flooding request to end."""
    order, preempted = flood_then_one(stack, "reserve", 0.25)
    assert order[0] == "quiet", order
    assert preempted >= 1
    # A prompt costing more than a flood request sorts behind the flood's head in the fair queue: the
    # head may not take the reserve, so the quiet request takes it past the head.
    order, _ = flood_then_one(stack, "reserve-long", 0.25, quiet_prompt="q" * 200)
    assert order[0] == "quiet", order
    order, _ = flood_then_one(stack, "no-reserve", 0.0)
    assert order.index("quiet") >= 1, order


def test_quota_refusals_name_the_limit_and_unused_tokens_come_back(stack: Stack) -> None:
    worker = stack.start_worker("quota", max_requests=4)
    gateway = stack.start_gateway({"model": "quota", "workers": [worker.address]}, tenants=TENANTS)
    stub = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))

    def tokens_left() -> int:
        (status,) = [
            t
            for t in stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=key("quiet")).tenants
            if t.name == "metered"
        ]
        return int(status.tokens_left)

    assert tokens_left() == 120
    # Reserved at admission: the prompt's upper bound (bytes + template overhead) plus max_new_tokens.
    answer = stub.Generate(request("quota", "hi", 4), metadata=key("metered"), timeout=60)
    used = answer.usage.input_tokens + answer.usage.output_tokens
    left = tokens_left()
    assert 120 - used <= left <= 120  # what it reserved beyond what it used came back (plus refill)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request("quota", "hi", 110), metadata=key("metered"), timeout=60)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_minute=120" in (error.details() or "")
    status = status_pb2.Status.FromString(dict(error.trailing_metadata() or ())[STATUS_DETAILS_KEY])
    failure, retry = error_details_pb2.QuotaFailure(), error_details_pb2.RetryInfo()
    kinds = [(detail.Unpack(failure), detail.Unpack(retry)) for detail in status.details]
    assert any(f for f, _ in kinds) and any(r for _, r in kinds)
    assert failure.violations[0].subject == "tenant:metered"
    assert retry.retry_delay.ToTimedelta().total_seconds() > 0
    # Other tenants are not held to its quota.
    assert stub.Generate(request("quota", "hi", 110), metadata=key("quiet"), timeout=60).usage.output_tokens
    # The operator's view: each tenant's weight, running and queued requests, and what is left.
    listed = subprocess.run(
        [sys.executable, "-m", "strata.cli", "models", "--address", gateway.address, "--api-key", "k-quiet"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    (line,) = [row for row in listed.splitlines() if row.startswith("metered")]
    assert "tokens/min left" in line and "/120" in line, listed
    wait_for(lambda: stack.worker_stats(worker).used_kv_blocks == 0, 30, "the worker freed every KV block")


def test_a_tenants_priority_ceiling_and_random_keys_never_make_labels(stack: Stack) -> None:
    worker = stack.start_worker("ceiling", max_requests=4)
    gateway = stack.start_gateway({"model": "ceiling", "workers": [worker.address]}, tenants=TENANTS)
    stub = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))
    batch = request("ceiling", "hi", 2, priority=gateway_pb2.PRIORITY_BATCH)
    assert stub.Generate(batch, metadata=key("batchy"), timeout=60).usage.output_tokens == 2
    assert stub.Generate(request("ceiling", "hi", 2), metadata=key("batchy"), timeout=60).usage.output_tokens
    interactive = request("ceiling", "hi", 2, priority=gateway_pb2.PRIORITY_INTERACTIVE)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(interactive, metadata=key("batchy"), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tenant 'batchy' may ask for batch at most" in (info.value.details() or "")
    before = tenant_labels()
    assert "batchy" in before
    keys = [secrets.token_hex(8) for _ in range(20)]
    for random_key in keys:
        with pytest.raises(grpc.RpcError) as info:
            metadata = (("authorization", f"Bearer {random_key}"),)
            stub.Generate(request("ceiling", "hi", 2), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = tenant_labels()
    assert after == before and not after & set(keys)


def test_the_prefix_cache_serves_a_tenant_its_own_prompts_and_never_anothers(stack: Stack) -> None:
    """The gateway sends the caller's tenant as the submission's cache salt: a prompt noisy sent is
    cached for noisy's repeat (every full block before its last token, which the engine always
    computes) and for nobody else; quiet's first send of it computes it all, and quiet's repeat finds
    quiet's own copy. The prompt opens with a fresh id, so no earlier prompt shares its first block."""
    worker = stack.start_worker("ceiling", max_requests=4)
    gateway = stack.start_gateway({"model": "ceiling", "workers": [worker.address]}, tenants=TENANTS)
    stub = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 3
    tokens = len(stack.prompt_ids("ceiling", prompt))
    block = EngineConfig.model_fields["block_size"].default  # the harness's workers keep the default
    warm = block * ((tokens - 1) // block)
    assert warm >= 3 * block, tokens

    def cached(tenant: str) -> int:
        usage = stub.Generate(request("ceiling", prompt, 2), metadata=key(tenant), timeout=60).usage
        assert usage.input_tokens == tokens, usage
        return int(usage.cached_input_tokens)

    assert cached("noisy") == 0
    assert cached("quiet") == 0, "quiet was served noisy's cached blocks of the same prompt"
    assert cached("noisy") == warm
    assert cached("quiet") == warm


def tenant_labels() -> set[str]:
    """Every value the process's metrics hold for a `tenant` label."""
    labels: set[str] = set()
    for family in REGISTRY.collect():
        for sample in family.samples:
            if "tenant" in sample.labels:
                labels.add(sample.labels["tenant"])
    return labels
