"""The model's native CPU kernels (csrc/*.cpp): compiling them into one library, loading it.

This module owns building the C++ sources with torch's extension tools (its headers, its libraries,
its OpenMP runtime, so the kernels share torch's thread pool) into a cache directory keyed by the
sources, torch's version and the compiler; loading the library through ctypes (which releases the GIL
for each call); and the entry points' signatures. No -march: each kernel carries code for several
instruction sets and picks one at run time from the CPU it runs on, not the build machine's.
`python -m services.worker.model.native` builds it (make setup runs that); a missing build is
compiled on first use; a machine without a compiler serves through torch's own operators after one
warning, and `status()` says why ("off (...)"), for the worker to report; STRATA_NATIVE_KERNELS=off in
the environment (or set_enabled) turns them off. A built library is readable and executable by all
(an image builds it as root and runs as another user); where the configured cache is not writable
by this user and holds no build, it is built in a cache of the user's own (`cache_dirs`).
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


def _user_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata" / "kernels"


def cache_dir() -> Path:
    """Where built kernels live: $STRATA_KERNEL_CACHE, else ~/.cache/strata/kernels."""
    configured = os.environ.get(_CACHE_ENV)
    return Path(configured) if configured else _user_cache()


def _writable(directory: Path) -> bool:
    """Whether this user may create files in `directory`, or in its nearest parent that exists."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return os.access(directory, os.W_OK | os.X_OK)


def _own_cache() -> Path:
    """This user's cache: ~/.cache/strata/kernels where home is writable, else one in the temp dir."""
    home = _user_cache()
    return home if _writable(home) else Path(tempfile.gettempdir()) / f"strata-kernels-{os.getuid()}"


def cache_dirs() -> tuple[Path, ...]:
    """Where a build is looked for, in order; the last is where one is built."""
    configured = cache_dir()
    return (configured,) if _writable(configured) else (configured, _own_cache())


def _checked_own(directory: Path) -> None:
    """Refuse a build directory another user could write to: its libraries are loaded into the worker."""
    stat = directory.stat()
    if stat.st_uid != os.getuid() or stat.st_mode & 0o022:
        raise RuntimeError(
            f"the kernel cache {directory} is not this user's own (owner uid {stat.st_uid}, mode "
            f"{stat.st_mode & 0o777:o}): set {_CACHE_ENV} to a directory only this user can write"
        )


def _compiler() -> list[str]:
    return (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()


def library_path() -> Path:
    """The built library's path, one per source text, torch version and compiler: the first cache
    directory that holds it, else where `build` puts it."""
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.name.encode())
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_compiler()).encode())
    name = f"strata_kernels-{key.hexdigest()[:16]}.so"
    directories = cache_dirs()
    return next((d / name for d in directories if (d / name).exists()), directories[-1] / name)


def build() -> Path:
    """Compile the kernels if these sources, torch and compiler have no build yet; return its path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent != cache_dir():
        _checked_own(target.parent)
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
        raise RuntimeError(
            f"building the native kernels with {command[0]} failed (exit {err.returncode}); "
            f"install a C++ compiler or set CXX\n{' '.join(command)}\n{err.stderr}"
        ) from err
    except FileNotFoundError as err:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"no C++ compiler {_compiler()[0]!r} for the native kernels: set CXX") from err
    # NamedTemporaryFile made it 0600: a worker running as another user could not load it.
    partial.chmod(0o755)
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
        self.paged_decode_attention.argtypes = [
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            *([_I64] * 7),
            _F32,
            _P,
            _P,
            _I64,
            _P,
            _I64,
        ]
        self.rms_norm = library.strata_rms_norm
        self.rms_norm.restype = None
        self.rms_norm.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _F32]
        self.decode_stack = library.strata_decode_stack
        self.decode_stack.restype = None
        self.decode_stack.argtypes = [_P, _I64, _P, _P, _P, _P, _P]
        self.gguf_supported = library.strata_gguf_supported
        self.gguf_supported.restype = ctypes.c_int
        self.gguf_supported.argtypes = [_I64, _I64]
        self.gguf_dequantize = library.strata_gguf_dequantize
        self.gguf_dequantize.restype = None
        self.gguf_dequantize.argtypes = [_I64, _P, _P, _I64, _I64]
        self.gguf_set_integer_rows = library.strata_gguf_set_integer_rows
        self.gguf_set_integer_rows.restype = ctypes.c_int
        self.gguf_set_integer_rows.argtypes = [ctypes.c_int]
        self.gguf_any_rows = library.strata_gguf_any_rows
        self.gguf_any_rows.restype = ctypes.c_int
        self.gguf_any_rows.argtypes = [_I64]
        self.gguf_linear = library.strata_gguf_linear
        self.gguf_linear.restype = None
        self.gguf_linear.argtypes = [_I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64]
        self.lora_add = library.strata_lora_add
        self.lora_add.restype = None
        self.lora_add.argtypes = [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]
        self.rotary = library.strata_rotary
        self.rotary.restype = None
        self.rotary.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64]


_library: Library | None = None
_load_error: str | None = None
"""Why the library could not be built or loaded; None until it failed."""
# Read once: library() runs several times per layer, and an environment lookup each time cost 3% of a
# decode step at batch 1.
_enabled = os.environ.get(_SWITCH_ENV, "on") != "off"


def set_enabled(enabled: bool) -> bool:
    """Turn the kernels on or off for this process (benchmarks compare both); returns the old state."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def enabled() -> bool:
    """Whether this process asked for the kernels (not whether they loaded: `status` says that)."""
    return _enabled


def library() -> Library | None:
    """The loaded kernels, built on first use; None where turned off or (after one warning) unbuildable."""
    global _library, _load_error
    if not _enabled:
        return None
    if _library is None and _load_error is None:
        try:
            _library = Library(build())
        except (RuntimeError, OSError) as err:
            _load_error = str(err).splitlines()[0]
            log.warning("native CPU kernels unavailable, using torch's operators: %s", err)
    return _library


def status() -> str:
    """ "on (<isa>)", or "off (<why>)": the kernels' state as the worker reports it."""
    if not _enabled:
        switched = os.environ.get(_SWITCH_ENV) == "off"
        return f"off ({_SWITCH_ENV}=off)" if switched else "off (turned off in this process)"
    loaded = library()
    return f"on ({loaded.isa().decode()})" if loaded is not None else f"off ({_load_error})"


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
