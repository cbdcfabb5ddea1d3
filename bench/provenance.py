"""Every record's provenance: the commit, command, machine, load and versions a figure came from.

The one way a benchmark (or any other writer of bench/results/) describes what ran: call
`start_provenance` when the run starts (after `torch.set_num_threads`, so the threads are the run's),
put it in the record's top-level "provenance", and `finish_provenance` at the end (`save_record`
does it for a record that has not). `check_provenance` lists what a record's block lacks; the unit
tests hold every committed record to it. The schema (bench/README.md, rule 8):

    commit, dirty, date (UTC, ISO 8601, the start), command (argv, module form),
    machine {cpu_model, logical_cpus, usable_cpus, physical_cores, threads, isa, device[, gpu, cuda]},
    load_average {start, end}, versions {python, torch, transformers, ...[, llama_cpp]}

`isa` is what the native kernels chose (services/worker/model/native, csrc/isa.h: the best the CPU
has, capped by STRATA_NATIVE_ISA), "off" when STRATA_NATIVE_KERNELS=off, "unavailable" when they
cannot be built, "none" on a CUDA run (they are CPU kernels). This module describes; it must not
time anything, load a model, or be imported by the product.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
ISAS = ("avx512", "avx2", "portable", "off", "unavailable", "none")
# Packages whose version can move a figure; the ones not installed are left out.
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "grpcio", "protobuf", "llguidance", "xgrammar")
REQUIRED_VERSIONS = ("python", "torch", "transformers")
MACHINE_KEYS = {
    "cpu_model": str,
    "logical_cpus": int,
    "usable_cpus": int,
    "physical_cores": int,
    "threads": int,
    "isa": str,
}
LLAMA_CPP_KEYS = ("version", "build_flags", "system_info")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def git_checkout(tree: Path = REPOSITORY) -> tuple[str, bool]:
    """The checkout's HEAD commit ("" outside git) and whether its tracked files outside bench/results/
    differ from it: a record an earlier step of the same make target just wrote (bench-peer's
    perplexity record, say) is not the code being measured."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, check=False)
    if head.returncode != 0:
        return "", False
    outside_records = ["--", ".", ":(exclude)bench/results"]
    dirty = (
        subprocess.run(["git", "diff", "--quiet", "HEAD", *outside_records], cwd=tree, check=False).returncode
        != 0
    )
    return head.stdout.strip(), dirty


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")  # Linux only; elsewhere platform's answer is the best there is
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _physical_cores() -> int:
    """Distinct (socket, core) pairs in /proc/cpuinfo; the logical CPUs where it does not say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    cores: set[tuple[str, str]] = set()
    physical = ""
    for line in text.splitlines():
        if line.startswith("physical id"):
            physical = line.split(":", 1)[1].strip()
        elif line.startswith("core id"):
            cores.add((physical, line.split(":", 1)[1].strip()))
    return len(cores) or os.cpu_count() or 1


def native_isa(device: str) -> str:
    """The instruction set the native kernels run with in this process (see the module docstring)."""
    if device != "cpu":
        return "none"
    from services.worker.model import native

    chosen = native.isa()
    if chosen is not None:
        return chosen
    return "off" if os.environ.get("STRATA_NATIVE_KERNELS") == "off" else "unavailable"


def command_line(argv: list[str] | None = None) -> list[str]:
    """argv as run, its program in module form (`python -m bench.engine`) or relative to the checkout."""
    argv = list(sys.argv if argv is None else argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if argv and argv[0] not in ("-c", "-m") and spec is not None and spec.name not in ("", "__main__"):
        return ["python", "-m", spec.name.removesuffix(".__main__"), *argv[1:]]
    if not argv or argv[0] in ("-c", "-m"):
        return ["python", *argv]
    program = Path(argv[0])
    if program.is_absolute() and program.is_relative_to(REPOSITORY):
        program = program.relative_to(REPOSITORY)
    elif program.is_absolute():
        program = Path(program.name)
    return [str(program), *argv[1:]]


def _versions() -> dict[str, Any]:
    versions: dict[str, Any] = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def start_provenance(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """The provenance block at the start of a run; `threads`: torch's current count when None."""
    import torch

    commit, dirty = git_checkout()
    machine: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count() or 1,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "physical_cores": _physical_cores(),
        "threads": torch.get_num_threads() if threads is None else threads,
        "isa": native_isa(device),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
        machine["cuda"] = torch.version.cuda
    return {
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine,
        # Other tenants of a shared machine show up here; a high load explains a wide spread.
        "load_average": {"start": list(os.getloadavg()), "end": None},
        "versions": _versions(),
    }


def finish_provenance(provenance: dict[str, Any]) -> dict[str, Any]:
    """The same block with the load average at the end of the run filled in (in place, and returned)."""
    provenance["load_average"]["end"] = list(os.getloadavg())
    return provenance


def _load_problems(load: object) -> list[str]:
    if not isinstance(load, dict):
        return ["provenance.load_average is not an object with start and end"]
    problems = []
    for edge in ("start", "end"):
        value = load.get(edge)
        if not (
            isinstance(value, list) and len(value) == 3 and all(isinstance(v, int | float) for v in value)
        ):
            problems.append(f"provenance.load_average.{edge} is {value!r}, not three numbers")
    return problems


def _machine_problems(machine: object) -> list[str]:
    if not isinstance(machine, dict):
        return ["provenance.machine is not an object"]
    problems = []
    for key, kind in MACHINE_KEYS.items():
        value = machine.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"provenance.machine.{key} is {value!r}, not a {kind.__name__}")
    if machine.get("isa") not in ISAS:
        problems.append(f"provenance.machine.isa is {machine.get('isa')!r}, not one of {', '.join(ISAS)}")
    return problems


def _version_problems(versions: object) -> list[str]:
    if not isinstance(versions, dict):
        return ["provenance.versions is not an object"]
    problems = [
        f"provenance.versions.{name} is missing"
        for name in REQUIRED_VERSIONS
        if not isinstance(versions.get(name), str)
    ]
    if "llama_cpp" in versions:
        peer = versions["llama_cpp"]
        missing = [key for key in LLAMA_CPP_KEYS if not isinstance(peer, dict) or key not in peer]
        if missing:
            problems.append(f"provenance.versions.llama_cpp lacks {', '.join(missing)}")
    return problems


def check_provenance(record: dict[str, Any]) -> list[str]:
    """What the record's provenance lacks or gets wrong; empty when it follows the schema and, for a
    timed record, the machine was not busy at its start."""
    problems = schema_problems(record)
    if record.get("timed", True) and not problems:
        problems += _busy_problems(record["provenance"])
    return problems


def schema_problems(record: dict[str, Any]) -> list[str]:
    """What the record's provenance lacks or gets wrong against the schema alone: for a --smoke record
    a test just wrote, whose load is the test run's own and which is never quoted."""
    provenance = record.get("provenance") if isinstance(record, dict) else None
    if not isinstance(provenance, dict):
        return ["no top-level provenance object: rerun the benchmark (bench/provenance.py writes it)"]
    problems = []
    commit = provenance.get("commit")
    if not (isinstance(commit, str) and _COMMIT.fullmatch(commit)):
        problems.append(f"provenance.commit is {commit!r}, not a 40-hex commit")
    if not isinstance(provenance.get("dirty"), bool):
        problems.append(f"provenance.dirty is {provenance.get('dirty')!r}, not true or false")
    try:
        date = datetime.datetime.fromisoformat(str(provenance.get("date")))
        if date.utcoffset() != datetime.timedelta(0):
            problems.append(f"provenance.date {provenance['date']} is not in UTC")
    except ValueError:
        problems.append(f"provenance.date is {provenance.get('date')!r}, not an ISO 8601 time")
    command = provenance.get("command")
    if not (isinstance(command, list) and command and all(isinstance(part, str) for part in command)):
        problems.append(f"provenance.command is {command!r}, not a non-empty argv list")
    problems += _machine_problems(provenance.get("machine"))
    problems += _load_problems(provenance.get("load_average"))
    problems += _version_problems(provenance.get("versions"))
    return problems


def _busy_problems(provenance: dict[str, Any]) -> list[str]:
    """A timed record whose machine already ran a whole machine's worth of other work at its start
    measured the neighbours as much as the code (the reruns at load 8-18 on 2 cores were 4-40x off)."""
    busy = provenance["load_average"]["start"][0]
    cpus = provenance["machine"]["usable_cpus"]
    if busy > cpus:
        return [
            f"provenance.load_average.start is {busy:.1f} on {cpus} CPUs: the machine was busy; "
            "rerun it alone (make records refuses to start on a busy machine), or mark a record that "
            'times nothing with "timed": false'
        ]
    return []
