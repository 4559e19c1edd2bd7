"""Quantized linear on CPUs: a small C kernel (kernels/qgemv.c) for few rows, dequantize and
F.linear for many.

Decode multiplies one row per sequence, where reading the weight is the whole cost: the C kernel
reads the codes as they are kept (4 or 8 bits) and never a float copy. It is compiled on first
use with the machine's C compiler (`cc -O3 -march=native -fopenmp`, ~1 s) into a per-user cache
and loaded with ctypes; where no compiler works, the torch reference runs instead and the reason
is logged once. Prefill (many rows) is compute-bound: the dequantized weight feeds the BLAS.

On CPUs with AVX512-BF16 (AMD Zen 4+, Intel Sapphire Rapids+), decode's 4-bit codes multiply x
rounded to bf16 (`rounds_x_to_bf16`): one instruction multiplies and adds 32 pairs, and a code
becomes a bf16 number with one byte shuffle, so a row costs about half the instructions of
fp32. Decode steps say so (`decoding()`, entered by core/decode_step.py); prefill multiplies
fp32 x however few its rows, even one: the keys and values of a prompt's tokens then do not
depend on how the prompt was cut into chunks (a server that reuses a cached prefix prefills
only the rest, often one token), and the answer does not change with the reuse.
"""

from __future__ import annotations

import contextvars
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu import cache_dir
from kernels.qweight import FORMATS, QuantWeight

log = logging.getLogger("zoo")

# the quantized products, decode's small ops (kernels/cpu_ops.py) and its fused blocks
# (kernels/cpu_decode.py): one library; the header is hashed into the cache key with them
SOURCES = [Path(__file__).with_name(name)
           for name in ("qgemv.c", "qdot.c", "cpu_ops.c", "cpu_decode.c")]  # fmt: skip
HEADERS = [Path(__file__).with_name("zoo_cpu.h")]
# Up to this many rows the kernel reads the codes directly (each vector of codes widened once
# and multiplied into every row of x); above, it writes the dequantized weight for the BLAS
# (single-thread, 1536 x 576 int4: 64 rows 2.25 ms directly, 0.65 ms in F.linear)
MAX_ROWS = 8
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# the instruction set: this machine's; tests also build x86-64-v3 (AVX2) and x86-64 (plain C)
MARCH = os.environ.get("ZOO_QGEMV_MARCH", "native")
_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.uint8: 3}


class _QWeight(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("dmin", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in
          ("N", "K", "gs", "superblock", "offset", "bits", "scale_kind", "min_kind", "type",
           "row_bytes")),
        ("perm", ctypes.c_void_p),
    ]  # fmt: skip


_built: list[ctypes.CDLL | None] = []  # library()'s answer, read by code being traced


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per (source, compiler, machine); None where it cannot
    be built (the reason is logged)."""
    _built.append(build(MARCH))
    return _built[0]


def build(march: str) -> ctypes.CDLL | None:
    """Compile (or find in the cache) the kernel for `-march=<march>`."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("zoo kernels: no C compiler found; quantized CPU matmuls use the reference")
        return None
    key = hashlib.sha256(b"".join(src.read_bytes() for src in [*SOURCES, *HEADERS]))
    flags = [*FLAGS, f"-march={march}"]
    key.update(" ".join([cc, *flags, platform.machine(), _cpu_flags()]).encode())
    out = cache_dir() / "kernels" / f"qgemv-{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = Path(tmp) / out.name
            cmd = [cc, *flags, *map(str, SOURCES), "-o", str(so), "-lm"]
            run = subprocess.run(cmd, capture_output=True)
            if run.returncode != 0:
                log.warning(
                    "zoo kernels: compiling %s failed (%s); quantized CPU matmuls use the "
                    "reference",
                    " ".join(src.name for src in SOURCES),
                    run.stderr.decode(errors="replace").strip()[-500:],
                )
                return None
            so.replace(out)  # atomic: concurrent builders each write their own temporary
    lib = ctypes.CDLL(str(out))
    lib.zoo_qgemv.argtypes = [ctypes.POINTER(_QWeight), ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_int, ctypes.c_int]  # fmt: skip
    lib.zoo_qgemv.restype = None
    lib.zoo_dequantize.argtypes = [ctypes.POINTER(_QWeight), ctypes.c_void_p, ctypes.c_int]
    lib.zoo_dequantize.restype = None
    lib.zoo_qgemv_bf16.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.zoo_qgemm.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int]
    lib.zoo_qgemm.restype = None
    lib.zoo_dequantize_rows.argtypes = [ptr, ptr, i64, ptr, ctypes.c_int]
    lib.zoo_dequantize_rows.restype = None
    lib.zoo_q8_row_bytes.argtypes = [i64]
    lib.zoo_q8_row_bytes.restype = i64
    lib.zoo_qdot_isa.restype = ctypes.c_char_p
    lib.zoo_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.zoo_rms_norm.restype = None
    lib.zoo_rope.argtypes = [ptr, *[i64] * 6, ptr, ptr, i64, i64, ctypes.c_int]
    lib.zoo_rope.restype = None
    lib.zoo_decode_attention.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                                         ptr, *[i64] * 6, ptr, i64, i64, ctypes.c_float,
                                         ctypes.c_float, ptr, ctypes.c_int]  # fmt: skip
    lib.zoo_decode_attention.restype = None
    lib.zoo_decode_blocks.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr,
                                      ptr, ctypes.c_int]  # fmt: skip
    lib.zoo_decode_blocks.restype = None
    return lib


_decoding: contextvars.ContextVar[bool] = contextvars.ContextVar("zoo_decoding", default=False)


@contextmanager
def decoding() -> Iterator[None]:
    """Within: products belong to a decode step (core/decode_step.py), where 4-bit codes may
    multiply bf16(x). Everywhere else (prefill, whatever its chunk: one token too) x stays
    fp32, so a prompt's keys and values do not depend on how it was cut into chunks."""
    token = _decoding.set(True)
    try:
        yield
    finally:
        _decoding.reset(token)


def rounds_x_to_bf16(w: QuantWeight, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `quant_linear(x, w)` here multiplies w's codes by bf16-rounded x: 4-bit codes
    in groups of 32, at most 8 rows, inside `decoding()`, on CPUs with AVX512-BF16 (where the same
    rows in fp32 are twice as many instructions). Its result then equals F.linear(bf16(x), W)
    to fp32 rounding, which is within bf16 rounding of F.linear(x, W)."""
    lib = lib or library()
    return (
        lib is not None
        and bool(lib.zoo_qgemv_bf16())
        and w.fmt.packed
        and w.fmt.group_of(w.in_features) == 32
        and x.numel() // w.in_features <= MAX_ROWS
        and _decoding.get()
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def describe(fmt, in_features, codes, scales, mins, d, dmin) -> _QWeight:
    """The C view of a weight's tensors (pointers: the tensors must stay alive)."""
    return _QWeight(
        _ptr(codes), _ptr(scales), _ptr(mins), _ptr(d), _ptr(dmin),
        codes.shape[0], in_features, fmt.group_of(in_features), fmt.superblock,
        fmt.offset, fmt.bits if fmt.packed else 8, _KINDS[scales.dtype],
        _KINDS[mins.dtype] if mins is not None else 0,
    )  # fmt: skip


def _traceable(x: torch.Tensor, w: QuantWeight) -> bool:
    # a trace only reads what an eager call built (kernels.dispatch.prepare builds it first):
    # building inside the trace would break the graph at its file checks
    return (
        x.dtype == torch.float32
        and x.shape[-1] == w.in_features
        and w.fmt.group_of(w.in_features) % 16 == 0
        and (_built or [None])[0] is not None
    )


def _desc(fmt, in_features: int, tensors) -> ctypes.Structure:
    """The C view of a weight's tensors, kept on its codes tensor (a compiled step passes the
    module's own buffers each call) and rebuilt when any of the five tensors is another object
    than the view was built from: decode calls each weight once per token, and building the
    struct costs as much as a small product."""
    codes = tensors[0]
    cached = getattr(codes, "_zoo_c_view", None)
    if (
        cached is not None
        and cached[:2] == (in_features, fmt.name)
        and all(a is b for a, b in zip(cached[2], tensors[1:], strict=True))
    ):
        return cached[3]
    desc = describe(fmt, in_features, *tensors)
    # the other tensors are held by reference so their addresses cannot be reused meanwhile
    codes._zoo_c_view = (in_features, fmt.name, tensors[1:], desc)
    return desc


def _tensors(w: QuantWeight) -> tuple:
    return (w.codes, w.scales, w.mins, w.d, w.dmin)


def _run(x2: torch.Tensor, fmt, in_features: int, *tensors, lib=None) -> torch.Tensor:
    """x2 (M, K) @ W.T straight from the codes (bf16(x) for 4-bit codes inside `decoding()`,
    where the CPU has AVX512-BF16)."""
    y = torch.empty(x2.shape[0], tensors[0].shape[0], dtype=torch.float32)
    (lib or library()).zoo_qgemv(
        ctypes.byref(_desc(fmt, in_features, tensors)), x2.data_ptr(), y.data_ptr(),
        x2.shape[0], torch.get_num_threads(), int(_decoding.get()),
    )  # fmt: skip
    return y


def _dequantize(fmt, in_features: int, *tensors, lib=None) -> torch.Tensor:
    """W (N, K) as float32, by the C kernel (SIMD, all threads)."""
    out = torch.empty(tensors[0].shape[0], in_features, dtype=torch.float32)
    (lib or library()).zoo_dequantize(
        ctypes.byref(_desc(fmt, in_features, tensors)), out.data_ptr(), torch.get_num_threads()
    )
    return out


def dequantize(w: QuantWeight, lib=None) -> torch.Tensor:
    """The whole weight as float32, by the C kernel: ~10x the reference's speed, to within fp32
    rounding of it (s * q + (min - offset * s))."""
    return _dequantize(w.fmt, w.in_features, *_tensors(w), lib=lib)


# The C kernel as ops that torch.compile keeps opaque: a compiled decode step calls them from its
# graph (a ctypes call would break it).
@torch.library.custom_op("zoo::qgemv", mutates_args=())
def _qgemv_op(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    d: torch.Tensor | None,
    dmin: torch.Tensor | None,
    fmt: str,
    in_features: int,
) -> torch.Tensor:
    """x (M, K) @ W.T for few rows."""
    return _run(x, FORMATS[fmt], in_features, codes, scales, mins, d, dmin)


@_qgemv_op.register_fake
def _(x, codes, scales, mins, d, dmin, fmt, in_features):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.custom_op("zoo::qdequantize", mutates_args=())
def _qdequantize_op(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    d: torch.Tensor | None,
    dmin: torch.Tensor | None,
    fmt: str,
    in_features: int,
) -> torch.Tensor:
    """W as float32 (N, K), for the BLAS to multiply many rows."""
    return _dequantize(FORMATS[fmt], in_features, codes, scales, mins, d, dmin)


@_qdequantize_op.register_fake
def _(codes, scales, mins, d, dmin, fmt, in_features):
    return codes.new_empty(codes.shape[0], in_features, dtype=torch.float32)


def _eager_desc(w: QuantWeight) -> ctypes.Structure | None:
    """w's C view (`_desc`'s) for eager calls, referenced from the weight itself so that the
    hot path checks one identity instead of five (rebuilt when `.to()` or `_apply` gave it new
    tensors); None where the C kernel cannot take it."""
    cached = w.__dict__.get("_c_view")
    if cached is not None and cached[0] is w.codes:
        return cached[1]
    if library() is None or w.fmt.group_of(w.in_features) % 16 or w.codes.device.type != "cpu":
        return None
    desc = ctypes.byref(_desc(w.fmt, w.in_features, _tensors(w)))  # the one view of w
    w.__dict__["_c_view"] = (w.codes, desc)
    return desc


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias on the CPU: the C kernel straight from the codes for up to MAX_ROWS fp32
    rows; more rows multiply the weight the C kernel dequantized, in the BLAS."""
    rows = x.numel() // w.in_features
    if not torch.compiler.is_compiling():  # decode's hot path: a few microseconds of Python
        usable = x.dtype == torch.float32 and x.shape[-1] == w.in_features
        desc = _eager_desc(w) if usable else None
        if desc is None:
            return F.linear(x, w.dequantize().to(x.dtype), bias)
        if rows > MAX_ROWS:
            return F.linear(x, dequantize(w), bias)
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], w.out_features)
        _built[0].zoo_qgemv(
            desc, x.data_ptr(), y.data_ptr(), rows, torch.get_num_threads(), int(_decoding.get())
        )
        return y if bias is None else y.add_(bias)
    if not _traceable(x, w):
        return F.linear(x, w.dequantize().to(x.dtype), bias)
    if rows > MAX_ROWS:
        return F.linear(x, _qdequantize_op(*_tensors(w), w.fmt.name, w.in_features), bias)
    x2 = x.reshape(rows, w.in_features).contiguous()
    y = _qgemv_op(x2, *_tensors(w), w.fmt.name, w.in_features)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], w.out_features)
