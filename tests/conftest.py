"""Test-wide environment, set before anything imports triton.

Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET must be set before triton
is first imported), and single-threaded BLAS keeps its many small matmuls fast on 2 cores.
Server processes started by the end-to-end tests get a clean copy of the environment instead
(see tests/e2e/servers.py).
"""

import os
from pathlib import Path

if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
