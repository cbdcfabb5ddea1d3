"""Import every module of the named packages, so an image build fails when a dependency is missing.

The images run it as their last build step (`python -m strata.import_check gateway services.tokenizer
strata` in the services image): a hand-kept list of modules to import goes stale as modules are added,
and a dependency imported by one module only (numpy by the gateway's step cost) is then found missing
by the first request that reaches it, in production. It walks each package with pkgutil, imports every
module but `__main__` ones (whose import would run the program), and reports each failure with its
module and error; the exit code is the number of failures (capped at 100). `--skip PREFIX` leaves out a
subtree that needs what the image deliberately lacks. This module must not import anything itself
beyond what it is asked to check.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def modules(package: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The dotted names of `package` and every module under it, `__main__` modules and `skip` left out."""
    root = importlib.import_module(package)
    names = [package]
    if hasattr(root, "__path__"):
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            names.append(info.name)
    return [
        name
        for name in names
        if name.rsplit(".", 1)[-1] != "__main__" and not any(name.startswith(prefix) for prefix in skip)
    ]


def check(packages: list[str], skip: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """The modules imported, and one line per module that failed: its name and the error."""
    imported, failures = 0, []
    for package in packages:
        try:
            names = modules(package, skip)
        except Exception as err:  # every failure is reported, none is swallowed
            failures.append(f"{package}: {type(err).__name__}: {err}")
            continue
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as err:  # reported below, and counted in the exit code
                failures.append(f"{name}: {type(err).__name__}: {err}")
            else:
                imported += 1
    return imported, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", help="packages to walk, such as gateway or services.tokenizer")
    parser.add_argument("--skip", action="append", default=[], metavar="PREFIX", help="modules to leave out")
    args = parser.parse_args(argv)
    imported, failures = check(args.packages, tuple(args.skip))
    for line in failures:
        print(f"import check: {line}", file=sys.stderr)
    print(f"import check: {imported} modules imported, {len(failures)} failed ({', '.join(args.packages)})")
    return min(len(failures), 100)


if __name__ == "__main__":
    sys.exit(main())
