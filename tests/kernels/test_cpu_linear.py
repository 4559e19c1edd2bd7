"""kernels.cpu.linear (kernels/cpu/split.py: the CPU few-rows fast path) against F.linear."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import dispatch
from kernels.cpu import split


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def split_pays(monkeypatch):
    """Pretend the probe found the split faster at every row count (as on the AMD machines)."""
    monkeypatch.setattr(split, "_split_pays", {(dt, 2): True for dt in dispatch.KERNEL_DTYPES})


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
    got, want = split.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_splits_few_rows_over_the_threads(two_threads, split_pays, monkeypatch):
    """The fast path is taken (one batched matmul of two blocks) only where it applies."""
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append(a.shape) or bmm(a, b))
    w = torch.randn(96, 40)
    split.linear(torch.randn(1, 40), w)
    assert calls == [(2, 48, 40)]
    split.linear(torch.randn(split.MAX_ROWS + 1, 40), w)  # many rows: MKL's own GEMM
    split.linear(torch.randn(1, 40), torch.randn(95, 40))  # rows do not split evenly
    assert len(calls) == 1


def test_torch_policy_takes_the_plain_reference(two_threads, monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    monkeypatch.setattr(
        kernels.cpu, "linear", lambda *a: pytest.fail("fast path under ZOO_KERNELS=torch")
    )
    x, w = torch.randn(1, 40), torch.randn(96, 40)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_a_wrong_input_width_is_refused_as_f_linear_refuses_it(two_threads, split_pays):
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        split.linear(torch.randn(2, 48), torch.randn(96, 64))  # not a view-reshape error


def _slow(fn):
    def slowed(*args):
        time.sleep(0.1)  # far above either path, even on a machine loaded 2x over
        return fn(*args)

    return slowed


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    """Each test probes afresh: no verdict remembered by an earlier test."""
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path))
    monkeypatch.delenv("ZOO_CPU_SPLIT", raising=False)


def test_a_verdict_is_remembered_across_processes(two_threads, monkeypatch):
    """The first process times the probe; a later one (a fresh in-memory table) reads the
    verdict back untimed, so every process on a machine takes the same path."""
    monkeypatch.setattr(split, "_split_pays", {})
    monkeypatch.setattr(split, "PROBE_REPEAT", 3)
    monkeypatch.setattr(split.F, "linear", _slow(F.linear))
    assert split.split_pays(torch.float32) is True
    monkeypatch.setattr(split, "_split_pays", {})  # as a new process starts
    monkeypatch.setattr(split, "_medians_s", lambda *fns: pytest.fail("timed again"))
    assert split.split_pays(torch.float32) is True
    monkeypatch.setattr(split, "_split_pays", {})
    monkeypatch.setenv("ZOO_CPU_SPLIT", "0")  # the user's word wins
    assert split.split_pays(torch.float32) is False


@pytest.mark.parametrize(
    "plain, split_s, kept", [(1.0, 0.9, None), (1.0, 1.2, False), (1.0, 0.5, True)]
)
def test_only_a_decisive_verdict_is_remembered(two_threads, monkeypatch, plain, split_s, kept):
    """A split 0.8-1x F.linear's time (what a probe beside busy processes tends to see) is
    not split now and timed again by the next process; a clear win or loss, twice, is kept."""
    timed = []
    monkeypatch.setattr(split, "_split_pays", {})
    monkeypatch.setattr(split, "_medians_s", lambda *fns: timed.append(1) or [plain, split_s])
    assert split.split_pays(torch.float32) is bool(kept)
    monkeypatch.setattr(split, "_split_pays", {})  # as a new process starts
    assert split.split_pays(torch.float32) is bool(kept)
    assert len(timed) == (4 if kept is None else 2)  # two rounds a probe


@pytest.mark.parametrize("slower, verdict", [("linear", True), ("split", False)])
def test_the_probe_keeps_whichever_path_is_faster(two_threads, monkeypatch, slower, verdict):
    monkeypatch.setattr(split, "_split_pays", {})
    monkeypatch.setattr(split, "PROBE_REPEAT", 3)
    if slower == "linear":
        monkeypatch.setattr(split.F, "linear", _slow(F.linear))
    else:
        monkeypatch.setattr(split, "split_linear", _slow(split.split_linear))
    assert split.split_pays(torch.float32) is verdict
    # remembered per (dtype, threads): asked again, or by linear at any row count, untimed
    monkeypatch.setattr(split, "_medians_s", lambda *fns: pytest.fail("timed twice"))
    assert split.split_pays(torch.float32) is verdict
    calls = []
    monkeypatch.setattr(
        split, "split_linear", lambda *a: calls.append(a) or split.torch.zeros(16, 96)
    )
    split.linear(torch.randn(16, 40), torch.randn(96, 40))
    assert len(calls) == verdict


def test_where_the_split_does_not_pay_f_linear_runs(two_threads, monkeypatch):
    monkeypatch.setattr(split, "_split_pays", {(torch.float32, 2): False})
    monkeypatch.setattr(
        split, "split_linear", lambda *a: pytest.fail("split where it does not pay")
    )
    x, w = torch.randn(4, 40), torch.randn(96, 40)
    assert torch.equal(split.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("n", [1, 3])
def test_any_thread_count_probes_without_error(monkeypatch, n):
    """One thread never splits (nor times); three threads probe a weight cut into three."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        monkeypatch.setattr(split, "_split_pays", {})
        monkeypatch.setattr(split, "PROBE_REPEAT", 1)
        if n == 1:
            monkeypatch.setattr(split, "_medians_s", lambda *fns: pytest.fail("timed, 1 thread"))
        assert split.split_pays(torch.float32) in (True, False)
        assert (torch.float32, n) in split._split_pays
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(1, 576, generator=g), torch.randn(1152, 576, generator=g)  # 3 x 384
        # whichever path the probe chose: sums of 576 terms of ~0.8 in another order differ by
        # up to ~5e-5 in fp32 (the split's bmm, 3 threads or 2, rounds further from float64)
        torch.testing.assert_close(split.linear(x, w), F.linear(x, w), rtol=1e-5, atol=2e-4)
    finally:
        torch.set_num_threads(old)


def test_a_trace_reads_the_verdict_and_never_times(two_threads, monkeypatch):
    """Inside torch.compile, linear takes what an eager probe found, or F.linear if none ran."""
    monkeypatch.setattr(split, "_medians_s", lambda *fns: pytest.fail("timed inside a trace"))
    calls = []
    real = split.split_linear
    monkeypatch.setattr(split, "split_linear", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(1, 40), torch.randn(96, 40)
    torch.compiler.assume_constant_result(split.threads)  # as a compiled decode step marks it
    for verdicts, splits in (({}, 0), ({(torch.float32, 2): True}, 1)):
        monkeypatch.setattr(split, "_split_pays", verdicts)
        torch._dynamo.reset()
        got = torch.compile(split.linear, backend="eager", fullgraph=True)(x, w)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert len(calls) == splits


def test_rounds_that_disagree_are_timed_again(two_threads, monkeypatch):
    """A clear win in one round and a clear loss in the other (a busy moment in one of them):
    no split now, nothing remembered, the next process times it again."""
    rounds = iter([[1.0, 0.5], [1.0, 1.2], [1.0, 0.5], [1.0, 0.5]])
    monkeypatch.setattr(split, "_split_pays", {})
    monkeypatch.setattr(split, "_medians_s", lambda *fns: next(rounds))
    assert split.split_pays(torch.float32) is False
    monkeypatch.setattr(split, "_split_pays", {})  # as a new process starts: two wins, kept
    assert split.split_pays(torch.float32) is True
    monkeypatch.setattr(split, "_split_pays", {})
    monkeypatch.setattr(split, "_medians_s", lambda *fns: pytest.fail("timed again"))
    assert split.split_pays(torch.float32) is True
