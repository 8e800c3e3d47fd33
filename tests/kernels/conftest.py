"""Kernel tests run Triton in its CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, and single-threaded BLAS keeps the
interpreter's many small matmuls fast on small machines. setdefault leaves a value set by the root
conftest (or by a GPU run with TRITON_INTERPRET=0) alone.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the environment is set)
import torch  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    """CUDA when a GPU runs real Triton (TRITON_INTERPRET=0), else the CPU interpreter."""
    if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1":
        return "cuda"
    return "cpu"
