"""DeepSeek V4's own quantized weights in a safetensors checkpoint, dequantized at load.

DeepSeek ships V4 (Flash, Pro) with each quantized `X.weight` beside an `X.scale` of e8m0
exponents (F8_E8M0: 2 ** (byte - 127)), in one of two forms (what llama.cpp's converter reads:
conversion/deepseek.py `dequant_model`, base.py `repack_mxfp4_blocks`):
- fp8: the weight F8_E4M3 (out, in), one scale per 128 x 128 block, (ceil(out / 128),
  ceil(in / 128)), the edge blocks partial: w[i, j] = fp8[i, j] * scale[i // 128, j // 128];
- fp4 (the routed experts, config.json's `expert_dtype: fp4`): the weight I8 (out, in / 2), two
  e2m1 codes a byte, element 2k in the low nibble, and one scale per 32 values, (out, in / 32):
  MXFP4's layout (safetensors_mxfp4.py), rows not grouped.
Weights without a scale (the compressors' and indexers' projections, the norms) are stored as
floats. The format reader (safetensors.py) hides the scales and reads each pair as one fp32
tensor of the weight's real shape; the loader casts it to the model's dtype.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import CheckpointError
from plugins.formats import safetensors_mxfp4 as mxfp4

if TYPE_CHECKING:
    import torch

SCALE = ".scale"  # X.weight -> X.scale
BLOCK = 128  # fp8: rows and columns per scale
GROUP = 32  # fp4: values per scale
FP8, FP4 = ("F8_E4M3",), ("I8", "U8")


def scale_of(name: str) -> str | None:
    """The name of the scale that goes with weight `name` (None: not a weight)."""
    return name.removesuffix(".weight") + SCALE if name.endswith(".weight") else None


def declared(header: dict[str, dict]) -> bool:
    """Whether the tensors are DeepSeek V4's pairs: an e8m0 `X.scale` beside an `X.weight`."""
    return any(
        name.endswith(SCALE)
        and entry["dtype"] == "F8_E8M0"
        and name[: -len(SCALE)] + ".weight" in header
        for name, entry in header.items()
    )


def shape(stored: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """A paired weight's shape as read: fp4 holds two values a byte."""
    return (*stored[:-1], 2 * stored[-1]) if dtype in FP4 else stored


def check(name: str, entry: dict, scale: dict, source: Path) -> None:
    """The scale grid fits the weight (from the header), or a `CheckpointError` naming both."""
    dims, dtype, want = tuple(entry["shape"]), entry["dtype"], None
    if len(dims) == 2:
        rows, cols = shape(dims, dtype)
        if dtype in FP8:
            want = [math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)]
        elif dtype in FP4 and cols % GROUP == 0:
            want = [rows, cols // GROUP]
    if want is None:
        raise CheckpointError(
            f"{source}: tensor {name!r} is {dtype} {list(dims)} beside an e8m0 scale; DeepSeek "
            f"V4 scales fp8 (F8_E4M3) or fp4 (I8) matrices, fp4 rows a multiple of {GROUP} values"
        )
    if list(scale["shape"]) != want:
        raise CheckpointError(
            f"{source}: tensor {name!r} {list(dims)} needs a scale of shape {want}, "
            f"got {scale['shape']}; the checkpoint is damaged"
        )


def dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A weight and its e8m0 scale (read as uint8) -> fp32, the weight's real shape."""
    import torch

    if w.dtype in (torch.int8, torch.uint8):  # fp4: MXFP4's blocks, one row at a time
        rows, half = w.shape
        blocks = w.view(torch.uint8).reshape(rows, half * 2 // GROUP, GROUP // 2)
        return mxfp4.dequantize(blocks, scale.view(torch.uint8))
    factor = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    rows, cols = w.shape
    factor = factor.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return w.float() * factor
