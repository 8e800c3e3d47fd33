"""Shared plumbing for the kernel families: backend choice and ragged-batch helpers.

Every kernel family exposes three functions with the same arguments: a Triton implementation
(``*_triton``), a plain-torch reference (``*_torch``) and a dispatcher (the bare name) that adds a
``backend`` argument. The dispatcher runs Triton on CUDA tensors and the reference elsewhere, so the
CPU path of the server never needs the Triton interpreter; tests force ``backend="triton"`` under
``TRITON_INTERPRET=1`` to exercise the kernels on the CPU.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (decides block-size defaults and bf16 upcasts)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Resolve ``backend`` for tensors: ``auto`` means Triton exactly when all are on CUDA.

    Raises early with a readable message instead of letting Triton fail on CPU pointers.
    """
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return on_cuda
    if backend == "triton":
        if not on_cuda and not interpreting():
            raise RuntimeError(
                "backend='triton' with CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
            )
        return True
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")


#: The FP8 formats SGLang names for its KV cache (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a KV buffer of ``dtype`` keeps it: divided by the layer's scale in float32, then
    cast (round to nearest even, as SGLang's pool writes). A plain cast at scale 1."""
    if scale == 1.0:
        return x.to(dtype)
    return (x.to(torch.float32) / scale).to(dtype)


def upcast_dots(dtype: torch.dtype) -> bool:
    """bf16 ``tl.dot`` is wrong in the interpreter (triton issue #11584): upcast there only."""
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs get IEEE dots so GPU results match the references (TF32 would cost ~1e-3);
    other dtypes keep the backend default (None), the only setting every backend accepts."""
    return "ieee" if dtype == torch.float32 else None


def segment_lengths(indptr: torch.Tensor) -> torch.Tensor:
    """Per-request lengths from a CSR pointer array (int64, on the pointer's device)."""
    return (indptr[1:] - indptr[:-1]).to(torch.int64)


def segment_ids(indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Request id of every element of a ragged array described by ``indptr`` (int64)."""
    lens = segment_lengths(indptr)
    ids = torch.arange(lens.numel(), device=indptr.device)
    return torch.repeat_interleave(ids, lens, output_size=total)


def positions_in_segment(indptr: torch.Tensor, total: int) -> torch.Tensor:
    """0-based position of every element inside its own request (int64)."""
    seg = segment_ids(indptr, total)
    return torch.arange(total, device=indptr.device) - indptr.to(torch.int64)[seg]


def keys_after_in_segment(indptr: torch.Tensor, total: int) -> torch.Tensor:
    """How many elements follow every element inside its own request (int64; 0 for the last)."""
    seg = segment_ids(indptr, total)
    return indptr.to(torch.int64)[seg + 1] - 1 - torch.arange(total, device=indptr.device)


def check_group(num_q_heads: int, num_kv_heads: int) -> int:
    """GQA group size G = H_q / H_kv; query head h reads KV head h // G."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}")
    return num_q_heads // num_kv_heads
