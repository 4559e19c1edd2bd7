"""Kernels for CPUs: the C sources, the one module that builds them, and the Python around them.

- build.py: compiles the C files here (qgemv.c, qdot.c, qformats.c, ops.c, step.c, decode.c,
  moe.c, delta.c, mla.c, mamba.c, shortconv.c; headers zoo_cpu.h, qformats.h, qvec.h, step.h)
  into one library, cached per
  machine, and loads it (ctypes); the other modules call that library through its `library()`.
- quant.py: products of GGML block weights (qdot.c; their formats: qformats.c, the 16-lane
  vectors: qvec.h), also as an op a compiled step calls.
- ops.py: decode's small ops, one C call each (ops.c).
- decode.py: a decode step's decoder blocks as one C call (decode.c), through the C views of
  views.py and, for MoE MLPs, gated DeltaNet layers and MLA, moe.py, delta.py, mla.py.
- split.py: few-row products split over the threads where the BLAS leaves them idle (torch
  only); its public names are this package's too (`kernels.cpu.linear`, `split_pays`, ...).
"""

from kernels.cpu.split import cache_dir, linear, split_pays, threads

__all__ = ["cache_dir", "linear", "split_pays", "threads"]
