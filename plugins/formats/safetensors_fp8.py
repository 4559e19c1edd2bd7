"""Block-scaled fp8 weights in a safetensors checkpoint, as DeepSeek-V3/R1 ship them.

config.json declares them (the hub's spelling; transformers calls it FineGrainedFP8Config):

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

and each quantized `X.weight` (out, in), stored as F8_E4M3, comes with a float
`X.weight_scale_inv` (ceil(out / 128), ceil(in / 128)): one scale per 128 x 128 block, the
edge blocks partial. The real weight is DeepSeek's `weight_dequant` (inference/kernel.py):

    w[i, j] = float32(fp8[i, j]) * scale_inv[i // 128, j // 128]

The format reader (safetensors.py) checks every pair from the header when it opens the
checkpoint and hides the `weight_scale_inv` tensors. On a GPU that computes in fp8 (CUDA
compute capability 8.9+: core/quantize.py decides) the loader keeps each linear weight as it is
stored: `keep` makes a `QuantWeight` of the fp8 bytes and the scales, and the quantized linear
kernels multiply by it. Elsewhere `dequantize` returns it in fp32, a strip of blocks at a time,
and the loader casts it to the model's dtype as it does any tensor: DeepSeek's own fp8 -> bf16
conversion. e4m3 has no infinities; its NaN bytes (0x7F, 0xFF) never come out of DeepSeek's
quantizer (it clamps to +-448), so a weight holding one is a damaged file: `CheckpointError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # torch loads only when weights are read: listing plugins stays light
    import torch

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names for torch's float8 dtypes
SCALE_DTYPES = ("F32", "BF16", "F16")
_FIELD = "field 'quantization_config"


@dataclass(frozen=True)
class BlockFP8:
    """The checkpoint's fp8 scheme: e4m3 values, one scale per (rows, cols) block."""

    block: tuple[int, int]

    @classmethod
    def from_config(cls, config: dict[str, Any], source: Path) -> BlockFP8 | None:
        """The scheme config.json declares; None when it declares no quantization. A
        quantization Zoo cannot read raises `ConfigError` naming the field."""
        qc = config.get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, dict):
            raise ConfigError(f"{source}: {_FIELD}' must be an object, got {qc!r}")
        method = qc.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"{source}: {_FIELD}' has quant_method {method!r}; Zoo reads only block-scaled "
                "fp8 checkpoints (quant_method 'fp8'); use a bf16 conversion of these weights"
            )
        fmt = qc.get("fmt", "e4m3")  # transformers' FineGrainedFP8Config has no fmt: e4m3
        if fmt not in ("e4m3", "float8_e4m3fn"):  # the latter: MiniMax M2's spelling
            raise ConfigError(
                f"{source}: {_FIELD}.fmt' is {fmt!r}; fp8 weights must be 'e4m3' (float8_e4m3fn)"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(
                f"{source}: {_FIELD}.activation_scheme' is {scheme!r}; only 'dynamic' "
                "(no stored activation scales) is supported"
            )
        block = qc.get("weight_block_size")
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(type(b) is int and b > 0 for b in block)
        ):
            raise ConfigError(
                f"{source}: {_FIELD}.weight_block_size' is {block!r}; it must be two positive "
                "ints, [rows, cols] per scale (DeepSeek: [128, 128]); per-tensor fp8 is not "
                "supported"
            )
        return cls((block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of an (out, in) weight: edge blocks count whole."""
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def check(self, header: dict[str, dict], source: Path) -> None:
        """Every fp8 weight has a scale of the right shape and every scale an fp8 weight,
        from the header alone; one `CheckpointError` lists all the tensors at fault."""
        problems = []
        for name, entry in header.items():
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            if name.endswith(SCALE_SUFFIX):
                weight = header.get(name.removesuffix(SCALE_SUFFIX))
                if weight is None or weight["dtype"] not in FP8_DTYPES:
                    got = "is absent" if weight is None else f"is {weight['dtype']}"
                    problems.append(f"{name!r} scales no fp8 weight (its weight {got})")
                elif dtype not in SCALE_DTYPES:
                    problems.append(f"{name!r} is {dtype}, not a float scale")
                elif len(weight["shape"]) == 2 and shape != self.scale_shape(weight["shape"]):
                    want = list(self.scale_shape(weight["shape"]))
                    problems.append(
                        f"{name!r} has shape {list(shape)} but its weight {list(weight['shape'])} "
                        f"in {self.block[0]}x{self.block[1]} blocks needs {want}"
                    )
            elif dtype in FP8_DTYPES:
                if dtype != "F8_E4M3":
                    problems.append(f"{name!r} is {dtype}, not the declared fmt e4m3 (F8_E4M3)")
                elif len(shape) != 2:
                    problems.append(f"{name!r} is fp8 with shape {list(shape)}, not a matrix")
                elif name + SCALE_SUFFIX not in header:
                    problems.append(f"{name!r} is fp8 but {name + SCALE_SUFFIX!r} is missing")
        if problems:
            more = f"; ... and {len(problems) - 8} more" if len(problems) > 8 else ""
            raise CheckpointError(
                f"{source}: {len(problems)} fp8 tensor(s) do not fit quantization_config "
                f"(weight_block_size {list(self.block)}): {'; '.join(problems[:8])}{more}"
            )

    def check_values(self, name: str, w: torch.Tensor, source: Path) -> None:
        """A weight holding e4m3 NaN bytes (0x7F, 0xFF) raises `CheckpointError` naming it."""
        import torch

        bad = int(((w.view(torch.uint8) & 0x7F) == 0x7F).sum())
        if bad:
            raise CheckpointError(
                f"{source}: fp8 tensor {name!r} holds {bad} NaN value(s) (bytes 0x7F / 0xFF), "
                "which a quantized checkpoint never contains: the file is damaged; download it "
                "again"
            )

    def keep(self, w: torch.Tensor, scale_inv: torch.Tensor):
        """fp8 (out, in) x its block scales -> a `QuantWeight` of the same bytes, each block's
        scale repeated over its rows in fp32 (exact): (out, ceil(in / cols)) scales."""
        import torch

        from kernels.qweight import QuantWeight, fp8_format

        rows, cols = self.block
        scales = scale_inv.float().repeat_interleave(rows, dim=0)[: w.shape[0]].contiguous()
        codes = w.contiguous().view(torch.uint8)
        return QuantWeight(fp8_format(cols), tuple(w.shape), codes, scales)

    def dequantize(self, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """fp8 (out, in) x its block scales -> fp32 (out, in), one strip of blocks at a time,
        so nothing beside the result is larger than a strip."""
        import torch

        rows, cols = self.block
        out = torch.empty(w.shape, dtype=torch.float32)
        for i, s in enumerate(scale_inv.float()):  # s: (ceil(in / cols),), one block row
            strip = slice(i * rows, (i + 1) * rows)
            out[strip] = w[strip].float() * s.repeat_interleave(cols)[: w.shape[1]]
        return out
