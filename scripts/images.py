"""Build the services image and the CPU worker image, offline where no registry answers.

`make images` runs this. It finds or provisions a Docker Engine (container_engine.py), picks the
base (local_base.py: the public Python image, else one made with mmdebstrap), puts a torch wheel
from pip's find-links into deploy/docker/wheels/ when there is one (the CPU worker then installs
torch from it instead of the PyTorch index), mounts the host's CA bundle into the builds as a
secret (pip's HTTPS to PyPI goes through the machine's own trust store; nothing is baked in), and
builds both images with BuildKit's layer cache. It prints each image's size and build time.
`--json PATH --cold` writes a record (bench/provenance.py) of a cold build (`--no-cache`) followed
by a cached rebuild of each image. It must not run the images: tests/containers does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from container_engine import Engine, engine
from local_base import base_image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.provenance import finish_provenance, start_provenance  # noqa: E402

WHEELS = ROOT / "deploy" / "docker" / "wheels"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGES = {
    "strata/services:0.1.0": ("deploy/docker/Dockerfile.services", None),
    "strata/worker-cpu:0.1.0": ("deploy/docker/Dockerfile.worker", "cpu"),
}


def torch_wheel() -> Path | None:
    """A torch CPU wheel of the pinned version in pip's find-links, for builds the index cannot feed."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    places = [os.environ.get("PIP_FIND_LINKS", "")]
    places += [line.split("=", 1)[1].strip("'\"") for line in listed.splitlines() if "find-links" in line]
    for place in filter(None, places):
        for found in sorted(Path(place).glob("torch-2.13.0+cpu-cp311-*.whl")):
            return found
    return None


def stage_wheel() -> str:
    """Link (or copy) the torch wheel into the build context; what the worker build will use."""
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    wheel = torch_wheel()
    if wheel is None:
        return "the PyTorch index (no torch wheel in pip's find-links)"
    target = WHEELS / wheel.name
    try:
        os.link(wheel, target)
    except OSError:
        shutil.copy2(wheel, target)
    return str(wheel)


def build(found: Engine, tag: str, base: str, *, cold: bool) -> float:
    dockerfile, target = IMAGES[tag]
    command = ["build", "-f", dockerfile, "-t", tag, "--build-arg", f"BASE_IMAGE={base}"]
    if target:
        command += ["--target", target]
    if CA_BUNDLE.exists():
        command += ["--secret", f"id=ca-bundle,src={CA_BUNDLE}"]
    if cold:
        command.append("--no-cache")
    started = time.monotonic()
    # Engine 25+ builds with BuildKit by default: the secret mounts need it.
    found.docker(*command, ".", capture=False, cwd=ROOT)
    return time.monotonic() - started


def size_bytes(found: Engine, tag: str) -> int:
    return int(found.docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write a record of the builds here")
    parser.add_argument(
        "--cold", action="store_true", help="build without the cache first, then rebuild cached"
    )
    args = parser.parse_args(argv)
    provenance = start_provenance()
    found = engine()
    print(f"images: Docker Engine {found.version}, {found.origin}", flush=True)
    began = time.monotonic()
    base = base_image(found)
    base_s = round(time.monotonic() - began, 1)
    torch_source = stage_wheel()
    print(f"images: base {base}; torch from {torch_source}", flush=True)
    figures: dict[str, dict[str, float | int]] = {}
    for tag in IMAGES:
        seconds: dict[str, float | int] = {}
        if args.cold:
            seconds["cold_build_s"] = round(build(found, tag, base, cold=True), 1)
        seconds["build_s" if not args.cold else "cached_build_s"] = round(
            build(found, tag, base, cold=False), 1
        )
        seconds["size_bytes"] = size_bytes(found, tag)
        figures[tag] = seconds
        shown = ", ".join(f"{k} {v}" for k, v in seconds.items())
        print(f"images: {tag}: {shown} ({seconds['size_bytes'] / 2**20:.0f} MiB)", flush=True)
    if args.json:
        record = {
            "engine": {"version": found.version, "origin": found.origin},
            "base_image": base,
            "base_image_s": base_s,
            "base_image_note": "the time to find, pull or make the base: about 0 once it is in the engine",
            "torch_source": torch_source,
            "images": figures,
            "provenance": finish_provenance(provenance),
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"images: wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
