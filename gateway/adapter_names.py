"""How a request's model names a route and a LoRA adapter, and who may use which adapter.

A model name is a route's (`smollm2`: its base model), `<route>:<adapter>` (that route's workers serve
the request through the adapter loaded under that name), or an alias from the gateway's
`adapter_aliases` that stands for one of those. A route whose own name holds ':' keeps it: the whole
name is looked up first. A tenant may be limited to some adapters (its `adapters`, by served name);
the base models stay open to it. This module only parses names and checks the tenant's list: it must
not know which adapters the workers have loaded (they refuse an unknown one, NOT_FOUND).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.status import NotFound, PermissionDenied

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping


@dataclass(frozen=True, slots=True)
class ModelName:
    """A request's model, resolved: its route and adapter ("" for the base model)."""

    route: str
    adapter: str = ""

    @property
    def served(self) -> str:
        """The name responses, logs and metrics give: `<route>:<adapter>`, or the route's."""
        return f"{self.route}:{self.adapter}" if self.adapter else self.route


def resolve(model: str, routes: Collection[str], aliases: Mapping[str, str]) -> ModelName:
    """The route and adapter `model` names; NotFound naming the known models when no route serves it."""
    name = aliases.get(model, model)
    if name in routes:
        return ModelName(name)
    route, colon, adapter = name.rpartition(":")
    if colon and adapter and route in routes:
        return ModelName(route, adapter)
    known = ", ".join([*routes, *aliases])
    raise NotFound(
        f"model: no route serves {model!r}; known models: {known} (an adapter is served as <model>:<adapter>)"
    )


def check_allowed(name: ModelName, tenant: str, allowed: Collection[str] | None) -> None:
    """Raise PermissionDenied when `tenant` may use only the adapters in `allowed` and `name` is another."""
    if name.adapter and allowed is not None and name.served not in allowed:
        may = ", ".join(sorted(allowed)) or "none"
        raise PermissionDenied(
            f"model: tenant {tenant!r} may not use adapter {name.served!r} (its adapters: {may})"
        )
