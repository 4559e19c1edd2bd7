"""kernels.dispatch: ZOO_KERNELS policies, errors instead of fallbacks, logging, import safety."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_harness import DEVICE, gpu, randn

import kernels
from kernels import KernelError, dispatch, reference


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.setattr(dispatch, "_chosen", {})
    monkeypatch.setattr(dispatch, "_logged", set())


def test_every_op_has_reference_and_triton():
    for op in dispatch.OPS:
        assert callable(getattr(reference, op)) and callable(getattr(kernels, op))
        assert dispatch.triton_op(op) is not getattr(reference, op)


def test_ops_stay_callable_after_importing_kernel_modules():
    # a submodule named like an op would replace kernels.<op> once imported
    for op in dispatch.OPS:
        dispatch.triton_op(op)
    for op in dispatch.OPS:
        assert getattr(kernels, op) is getattr(dispatch, op)


def test_torch_forces_reference(monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    assert dispatch.pick("rms_norm", randn(2, 8)) is reference.rms_norm


@pytest.mark.skipif(DEVICE == "cuda", reason="auto on CUDA picks Triton")
def test_auto_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("ZOO_KERNELS", raising=False)
    assert dispatch.pick("swiglu", randn(2, 8)) is reference.swiglu


def test_triton_forced_runs_kernel(monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "triton")
    fn = dispatch.pick("rms_norm", randn(2, 8))
    assert fn is not reference.rms_norm and fn.__module__ == "kernels.rmsnorm"
    x, w = randn(3, 37, 123), torch.rand(123, device=DEVICE)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors")
def test_triton_forced_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelError, match="TRITON_INTERPRET"):
        kernels.swiglu(randn(2, 8))


def test_triton_forced_unsupported_dtype_raises(monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "triton")
    with pytest.raises(KernelError, match="float64"):
        kernels.swiglu(randn(2, 8, dtype=torch.float64))


def test_bad_policy_raises(monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "cuda")
    with pytest.raises(KernelError, match="ZOO_KERNELS='cuda'"):
        kernels.swiglu(randn(2, 8))


def test_choice_logged_once_per_op(monkeypatch, caplog):
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    with caplog.at_level(logging.INFO, logger="zoo"):
        for _ in range(3):
            kernels.swiglu(randn(2, 8))
    lines = [r.getMessage() for r in caplog.records if "swiglu" in r.getMessage()]
    assert len(lines) == 1 and "torch" in lines[0]


def test_a_choice_made_inside_a_trace_breaks_no_graph(monkeypatch):
    """The first pick of an op may happen while torch.compile traces (nothing eager ran yet);
    its log line would break the graph there, so it is skipped."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("ZOO_KERNELS", "torch")
    counters.clear()
    out = torch.compile(kernels.swiglu, backend="eager", fullgraph=False)(randn(2, 8))
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    assert out.shape == (2, 4) and any(k[0] == "swiglu" for k in dispatch._chosen)


@pytest.mark.skipif(DEVICE == "cuda", reason="flips the CPU interpreter")
def test_kernel_module_redecorates_when_interpreter_flag_changes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.kernel_module("kernels.silu_mul").INTERPRETED is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = dispatch.kernel_module("kernels.silu_mul")
    assert mod.INTERPRETED is True
    gate_up = randn(3, 10)
    torch.testing.assert_close(mod.swiglu(gate_up), reference.swiglu(gate_up))


def test_import_without_triton():
    code = textwrap.dedent(
        """
        import os, sys
        sys.modules["triton"] = None  # as on macOS / Windows: import triton fails
        os.environ["ZOO_KERNELS"] = "auto"
        import torch, kernels
        x = torch.randn(2, 8)
        assert torch.equal(kernels.swiglu(x), kernels.reference.swiglu(x))
        os.environ["ZOO_KERNELS"] = "triton"
        try:
            kernels.swiglu(x)
        except kernels.KernelError as e:
            assert "triton is not installed" in str(e), e
        else:
            raise SystemExit("no KernelError")
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@gpu
def test_auto_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("ZOO_KERNELS", raising=False)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
            continue
        fn = dispatch.pick("rms_norm", torch.empty(1, device="cuda", dtype=dtype))
        assert fn is not reference.rms_norm
