"""MXFP4 expert weights in a safetensors checkpoint, as openai/gpt-oss ships them.

config.json declares them with `"quantization_config": {"quant_method": "mxfp4", ...}`; each
quantized `X` is stored as `X_blocks` (..., G, 16) uint8, two fp4 (e2m1) codes a byte, low
nibble first, and `X_scales` (..., G) uint8, one e8m0 exponent (biased by 127) per 32 values:

    w[..., 32 g + 2 j + h] = FP4[nibble h of blocks[..., g, j]] * 2 ** (scales[..., g] - 127)

The reader hides the `_scales` tensors and offers each `X_blocks` three ways: kept, as GGML's
MXFP4 blocks (`to_ggml`: the same values, what llama.cpp's converter writes), which the CPU
kernels multiply as stored (a gpt-oss-20b resident in about its file's size); kept for the GPU
kernels (`keep`: a `QuantWeight`, or for stacked experts a `QuantExperts`, of the same bytes
with the nibbles reordered); or dequantized
to fp32, (..., G * 32), by the same lookup table and ldexp as transformers'
`convert_moe_packed_tensors` (bit-exact), less its final gpt-oss transpose: the weight map says
where the (E, out, in) result goes (`dequantize=True`). Code 8 is -0.0 in transformers' table and
+0.0 in GGML's (and the kept forms'): equal values, the only bits in which the forms differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from kernels.qweight import QuantExperts, QuantWeight

BLOCKS, SCALES = "_blocks", "_scales"
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def check(header: dict[str, dict], source: Path) -> None:
    """Every `X_blocks` is U8 (..., G, 16) with a U8 `X_scales` (..., G), and every scale has
    its blocks; one `CheckpointError` lists all the tensors at fault."""
    problems = []
    for name, entry in header.items():
        if name.endswith(SCALES):
            blocks = header.get(name.removesuffix(SCALES) + BLOCKS)
            if blocks is None:
                problems.append(f"{name!r} scales no {BLOCKS} tensor")
            elif entry["dtype"] != "U8" or list(entry["shape"]) != list(blocks["shape"][:-1]):
                problems.append(
                    f"{name!r} is {entry['dtype']} {list(entry['shape'])}, not U8 of its blocks' "
                    f"shape less the last dim ({list(blocks['shape'][:-1])})"
                )
        elif name.endswith(BLOCKS):
            shape = list(entry["shape"])
            if entry["dtype"] != "U8" or len(shape) < 2 or shape[-1] != 16:
                problems.append(f"{name!r} is {entry['dtype']} {shape}, not U8 (..., G, 16)")
            elif name.removesuffix(BLOCKS) + SCALES not in header:
                problems.append(f"{name!r} has no {name.removesuffix(BLOCKS) + SCALES!r}")
    if problems:
        raise CheckpointError(
            f"{source}: {len(problems)} MXFP4 tensor(s) do not fit quantization_config "
            f"(quant_method mxfp4): {'; '.join(problems[:8])}"
        )


def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized shape of (..., G, 16) blocks: (..., G * 32)."""
    return (*blocks_shape[:-2], blocks_shape[-2] * 32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) uint8 codes and (..., G) uint8 e8m0 scales -> fp32 (..., G * 32)."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty((*blocks.shape[:-1], 32), dtype=torch.float32)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, (scales.int() - 127)[..., None], out=out)
    return out.flatten(-2)


def to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """(..., G, 16) codes and (..., G) scales -> GGML MXFP4 blocks (..., G * 17) uint8: per 32
    values the scale byte (the same e8m0: GGML doubles the e2m1 values and halves the scale),
    then 16 bytes holding value j in the low nibble of byte j and value j + 16 in its high
    nibble (here values 2j and 2j + 1 share byte j)."""
    b = blocks.numpy()
    codes = np.empty((*b.shape[:-1], 32), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 0x0F, b >> 4
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales.numpy()[..., None], packed], axis=-1)
    return out.reshape(*b.shape[:-2], -1)


def keep(blocks: torch.Tensor, scales: torch.Tensor) -> QuantWeight | QuantExperts:
    """(out, G, 16) codes and (out, G) scales -> a `QuantWeight` (out, G * 32) in
    kernels/qweight.py's layout (the same e8m0 bytes; value j of a group in the low nibble of
    byte j, value j + 16 in its high one), lossless; stacked experts' (E, out, G, 16) -> a
    `QuantExperts` of E of them."""
    import torch

    from kernels.qweight import FORMATS, QuantExperts, QuantWeight

    codes = torch.empty((*blocks.shape[:-1], 32), dtype=torch.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).flatten(-2)  # (..., out, G * 16)
    fmt, scales = FORMATS["mxfp4"], scales.contiguous()
    if blocks.ndim == 3:
        return QuantWeight(fmt, shape(blocks.shape), packed, scales)
    if blocks.ndim != 4:
        raise ValueError(f"MXFP4 blocks are (out, G, 16) or (E, out, G, 16), not {blocks.shape}")
    rows = shape(blocks.shape)[1:]
    return QuantExperts([QuantWeight(fmt, rows, c, s) for c, s in zip(packed, scales, strict=True)])
