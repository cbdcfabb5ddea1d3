"""Settings of the gateway: where it listens, the tokenizer service, routes to workers, request limits.

Read once at start through strata.settings (YAML section `gateway`, then STRATA_GATEWAY_* variables;
routes as JSON in STRATA_GATEWAY_ROUTES). This module must not open connections.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.adapter_names import resolve as resolve_model
from gateway.tenant_settings import DEFAULT_TENANT, TenantSettings, check_tenants
from strata.rpc import MIB, check_listen
from strata.settings import ServiceSettings
from strata.status import NotFound
from strata.tls import ClientTlsSettings


class RouteSettings(BaseModel):
    """One model name, the workers that serve it, its admission limits and its fallback."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    """The model name clients ask for (and the tokenizer service knows)."""
    workers: tuple[str, ...] = ()
    """host:port of each worker serving this model (a static list); set this or `dns`."""
    dns: str = ""
    """name:port whose addresses are the workers (a Kubernetes headless service); set this or `workers`."""
    dns_refresh_s: float = 5.0
    """How often `dns` is resolved again; new addresses get links, vanished ones close once idle."""
    fallback: str = ""
    """Another route's model: the smaller model, with the same tokenizer, that serves when this one can't."""
    fallback_enabled: bool = True
    """False never uses `fallback` for this route."""
    adapter_fallback_to_base: bool = False
    """A request through a LoRA adapter that falls back runs on `fallback` through the same adapter (its
    workers must have it loaded, else it fails NOT_FOUND); true runs it on the fallback's base model."""
    max_queued_requests: int = 64
    """Requests waiting for a worker credit at most; more are refused (RESOURCE_EXHAUSTED) at once."""
    max_queued_tokens: int = 32768
    """Prompt tokens waiting for a worker credit at most (a lone request always fits)."""
    ttft_slo_ms: float = 2000.0
    """The time to first token every admitted request is promised; 0 turns the check off."""
    ttft_slo_share: float = 0.75
    """A request is admitted when its forecast time to first token is at most this share of
    ttft_slo_ms: the rest is margin for what the forecast cannot see (another worker's load slowing
    the steps, the arrivals of the next moments)."""
    itl_slo_ms: float = 0.0
    """The inter-token latency every admitted request is promised; 0 (the default) promises none. Its
    workers then cut prefill into smaller chunks and run fewer sequences, so that a step of a stream
    decoding stays within it (services/worker/engine/step_limits.py); the TTFT forecast sees the
    smaller chunks and fewer slots they report, so both promises hold together and more requests are
    refused under load."""
    fair_reserve_share: float = 0.125
    """With fair queuing on, the share of each worker's credits (its max_requests) that only a tenant
    holding less than its weighted share of the work open there may take; never more than the credits
    beyond the worker's running limit, so a lone tenant still fills every running slot. A tenant that
    floods the route leaves this room for another tenant's next request, which the worker runs at once
    by preempting the flooding tenant's youngest sequence (services/worker/engine/yielding.py). 0
    turns it off."""
    forecast_cached_prompts: bool = True
    """The TTFT forecast prices only the part of a prompt its worker's prefix cache likely lacks
    (gateway/prompt_prefix.py); false prices every prompt token as computed, as with the cache off."""
    prefix_routing_tokens: int = 64
    """With several workers, requests whose first this-many prompt tokens (and tenant) agree go to
    the same worker, which has their prefix cached (prefix_routing.py); 0 routes to the least loaded."""
    prefix_routing_load_factor: float = 1.25
    """Prefix routing's load bound: a worker takes a request for its prefix only while its open
    requests stay within this factor of the route's average; otherwise the least loaded takes it."""

    @model_validator(mode="after")
    def _check(self) -> RouteSettings:
        if bool(self.workers) == bool(self.dns):
            raise ValueError(
                f"route {self.model!r} must set exactly one of workers (e.g. [127.0.0.1:50053]) "
                "or dns (e.g. strata-worker.default.svc:50053)"
            )
        if self.dns and not _has_port(self.dns):
            raise ValueError(f"route {self.model!r}: dns={self.dns!r} must be name:port, e.g. workers:50053")
        if not self.dns_refresh_s > 0:
            raise ValueError(f"route {self.model!r}: dns_refresh_s={self.dns_refresh_s} must be > 0, e.g. 5")
        if self.fallback == self.model:
            raise ValueError(f"route {self.model!r} names itself as its fallback; name another route")
        if not 0 < self.ttft_slo_share <= 1:
            raise ValueError(
                f"route {self.model!r}: ttft_slo_share={self.ttft_slo_share} must be in (0, 1], e.g. 0.75"
            )
        if not 0 <= self.fair_reserve_share < 1:
            raise ValueError(
                f"route {self.model!r}: fair_reserve_share={self.fair_reserve_share} must be in [0, 1), "
                "e.g. 0.125"
            )
        if self.prefix_routing_load_factor < 1:
            raise ValueError(
                f"route {self.model!r}: prefix_routing_load_factor={self.prefix_routing_load_factor} must be "
                ">= 1 (1 keeps every worker at the average), e.g. 1.25"
            )
        names = (
            "max_queued_requests",
            "max_queued_tokens",
            "ttft_slo_ms",
            "itl_slo_ms",
            "prefix_routing_tokens",
        )
        for name in names:
            if getattr(self, name) < 0:
                raise ValueError(f"route {self.model!r}: {name}={getattr(self, name)} must be >= 0")
        return self


def _has_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit()


class GatewaySettings(ServiceSettings):
    """The gateway's settings."""

    model_config = SettingsConfigDict(env_prefix="STRATA_GATEWAY_")
    section: ClassVar[str] = "gateway"
    path_fields: ClassVar[tuple[str, ...]] = ("api_keys_file",)

    listen: str = "127.0.0.1:50051"
    """host:port clients call; port 0 takes a free one (announced with --announce-file)."""
    name: str = "gateway"
    """This gateway's name in workers' logs."""
    tokenizer_address: str
    """host:port of the tokenizer service (strata up fills it in)."""
    routes: tuple[RouteSettings, ...]
    """Model routes (strata up fills them in from the workers it starts)."""
    default_model: str = ""
    """The model an empty GenerateRequest.model selects; empty is the first route."""
    default_max_new_tokens: int = 64
    """max_new_tokens when a request leaves it 0."""
    max_message_bytes: int = 1 * MIB
    """Largest client request; a bigger one is refused with RESOURCE_EXHAUSTED."""
    max_stop_strings: int = 8
    """Most stop strings per request."""
    max_stop_string_bytes: int = 64
    """Longest stop string, in UTF-8 bytes."""
    max_request_id_chars: int = 128
    """Longest caller-chosen request id."""
    max_batch_delay_ms: float = 2.0
    """Under load, how long an arrival waits for others to share its Tokenize call (and so its
    worker submission); an arrival at an idle gateway goes at once."""
    max_batch_size: int = 64
    """Most prompts in one Tokenize call."""
    connect_timeout_s: float = 120.0
    """How long to wait at start for the tokenizer and each worker to be ready."""
    tokenizer_timeout_s: float = 10.0
    """Bound on one call to the tokenizer service (Tokenize, Detokenize, GetTokenizerInfo)."""
    overload_retry_after_s: float = 1.0
    """Retry hint sent with RESOURCE_EXHAUSTED while the gateway has no measured wait to offer."""
    reconnect_backoff_max_s: float = 1.0
    """Longest wait between attempts to reach a worker or the tokenizer service again."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM or SIGINT, how long running streams may take to finish before they are cancelled."""
    stream_idle_timeout_s: float = 30.0
    """A streaming client that takes no message for this long loses its request (cancelled on the
    worker, its KV blocks freed): a stuck reader cannot hold memory."""
    max_new_tokens_limit: int = 4096
    """The most tokens one request may ask for; more is INVALID_ARGUMENT (before any worker is asked)."""
    internal_tls: ClientTlsSettings | None = None
    """TLS to the tokenizer service and the workers: the CA that signed their certificates and, for
    mutual TLS, the gateway's own certificate and key; unset: plaintext."""
    api_keys: tuple[SecretStr, ...] = ()
    """Keys clients must send as `authorization: Bearer <key>`; with none here or in api_keys_file,
    the gateway takes every call."""
    api_keys_file: Path | None = None
    """A file of keys, one per line (blank lines and # comments ignored), read at start."""
    tenants: tuple[TenantSettings, ...] = ()
    """Who shares the gateway: each tenant's keys, weight and limits (tenant_settings.py). Requests
    with a plain api_keys key, or with no key when none is configured, are the default tenant's."""
    fair_queuing: bool = True
    """Serve waiting requests by tenant, weighted fair on token cost; false: first come, first served."""
    http_listen: str = ""
    """host:port of the OpenAI-compatible HTTP API (docs/http-api.md), served by the same process and
    pipeline, with the same TLS (`tls`) and API keys; port 0 takes a free one; empty turns it off."""
    http_default_max_tokens: int = 256
    """max_tokens of an HTTP request that sends neither max_tokens nor max_completion_tokens, capped by
    max_new_tokens_limit and the model's context (the gRPC API's default is default_max_new_tokens)."""
    http_max_connections: int = 1024
    """Open HTTP connections at most; a connection beyond it has its requests answered 503 (an OpenAI
    error body with Retry-After) and is closed."""
    http_keep_alive_s: int = 5
    """How long an idle HTTP/1.1 keep-alive connection stays open."""
    http_header_timeout_s: float = 10.0
    """A request's head (request line and headers) must arrive within this many seconds of the
    connection opening or of its first byte; a slower one is answered 408 and closed (slowloris)."""
    http_body_timeout_s: float = 30.0
    """A request's whole body must arrive within this many seconds of its head; a slower one is 408."""
    adapter_aliases: dict[str, str] = Field(default_factory=dict)
    """Model names that stand for a route's LoRA adapter: `{"support-bot": "smollm2:support"}`
    (docs/lora.md); an adapter is served as `<model>:<adapter>` with or without one."""
    admin_keys: tuple[SecretStr, ...] = ()
    """Keys the HTTP API's adapter endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) take as
    `authorization: Bearer <key>`; none turns those endpoints off (404)."""
    worker_admin_token: SecretStr | None = None
    """The admin_token the gateway's workers take: the adapter endpoints forward loads and unloads with it."""
    responses_store_ttl_s: float = 3600.0
    """How long a stored Responses API answer (`store: true`) can be continued or fetched."""
    responses_store_bytes: int = 16 * MIB
    """Each tenant's stored Responses API answers together take at most this many bytes (their JSON
    text and their conversations'); past it, the tenant's oldest are forgotten first."""

    @field_validator("http_listen")
    @classmethod
    def _http_host_port(cls, value: str) -> str:
        return check_listen(value, "127.0.0.1:8000")

    def default_keys(self) -> tuple[str, ...]:
        """The plain API keys, from the settings and the file: the default tenant's."""
        keys = [key.get_secret_value() for key in self.api_keys]
        if self.api_keys_file is not None:
            for line in self.api_keys_file.read_text().splitlines():
                if line.strip() and not line.strip().startswith("#"):
                    keys.append(line.strip())
        return tuple(keys)

    def tenant_keys(self) -> tuple[tuple[bytes, str], ...]:
        """Every accepted key, as bytes for a constant-time comparison, with the tenant it names."""
        keys = [(key.encode(), DEFAULT_TENANT) for key in self.default_keys()]
        for tenant in self.tenants:
            keys.extend((key.get_secret_value().encode(), tenant.name) for key in tenant.api_keys)
        return tuple(keys)

    def accepted_keys(self) -> tuple[bytes, ...]:
        """Every API key, the default tenant's and the tenants', as bytes."""
        return tuple(key for key, _ in self.tenant_keys())

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        names = [route.model for route in self.routes]
        if not names:
            raise ValueError("routes must name at least one model and its workers")
        if len(set(names)) != len(names):
            raise ValueError(f"routes name a model twice: {names}; merge their worker lists")
        if self.default_model and self.default_model not in names:
            raise ValueError(f"default_model={self.default_model!r} is not among the routes {names}")
        if self.default_max_new_tokens < 1:
            raise ValueError(f"default_max_new_tokens={self.default_max_new_tokens} must be >= 1, e.g. 64")
        for route in self.routes:
            if route.fallback and route.fallback not in names:
                raise ValueError(
                    f"route {route.model!r} falls back to {route.fallback!r}, "
                    f"which is not among the routes {names}"
                )
        if self.max_batch_delay_ms < 0:
            raise ValueError(f"max_batch_delay_ms={self.max_batch_delay_ms} must be >= 0, e.g. 2")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1, e.g. 64")
        for name in ("tokenizer_timeout_s", "overload_retry_after_s", "reconnect_backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0, e.g. 1")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s={self.shutdown_grace_s} must be >= 0, e.g. 30")
        if not self.stream_idle_timeout_s > 0:
            raise ValueError(f"stream_idle_timeout_s={self.stream_idle_timeout_s} must be > 0, e.g. 30")
        if self.max_new_tokens_limit < self.default_max_new_tokens:
            raise ValueError(
                f"max_new_tokens_limit={self.max_new_tokens_limit} is below default_max_new_tokens="
                f"{self.default_max_new_tokens}; raise it, e.g. 4096"
            )
        for name in ("http_default_max_tokens", "http_max_connections", "http_keep_alive_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1, e.g. 256")
        if not self.responses_store_ttl_s > 0:
            raise ValueError(f"responses_store_ttl_s={self.responses_store_ttl_s} must be > 0, e.g. 3600")
        if self.responses_store_bytes < 0:
            raise ValueError(
                f"responses_store_bytes={self.responses_store_bytes} must be >= 0 (0 keeps nothing), "
                "e.g. 16777216"
            )
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0, e.g. 10")
        if self.api_keys_file is not None:
            try:
                self.accepted_keys()
            except OSError as exc:
                raise ValueError(f"api_keys_file: cannot read {self.api_keys_file}: {exc.strerror}") from exc
        if any(not key.get_secret_value().strip() for key in self.api_keys):
            raise ValueError("api_keys must not hold an empty key; remove it")
        check_tenants(self.tenants, self.default_keys())
        for alias, target in self.adapter_aliases.items():
            try:
                named = resolve_model(target, names, {})
            except NotFound:
                named = None
            if alias in names or named is None or not named.adapter:
                raise ValueError(
                    f"adapter_aliases: {alias!r} -> {target!r} must map a name that is not a route's to "
                    f"<route>:<adapter> of a route among {names}, e.g. {names[0]}:support"
                )
        if any(not key.get_secret_value().strip() for key in self.admin_keys):
            raise ValueError("admin_keys must not hold an empty key; remove it")
        return self

    @property
    def default_route(self) -> str:
        return self.default_model or self.routes[0].model
