"""The images' base: the public Python image where a registry answers, else one made here.

The Dockerfiles start from `ARG BASE_IMAGE` (default python:3.11.14-slim-bookworm). `base_image()`
returns that image when the engine has it or can pull it; otherwise a local base of the same Debian
release, made once with mmdebstrap from Debian's mirror (minbase plus python3, python3-venv,
python-is-python3, passwd and ca-certificates: what the Dockerfiles run) and imported into the
engine, where it stays for later builds. This module makes or finds the base; it must not build the
project's images.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import TYPE_CHECKING

from container_engine import CACHE, MIRROR, apt_install

if TYPE_CHECKING:
    from container_engine import Engine

PUBLIC = "python:3.11.14-slim-bookworm"
LOCAL = "strata-local/python-bookworm:3.11"
RELEASE = "bookworm"
INCLUDE = ("python3", "python3-venv", "python-is-python3", "passwd", "ca-certificates")
PULL_TIMEOUT_S = 120


def _has(engine: Engine, image: str) -> bool:
    return engine.docker("image", "inspect", image, check=False).returncode == 0


def _pulled(engine: Engine) -> bool:
    try:
        return engine.docker("pull", PUBLIC, check=False, timeout=PULL_TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _make_local(engine: Engine) -> None:
    if shutil.which("mmdebstrap") is None:
        if os.getuid() != 0 or shutil.which("apt-get") is None:
            raise SystemExit(
                f"{PUBLIC} cannot be pulled and mmdebstrap is missing: install it "
                f"(apt-get install mmdebstrap) or pass BASE_IMAGE=<an image you have>"
            )
        apt_install("mmdebstrap")
    rootfs = CACHE / f"rootfs-{RELEASE}.tar"
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={','.join(INCLUDE)}",
            RELEASE,
            str(rootfs),
            MIRROR,
        ],
        check=True,
    )
    engine.docker(
        "import",
        "--change",
        'CMD ["python3"]',
        str(rootfs),
        LOCAL,
    )
    rootfs.unlink()


def base_image(engine: Engine) -> str:
    """The public base when the engine has or can pull it, else the local one (made on first use)."""
    if _has(engine, PUBLIC) or _pulled(engine):
        return PUBLIC
    if not _has(engine, LOCAL):
        print(f"images: {PUBLIC} cannot be pulled; making {LOCAL} with mmdebstrap from {MIRROR}", flush=True)
        _make_local(engine)
    return LOCAL
