"""`python -m bench.tenants` against stacks: the whole run against an in-process gateway that names
each call's tenant by its API key (the stacks it would spawn replaced by that gateway, so the config
copies, the capacity run, the alternation and every call's key are checked), the request driver's
metadata, and a smoke run against spawned tiny stacks, skipped while the gateway rejects `tenants`.

The fairness arithmetic, the reductions, the verdict, the record and the options are
tests/unit/test_bench_tenants.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import yaml

from bench import tenant_run
from bench.driver import send
from bench.session import Endpoints
from bench.stack_prompts import Prompt
from bench.tenant_load import API_KEYS, gateway_overrides
from bench.tenants import main
from strata.settings import SettingsError
from strata.status import ELAPSED_KEY, ResourceExhausted, abort
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway_thread import serving_in_a_thread
from tests.tiny_tokenizer import write_tiny_tokenizer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

PRIMARY = "primary"
NEW = 4
TOKENS = {"noisy": 24, "quiet": 8}


class _TenantGateway(gateway_pb2_grpc.GatewayServicer):
    """Names each call's tenant by its key (UNAUTHENTICATED without a known one), holds every stream
    `hold_s` before its tokens, and refuses a noisy request at once while 2 noisy ones are in flight;
    its usage counts each tenant's prompt length."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.noisy_in_flight = 0
        self.calls: list[tuple[str, str, str]] = []
        """(method, tenant, request id) of every call, in arrival order."""

    async def _tenant(self, method: str, request_id: str, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        tenant = next((name for name, key in API_KEYS.items() if header == f"Bearer {key}"), "")
        self.calls.append((method, tenant, request_id))
        if not tenant:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        return tenant

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.GenerateResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the benchmark streams")
        raise AssertionError("abort returned")

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.ListModelsResponse:
        await self._tenant("ListModels", "", context)
        return gateway_pb2.ListModelsResponse(
            default_model=PRIMARY, models=[gateway_pb2.ModelInfo(name=PRIMARY)]
        )

    async def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        tenant = await self._tenant("GenerateStream", request.request_id, context)
        assert request.no_fallback and not request.allow_fallback and request.sampling.ignore_eos
        noisy = tenant == "noisy"
        if noisy and self.noisy_in_flight >= 2:
            refusal = ResourceExhausted("queue full: 2 requests waiting", 0.1)
            refusal.metadata = ((ELAPSED_KEY, "0.2"),)  # decided at once, however late the client reads it
            await abort(context, refusal)
        self.noisy_in_flight += noisy
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.noisy_in_flight -= noisy
        yield gateway_pb2.GenerateStreamResponse(token_ids=list(range(request.sampling.max_new_tokens)))
        usage = common_pb2.Usage(input_tokens=TOKENS[tenant], output_tokens=request.sampling.max_new_tokens)
        yield gateway_pb2.GenerateStreamResponse(
            final=gateway_pb2.GenerateResponse(model=PRIMARY, usage=usage)
        )


def test_the_driver_sends_the_call_metadata_it_is_given_and_none_otherwise() -> None:
    servicer = _TenantGateway(hold_s=0.0)
    prompt = Prompt("x", (1, 2))
    request = gateway_pb2.GenerateRequest(
        prompt=prompt.text, request_id="r", no_fallback=True,
        sampling=common_pb2.SamplingParams(max_new_tokens=NEW, ignore_eos=True),
    )  # fmt: skip

    async def drive() -> list[str]:
        with serving_in_a_thread(servicer) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub: Any = gateway_pb2_grpc.GatewayStub(channel)
                keyed = await send(
                    stub, 0, request, 10.0, metadata=(("authorization", f"Bearer {API_KEYS['quiet']}"),)
                )
                bare = await send(stub, 1, request, 10.0)
        return [keyed.status, bare.status]

    assert asyncio.run(drive()) == ["OK", "UNAUTHENTICATED"]
    assert [tenant for _, tenant, _ in servicer.calls] == ["quiet", ""]


def test_the_run_copies_the_config_measures_each_shape_and_alternates_with_each_tenants_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = {
        "model_name": PRIMARY,
        "model_path": str(write_tiny_tokenizer(tmp_path)),
        "device": "cpu",
    }
    config = tmp_path / "stack.yaml"
    routes = [{"model": PRIMARY, "ttft_slo_ms": 5000}]
    config.write_text(yaml.safe_dump({"workers": [worker], "gateway": {"routes": routes}}))
    servicer = _TenantGateway(hold_s=0.05)
    started: list[Path] = []

    @contextlib.contextmanager
    def fake_spawned(path: Path, log_dir: Path) -> Iterator[Endpoints]:
        started.append(path)
        yield Endpoints(address, None)

    monkeypatch.setattr(tenant_run, "spawned", fake_spawned)
    out = tmp_path / "tenants.json"
    argv = [
        "--config", str(config), "--smoke", "--runs", "2", "--duration", "0.3", "--gap", "0",
        "--noisy-prompt-tokens", str(TOKENS["noisy"]), "--quiet-prompt-tokens", str(TOKENS["quiet"]),
        "--new-tokens", str(NEW), "--capacity-concurrency", "2", "--capacity-requests", "4",
        "--log-dir", str(tmp_path / "work"), "--json", str(out), "--no-progress",
    ]  # fmt: skip
    with serving_in_a_thread(servicer) as address:
        assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["voided"] is False and record["invalid_reasons"] == ["--smoke run"]
    # The capacity stack is the FIFO copy's without the SLO check; then on, off, on, off, each its own.
    names = [path.name for path in started]
    assert names == ["capacity.yaml", *["fair-queuing-on.yaml", "fair-queuing-off.yaml"] * 2]
    capacity = yaml.safe_load((tmp_path / "work" / "capacity.yaml").read_text())["gateway"]
    assert capacity["fair_queuing"] is False
    assert capacity["routes"] == [{**route, "ttft_slo_ms": 0} for route in routes]
    for name, fair in (("on", True), ("off", False)):
        written = yaml.safe_load((tmp_path / "work" / f"fair-queuing-{name}.yaml").read_text())
        assert written["gateway"]["routes"] == routes
        assert {k: written["gateway"][k] for k in ("fair_queuing", "tenants")} == gateway_overrides(fair)
        assert written["workers"][0]["model_path"] == worker["model_path"]
    assert [(p["contestant"], p["round"]) for p in record["phases"]] == [
        ("on", 1),
        ("off", 1),
        ("on", 2),
        ("off", 2),
    ]
    capacity, rates = record["capacity"], record["rates"]
    for tenant, factor in (("noisy", 5.0), ("quiet", 0.3)):
        shape = capacity["shapes"][tenant]
        assert (
            shape["prompt_tokens"] == TOKENS[tenant] and shape["concurrency"] == 2 and shape["completed"] == 4
        )
        assert rates[tenant]["rate_rps"] == pytest.approx(factor * shape["requests_per_s"])
        assert rates[tenant]["arrivals_per_phase"] == max(1, round(rates[tenant]["rate_rps"] * 0.3))
    # Every call carried a known key, each request its own tenant's: the capacity run's per shape, the
    # same requests in each of the four phases.
    assert all(tenant for _, tenant, _ in servicer.calls)
    generated = [(tenant, rid) for method, tenant, rid in servicer.calls if method == "GenerateStream"]
    capacity_calls = [tenant for tenant, rid in generated if rid.startswith("bench-capacity-")]
    assert capacity_calls == ["noisy"] * 4 + ["quiet"] * 4
    tagged = [(tenant, rid) for tenant, rid in generated if not rid.startswith("bench-capacity-")]
    assert all(rid.startswith(f"bench-tenants-{tenant}-") for tenant, rid in tagged)
    phase_ids = [rid for _, rid in tagged if "-phase-" in rid]
    arrivals = rates["noisy"]["arrivals_per_phase"] + rates["quiet"]["arrivals_per_phase"]
    assert len(phase_ids) == 4 * arrivals and len(set(phase_ids)) == arrivals
    for name in ("on", "off"):
        contestant = record["contestants"][name]
        quiet, noisy = contestant["tenants"]["quiet"], contestant["tenants"]["noisy"]
        assert quiet["offered"] == 2 * rates["quiet"]["arrivals_per_phase"] == quiet["completed"]
        assert noisy["offered"] == 2 * rates["noisy"]["arrivals_per_phase"]
        assert noisy["refused"] > 0 and noisy["refusal_reasons"] == {"queue_full": noisy["refused"]}
        assert contestant["quiet_served_share"] == 1.0 and contestant["jain_index"] is not None
    assert record["workload"]["ttft_slo_ms"] == 5000.0 and record["target"]["judged"] == "on"
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def _gateway_rejects_tenants() -> str | None:
    """Why the gateway's settings refuse the benchmark's gateway keys; None once they accept them."""
    from gateway.settings import GatewaySettings

    data = {"tokenizer_address": "127.0.0.1:1", "routes": [{"model": PRIMARY, "workers": ["127.0.0.1:2"]}]}
    try:
        GatewaySettings.build({**data, **gateway_overrides(True)})
    except SettingsError as exc:
        return "; ".join(line.strip() for line in str(exc).splitlines()[1:])
    return None


REJECTED = _gateway_rejects_tenants()


@pytest.mark.slow
@pytest.mark.skipif(
    REJECTED is not None, reason=f"the gateway rejects the fair_queuing/tenants settings: {REJECTED}"
)
def test_smoke_run_against_spawned_tiny_stacks_with_tenants(tmp_path: Path, tiny_serving_dir: Path) -> None:
    engine = {"num_blocks": 32, "max_num_seqs": 2, "max_num_batched_tokens": 64}
    worker = {"model_name": PRIMARY, "model_path": str(tiny_serving_dir), "device": "cpu", "threads": 1,
              "engine": engine, "max_requests": 2}  # fmt: skip
    config = {
        "tokenizer": {"listen": "127.0.0.1:0", "models": {PRIMARY: str(tiny_serving_dir)}},
        "workers": [worker],
        "gateway": {"listen": "127.0.0.1:0", "default_model": PRIMARY,
                    "routes": [{"model": PRIMARY, "max_queued_requests": 2, "ttft_slo_ms": 5000}]},
    }  # fmt: skip
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "tenants.json"
    argv = [
        "--config", str(path), "--smoke", "--duration", "2", "--noisy-prompt-tokens", "48",
        "--capacity-requests", "4", "--log-dir", str(tmp_path / "work"), "--json", str(out), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["voided"] is False and [p["contestant"] for p in record["phases"]] == ["on", "off"]
    for name in ("on", "off"):
        tenants = record["contestants"][name]["tenants"]
        for tenant, rate in record["rates"].items():
            assert (
                tenants[tenant]["offered"] == rate["arrivals_per_phase"] and tenants[tenant]["errors"] == {}
            )
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
