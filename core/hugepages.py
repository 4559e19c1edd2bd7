"""A CPU model's memory: its weights in transparent huge pages, and freed activations kept for
the next forward (`keep_freed_memory`).

Decode streams every weight once per token. With the kernel's 4 KiB pages, a 540 MB fp32
model spans 130k pages, far more than the TLB holds, so the stream also walks page tables;
with 2 MiB pages it spans 260. Linux gives huge pages to an anonymous mapping that asks for
them (madvise MADV_HUGEPAGE; `/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the
common default, gives them to no one else), and torch's allocator does not ask. Measured on
an AMD EPYC (2 vCPUs), SmolLM2-135M's fused decode step: fp32 22.2 -> 20.6 ms, Q4_1 kept
6.9 -> 6.1 ms (benchmarks/huge_pages.py; docs/benchmarks-history.md).

`move_to_huge_pages` copies a model's float weights into one private anonymous mapping that
asks for huge pages, 2 MiB aligned, each weight still its own storage over its part of it: the
values and shapes are unchanged, only where they live. Call it before anything holds the
weights' addresses (load_model does, before the decode step is built). Where the platform has
no such advice, huge pages are off, or the mapping cannot be had, it does nothing.
Quantized weights stay where the loader put them: kernels/cpu/qdot.c requests each unit's codes
ahead of use, and on Llama-3.2-1B's shapes (Q4_K_M) huge pages moved decode by 1% (40.1 vs
40.5 tok/s) while the copy added 0.4 s to a 1.8 s load (measured when the choice was made,
2026-11-24).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # bytes in a huge page (x86-64, arm64 with 4 KiB base pages)
PAGE = 4096
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this process can have transparent huge pages by asking."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        return False
    try:
        return "[never]" not in THP.read_text()
    except OSError:
        return False


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def move_to_huge_pages(net: nn.Module, min_bytes: int = PAGE) -> int:
    """Move net's CPU parameters and buffers of at least `min_bytes` that own their whole
    storage into huge pages, packed one after another (tensors sharing a storage, such as tied
    embeddings, go on sharing it); returns the bytes moved (0 where huge pages are not
    available)."""
    if not available():
        return 0
    uses: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}
    for mod in net.modules():
        for kind in (mod._parameters, mod._buffers):
            for name, t in kind.items():
                if t is None or t.device.type != "cpu" or not t.is_contiguous():
                    continue
                if not t.is_floating_point():  # quantized codes: see the module's docstring
                    continue
                storage = t.untyped_storage()
                whole = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
                if whole and storage.nbytes() >= min_bytes:
                    uses.setdefault(storage.data_ptr(), []).append((mod, name, t))
    if not uses:
        return 0
    total = sum(_round(places[0][2].nbytes, PAGE) for places in uses.values())
    try:
        area = mmap.mmap(-1, _round(total, HUGE) + HUGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # e.g. strict overcommit while the old copies are still resident
        return 0
    # each tensor made from it keeps the mapping alive (torch.frombuffer holds the buffer)
    start = torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr()
    at = (-start) % HUGE
    while uses:  # one tensor at a time, each old copy freed as soon as it is replaced
        _, places = uses.popitem()
        n = places[0][2].nbytes  # the whole storage (checked above)
        raw = torch.frombuffer(area, dtype=torch.uint8, count=n, offset=at)  # its own storage
        raw.copy_(places[0][2].view(-1).view(torch.uint8))
        at += _round(n, PAGE)
        for mod, name, t in places:
            new = raw.view(t.dtype).view(t.shape)
            if name in mod._parameters:
                mod._parameters[name].data = new
            else:
                mod._buffers[name] = new
        del places, t
    _give_back_freed_memory()
    return total


def _give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc keeps the ones the old copies held,
    tens of MB of resident memory otherwise)."""
    with contextlib.suppress(AttributeError, OSError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)


# glibc's mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(nbytes: int = 1 << 30) -> bool:
    """Have glibc keep freed blocks up to `nbytes` for reuse instead of giving them back to the
    system. A prefill's activations are tens of MB (512 tokens of Llama-3.2-1B's shape: a 32 MB
    gate|up output per layer); glibc maps blocks from 32 MB up afresh on every call and unmaps
    them when freed, so each forward faults every page in again, at several microseconds a page
    in a virtual machine: 0.4-1.0 s of a 1.9 s prefill, measured (docs/benchmarks.md). Returns
    whether it was set (not glibc: False, nothing done)."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, nbytes)
        )
    except (AttributeError, OSError):
        return False
