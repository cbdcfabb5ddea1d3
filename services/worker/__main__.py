"""`python -m services.worker --config FILE --index N --announce-file PATH`: run one model worker."""

from __future__ import annotations

import sys

from services.worker.server import main

if __name__ == "__main__":
    sys.exit(main())
