"""kernels.cpu.linear (the CPU few-rows fast path) against F.linear."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu, dispatch


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def split_pays(monkeypatch):
    """Pretend the probe found the split faster at every row count (as on the AMD machines)."""
    verdicts = {(dt, 2, rows): True for dt in dispatch.KERNEL_DTYPES for rows in cpu.PROBE_ROWS}
    monkeypatch.setattr(cpu, "_split_pays", verdicts)


@pytest.mark.parametrize(
    "lead, out_features, bias",
    [((1,), 96, False), ((1, 1), 96, True), ((3, 1), 50, True), ((2, 4), 64, False),
     ((16,), 32, False), ((17,), 32, True), ((5,), 33, False)],
)  # fmt: skip
def test_matches_f_linear(two_threads, split_pays, lead, out_features, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, 40, generator=g)
    w = torch.randn(out_features, 40, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    got, want = cpu.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_splits_few_rows_over_the_threads(two_threads, split_pays, monkeypatch):
    """The fast path is taken (one batched matmul of two blocks) only where it applies."""
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append(a.shape) or bmm(a, b))
    w = torch.randn(96, 40)
    cpu.linear(torch.randn(1, 40), w)
    assert calls == [(2, 48, 40)]
    cpu.linear(torch.randn(cpu.MAX_ROWS + 1, 40), w)  # many rows: MKL's own GEMM
    cpu.linear(torch.randn(1, 40), torch.randn(95, 40))  # rows do not split evenly
    assert len(calls) == 1


def test_torch_policy_takes_the_plain_reference(two_threads, monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    monkeypatch.setattr(cpu, "linear", lambda *a: pytest.fail("fast path under ZOO_KERNELS=torch"))
    x, w = torch.randn(1, 40), torch.randn(96, 40)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_a_wrong_input_width_is_refused_as_f_linear_refuses_it(two_threads, split_pays):
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        cpu.linear(torch.randn(2, 48), torch.randn(96, 64))  # not a view-reshape error


def _slow(fn):
    def slowed(*args):
        time.sleep(0.002)
        return fn(*args)

    return slowed


@pytest.mark.parametrize("slower, verdict", [("linear", True), ("split", False)])
def test_the_probe_keeps_whichever_path_is_faster(two_threads, monkeypatch, slower, verdict):
    monkeypatch.setattr(cpu, "_split_pays", {})
    monkeypatch.setattr(cpu, "PROBE_REPEAT", 3)
    if slower == "linear":
        monkeypatch.setattr(cpu.F, "linear", _slow(F.linear))
    else:
        monkeypatch.setattr(cpu, "_split", _slow(cpu._split))
    assert cpu.calibrate(torch.float32) == dict.fromkeys(cpu.PROBE_ROWS, verdict)
    # remembered per (dtype, threads, probed rows): 3 rows take the 4-row verdict, untimed
    monkeypatch.setattr(cpu, "_medians_s", lambda *fns: pytest.fail("timed twice"))
    assert cpu.split_pays(torch.float32, 3) is verdict


def test_where_the_split_does_not_pay_f_linear_runs(two_threads, monkeypatch):
    monkeypatch.setattr(cpu, "_split_pays", {(torch.float32, 2, r): False for r in cpu.PROBE_ROWS})
    monkeypatch.setattr(cpu, "_split", lambda *a: pytest.fail("split where it does not pay"))
    x, w = torch.randn(4, 40), torch.randn(96, 40)
    assert torch.equal(cpu.linear(x, w), F.linear(x, w))


def test_one_thread_never_splits_and_never_times(monkeypatch):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(cpu, "_medians_s", lambda *fns: pytest.fail("timed with one thread"))
        assert cpu.split_pays(torch.float32) is False
    finally:
        torch.set_num_threads(old)
