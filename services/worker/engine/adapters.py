"""The engine's LoRA adapters: which it serves, which sit in which memory slot, which are in use.

An adapter is known by name once loaded (its files read and checked against the base, lora_file.py). At
most `slots` of them are resident, each in one slot of the model's LoraSlots; an evicted one's weights
leave memory (read again from disk when wanted), and of the adapters loaded and not used yet at most
`slots` wait in host memory, the others on disk. A waiting sequence that names an adapter is admitted
only once its adapter holds a slot: the scheduler asks `acquire`, which keeps a resident adapter, or
gives a non-resident one a free slot or the least recently used slot that no running sequence's adapter
holds, queueing its weights for the runner to install before the step runs (`take_installs`). An adapter
whose weights are not in memory (evicted, or left on disk at its load) is `wanted`: the engine reads it again
between steps. Which adapters are in use is read from the running sequences each time, so no path can
leak a pin. An unloaded adapter takes no new requests; its slot is freed once no running or waiting
sequence uses it.

This module owns the names, the slots' assignment and the LRU order. It is pure Python (no torch, no
I/O): the engine reads files, the runner writes slots (lora.py), the scheduler decides admission.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

    from services.worker.model.lora_file import AdapterWeights


class UnknownAdapterError(LookupError):
    """A request named an adapter this engine does not serve."""

    def __init__(self, name: str, known: Iterable[str] = ()) -> None:
        served = ", ".join(sorted(known)) or "none"
        super().__init__(f"adapter {name!r} is not loaded on this worker (loaded: {served})")
        self.name = name


class AdapterExistsError(ValueError):
    """An adapter of this name is loaded (or still unloading)."""


class NoAdapterSlotsError(RuntimeError):
    """The engine was built without adapter slots (engine.lora.max_loras is 0)."""


@dataclass(slots=True)
class _Adapter:
    path: Path
    rank: int
    weights: AdapterWeights | None
    """In host memory from its read until installed into a slot; None while on disk or resident."""
    generation: int
    stamp: object
    """What its files were when loaded (lora_serving.py compares it before reading them back)."""
    unloading: bool = False


class AdapterTable:
    """Names -> slots for one engine; used from the engine's thread only."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._adapters: dict[str, _Adapter] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()
        """Resident adapter -> its slot, least recently acquired first."""
        self._installs: list[tuple[int, AdapterWeights]] = []
        self.wanted: set[str] = set()
        """Adapters a waiting sequence needs whose weights must be read again from disk."""
        self._generation = 0
        self.accepting: frozenset[str] = frozenset()
        """The adapters that take requests: replaced whole on every change, so the event loop's checks
        (AsyncEngine.check) read it while the engine's thread changes the rest."""
        self.num_loads = 0
        """Installs into a slot since start (a first use or a reload after eviction)."""

    @property
    def unloading(self) -> bool:
        return any(adapter.unloading for adapter in self._adapters.values())

    def describe(self) -> list[tuple[str, Path, int, bool]]:
        """(name, path, rank, resident) of each adapter that takes requests, by name."""
        known = self._adapters
        return [(n, known[n].path, known[n].rank, n in self._resident) for n in self.names()]

    def names(self) -> list[str]:
        """The adapters that take requests, sorted."""
        return sorted(self.accepting)

    def path(self, name: str) -> Path:
        return self._adapters[name].path

    def stamp(self, name: str) -> object:
        return self._adapters[name].stamp

    def check(self, name: str) -> None:
        """Raise UnknownAdapterError unless `name` takes requests (safe from any thread)."""
        accepting = self.accepting
        if name not in accepting:
            raise UnknownAdapterError(name, accepting)

    def add(self, name: str, path: Path, weights: AdapterWeights, stamp: object) -> None:
        """Serve `weights` (read from `path`, whose files were `stamp`) as `name`."""
        known = self._adapters.get(name)
        if known is not None:
            state = "is still unloading: wait for its requests to end" if known.unloading else "is loaded"
            raise AdapterExistsError(f"adapter {name!r} {state}; unload it first to replace it")
        # Host memory holds at most as many adapters waiting for their first slot as there are slots;
        # past that, one is read again from disk at its first request.
        waiting = sum(adapter.weights is not None for adapter in self._adapters.values())
        kept = weights if waiting < self.slots else None
        self._adapters[name] = _Adapter(path, weights.rank, kept, self._generation, stamp)
        self._generation += 1
        self._publish()

    def identity(self, name: str) -> str:
        """`name` and its load: what salts its sequences' cached KV blocks, so blocks computed through
        an adapter are never served to the base, another adapter, or a later load under the same name."""
        return f"{name}#{self._adapters[name].generation}"

    def remove(self, name: str, queued: Iterable[str]) -> None:
        """Take no new requests for `name`; free its slot now, or once no name in `queued` (the
        adapters of the running and waiting sequences) is it."""
        self.check(name)
        self.retire(name, queued)

    def retire(self, name: str, queued: Iterable[str]) -> None:
        """`remove` without the check: also for an adapter unloading already (one that cannot be read
        back from disk)."""
        if name in self._adapters:
            self._adapters[name].unloading = True
            self._publish()
        self.collect(queued)

    def collect(self, queued: Iterable[str]) -> None:
        """Forget unloading adapters that no name in `queued` is (their last requests ended)."""
        using = set(queued)
        for name in [n for n, a in self._adapters.items() if a.unloading and n not in using]:
            del self._adapters[name]
            self._resident.pop(name, None)
            self.wanted.discard(name)

    def refill(self, name: str, weights: AdapterWeights) -> None:
        """Weights of a wanted adapter, read again from disk."""
        adapter = self._adapters.get(name)
        if adapter is not None and adapter.weights is None and name not in self._resident:
            adapter.weights = weights
        self.wanted.discard(name)

    def _publish(self) -> None:
        self.accepting = frozenset(n for n, a in self._adapters.items() if not a.unloading)

    def acquire(self, name: str, running: Iterable[str]) -> bool:
        """Whether a sequence of `name` may start now: True once `name` holds a slot (given it here if
        one is free or held by an adapter no name in `running` uses)."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return True
        adapter = self._adapters[name]
        if adapter.weights is None:
            self.wanted.add(name)
            return False
        slot = self._free_slot(set(running))
        if slot is None:
            return False
        self._resident[name] = slot
        self._installs.append((slot, adapter.weights))
        adapter.weights = None  # the slot is its copy now; evicted, it is read again from disk
        self.num_loads += 1
        return True

    def slot(self, name: str) -> int:
        """The slot of a resident adapter (a running sequence's)."""
        return self._resident[name]

    def take_installs(self) -> list[tuple[int, AdapterWeights]]:
        """The (slot, weights) the runner must write before the coming step, in order."""
        installs, self._installs = self._installs, []
        return installs

    def _free_slot(self, using: set[str]) -> int | None:
        taken = set(self._resident.values())
        free = next((slot for slot in range(self.slots) if slot not in taken), None)
        if free is not None:
            return free
        victim = next((name for name in self._resident if name not in using), None)
        if victim is None:
            return None
        return self._resident.pop(victim)
