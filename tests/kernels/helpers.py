"""Shared cases and checks for the kernel tests.

Every test runs once on the CPU in fp32 through the Triton interpreter (small
shapes, part of `make test`) and, marked `gpu`, on CUDA in fp32, bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# relative L2 error bounds against an fp32 reference on the same (rounded) inputs
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def cases() -> list:
    """(device, dtype) params: the interpreter case on CPU, the three dtypes on CUDA."""
    cpu = pytest.param("cpu", torch.float32, id="interp-fp32", marks=pytest.mark.skipif(HAS_CUDA, reason="CPU-only case"))
    gpu_marks = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
    gpu = [
        pytest.param("cuda", dtype, id=f"cuda-{name}", marks=gpu_marks)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
    ]
    return [cpu, *gpu]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """No NaN anywhere (outputs start as NaN) and relative error under the dtype's bound."""
    assert not torch.isnan(out).any(), f"{what}: NaN left (unwritten element)"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"{what}: relative error {err:.3g} >= {REL_TOL[dtype]}"


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))
