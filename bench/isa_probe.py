"""Which x86 instruction sets this process may really execute, and the llama.cpp build flags from that.

/proc/cpuinfo is not enough: a virtual machine can list AVX-512 or AMX while the hypervisor or the
kernel refuses them (AMX needs Linux's arch_prctl(ARCH_REQ_XCOMP_PERM) grant, which a kernel may
deny), and a build made for the listed set (GGML_NATIVE=ON, -march=native) then dies with SIGILL.
So each feature group is a tiny C program, compiled with gcc and run in a child process: it
executes at least one instruction of each feature it claims (inline assembly, so no compiler can fold
it away) and exits 0; SIGILL, any other signal or a refused permission (exit 3) means not usable.

This module probes and chooses flags; it must not build llama.cpp (bench/peer_setup.py does) nor
time anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

# AMX's permission request needs the syscall headers; the other programs include them unused.
_MAIN = (
    "#include <string.h>\n#include <sys/syscall.h>\n#include <unistd.h>\n"
    "int main(void) {{\n{body}\n  return 0;\n}}\n"
)

# One program per group of features that llama.cpp enables together; each body runs one
# instruction per feature. Registers are zeroed first so no instruction faults on its data.
PROGRAMS: dict[str, str] = {
    # GGML_SSE42/AVX/AVX2/FMA/F16C/BMI2: llama.cpp's AVX2 baseline.
    "avx2": """
  unsigned long long x = 5, m = 3, r;
  __asm__ volatile("vpxor %%ymm0, %%ymm0, %%ymm0\\n\\t"
                   "vpaddd %%ymm0, %%ymm0, %%ymm1\\n\\t"
                   "vfmadd231ps %%ymm0, %%ymm0, %%ymm1\\n\\t"
                   "vcvtph2ps %%xmm0, %%ymm2\\n\\t"
                   "crc32q %%rax, %%rax\\n\\t"
                   "vzeroupper" ::: "xmm0", "xmm1", "xmm2", "rax");
  __asm__ volatile("pdep %2, %1, %0" : "=r"(r) : "r"(x), "r"(m));
  (void)r;""",
    # GGML_AVX512: F, CD, VL, DQ and BW together (what ggml passes as -mavx512f ... -mavx512bw).
    "avx512": """
  __asm__ volatile("vpxord %%zmm0, %%zmm0, %%zmm0\\n\\t"
                   "vpconflictd %%zmm0, %%zmm1\\n\\t"
                   "vpaddd %%ymm0, %%ymm0, %%ymm1\\n\\t"
                   "vpmullq %%zmm0, %%zmm0, %%zmm1\\n\\t"
                   "vpaddb %%zmm0, %%zmm0, %%zmm1\\n\\t"
                   "vzeroupper" ::: "xmm0", "xmm1");""",
    "avx512_vnni": """
  __asm__ volatile("vpxord %%zmm0, %%zmm0, %%zmm0\\n\\t"
                   "vpdpbusd %%zmm0, %%zmm0, %%zmm1\\n\\t"
                   "vzeroupper" ::: "xmm0", "xmm1");""",
    "avx512_vbmi": """
  __asm__ volatile("vpxord %%zmm0, %%zmm0, %%zmm0\\n\\t"
                   "vpermb %%zmm0, %%zmm0, %%zmm1\\n\\t"
                   "vzeroupper" ::: "xmm0", "xmm1");""",
    "avx512_bf16": """
  __asm__ volatile("vpxord %%zmm0, %%zmm0, %%zmm0\\n\\t"
                   "vdpbf16ps %%zmm0, %%zmm0, %%zmm1\\n\\t"
                   "vzeroupper" ::: "xmm0", "xmm1");""",
    # AVX-VNNI is the VEX encoding of the same dot product, a separate CPUID bit.
    "avx_vnni": """
  __asm__ volatile("vpxor %%ymm0, %%ymm0, %%ymm0\\n\\t"
                   "%{vex%} vpdpbusd %%ymm0, %%ymm0, %%ymm1\\n\\t"
                   "vzeroupper" ::: "xmm0", "xmm1");""",
    # AMX: Linux grants the tile data state only on request; a refusal is exit 3.
    "amx": """
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0)
    return 3;
  unsigned char config[64] __attribute__((aligned(64)));
  memset(config, 0, sizeof config);
  config[0] = 1;                                    /* palette 1 */
  for (int t = 0; t < 3; ++t) { config[16 + 2 * t] = 64; config[48 + t] = 16; }  /* 16 rows x 64 B */
  static signed char a[16 * 64], b[16 * 64];
  static int c[16 * 16];
  memset(a, 1, sizeof a);
  memset(b, 2, sizeof b);
  __asm__ volatile("ldtilecfg %0" :: "m"(config));
  __asm__ volatile("tilezero %%tmm0\\n\\t"
                   "tileloadd (%0,%2,1), %%tmm1\\n\\t"
                   "tileloadd (%1,%2,1), %%tmm2\\n\\t"
                   "tdpbssd %%tmm2, %%tmm1, %%tmm0\\n\\t"
                   "tilestored %%tmm0, (%3,%2,1)\\n\\t"
                   "tilezero %%tmm1\\n\\t"
                   "tdpbf16ps %%tmm2, %%tmm1, %%tmm0\\n\\t"
                   "tilerelease" :: "r"(a), "r"(b), "r"(64L), "r"(c) : "memory");
  /* 64 products of 1 x 2 per element: anything else means the tiles did not compute. */
  if (c[0] != 128 || c[255] != 128) return 4;""",
}
REFUSED_EXIT = 3

# The ggml CMake options each probed group switches on.
GGML_OPTIONS: dict[str, tuple[str, ...]] = {
    "avx2": ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"),
    "avx_vnni": ("GGML_AVX_VNNI",),
    "avx512": ("GGML_AVX512",),
    "avx512_vnni": ("GGML_AVX512_VNNI",),
    "avx512_vbmi": ("GGML_AVX512_VBMI",),
    "avx512_bf16": ("GGML_AVX512_BF16",),
    "amx": ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"),
}
# Groups that need another one (ggml enables the AVX-512 extensions only inside GGML_AVX512).
REQUIRES = {
    "avx_vnni": "avx2",
    "avx512": "avx2",
    "avx512_vnni": "avx512",
    "avx512_vbmi": "avx512",
    "avx512_bf16": "avx512",
    "amx": "avx512",
}
# STRATA_NATIVE_ISA caps (services/worker/model/csrc/isa.h): the groups the peer may use under each,
# so both sides run the same instruction set. No cap: whatever runs.
CAPS: dict[str, frozenset[str]] = {"portable": frozenset(), "avx2": frozenset({"avx2"})}


CAP_ENV = "STRATA_NATIVE_ISA"


def add_cap_option(parser: argparse.ArgumentParser) -> None:
    """`--native-isa`, so a record of a capped run stores the cap in its command and reruns capped."""
    parser.add_argument(
        "--native-isa",
        choices=sorted(CAPS),
        help=f"cap both sides' instruction set ({CAP_ENV}): avx2 measures a machine without AVX-512",
    )


def apply_cap(cap: str | None) -> None:
    """Set the cap for this process and every process it starts: our kernels read it when they load,
    the peer's build plan when it is made, so call this before either."""
    if cap is not None:
        os.environ[CAP_ENV] = cap


@dataclass(frozen=True, slots=True)
class Probe:
    """One group's outcome: usable, and why (runs, SIGILL, refused, does not compile)."""

    group: str
    usable: bool
    reason: str


def outcome(group: str, returncode: int) -> Probe:
    """What a probe program's exit status means."""
    if returncode == 0:
        return Probe(group, True, "runs")
    if returncode == REFUSED_EXIT:
        return Probe(group, False, "the kernel refused the permission (arch_prctl)")
    if returncode < 0:
        return Probe(group, False, f"killed by {signal.Signals(-returncode).name}")
    return Probe(group, False, f"exited {returncode}")


def probe(group: str, workdir: Path, compiler: str = "gcc") -> Probe:
    source = workdir / f"{group}.c"
    binary = workdir / group
    source.write_text(_MAIN.format(body=PROGRAMS[group]))
    built = subprocess.run(
        [compiler, "-O0", "-o", str(binary), str(source)], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        first = (built.stderr.strip().splitlines() or ["no message"])[0]
        return Probe(group, False, f"does not compile: {first}")
    return outcome(group, subprocess.run([str(binary)], check=False, timeout=30).returncode)


def probe_all(compiler: str = "gcc") -> dict[str, Probe]:
    """Every group probed in its own child process."""
    if shutil.which(compiler) is None:
        raise SystemExit(f"bench.isa_probe: no {compiler} on PATH: install it (apt-get install gcc)")
    with tempfile.TemporaryDirectory(prefix="strata-isa-") as scratch:
        return {group: probe(group, Path(scratch), compiler) for group in PROGRAMS}


def usable_groups(probes: dict[str, Probe], cap: str | None = None) -> frozenset[str]:
    """The groups that run, whose prerequisite runs too, within the cap."""
    if cap is not None and cap not in CAPS:
        raise SystemExit(
            f"bench.isa_probe: STRATA_NATIVE_ISA={cap!r} is no cap: use one of {sorted(CAPS)} or unset it"
        )
    running = {group for group, found in probes.items() if found.usable}
    chosen: set[str] = set()
    for group in GGML_OPTIONS:
        needed = REQUIRES.get(group)
        if group in running and (needed is None or needed in chosen):
            chosen.add(group)
    return frozenset(chosen if cap is None else chosen & CAPS[cap])


def ggml_flags(groups: frozenset[str]) -> tuple[str, ...]:
    """Explicit CMake flags, every ggml ISA option named ON or OFF, never GGML_NATIVE."""
    flags = ["-DGGML_NATIVE=OFF"]
    for group, options in GGML_OPTIONS.items():
        state = "ON" if group in groups else "OFF"
        flags.extend(f"-D{option}={state}" for option in options)
    return tuple(flags)


def label(groups: frozenset[str]) -> str:
    """A short name for a flag set, for the build directory: the widest group, then extensions."""
    if not groups:
        return "portable"
    return "-".join(sorted(groups, key=list(GGML_OPTIONS).index))
