"""`python -m gateway --config F --announce-file P`: run the gateway until SIGTERM or SIGINT."""

from __future__ import annotations

import sys

from gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
