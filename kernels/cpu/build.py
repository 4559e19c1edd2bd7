"""The CPU C library (kernels/cpu/qgemv.c, qdot.c and qformats.c, ops.c and the fused step's
decode.c, moe.c, delta.c, mla.c, mamba.c, shortconv.c): built and loaded here, called by the
modules beside this one.

The library is compiled on first use with the machine's C compiler (`cc -O3 -march=native
-fopenmp`, a few seconds) into a per-user cache and loaded with ctypes; where no compiler
works, the torch references run instead and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from kernels.cpu.split import cache_dir

log = logging.getLogger("zoo")

# the block products, decode's small ops (kernels/cpu/ops.py) and its fused blocks
# (kernels/cpu/decode.py): one library; the headers are hashed into the cache key with them
_C_FILES = ("qgemv.c", "qdot.c", "qformats.c", "ops.c", "step.c", "decode.c", "moe.c", "delta.c",
            "mla.c", "mamba.c", "shortconv.c")  # fmt: skip
_H_FILES = ("zoo_cpu.h", "qformats.h", "qvec.h", "step.h")
SOURCES = [Path(__file__).with_name(name) for name in _C_FILES]
HEADERS = [Path(__file__).with_name(name) for name in _H_FILES]
MAX_ROWS = 16  # rows of x a fused decode step takes (zoo_cpu.h's MAX_ROWS)
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# the instruction set: this machine's; tests also build x86-64-v3 (AVX2) and x86-64 (plain C)
MARCH = os.environ.get("ZOO_QGEMV_MARCH", "native")


class QWeightView(ctypes.Structure):
    """zoo_cpu.h's qweight_t: fp32 rows (type 0) or repacked GGML blocks (type: GGML's id)."""

    _fields_ = [("data", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("type", ctypes.c_int64)]  # fmt: skip


_built: list[ctypes.CDLL | None] = []  # library()'s answer, for the hot path


@cache
def library() -> ctypes.CDLL | None:
    """The compiled library, built once per (source, compiler, machine); None where it cannot
    be built (the reason is logged)."""
    _built.append(build(MARCH))
    return _built[0]


def built() -> bool:
    """Whether the library was built already: code being traced by torch.compile asks this
    instead of calling `library()` (building inside a trace would break the graph)."""
    return bool(_built) and _built[0] is not None


def build(march: str) -> ctypes.CDLL | None:
    """Compile (or find in the cache) the library for `-march=<march>`."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("zoo kernels: no C compiler found; CPU block products use the reference")
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
                    "zoo kernels: compiling %s failed (%s); CPU block products use the reference",
                    " ".join(src.name for src in SOURCES),
                    run.stderr.decode(errors="replace").strip()[-500:],
                )
                return None
            so.replace(out)  # atomic: concurrent builders each write their own temporary
    return _declare(ctypes.CDLL(str(out)))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library's functions' argument and result types."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    sigs = {
        "zoo_qgemm": ([ptr, ptr, ptr, i64, i32], None),
        "zoo_repack": ([i64, ptr, i64, i64, ptr, i32], None),
        "zoo_repacked_bytes": ([i64, i64, i64], i64),
        "zoo_dequantize_rows": ([ptr, ptr, i64, ptr, i32], None),
        "zoo_q8_row_bytes": ([i64], i64),
        "zoo_q8_quantize_row": ([ptr, i64, ptr, ptr], None),
        "zoo_qdot_isa": ([], ctypes.c_char_p),
        "zoo_rms_norm": ([ptr, ptr, ptr, ptr, ptr, i64, i64, f32], None),
        "zoo_rope": ([ptr, *[i64] * 6, ptr, ptr, i64, i64, i32], None),
        "zoo_decode_attention": ([ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr,
                                  *[i64] * 6, ptr, i64, i64, f32, f32, ptr, i32], None),
        "zoo_decode_blocks": ([ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32],
                              None),
        "zoo_moe_route": ([ptr, ptr, i64, ptr, ptr], None),
    }  # fmt: skip
    for name, (args, result) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
