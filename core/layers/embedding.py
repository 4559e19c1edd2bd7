"""Token embedding and the LM head (a separate matrix, or the embedding itself when tied).

Either weight may be a `QuantWeight` (core/quantize.py): the head then multiplies through
`kernels.linear`'s quantized path, and the embedding decodes the rows it looks up."""

import torch
from torch import nn

import kernels
from core.config import EmbeddingSpec
from kernels.blocks import BlockWeight
from kernels.qweight import QuantWeight


class Embedding(nn.Embedding):
    """ids (B, T) -> (B, T, hidden), times `spec.scale` rounded to the weights' dtype."""

    def __init__(self, vocab: int, hidden: int, spec: EmbeddingSpec):
        super().__init__(vocab, hidden)
        self.scale = spec.scale

    def reset_parameters(self) -> None:
        """No random values on the meta device, where models are built: they would be
        overwritten by the checkpoint's (and drawing them imports torch._dynamo: ~1.2 s)."""
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(
            w, QuantWeight | BlockWeight
        ):  # kept quantized: only the rows looked up are decoded
            x = w.select_rows(ids).to(w.dtype)
        else:
            x = super().forward(ids)
        if self.scale == 1.0:
            return x
        # Gemma: transformers rounds sqrt(hidden) to the model dtype before multiplying
        return x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)


class LMHead(nn.Module):
    """logits = h @ W.T, with W its own parameter or the tied embedding's."""

    def __init__(self, hidden: int, vocab: int, tied_to: nn.Module | None):
        super().__init__()
        self.tied_to = [tied_to]  # a list keeps the tied module out of this one's parameters
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tied = self.tied_to[0]
        return kernels.linear(h, tied.weight if tied is not None else self.weight)
