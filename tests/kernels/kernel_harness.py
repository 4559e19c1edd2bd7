"""Shared set-up of the kernel tests (a plain module, not a conftest: a second conftest.py
would shadow the root one that `from conftest import LLAMA32` relies on).

Import it first in every test module of tests/kernels. Without CUDA it sets TRITON_INTERPRET=1,
so the Triton kernels run on CPU tensors in triton's interpreter. `@triton.jit` reads the
variable when it decorates; kernel modules decorated earlier without it are re-decorated by
`kernels.dispatch.kernel_module`, which `triton_op` goes through, so test order does not matter.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# triton is a dependency on Linux (pyproject.toml): there, its absence is a broken install and
# fails every kernel test module; elsewhere (macOS, Windows: no triton wheels) they skip.
if sys.platform.startswith("linux"):
    try:
        import triton  # noqa: F401
    except ImportError as err:
        pytest.fail(
            f"triton cannot be imported ({err}), but pyproject.toml requires it on Linux: "
            "reinstall the project (pip install -e '.[test]')",
            pytrace=False,
        )
else:
    pytest.importorskip("triton", reason="triton is not installed (it ships for Linux only)")

from kernels.dispatch import triton_op  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
SM80 = CUDA and torch.cuda.get_device_capability() >= (8, 0)

# fp32 and bf16 everywhere (bf16 on GPUs of compute capability 8.0+)
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(CUDA and not SM80, reason="bf16 kernels need sm80+"),
    ),
]


def gpu(fn):
    """Mark a test GPU-only: `-m gpu` selects it, and it skips cleanly without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn))


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    """|got - want| <= atol + rtol * |want| elementwise, dtypes and shapes equal."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    atol, rtol = tol
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def assert_experts_match_dequantized(x, ids, w, gate_up, down, tol: tuple[float, float]) -> None:
    """The Triton MoE on quantized experts (QuantExperts) against the reference on the same
    experts dequantized, which the reference also reads QuantExperts as."""
    from kernels import reference

    deq = [q.dequantize().to(x.dtype) for q in (gate_up, down)]
    want = reference.moe_experts(x, ids, w, *deq)
    # the reference reads QuantExperts by dequantizing each expert it runs: the same numbers
    assert torch.equal(reference.moe_experts(x, ids, w, gate_up, down), want)
    got = triton_op("moe_experts")(x, ids, w, gate_up, down)
    assert_close(got, want, tol)
    assert got.abs().max() > 0.01  # not vacuous: the experts contribute


def randn(*shape, dtype=torch.float32, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


__all__ = ["CUDA", "DEVICE", "DTYPES", "assert_close", "gpu", "randn", "triton_op"]
