"""What one streaming request runs in the gateway: the modules it enters, the gateway types it makes,
the walk a reader of its path takes, and the line counts of the request-path code.

Starts the real tokenizer service, one worker and the gateway in this process on 127.0.0.1:0 over the
default model (`make model`), sends one warm-up request, then one streaming request while a profile
hook records every gateway function that runs and a wrapper on each gateway class's `__init__`
records every gateway type made. The walk is the gateway functions the request runs from
`Pipeline._serve` on, each at its first call, in the order they are first called: read as a list of
modules (a function in the same module as the one before is the same stop), it counts the stops, the
returns to a module the walk already left, and the stops in each module. Every call from one gateway
module into another while the request runs is kept too: one into a module that imports the caller
(directly or through others, read from the sources' imports, TYPE_CHECKING ones included) goes up the
layers, a callback the lower module was handed. A wake-up through an event, a timer or a future's
callback is no call: nothing of the module woken was handed down. The figures are the request path's
size and shape as a newcomer reading the code meets it; they change only when the code does. This
script must not change any service's behaviour: the hooks only record.

    .venv/bin/python scripts/request_path.py [--model-dir DIR] [--json PATH] [--tree DIR]

`--tree` measures another checkout's code (an older commit in a git worktree) with this script.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import functools
import importlib
import inspect
import json
import pkgutil
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _tree() -> Path:
    """The checkout whose code is measured: --tree's, else this script's."""
    if "--tree" in sys.argv[:-1]:
        return Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    return ROOT


TREE = _tree()
sys.path.insert(0, str(ROOT))
from bench.provenance import finish_provenance, start_provenance  # noqa: E402  (this checkout's)
from bench.stats import save_record  # noqa: E402

sys.path.insert(0, str(TREE))

import gateway  # noqa: E402  (after the path: the measured checkout's packages, never an installed copy)
from gateway.server import start as start_gateway  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from services.tokenizer.server import start as start_tokenizer  # noqa: E402
from services.tokenizer.settings import TokenizerSettings  # noqa: E402
from services.worker.server import start as start_worker  # noqa: E402
from services.worker.settings import WorkerSettings  # noqa: E402
from strata.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

GATEWAY_DIR = Path(gateway.__file__).resolve().parent
WORKER_DIR = TREE / "services" / "worker"
WALK_START = "_serve"


class Recorder:
    """The gateway modules entered and the gateway types made while `on` is set."""

    def __init__(self) -> None:
        self.on = False
        self.modules: set[str] = set()
        self.types: set[str] = set()
        self.walk: list[tuple[str, str]] = []
        """(module, function) at each gateway function's first call from Pipeline._serve's on."""
        self._seen: set[object] = set()
        self.calls: set[tuple[str, str, str, str]] = set()
        """(caller module, caller function, callee module, callee function) of every call from one
        gateway module into another while `on` is set (a coroutine resumed through the one awaiting it
        counts as called by it again, as it was)."""

    def profile(self, frame: Any, event: str, arg: object) -> None:
        if self.on and event == "call":
            code = frame.f_code
            path = Path(code.co_filename)
            if path.parent == GATEWAY_DIR:
                self.modules.add(path.stem)
                caller = frame.f_back
                if caller is not None and Path(caller.f_code.co_filename).parent == GATEWAY_DIR:
                    source = Path(caller.f_code.co_filename).stem
                    if source != path.stem:
                        self.calls.add((source, caller.f_code.co_qualname, path.stem, code.co_qualname))
                started = self.walk or (path.stem == "pipeline" and code.co_name == WALK_START)
                # A coroutine's every resumption is a call: a function is on the walk at its first
                # call only, and one first called before _serve (the front door) is not on it.
                if code not in self._seen:
                    self._seen.add(code)
                    if started:
                        self.walk.append((path.stem, code.co_qualname))

    def wrap_classes(self) -> None:
        """Wrap the `__init__` of every class defined in a gateway module (enums and protocols aside)."""
        for info in pkgutil.iter_modules([str(GATEWAY_DIR)]):
            module = importlib.import_module(f"gateway.{info.name}")
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ != module.__name__ or getattr(cls, "_is_protocol", False):
                    continue
                if issubclass(cls, Exception) or "__init__" not in cls.__dict__:
                    continue
                cls.__init__ = self._recording(cls, cls.__dict__["__init__"])  # type: ignore[method-assign]

    def _recording(self, cls: type, init: Any) -> Any:
        name = f"{cls.__module__.removeprefix('gateway.')}.{cls.__qualname__}"

        @functools.wraps(init)
        def recorded(instance: object, *args: object, **kwargs: object) -> None:
            if self.on:
                self.types.add(name)
            init(instance, *args, **kwargs)

        return recorded


def walk_figures(walk: list[tuple[str, str]]) -> dict[str, Any]:
    """The walk as a reader takes it: stops (a run of functions in one module is one stop), the
    returns to a module already left, and the stops per module, most first."""
    stops: list[str] = []
    for module, _ in walk:
        if not stops or stops[-1] != module:
            stops.append(module)
    entries: dict[str, int] = {}
    returns = 0
    for module in stops:
        returns += module in entries
        entries[module] = entries.get(module, 0) + 1
    return {
        "functions": [f"{module}.{name}" for module, name in walk],
        "stops": len(stops),
        "modules": len(entries),
        "returns_to_a_module_left": returns,
        "stops_per_module": dict(sorted(entries.items(), key=lambda item: (-item[1], item[0]))),
        "most_stops_in_one_module": max(entries.values(), default=0),
    }


def import_graph() -> dict[str, set[str]]:
    """Each gateway module's gateway imports, TYPE_CHECKING ones included, read from its source."""
    graph: dict[str, set[str]] = {}
    for path in GATEWAY_DIR.glob("*.py"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "gateway":
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gateway."):
                imported.add(node.module.removeprefix("gateway.").split(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(
                    alias.name.split(".")[1] for alias in node.names if alias.name.startswith("gateway.")
                )
        graph[path.stem] = imported
    return graph


def upward_calls(calls: set[tuple[str, str, str, str]]) -> dict[str, Any]:
    """The calls that go up the layers: from a module into one that imports it (directly or through
    others). The code below holds a callback, a protocol or a lambda of the module above it, so a
    reader of the lower module is sent back up to find what runs."""
    graph = import_graph()

    def above(module: str) -> set[str]:
        found: set[str] = set()
        frontier = {module}
        while frontier:
            frontier = {name for name, imported in graph.items() if imported & frontier} - found
            found |= frontier
        return found

    importers = {module: above(module) for module in {source for source, _, _, _ in calls}}
    edges = sorted(
        f"{source}.{caller} -> {target}.{callee}"
        for source, caller, target, callee in calls
        if target in importers[source]
    )
    return {"count": len(edges), "calls": edges}


def line_counts() -> dict[str, int]:
    gateway_lines = sum(len(path.read_text().splitlines()) for path in GATEWAY_DIR.glob("*.py"))
    worker_lines = sum(len(path.read_text().splitlines()) for path in WORKER_DIR.glob("*.py"))
    return {"gateway": gateway_lines, "services/worker outside engine/ and model/": worker_lines}


async def measure(model_dir: Path, recorder: Recorder) -> None:
    tokenizer = await start_tokenizer(
        TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {"m": model_dir}})
    )
    worker = await start_worker(
        WorkerSettings.build(
            {"listen": "127.0.0.1:0", "model_name": "m", "model_path": model_dir, "device": "cpu"}
        )
    )
    await worker.wait_ready()
    server = await start_gateway(
        GatewaySettings.build(
            {
                "listen": "127.0.0.1:0",
                "tokenizer_address": tokenizer.address,
                "routes": [{"model": "m", "workers": [worker.address]}],
            }
        )
    )
    try:
        assert await server.wait_ready(60.0), "the gateway never became ready"
        import grpc

        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = gateway_pb2.GenerateRequest(prompt="The capital of France is")
            request.sampling.max_new_tokens = 8
            await stub.Generate(request)  # warm: links connected, first-call paths taken
            recorder.on = True
            async for _ in stub.GenerateStream(request):
                pass
            await asyncio.sleep(0.2)  # the request's last bookkeeping (cancel of a finished request)
            recorder.on = False
    finally:
        await server.stop(0)
        await worker.stop(0)
        await tokenizer.stop(0)


def _tree_commit() -> str:
    """The commit of the measured checkout (this one's unless --tree names another)."""
    import subprocess

    return subprocess.run(
        ["git", "-C", str(TREE), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    args = parser.parse_args()
    provenance = start_provenance()
    recorder = Recorder()
    recorder.wrap_classes()
    threading.setprofile(recorder.profile)
    sys.setprofile(recorder.profile)
    try:
        asyncio.run(measure(args.model_dir, recorder))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    modules_total = len([path for path in GATEWAY_DIR.glob("*.py") if not path.stem.startswith("__")])
    record = {
        "provenance": finish_provenance(provenance),
        # A census of the code the request ran: no figure depends on the machine's load.
        "timed": False,
        "gateway_modules_run": sorted(recorder.modules),
        "gateway_modules_run_count": len(recorder.modules),
        "gateway_modules_total": modules_total,
        "gateway_types_made": sorted(recorder.types),
        "gateway_types_made_count": len(recorder.types),
        "walk_from_serve": walk_figures(recorder.walk),
        "upward_calls": upward_calls(recorder.calls),
        "measured_tree": _tree_commit(),
        "lines": line_counts(),
    }
    print(json.dumps(record, indent=2))
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
