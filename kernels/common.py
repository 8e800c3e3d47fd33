"""Shared plumbing for the kernel families: backend choice and ragged-batch helpers.

Every kernel family exposes three functions with the same arguments: a Triton implementation
(``*_triton``), a plain-torch reference (``*_torch``) and a dispatcher (the bare name) that adds a
``backend`` argument. The dispatcher runs Triton on CUDA tensors and the reference elsewhere, so the
CPU path of the server never needs the Triton interpreter; tests force ``backend="triton"`` under
``TRITON_INTERPRET=1`` to exercise the kernels on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
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


@dataclass(frozen=True, eq=False)
class Segments:
    """A ragged batch: ``indptr`` [B+1] bounds B requests' ``total`` elements, none longer than
    ``max_len`` (the width of `to_dense`'s rows; all three known on the host, so nothing is read
    back).

    Each element's request and position are computed once, when first asked: the sparse layers of
    one prefill share its keys' `Segments` (`ForwardPlan.keys`), so they pay for them once, not
    once per layer and helper.
    """

    indptr: torch.Tensor
    total: int
    max_len: int

    @classmethod
    def of(cls, indptr: torch.Tensor) -> Segments:
        """The batch ``indptr`` bounds, its sizes read from it (which waits on a GPU: for tests and
        offline tools; a forward has them on the host)."""
        lengths = (indptr[1:] - indptr[:-1]).tolist()
        return cls(indptr, sum(lengths), max(lengths, default=0))

    @property
    def batch(self) -> int:
        return self.indptr.numel() - 1

    @cached_property
    def lengths(self) -> torch.Tensor:
        """[B] int64: each request's element count."""
        return (self.indptr[1:] - self.indptr[:-1]).to(torch.int64)

    @cached_property
    def ids(self) -> torch.Tensor:
        """[total] int64: each element's request."""
        requests = torch.arange(self.batch, device=self.indptr.device)
        return torch.repeat_interleave(requests, self.lengths, output_size=self.total)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[total] int64: each element's 0-based position in its request."""
        return torch.arange(self.total, device=self.indptr.device) - self.indptr.to(torch.int64)[self.ids]

    @cached_property
    def after(self) -> torch.Tensor:
        """[total] int64: how many elements follow each in its request (0 for the last)."""
        return self.lengths[self.ids] - 1 - self.positions

    def to_dense(self, values: torch.Tensor, fill: float, before: int = 0, after: int = 0) -> torch.Tensor:
        """``values`` [total, H] as [B, H, before + max_len + after]: request b's element at
        position p at ``[b, :, before + p]``, ``fill`` everywhere else (the ``before`` and ``after``
        margins too, so a sliding window over a row never reaches another request)."""
        dense = values.new_full((self.batch, values.shape[1], before + self.max_len + after), fill)
        dense[self.ids, :, self.positions + before] = values
        return dense

    def from_dense(self, dense: torch.Tensor) -> torch.Tensor:
        """[total, H]: the elements of ``dense`` [B, H, >= max_len] (request b's position p at
        ``[b, :, p]``), the inverse of `to_dense` without margins."""
        return dense[self.ids, :, self.positions]


def check_group(num_q_heads: int, num_kv_heads: int) -> int:
    """GQA group size G = H_q / H_kv; query head h reads KV head h // G."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}")
    return num_q_heads // num_kv_heads
