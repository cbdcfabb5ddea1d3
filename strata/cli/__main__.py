"""`python -m strata.cli COMMAND ...`: the `strata` command, for a venv whose scripts are not on PATH."""

from __future__ import annotations

import sys

from strata.cli import main

if __name__ == "__main__":
    sys.exit(main())
