"""LoRA deltas on the model's projections: the resident adapters' weights and the step's rows' slots.

`LoraSlots` holds `slots` adapters at once, stacked per layer and fused projection (A [slots, R, in], Bt
[slots, R, out], R = components x max_rank; lora_file.py says the layout), allocated once so their
addresses never change (the native decode stack points at them). Before a step the runner says which slot
each row reads (`set_rows`: -1 for the base model, or None when no row has an adapter, which costs
nothing); each projection then adds, to every adapter row of its output, (x . A[slot]^T) . Bt[slot],
computed per group of rows that share a slot, never by merging an adapter into the base weights, so one
batch mixes adapters and the base. On the CPU in float32 the native kernel does it (csrc/lora.cpp: the
rows' shrink to R values, then their expansion over the output columns, both in slot order so each slot's
weights are read once a step); elsewhere torch, one pair of matmuls per slot in the step.

This module owns the slot tensors' contents: `install` writes an adapter into a slot (over whatever an
evicted one left there). It must not decide which adapter sits in which slot (the engine's adapter table
does) nor read adapter files (lora_file.py does).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from services.worker.model import native
from services.worker.model.lora_file import PROJECTIONS, columns, widths

if TYPE_CHECKING:
    from services.worker.model.config import ModelConfig
    from services.worker.model.lora_file import AdapterWeights


class LoraRows:
    """One step's rows' slots (-1: the base model), as the native kernel and torch each take them."""

    def __init__(self, slots: list[int], device: torch.device) -> None:
        self._slots = slots
        self._device = device
        self.slots = torch.tensor(slots, dtype=torch.int64)
        """On the CPU, whatever the model's device: the native kernel reads it there."""
        ordered = sorted((slot, row) for row, slot in enumerate(slots) if slot >= 0)
        self.order = torch.tensor([row for _, row in ordered], dtype=torch.int64)
        """The rows with an adapter, by slot: the kernel reads each slot's weights once a step."""

    @functools.cached_property
    def groups(self) -> list[tuple[int, Tensor]]:
        """Per slot of the step, its rows' indices on the model's device (torch's path only)."""
        rows = self._slots
        return [
            (slot, torch.tensor([i for i, s in enumerate(rows) if s == slot], device=self._device))
            for slot in sorted(set(rows) - {-1})
        ]


class LoraLayer:
    """One decoder layer's slot tensors, per fused projection, and the step its deltas apply to."""

    def __init__(
        self, owner: LoraSlots, weights: dict[str, tuple[Tensor, Tensor]], bands: dict[str, Tensor]
    ) -> None:
        self.owner = owner
        self.weights = weights
        self.bands = bands
        """Per projection, [components, 4]: each component's first rank row, rank rows, first and end
        output column (csrc/lora.cpp reads only those columns of its rows of Bt)."""

    def add(self, projection: str, x: Tensor, y: Tensor) -> None:
        """y[i] += (x[i] . A[slot_i]^T) . Bt[slot_i] for every adapter row i of this step."""
        rows = self.owner.rows
        if rows is None:
            return
        a, bt = self.weights[projection]
        kernels = native.library() if _native(x, y, a) else None
        if kernels is not None:
            bands = self.bands[projection]
            kernels.lora_add(
                x.data_ptr(),
                y.data_ptr(),
                rows.slots.data_ptr(),
                rows.order.data_ptr(),
                rows.order.shape[0],
                a.data_ptr(),
                bt.data_ptr(),
                bands.data_ptr(),
                bands.shape[0],
                x.shape[0],
                x.shape[1],
                y.shape[1],
                a.shape[1],
            )
            return
        for slot, index in rows.groups:
            y.index_add_(0, index, (x.index_select(0, index) @ a[slot].T) @ bt[slot])


def _native(x: Tensor, y: Tensor, a: Tensor) -> bool:
    tensors = (x, y, a)
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


class LoraSlots:
    """`slots` adapters' weights over one model, and which slot each row of the current step reads."""

    def __init__(
        self, config: ModelConfig, slots: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.slots = slots
        self.max_rank = max_rank
        self.rows: LoraRows | None = None
        self.device = device
        shapes, spans = widths(config), columns(config)
        bands = {
            name: torch.tensor(
                [[c * max_rank, max_rank, first, end] for c, (first, end) in enumerate(spans[name])],
                dtype=torch.int64,
            )
            for name in PROJECTIONS
        }
        self.layers = [
            LoraLayer(
                self,
                {
                    name: (
                        torch.zeros(slots, len(spans[name]) * max_rank, width_in, device=device, dtype=dtype),
                        torch.zeros(
                            slots, len(spans[name]) * max_rank, width_out, device=device, dtype=dtype
                        ),
                    )
                    for name, (width_in, width_out) in shapes.items()
                },
                bands,
            )
            for _ in range(config.num_hidden_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for layer in self.layers for a, bt in layer.weights.values())

    def install(self, slot: int, adapter: AdapterWeights) -> None:
        """Write `adapter` into `slot`: each component's rank rows into its max_rank band, the rest zero."""
        for layer, found in zip(self.layers, adapter.layers, strict=True):
            for name in PROJECTIONS:
                a, bt = layer.weights[name]
                a[slot].zero_()
                bt[slot].zero_()
                if name not in found:
                    continue
                source_a, source_bt = found[name]
                for component in range(source_a.shape[0] // adapter.rank):
                    band = slice(component * adapter.rank, (component + 1) * adapter.rank)
                    first = component * self.max_rank
                    target = slice(first, first + adapter.rank)
                    a[slot, target] = source_a[band].to(a.dtype)
                    bt[slot, target] = source_bt[band].to(bt.dtype)

    def set_rows(self, slots: list[int] | None) -> None:
        """The coming step's slot per row (-1: base), or None when no row has an adapter."""
        self.rows = LoraRows(slots, self.device) if slots is not None else None
