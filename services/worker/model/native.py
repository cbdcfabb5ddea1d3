"""The model's native CPU kernels (csrc/*.cpp): compiling them into one library, loading it.

This module owns building the C++ sources with torch's extension tools (its headers, its libraries,
its OpenMP runtime, so the kernels share torch's thread pool) into a cache directory keyed by the
sources, torch's version and the compiler; loading the library through ctypes (which releases the GIL
for each call); and the entry points' signatures. No -march: each kernel carries code for several
instruction sets and picks one at run time from the CPU it runs on, not the build machine's.
`python -m services.worker.model.native` builds it (make setup runs that); a missing build is
compiled on first use; a machine without a compiler serves through torch's own operators after one
warning; STRATA_NATIVE_KERNELS=off in the environment (or set_enabled) turns them off;
STRATA_NATIVE_ISA=avx2 or portable caps the instruction set (csrc/isa.h), so tests run every code path
on one machine. It must not decide when a kernel applies: small_linear.py and attention.py do.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))
# Headers are part of a build's identity too: a changed header must not reuse an old library.
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
_CACHE_ENV = "STRATA_KERNEL_CACHE"
_SWITCH_ENV = "STRATA_NATIVE_KERNELS"
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def cache_dir() -> Path:
    """Where built kernels live: $STRATA_KERNEL_CACHE, else ~/.cache/strata/kernels."""
    configured = os.environ.get(_CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata" / "kernels"


def _compiler() -> list[str]:
    return (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()


def library_path() -> Path:
    """The built library's path: one per source text, torch version and compiler."""
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.name.encode())
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_compiler()).encode())
    return cache_dir() / f"strata_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels if these sources, torch and compiler have no build yet; return its path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = cpp_extension.library_paths()[0]
    # Two workers starting at once may both compile: each writes its own file, the rename is atomic.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as scratch:
        partial = Path(scratch.name)
    command = [
        *_compiler(),
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        *(str(source) for source in SOURCES),
        "-o",
        str(partial),
        # torch's own libgomp first: one OpenMP runtime (and thread team) per process.
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as err:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building the native kernels failed: {' '.join(command)}\n{err.stderr}") from err
    except FileNotFoundError as err:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"no C++ compiler {_compiler()[0]!r} for the native kernels: set CXX") from err
    partial.replace(target)
    return target


class Library:
    """The loaded kernels' entry points, with their C signatures."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        self.isa = library.strata_small_linear_isa
        self.isa.restype = ctypes.c_char_p
        self.isa.argtypes = []
        self.small_linear = library.strata_small_linear
        self.small_linear.restype = None
        self.small_linear.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64]
        self.small_linear_int8 = library.strata_small_linear_int8
        self.small_linear_int8.restype = None
        self.small_linear_int8.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64]
        self.paged_decode_attention = library.strata_paged_decode_attention
        self.paged_decode_attention.restype = None
        self.paged_decode_attention.argtypes = [_P, _P, _P, _P, _P, _P, *([_I64] * 7), _F32, _P, _P, _I64, _P]
        self.rms_norm = library.strata_rms_norm
        self.rms_norm.restype = None
        self.rms_norm.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _F32]
        self.decode_stack = library.strata_decode_stack
        self.decode_stack.restype = None
        self.decode_stack.argtypes = [_P, _I64, _P, _P, _P, _P, _P]
        self.rotary = library.strata_rotary
        self.rotary.restype = None
        self.rotary.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64]


_library: Library | None = None
_load_failed = False
# Read once: library() runs several times per layer, and an environment lookup each time cost 3% of a
# decode step at batch 1.
_enabled = os.environ.get(_SWITCH_ENV, "on") != "off"


def set_enabled(enabled: bool) -> bool:
    """Turn the kernels on or off for this process (benchmarks compare both); returns the old state."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def library() -> Library | None:
    """The loaded kernels, built on first use; None where turned off or (after one warning) unbuildable."""
    global _library, _load_failed
    if not _enabled:
        return None
    if _library is None and not _load_failed:
        try:
            _library = Library(build())
        except (RuntimeError, OSError) as err:
            _load_failed = True
            log.warning("native CPU kernels unavailable, using torch's operators: %s", err)
    return _library


def isa() -> str | None:
    """The instruction set the kernels chose on this CPU, or None when they are unavailable."""
    loaded = library()
    return loaded.isa().decode() if loaded is not None else None


def main() -> int:
    path = build()
    print(f"native CPU kernels: {path} ({isa()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
