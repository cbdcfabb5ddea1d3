"""Reading a LoRA adapter in PEFT's format into the shapes the model's fused projections take.

A PEFT adapter is a folder with `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, ...) and
`adapter_model.safetensors`, whose tensors are named `...layers.<i>.<self_attn|mlp>.<module>.lora_A
.weight` [rank, in] and `...lora_B.weight` [out, rank]. The model fuses q/k/v into one projection and
gate/up into another (layers.py), so an adapter's modules are laid out here per fused projection and
component (q, k, v; gate, up): A stacks each component's A rows ([components x rank, in]) and Bt holds
its B transposed and scaled by alpha / rank (alpha / sqrt(rank) with rsLoRA) in that component's
output columns, zero elsewhere ([components x rank, out]). A module fused in the checkpoint too
(Phi-3's qkv_proj) gives each component it spans its A and its rows of B. The delta of a row is then
(x . A^T) . Bt, whatever the projection, and component c's rank rows touch only its own columns.

This module owns the reading and every check of an adapter against the base it is for: it refuses,
naming the problem, a missing or unreadable file, an option it cannot serve (DoRA, biases, modules to
save, per-module alphas or ranks), a module outside the seven projections, a layer the base lacks, or a shape
that does not fit the base (another base's adapter). It must not place adapters in memory slots
(lora.py) nor decide which are resident (the engine's adapter table).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

    from services.worker.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The model's fused projections, in the order every per-layer table here uses."""
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter cannot be served on this base. The message names the adapter and the problem."""


@dataclass(frozen=True, slots=True)
class Part:
    """Where one checkpoint module sits in a fused projection: the components its output covers (q/k/v
    are components 0, 1, 2 of qkv; Phi-3's fused qkv_proj covers all three)."""

    projection: str
    components: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter, read and checked: per layer, per fused projection, (A, Bt) or None."""

    name: str
    rank: int
    layers: tuple[dict[str, tuple[Tensor, Tensor]], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for layer in self.layers for a, bt in layer.values())


def parts() -> dict[str, Part]:
    """Every module name an adapter may target -> where it sits in the base's fused projections."""
    return {
        "q_proj": Part("qkv", (0,)),
        "k_proj": Part("qkv", (1,)),
        "v_proj": Part("qkv", (2,)),
        "qkv_proj": Part("qkv", (0, 1, 2)),
        "o_proj": Part("o", (0,)),
        "gate_proj": Part("gate_up", (0,)),
        "up_proj": Part("gate_up", (1,)),
        "gate_up_proj": Part("gate_up", (0, 1)),
        "down_proj": Part("down", (0,)),
    }


def widths(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per fused projection: (in features, out features)."""
    q, kv, inter, hidden = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    return {
        "qkv": (hidden, q + 2 * kv),
        "o": (q, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }


def columns(config: ModelConfig) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per fused projection: each component's output columns [first, end)."""
    q, kv, inter, hidden = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    return {
        "qkv": ((0, q), (q, q + kv), (q + kv, q + 2 * kv)),
        "o": ((0, hidden),),
        "gate_up": ((0, inter), (inter, 2 * inter)),
        "down": ((0, hidden),),
    }


def read_adapter(name: str, directory: Path, config: ModelConfig, max_rank: int) -> AdapterWeights:
    """Read and check the PEFT adapter in `directory` for a base of `config`; AdapterError if unfit."""
    settings = _settings(name, directory)
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: adapter_config.json's r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise AdapterError(
            f"adapter {name!r} has rank {rank}, above this worker's max_lora_rank={max_rank}: raise "
            "max_lora_rank (memory for every slot grows with it) or serve a lower-rank adapter"
        )
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"adapter {name!r}: lora_alpha={alpha!r} must be a number")
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _tensors(name, directory)
    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B of a decoder layer")
        layer, module, side = int(match[1]), match[2], match[3]
        found.setdefault((layer, module), {})[side] = tensor
    layers: list[dict[str, tuple[Tensor, Tensor]]] = [{} for _ in range(config.num_hidden_layers)]
    places, shapes, spans = parts(), widths(config), columns(config)
    for (layer, module), pair in sorted(found.items()):
        place = places.get(module)
        if place is None:
            raise AdapterError(
                f"adapter {name!r} targets {module!r}; the served modules are {', '.join(places)}"
            )
        if layer >= config.num_hidden_layers:
            raise AdapterError(
                f"adapter {name!r} has weights for layer {layer}; the base has {config.num_hidden_layers} "
                "layers: it was trained for another base"
            )
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} alone")
        in_features, out_features = shapes[place.projection]
        covered = [spans[place.projection][c] for c in place.components]
        width = sum(end - first for first, end in covered)
        a, b = pair["A"], pair["B"]
        module_rank = a.shape[0]
        if a.shape != (module_rank, in_features) or b.shape != (width, module_rank) or module_rank > rank:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"the base takes A [<= {rank}, {in_features}] and B [{width}, rank]: it was "
                "trained for another base"
            )
        components = len(spans[place.projection])
        fused = layers[layer].setdefault(
            place.projection,
            (torch.zeros(components * rank, in_features), torch.zeros(components * rank, out_features)),
        )
        # A module spanning several components (a fused qkv_proj) gives each its A and its rows of B.
        offset = 0
        for component, (first, end) in zip(place.components, covered, strict=True):
            band = slice(component * rank, component * rank + module_rank)
            fused[0][band] = a.float()
            fused[1][band, first:end] = b[offset : offset + end - first].float().T * scale
            offset += end - first
    return AdapterWeights(name, rank, tuple(layers))


def _settings(name: str, directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise AdapterError(f"adapter {name!r}: no {CONFIG_FILE} in {directory}") from err
    except (OSError, json.JSONDecodeError) as err:
        raise AdapterError(f"adapter {name!r}: {path} is not readable JSON ({err})") from err
    if not isinstance(settings, dict):
        raise AdapterError(f"adapter {name!r}: {path} must hold a JSON object")
    kind = settings.get("peft_type", "LORA")
    refusals = (
        (kind != "LORA", f"peft_type {kind!r} (only LORA is served)"),
        (bool(settings.get("use_dora")), "DoRA (use_dora: true)"),
        (settings.get("bias", "none") != "none", f"trained biases (bias: {settings.get('bias')!r})"),
        (bool(settings.get("modules_to_save")), f"modules_to_save {settings.get('modules_to_save')!r}"),
        (bool(settings.get("alpha_pattern")), "per-module alphas (alpha_pattern)"),
        (bool(settings.get("rank_pattern")), "per-module ranks (rank_pattern)"),
        (bool(settings.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D bases)"),
    )
    for refused, what in refusals:
        if refused:
            raise AdapterError(f"adapter {name!r} uses {what}, which Strata does not serve")
    return settings


def _tensors(name: str, directory: Path) -> dict[str, Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.exists():
        raise AdapterError(f"adapter {name!r}: no {WEIGHTS_FILE} in {directory}")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise AdapterError(f"adapter {name!r}: {path} is not a readable safetensors file ({err})") from err
    if not tensors:
        raise AdapterError(f"adapter {name!r}: {path} holds no tensors")
    return tensors
