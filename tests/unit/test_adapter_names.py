"""Model names that carry a LoRA adapter: `<route>:<adapter>`, aliases, routes whose own names hold
':', tenants limited to some adapters, and the gateway settings that name them."""

from __future__ import annotations

import pytest

from gateway.adapter_names import ModelName, check_allowed, resolve
from gateway.settings import GatewaySettings
from strata.settings import SettingsError
from strata.status import NotFound, PermissionDenied

ROUTES = ("smollm2", "qwen:1.5b")
ALIASES = {"support-bot": "smollm2:support"}


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("smollm2", ModelName("smollm2")),
        ("smollm2:support", ModelName("smollm2", "support")),
        ("support-bot", ModelName("smollm2", "support")),
        ("qwen:1.5b", ModelName("qwen:1.5b")),
        ("qwen:1.5b:coder", ModelName("qwen:1.5b", "coder")),
    ],
)
def test_a_model_name_resolves_to_its_route_and_adapter(model: str, expected: ModelName) -> None:
    assert resolve(model, ROUTES, ALIASES) == expected


@pytest.mark.parametrize("model", ["llama", "llama:support", "smollm2:", ":support"])
def test_a_name_no_route_serves_is_not_found_naming_the_known_ones(model: str) -> None:
    with pytest.raises(NotFound, match=r"no route serves .*known models: smollm2, qwen:1\.5b, support-bot"):
        resolve(model, ROUTES, ALIASES)


def test_served_names_say_the_adapter() -> None:
    assert ModelName("smollm2", "support").served == "smollm2:support"
    assert ModelName("smollm2").served == "smollm2"


def test_a_tenant_limited_to_some_adapters_keeps_the_base_models() -> None:
    allowed = {"smollm2:support"}
    check_allowed(ModelName("smollm2", "support"), "search", allowed)
    check_allowed(ModelName("smollm2"), "search", allowed)
    check_allowed(ModelName("smollm2", "other"), "ops", None)
    with pytest.raises(PermissionDenied, match="tenant 'search' may not use adapter 'smollm2:other'"):
        check_allowed(ModelName("smollm2", "other"), "search", allowed)


def _settings(**extra: object) -> GatewaySettings:
    routes = [{"model": "smollm2", "workers": ["127.0.0.1:1"]}]
    return GatewaySettings.build({"tokenizer_address": "127.0.0.1:2", "routes": routes, **extra})


@pytest.mark.parametrize(
    "aliases",
    [{"smollm2": "smollm2:x"}, {"bot": "smollm2"}, {"bot": "other:x"}, {"bot": "smollm2:"}],
)
def test_an_alias_must_name_an_adapter_of_a_route(aliases: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match=r"adapter_aliases: .* must map a name that is not a route's"):
        _settings(adapter_aliases=aliases)


def test_admin_keys_must_not_be_empty() -> None:
    assert _settings(adapter_aliases=ALIASES | {"support-bot": "smollm2:support"}).adapter_aliases
    with pytest.raises(SettingsError, match="admin_keys must not hold an empty key"):
        _settings(admin_keys=[" "])
