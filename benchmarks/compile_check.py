"""Compile every Triton kernel for NVIDIA GPUs on a machine without one (no launch).

The interpreter tests prove the kernels' arithmetic; this proves the same code also lowers
through the real compiler (TTIR -> TTGIR -> LLVM -> PTX -> cubin with triton's bundled ptxas)
for sm80 (A100) and sm90 (H100/H200), for fp32 and bf16 at model-like shapes. Kernels are
compiled through their launchers, whose `kernel[grid](...)` launches become `warmup` calls.

    .venv/bin/python benchmarks/compile_check.py [--arch 80 90] [--dtype float32 bfloat16]

Prints registers, stack (spills) and shared memory per kernel (cuobjdump -res-usage).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class NoGPU:
    """Just enough of triton's driver to compile for `target` without a device."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch  # a device id per arch: the JIT caches kernels per device

    def get_current_stream(self, device=None):
        return 0


COMPILED: list = []  # (kernel name, CompiledKernel) of the current op


def _compile_only(self, grid):
    def warm(*args, **kw):
        COMPILED.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kw)))

    return warm


def _usage(kernel) -> str:
    """registers / spill stores / shared memory of a compiled kernel, from its cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    spill = re.search(r"STACK:(\d+)", out)
    return (
        f"regs {regs.group(1) if regs else '?'} stack {spill.group(1) if spill else '?'} "
        f"smem {kernel.metadata.shared}"
    )


def cases(dtype):
    """(op, args) at small model-like shapes: Llama-3.1-8B heads, a DeepSeek-V2-Lite MLA/MoE."""
    r = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
    cos, sin = torch.rand(1, 3, 64), torch.rand(1, 3, 64)
    yield "rms_norm", (r(3, 4096), r(4096), 1e-5)
    yield "rms_norm_residual", (r(3, 4096), r(3, 4096), r(4096), 1e-5)
    yield "apply_rope", (r(1, 32, 3, 128), r(1, 8, 3, 128), cos, sin, False)
    yield (
        "apply_rope",
        (r(1, 16, 3, 192)[..., 128:], r(1, 1, 3, 64), cos[..., :32], sin[..., :32], True),
    )
    yield "swiglu", (r(3, 2 * 14336),)
    yield "attention", (r(2, 32, 1, 128), r(2, 8, 300, 128), r(2, 8, 300, 128), 299, 0.088)
    yield "attention", (r(2, 32, 20, 128), r(2, 8, 30, 128), r(2, 8, 30, 128), 10, 0.088)
    yield (
        "attention",
        (r(2, 32, 1, 128), r(2, 8, 30, 128), r(2, 8, 30, 128), torch.tensor([5, 29]), 0.088),
    )
    yield (
        "mla_attention",
        (r(2, 16, 1, 512), r(2, 16, 1, 64), r(2, 300, 512), r(2, 300, 64), 299, 0.07),
    )
    yield (
        "mla_attention",
        (r(2, 16, 20, 512), r(2, 16, 20, 64), r(2, 30, 512), r(2, 30, 64), 10, 0.07),
    )
    ids = torch.randint(0, 64, (5, 6))
    yield (
        "moe_experts",
        (r(5, 2048), ids, torch.rand(5, 6), r(64, 2 * 1408, 2048), r(64, 2048, 1408)),
    )
    # quantized weights: the GEMV for 1 and 4 rows, tiled for 300 (Llama-3.1-8B's q_proj);
    # packed 4-bit codes with two-level scales and minimums, 6-bit codes; a narrow output (64
    # features) splits K, which adds the split-sum kernel
    for kind, rows, n in (("q4_k", 1, 4096), ("q4_k", 300, 4096), ("q6_k", 4, 4096),
                          ("q6_k", 300, 4096), ("q8_0", 1, 64)):  # fmt: skip
        yield "quant_linear", (r(rows, 4096), _quant_weight(kind, n, 4096), r(n))


def _quant_weight(kind: str, n: int, k: int):
    """A `QuantWeight` of random codes and scales in the format's dtypes (only they and the
    shapes matter to the compiler)."""
    from kernels.qweight import FORMATS, QuantWeight

    fmt = FORMATS[kind]
    groups = k // fmt.group_of(k)
    if fmt.packed:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    else:
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    if fmt.superblock:  # K-quants: small integers per group, fp16 per super-block
        small = torch.int8 if kind == "q6_k" else torch.uint8
        scales = torch.randint(0, 64, (n, groups), dtype=small)
        d = torch.rand(n, k // fmt.superblock).half()
    else:
        scales, d = torch.rand(n, groups).half(), None
    mins = torch.randint_like(scales, 0, 64) if fmt.minimum else None
    dmin = d if fmt.minimum else None
    return QuantWeight(fmt, (n, k), codes, scales, mins, d, dmin)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    from kernels.dispatch import triton_op

    JITFunction.__getitem__ = _compile_only
    for arch in args.arch:
        driver.set_active(NoGPU(GPUTarget("cuda", arch, 32)))
        for dtype in (getattr(torch, d) for d in args.dtype):
            for op, op_args in cases(dtype):
                COMPILED.clear()
                t0 = time.perf_counter()
                triton_op(op)(*op_args)
                dt = time.perf_counter() - t0
                for name, kernel in COMPILED:
                    print(
                        f"sm{arch} {str(dtype)[6:]:9s} {op:18s} {name:22s} {_usage(kernel):32s}"
                        f" ({dt:.1f}s)",
                        flush=True,
                    )
    print(f"all kernels compile (triton {triton.__version__})")


if __name__ == "__main__":
    main()
