"""bench.isa_probe: what a probe's exit means, which ggml flags follow, and one real probe run.

The flag choice is checked on given outcomes (a VM that lists AMX but refuses it, one without
AVX-512, the avx2 cap); the real probe compiles and runs its programs here, so it must at least find
what the interpreter itself runs on (x86-64 with AVX2 on every machine this project benchmarks).
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
from pathlib import Path

import pytest

from bench.isa_probe import (
    GGML_OPTIONS,
    PROGRAMS,
    REFUSED_EXIT,
    Probe,
    apply_cap,
    ggml_flags,
    label,
    outcome,
    probe,
    probe_all,
    usable_groups,
)
from bench.peer import parse_args as peer_args
from bench.peer_setup import plan_build
from bench.serve_peer import parse as serve_peer_args


def _found(*usable: str) -> dict[str, Probe]:
    return {group: Probe(group, group in usable, "runs" if group in usable else "x") for group in PROGRAMS}


def test_exit_status_means_runs_sigill_or_refused() -> None:
    assert outcome("avx512", 0).usable
    sigill = outcome("avx512", -signal.SIGILL)
    assert not sigill.usable and sigill.reason == "killed by SIGILL"
    refused = outcome("amx", REFUSED_EXIT)
    assert not refused.usable and "refused" in refused.reason


def test_flags_name_every_option_explicitly_and_never_native() -> None:
    everything = usable_groups(_found(*PROGRAMS))
    flags = ggml_flags(everything)
    assert flags[0] == "-DGGML_NATIVE=OFF"
    assert "-DGGML_NATIVE=ON" not in flags
    named = {flag.split("=")[0].removeprefix("-D") for flag in flags[1:]}
    assert named == {option for options in GGML_OPTIONS.values() for option in options}
    assert all(flag.endswith("=ON") for flag in flags[1:])


def test_amx_listed_but_refused_builds_avx512_without_amx() -> None:
    groups = usable_groups(_found("avx2", "avx512", "avx512_vnni", "avx_vnni"))
    flags = ggml_flags(groups)
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)


def test_an_extension_without_its_base_is_not_used() -> None:
    # AVX-512 VNNI runs but AVX-512 F/BW/VL does not: ggml only enables the extensions inside AVX512.
    groups = usable_groups(_found("avx2", "avx512_vnni", "amx"))
    assert groups == frozenset({"avx2"})


def test_the_avx2_cap_matches_our_kernels_and_gets_its_own_build_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = _found(*PROGRAMS)
    flags = ggml_flags(usable_groups(found, "avx2"))
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_FMA=ON" in flags
    assert "-DGGML_AVX512=OFF" in flags and "-DGGML_AVX_VNNI=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags
    monkeypatch.setenv("STRATA_NATIVE_ISA", "avx2")
    capped = plan_build(tmp_path, found)
    monkeypatch.delenv("STRATA_NATIVE_ISA")
    full = plan_build(tmp_path, found)
    assert capped.directory == tmp_path / "build-avx2" and capped.cap == "avx2"
    assert full.directory != capped.directory and full.isa_flags != capped.isa_flags
    assert label(frozenset()) == "portable"
    with pytest.raises(SystemExit, match="avx3"):
        usable_groups(found, "avx3")


def test_the_native_isa_option_caps_the_peer_build_and_what_the_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The option, not the environment, carries the cap, so a record's stored command reruns capped.
    monkeypatch.delenv("STRATA_NATIVE_ISA", raising=False)
    found = _found(*PROGRAMS)
    assert peer_args([]).native_isa is None
    apply_cap(peer_args([]).native_isa)
    assert plan_build(tmp_path, found).cap is None
    apply_cap(serve_peer_args(["--native-isa", "avx2"]).native_isa)
    assert os.environ["STRATA_NATIVE_ISA"] == "avx2"
    assert plan_build(tmp_path, found).directory == tmp_path / "build-avx2"
    with pytest.raises(SystemExit):
        peer_args(["--native-isa", "avx3"])


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="the probes are x86-64 C"
)
def test_the_real_probe_finds_what_this_cpu_runs(tmp_path: Path) -> None:
    found = probe_all()
    assert set(found) == set(PROGRAMS)
    cpu = Path("/proc/cpuinfo").read_text()
    if " avx2 " in cpu:
        assert found["avx2"].usable, found["avx2"].reason
    # A probe that cannot run its instruction says so instead of passing: an invalid AMX program
    # (no tile config loaded) must fail, whatever this CPU has.
    broken = PROGRAMS["amx"].replace('__asm__ volatile("ldtilecfg %0" :: "m"(config));', "")
    assert broken != PROGRAMS["amx"]
    PROGRAMS["amx-broken"] = broken
    try:
        broken_probe = probe("amx-broken", tmp_path)
        assert not broken_probe.usable and "does not compile" not in broken_probe.reason
    finally:
        del PROGRAMS["amx-broken"]
