"""Products of block weights on CPUs (kernels/cpu/qdot.c, in build.py's library).

`block_linear` multiplies x by a `kernels.blocks.BlockWeight` (GGML blocks, repacked): x is
quantized to 8-bit blocks, twice (its codes and the remainder's: 15 bits in effect), and each
64-byte vector of codes meets 4 codes of x in one u8 x s8 multiply-add (VNNI's vpdpbusd where
the CPU has it). Decode (one row per sequence) streams the weights at the memory's rate;
prefill reuses each group of 16 weight rows, from the caches, for every row of x. A row's
result does not depend on the other rows: a prompt's keys and values are the same whether it
was prefilled in one chunk or several, and a batch's rows equal each alone.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.cpu.build import QWeightView, library


def block_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a `kernels.blocks.BlockWeight` W (kernels/cpu/qdot.c), any number of
    rows; fp32 x (other dtypes: the dequantized weight in F.linear)."""
    if torch.compiler.is_compiling():
        y = _qdot_op(x.reshape(-1, w.in_features).contiguous(), w.blocks, w.fmt.type,
                     w.shape[0], w.shape[1])  # fmt: skip
        y = y.view(*x.shape[:-1], w.out_features)
        return y if bias is None else y + bias
    if x.dtype != torch.float32 or x.shape[-1] != w.in_features or library() is None:
        return F.linear(x, w.dequantize().to(x.dtype), bias)
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], w.out_features)
    library().zoo_qgemm(ctypes.byref(w.c_view()), x.data_ptr(), y.data_ptr(),
                        x.numel() // w.in_features, torch.get_num_threads())  # fmt: skip
    return y if bias is None else y.add_(bias)


# The product as an op that torch.compile keeps opaque: a compiled decode step calls it from its
# graph (a ctypes call would break it).
@torch.library.custom_op("zoo::qdot", mutates_args=())
def _qdot_op(x: torch.Tensor, blocks: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """x (M, K) @ W.T for a repacked block weight of GGML type `kind`."""
    view = QWeightView(blocks.data_ptr(), n, k, kind)
    y = x.new_empty(x.shape[0], n)
    library().zoo_qgemm(ctypes.byref(view), x.data_ptr(), y.data_ptr(), x.shape[0],
                        torch.get_num_threads())  # fmt: skip
    return y


@_qdot_op.register_fake
def _(x, blocks, kind, n, k):
    return x.new_empty(x.shape[0], n)
