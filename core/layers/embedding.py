"""Token embedding and the LM head (a separate matrix, or the embedding itself when tied)."""

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Embedding):
    pass


class LMHead(nn.Module):
    """logits = h @ W.T, with W its own parameter or the tied embedding's."""

    def __init__(self, hidden: int, vocab: int, tied_to: Embedding | None):
        super().__init__()
        self.tied_to = [tied_to]  # a list keeps the tied module out of this one's parameters
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tied = self.tied_to[0]
        return F.linear(h, tied.weight if tied is not None else self.weight)
