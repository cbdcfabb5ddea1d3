"""`python -m services.tokenizer --config F --announce-file P`: run the tokenizer service."""

from __future__ import annotations

import sys

from services.tokenizer.server import main

if __name__ == "__main__":
    sys.exit(main())
