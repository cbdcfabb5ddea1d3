"""tests/gpu needs a CUDA device: without one these modules are not collected at all (CI has no GPU).

bench/gpu.sh runs them on the lent H200. Collection, not a skip, keeps a CPU run from reporting
tests that never ran as if they had been considered.
"""

from __future__ import annotations

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
