"""An engine's LoRA adapters end to end: their files read, their slots written, each step's rows.

Built when engine.lora.max_loras > 0: it allocates the model's adapter slots (lora.py) and attaches them,
before the KV cache is sized, so their memory counts as the model's. Loading an adapter reads and checks
its files against the base (lora_file.py) and hands its weights to the adapter table (adapters.py), which
decides slots; an adapter the table evicted and a waiting request wants again is read back here between
steps (`refill`), if its files are still those it was loaded from. Before each step the runner asks for
the table's pending installs to be written (`install_pending`) and for the step's per-row slots (`rows`).
Everything runs on the engine's thread. This module owns reading adapters and the slot tensors' lifetime;
it must not choose slots (the table does) nor compute deltas (the model's layers do).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.worker.engine.adapters import AdapterTable
from services.worker.model.lora import LoraSlots
from services.worker.model.lora_file import WEIGHTS_FILE, AdapterError, read_adapter

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.config import LoraConfig
    from services.worker.engine.sequence import ScheduledBatch
    from services.worker.model.loader import LoadedModel

log = logging.getLogger(__name__)


class LoraServing:
    """One engine's adapter slots, table and files."""

    def __init__(self, loaded: LoadedModel, config: LoraConfig) -> None:
        self.config = config
        self.model_config = loaded.config
        self.slots = LoraSlots(
            loaded.config, config.max_loras, config.max_lora_rank, loaded.device, loaded.dtype
        )
        loaded.model.attach_lora(self.slots)
        self.table = AdapterTable(config.max_loras)

    @property
    def nbytes(self) -> int:
        """The slots' memory, taken at start whatever is loaded."""
        return self.slots.nbytes

    def load(self, name: str, path: Path) -> int:
        """Read, check and serve the adapter in `path` as `name`; its rank. Raises AdapterError (or
        AdapterExistsError for a name loaded already) and changes nothing then."""
        if not name or ":" in name:
            raise AdapterError(
                f"adapter name {name!r} must be non-empty and hold no ':' (base:adapter names it)"
            )
        stamp = _stamp(path)
        weights = read_adapter(name, path, self.model_config, self.config.max_lora_rank)
        self.table.add(name, path, weights, stamp)
        log.info(
            "adapter %s loaded from %s (rank %d, %.1f MiB)", name, path, weights.rank, weights.nbytes / 2**20
        )
        return weights.rank

    def refill(self) -> list[str]:
        """Read back the adapters waiting requests want; the names of those that could not be (their
        files changed or vanished since they were loaded): the engine unloads those and fails their
        requests, never its step loop."""
        failed = []
        for name in sorted(self.table.wanted):
            path = self.table.path(name)
            try:
                if _stamp(path) != self.table.stamp(name):
                    raise AdapterError(f"adapter {name!r}: {path} changed since it was loaded; load it again")
                weights = read_adapter(name, path, self.model_config, self.config.max_lora_rank)
            except (
                Exception
            ) as err:  # whatever the files hold now, one adapter's requests fail, not the engine
                log.error("adapter %s cannot be read back from %s, unloading it: %r", name, path, err)
                failed.append(name)
                continue
            self.table.refill(name, weights)
        return failed

    def install_pending(self) -> None:
        for slot, weights in self.table.take_installs():
            self.slots.install(slot, weights)

    def rows(self, batch: ScheduledBatch) -> list[int] | None:
        """Each row's slot in this step (-1: the base model), or None when no row has an adapter."""
        if not any(entry.seq.adapter for entry in batch.entries):
            return None
        slots: list[int] = []
        for entry in batch.entries:
            slot = self.table.slot(entry.seq.adapter) if entry.seq.adapter else -1
            slots.extend([slot] * entry.num_tokens)
        return slots


def _stamp(path: Path) -> tuple[int, int] | None:
    """The weights file's modification time and size: a read-back must find the files it loaded."""
    try:
        stat = (path / WEIGHTS_FILE).stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)
